"""A trained reward model as a text reward source (for the reward server, or any text batch).

In the step-3 loop the reward model scores token ids directly (:class:`chatrl.rewards.base.ModelReward`);
here prompts and answers are texts, formatted and tokenized exactly as
``python -m chatrl.step2_reward.score`` does (:func:`chatrl.step2_reward.score.encode_rows`).
"""

from __future__ import annotations

import logging

import torch

from chatrl.data.schema import Sample
from chatrl.models import load_tokenizer
from chatrl.precision import resolve_dtype
from chatrl.reward_model import encode_rows, load_reward_model, prompt_messages, score_sequences
from chatrl.rewards.base import RewardBatch, RewardError, check_scores

log = logging.getLogger(__name__)


class TextRewardModel:
    """Scores ``(prompt, answer)`` texts with a chatrl (or Hugging Face sequence-classification) reward model.

    Args:
        model_dir: step 2's ``--output_dir``.
        max_seq_len: prompt + answer tokens; longer prompts lose their oldest tokens.
        batch_size: sequences per forward pass.
        dtype: ``fp32``, ``bf16``, ``fp16`` or ``auto`` (:func:`chatrl.precision.resolve_dtype` for the
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

    def __call__(self, batch: RewardBatch) -> torch.Tensor:

        samples = [Sample(prompt_messages(p), a) for p, a in zip(batch.prompts, batch.answers, strict=True)]
        encoded = encode_rows(self.tokenizer, samples, self.max_seq_len)
        for i, e in enumerate(encoded):
            if e is None:
                raise RewardError(f"reward model: answer {i} at step {batch.step} does not fit "
                                  f"max_seq_len={self.max_seq_len} tokens")
        scores = score_sequences(self.model, [e[0] for e in encoded], self.tokenizer.pad_token_id,
                                 self.batch_size, self.device)
        return check_scores(scores, len(batch), f"reward model (step {batch.step})")
