"""A trained reward model as a text reward source (for the reward server, or any text batch).

In the step-3 loop the reward model scores token ids directly (:class:`chatrl.rewards.base.ModelReward`).
Behind a server it gets what the client sends (:class:`chatrl.rewards.base.RewardBatch`), in this
order of preference, so that the served score equals the in-process one:

1. ``token_ids``, when they read as ``formatted_texts`` with this model's tokenizer (the same
   tokenizer as the actor's): exactly the ids the in-process model scores;
2. ``formatted_texts``: the conversation as the actor saw it, chat markers and special tokens
   kept, tokenized without adding any;
3. (a client that sends neither) ``prompts`` and ``answers`` formatted and tokenized as
   ``python -m chatrl.step2_reward.score`` does (:func:`chatrl.models.reward_model.encode_rows`); the
   prompt's special tokens were removed, so a chat-template prompt is formatted anew.
"""

from __future__ import annotations

import logging

import torch

from chatrl.data.schema import Sample
from chatrl.models.causal_lm import load_tokenizer
from chatrl.models.precision import resolve_dtype
from chatrl.models.reward_model import encode_rows, load_reward_model, prompt_messages, score_sequences
from chatrl.packing import pack
from chatrl.rewards.base import RewardBatch, RewardError, check_scores, decode_exactly

log = logging.getLogger(__name__)


class TextRewardModel:
    """Scores ``(prompt, answer)`` texts with a chatrl (or Hugging Face sequence-classification) reward model.

    Args:
        model_dir: step 2's ``--output_dir``.
        max_seq_len: prompt + answer tokens; longer prompts lose their oldest tokens.
        batch_size: sequences per forward pass.
        dtype: ``fp32``, ``bf16``, ``fp16`` or ``auto`` (:func:`chatrl.models.precision.resolve_dtype` for the
            device; the scores are float32 in every dtype). device: torch device (default cuda if available).

    Raises:
        RewardError: at call time, an answer that alone does not fit ``max_seq_len`` (names the row).
    """

    def __init__(self, model_dir: str, max_seq_len: int = 512, batch_size: int = 8, dtype: str = "fp32",
                 device=None, name: str = "model"):

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(model_dir)
        self.dtype, why = resolve_dtype(dtype, self.device.type)
        if why:
            log.info("reward model %s in %s (%s)", model_dir, self.dtype, why)
        self.model = load_reward_model(model_dir, self.tokenizer, dtype=self.dtype,
                                       require_head=True).to(self.device).eval()
        self.max_seq_len, self.batch_size, self.name = max_seq_len, batch_size, name

    def encode(self, batch: RewardBatch) -> list[list[int]]:
        """The token ids to score for each row (module docstring: ids, formatted texts, or prompts and answers).

        Raises:
            RewardError: a sequence longer than ``max_seq_len`` (or an answer that alone does not fit).
        """
        if batch.formatted_texts is not None:
            if batch.token_ids is not None and self.reads_alike(batch.token_ids, batch.formatted_texts):
                seqs = [list(ids) for ids in batch.token_ids]
            else:
                seqs = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in batch.formatted_texts]
            for i, ids in enumerate(seqs):
                if len(ids) > self.max_seq_len:
                    raise RewardError(f"reward model: sequence {i} at step {batch.step} has {len(ids)} tokens, over "
                                      f"max_seq_len={self.max_seq_len}")
            return seqs
        samples = [Sample(prompt_messages(p), a) for p, a in zip(batch.prompts, batch.answers, strict=True)]
        encoded = encode_rows(self.tokenizer, samples, self.max_seq_len)
        for i, e in enumerate(encoded):
            if e is None:
                raise RewardError(f"reward model: answer {i} at step {batch.step} does not fit "
                                  f"max_seq_len={self.max_seq_len} tokens")
        return [e[0] for e in encoded]

    def reads_alike(self, token_ids: list[list[int]], texts: list[str]) -> bool:
        """Whether every row's ids, decoded by this tokenizer with its special tokens, give the row's text."""
        size = len(self.tokenizer)
        return all((not ids or max(ids) < size) and decode_exactly(self.tokenizer, ids) == text
                   for ids, text in zip(token_ids, texts, strict=True))

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        scores = score_sequences(self.model, self.encode(batch), self.tokenizer.pad_token_id, self.batch_size,
                                 self.device)
        return check_scores(scores, len(batch), f"reward model (step {batch.step})")


def reward_model_scores(reward_engine, micro_batch: int, pad_token_id: int | None = None):
    """Step 3's reward model's end score, ``micro_batch`` rollouts per pass, packed into rows of their
    real tokens when ``pad_token_id`` is given (``--packing``: the same scores):
    ``score_fn(sequences (B, T), attention_mask (B, T), prompt_len) -> (B,)``."""

    @torch.no_grad()
    def score_fn(seq, mask, prompt_len):
        scores = []
        for i in range(0, len(seq), micro_batch):
            s, m = seq[i:i + micro_batch], mask[i:i + micro_batch]
            if pad_token_id is None:
                scores.append(reward_engine(s, m).end_scores)
            else:
                packed = pack([row[keep > 0] for row, keep in zip(s, m, strict=True)], pad_token_id)
                scores.append(reward_engine(packed.input_ids, None, packed=packed).end_scores)
        return torch.cat(scores)

    return score_fn
