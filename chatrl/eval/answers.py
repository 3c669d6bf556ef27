"""Each model's answers to the evaluation prompts, greedy and sampled over seeds, through chatrl's
generation (:func:`chatrl.generation.generate_answers` on :func:`chatrl.generation.inference_engine`:
step 3's decoder, left padding, the stop ids of :func:`chatrl.models.causal_lm.stop_token_ids` as in ``chat.py``),
and the KL of each answer to a reference model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from chatrl.config import SamplingConfig
from chatrl.data.examples import left_cut
from chatrl.data.formatting import encode_prompts
from chatrl.generation import answer_tokens, generate_answers, inference_engine, left_pad
from chatrl.logprobs import token_logprobs
from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, stop_token_ids

GREEDY = "greedy"


@dataclass
class Answer:
    """One answer: its text (special tokens removed, stripped), its length in the model's tokens (the
    stop token included), whether it ended its turn within the budget, and its KL to the reference
    (``Σ_t log π(y_t) − log π_ref(y_t)`` over its tokens, nats; None without a reference)."""

    text: str
    tokens: int
    ended: bool
    kl: float | None = None


def decodings(seeds: Sequence[int], greedy: bool = True) -> list[str]:
    """The decoding names of an evaluation: ``"greedy"`` (unless ``greedy`` is False) then ``"seed<S>"`` per seed.

    Raises:
        ValueError: nothing to decode (no greedy answers and no seed), or a repeated seed.
    """
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds repeats a seed: {list(seeds)}")
    names = ([GREEDY] if greedy else []) + [f"seed{s}" for s in seeds]
    if not names:
        raise ValueError("nothing to generate: --no_greedy and no --seeds")
    return names


def encode_eval_prompts(tokenizer, conversations: Sequence[Sequence[dict]], max_prompt_len: int) -> list[list[int]]:
    """Each conversation's prompt ids in the model's own format (:func:`chatrl.data.formatting.encode_prompts`:
    its chat template, else the Human/Assistant convention), cut from the left to ``max_prompt_len``
    tokens as step 3 cuts its prompts (a leading BOS stays)."""
    ids = encode_prompts(tokenizer, conversations)
    return [left_cut(p, max_prompt_len, tokenizer.bos_token_id) or p[-1:] for p in ids]


@torch.no_grad()
def answer_logprob_sums(model, prompts: Sequence[Sequence[int]], generated: torch.Tensor, lengths: Sequence[int],
                        pad_token_id: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
                        ) -> torch.Tensor:
    """``(B,)`` summed log-probabilities (nats) of each row's first ``lengths[i]`` generated tokens given
    its prompt, under ``model`` at ``temperature`` (the softmax of logits / T) and with the sampler's
    top-k / top-p filters on its own logits (:func:`chatrl.logprobs.token_logprobs`): one forward pass of
    prompt + answer, position ids from the mask, the LM head on the answer positions only.

    Args:
        prompts: ``B`` prompt id lists. generated: ``(B, A)`` tokens after the prompts. lengths: the
            answer tokens of each row (through its stop token). pad_token_id: the padding of the batch.
        temperature: > 0 (1: the raw logits). top_k, top_p: 0 and 1: off.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)
    gen = generated.to(device)
    answer_mask = (torch.arange(gen.shape[1], device=device)[None, :]
                   < torch.as_tensor(list(lengths), device=device)[:, None]).long()
    seq = torch.cat([ids.to(device), gen], dim=1)
    logits = causal_lm_logits(model, seq, torch.cat([mask.to(device), answer_mask], dim=1),
                              logits_to_keep=gen.shape[1] + 1)
    logp = token_logprobs(logits[:, :-1], gen, temperature, top_k=top_k, top_p=top_p)
    return (logp * answer_mask).sum(dim=1).cpu()


class Reference:
    """The reference model of the KL figure (``--reference``), loaded once.

    Args:
        path: its HF folder. tokenizer: its tokenizer. dtype: ``fp32`` | ``bf16`` | ``fp16``. device: torch device.
    """

    def __init__(self, path: str, tokenizer, dtype: str, device, trust_remote_code: bool = False):
        self.path, self.tokenizer = path, tokenizer
        self.model = load_causal_lm(path, tokenizer, dtype=dtype, trust_remote_code=trust_remote_code).to(device).eval()

    def reads(self, tokenizer) -> bool:
        """Whether answers in ``tokenizer``'s ids mean the same tokens to the reference (same vocabulary):
        only then is the KL defined token by token."""
        return tokenizer.get_vocab() == self.tokenizer.get_vocab()


@torch.no_grad()
def answer_prompts(model, tokenizer, prompt_ids: Sequence[Sequence[int]], names: Sequence[str],
                   sampling: SamplingConfig,
                   batch_size: int, max_new_tokens: int, reference: Reference | None = None,
                   progress: Callable[[int], None] | None = None) -> dict[str, list[Answer]]:
    """The model's answers to every prompt for each decoding in ``names`` (:func:`decodings`).

    Prompts are batched ``batch_size`` at a time, longest first (less padding); greedy answers are
    decoded greedily, ``seed<S>`` answers with ``sampling`` after ``torch.manual_seed(S)`` (so a
    model's sampled answers are reproducible for a given prompt set and batch size). With a
    ``reference`` that reads the model's tokens, each answer's KL is ``Σ_t log π(y_t) − log π_ref(y_t)``
    over its tokens through the stop token: for sampled answers the Monte-Carlo (k1) estimate of
    KL(π‖π_ref) per answer (Schulman 2020, "Approximating KL divergence"), as step 3 logs it; for
    greedy answers the same log-ratio, not an unbiased KL estimate. log π and log π_ref are both one
    forward pass of prompt + answer (:func:`answer_logprob_sums`) at the sampler's temperature and with
    its top-k / top-p filters (greedy: the raw logits), so the reference itself scores exactly 0: the
    sampler's own log-probs differ from a forward pass by the decoder's rounding (about 1e-6 nats a token
    in fp32, but 0.11 nats an answer of 55 tokens in bf16 on SmolLM2-135M-Instruct, more than the KL
    step 3 had moved its actor).

    Args:
        model: an HF causal LM in eval mode. tokenizer: its tokenizer (pad and stop ids).
        prompt_ids: ``N`` prompts' ids (:func:`encode_eval_prompts`). sampling: the sampled decodings'
            ``--temperature``, ``--top_k``, ``--top_p`` (0: greedy).
        progress: called with the number of prompts answered after each batch.

    Returns:
        decoding name → ``N`` :class:`Answer` in prompt order.
    """
    stops = stop_token_ids(tokenizer, model)
    engine = inference_engine(model)
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    with_kl = reference is not None and reference.reads(tokenizer)
    out: dict[str, list[Answer]] = {}
    for name in names:
        if name == GREEDY:
            how, temperature, filters = None, 1.0, {}
        else:
            torch.manual_seed(int(name[len("seed"):]))
            how, (temperature, top_k, top_p) = sampling, sampling.scored
            filters = {"top_k": top_k, "top_p": top_p}
        answers: list[Answer | None] = [None] * len(prompt_ids)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = [prompt_ids[i] for i in rows]
            gen = generate_answers(engine, batch, tokenizer, max_new_tokens, how)
            cut = answer_tokens(gen, stops)
            kl = None
            if with_kl:
                lengths = [len(ids) for ids, _ in cut]
                mine, ref = (answer_logprob_sums(m, batch, gen, lengths, tokenizer.pad_token_id, temperature, **filters)
                             for m in (model, reference.model))
                kl = (mine - ref).tolist()
            for j, (i, (ids, ended)) in enumerate(zip(rows, cut, strict=True)):
                text = tokenizer.decode(ids, skip_special_tokens=True).strip()
                answers[i] = Answer(text, len(ids), ended, None if kl is None else float(kl[j]))
            if progress is not None:
                progress(len(rows))
        out[name] = answers
    return out
