"""Generation shared by the training steps and the evaluation: left-padding prompts, step 3's generation
engine for any model (:func:`inference_engine`), one batch of answers with chatrl's stop ids
(:func:`generate_answers`), and the share of greedy answers that end their turn (steps 1 and DPO
report it after training)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from chatrl.config import HybridEngineConfig, SamplingConfig
from chatrl.distributed.dist import DistInfo, all_reduce_sum
from chatrl.hybrid_engine import HybridEngine
from chatrl.hybrid_engine.tp_plan import family_of
from chatrl.models.causal_lm import base_model, stop_token_ids


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a left-padded batch: ``(ids (B, P), attention_mask (B, P))``, ``P`` the longest prompt.

    Raises:
        ValueError: no prompt.
    """
    if not prompts:
        raise ValueError("left_pad: no prompt")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


class _Unpartitioned:
    """What :class:`~chatrl.hybrid_engine.HybridEngine` reads of a DeepSpeed engine, for a module outside
    DeepSpeed: no ZeRO partitions, and weights that never go stale (no optimizer step)."""

    global_steps = 0

    def __init__(self, module):
        self.module = module

    def zero_optimization_stage(self) -> int:
        return 0


def inference_engine(model) -> HybridEngine:
    """Step 3's generation (:class:`~chatrl.hybrid_engine.HybridEngine`) for ``model``.

    A DeepSpeed engine (steps 1 and DPO after training) generates with HF ``generate`` on its
    training layout (the engine's plain path: synced decoding under ZeRO-3, so that ranks finishing
    early keep serving the gathers). A module outside DeepSpeed (an HF causal LM, maybe under peft)
    of a family the engine serves decodes with the engine's KV-cache loop on the module itself, the
    decoder of step 3's rollouts (greedy tokens equal to HF ``generate``'s, tested in
    ``tests/stages/test_hybrid_engine.py``); other families fall back to HF ``generate``. The
    intra-op thread count is left as it is (``OMP_NUM_THREADS``, ``torch.set_num_threads``).
    """
    if hasattr(model, "zero_optimization_stage"):
        return HybridEngine(model, HybridEngineConfig(enable_hybrid_engine=False),
                            num_threads=torch.get_num_threads(), pin_threads=False)
    served = family_of(base_model(model)) is not None
    return HybridEngine(_Unpartitioned(model), HybridEngineConfig(enable_hybrid_engine=served),
                        num_threads=torch.get_num_threads(), pin_threads=False)


@torch.no_grad()
def generate_answers(engine: HybridEngine, prompts: Sequence[Sequence[int]], tokenizer, max_new_tokens: int,
                     sampling: SamplingConfig | None, output_logprobs: bool = False):
    """Answers to one batch of prompts: the left-padded batch (:func:`left_pad`) through ``engine``
    (:func:`inference_engine`), stopping at :func:`chatrl.models.causal_lm.stop_token_ids` (the chat template's
    end-of-turn token and the EOS, as ``chat.py`` and step 3), greedy or sampled from the global
    torch RNG.

    Args:
        engine: the generating engine. prompts: ``B`` token-id lists (no answer). tokenizer: the
            model's (pad and stop ids). max_new_tokens: the answer budget. sampling: ``--temperature``,
            ``--top_k``, ``--top_p``; ``None``: greedy decoding. output_logprobs: also return the sampler's
            log-prob of each generated token under the distribution it was drawn from
            (:meth:`chatrl.hybrid_engine.HybridEngine.generate`).

    Returns:
        ``(B, max_new_tokens)`` long: the generated tokens, the pad id after an answer's first stop id;
        with ``output_logprobs`` a pair ``(tokens, logprobs (B, max_new_tokens) fp32, 0 after the stop)``.
    """
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    out = engine.generate(ids, mask, max_new_tokens=max_new_tokens, sampling=sampling,
                          eos_token_id=stop_token_ids(tokenizer, engine.module), pad_token_id=tokenizer.pad_token_id,
                          output_logprobs=output_logprobs)
    if output_logprobs:
        return out[0][:, ids.shape[1]:], out[1]
    return out[:, ids.shape[1]:]


def answer_tokens(generated: torch.Tensor, stops: Sequence[int]) -> list[tuple[list[int], bool]]:
    """Each row of ``generated`` ``(B, A)`` cut after its first stop id: ``(ids, ended)`` per row,
    ``ended`` whether a stop id was generated (the answer ended its turn within the budget)."""
    out = []
    stop_set = set(int(s) for s in stops)
    for row in generated.tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_set), None)
        out.append((row[:cut + 1], True) if cut is not None else (row, False))
    return out


@torch.no_grad()
def eos_rate(engine, prompts: Sequence[Sequence[int]], tokenizer, max_new_tokens: int, zero_stage: int,
             info: DistInfo) -> float:
    """Share of greedy answers to ``prompts`` that end their turn within ``max_new_tokens`` (EOS or the
    chat template's end-of-turn token, :func:`chatrl.models.causal_lm.stop_token_ids`); NaN without prompts.

    Every rank calls it with the same ``prompts`` and answers its share (``prompts[rank::world]``,
    padded with a one-token prompt so that every rank generates as many rows: synced decoding under
    ZeRO-3 needs it); the counts are summed over ranks.

    Args:
        engine: a DeepSpeed engine (or module) of a causal LM; left in train mode afterwards.
        prompts: token ids of each prompt (no answer).
        tokenizer: the model's (pad and stop ids).
        max_new_tokens: the answer budget. zero_stage: the engine's ZeRO stage (the engine's own
            decides synced decoding, :func:`inference_engine`). info: this rank.
    """
    if not prompts:
        return math.nan
    engine.eval()
    mine = list(prompts[info.rank::info.world_size])
    per_rank = math.ceil(len(prompts) / info.world_size)
    batch = mine + [list(prompts[0][:1])] * (per_rank - len(mine))
    answers = generate_answers(inference_engine(engine), batch, tokenizer, max_new_tokens, None)
    ended = sum(e for _, e in answer_tokens(answers, stop_token_ids(tokenizer, engine))[: len(mine)])
    engine.train()
    counts = all_reduce_sum(torch.tensor([float(ended), len(mine)], dtype=torch.float64))
    return counts[0].item() / max(counts[1].item(), 1)
