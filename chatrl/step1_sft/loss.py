"""Supervised fine-tuning loss: next-token cross-entropy over answer tokens, summed and counted.

Returning ``(sum, count)`` instead of a mean lets the caller weight every token of an optimizer
step equally, whatever the padding, the micro-batch split or the number of ranks: the mean of
per-micro-batch means over-weights short answers (the "gradient accumulation loss" bug).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of the labelled tokens and how many there are.

    Args:
        logits: ``(B, T, V)``: position ``t`` predicts token ``t + 1``.
        labels: ``(B, T)`` long, aligned with the inputs (not shifted); ``-100`` marks tokens that
            carry no loss (pads, and prompt tokens when the prompt is masked).

    Returns:
        ``(nll_sum, n_tokens)``: a scalar float32 tensor (nats) and a scalar long tensor.

    Raises:
        ValueError: shapes disagree.
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on (B, T)")
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, (shift_labels != IGNORE_INDEX).sum()
