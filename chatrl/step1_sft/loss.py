"""Supervised fine-tuning loss: next-token cross-entropy over answer tokens, summed and counted.

Returning ``(sum, count)`` instead of a mean lets the caller weight every token of an optimizer
step equally, whatever the padding, the micro-batch split or the number of ranks: the mean of
per-micro-batch means over-weights short answers (the "gradient accumulation loss" bug).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatrl.logprobs import IGNORE_INDEX, token_logprobs
from chatrl.models.causal_lm import causal_lm_logits, labelled_token_logits
from chatrl.packing import PackedRows


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
    # shift the labels, not the logits: no (B, T - 1, V) copy of the largest tensor of the step
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    nll = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    return nll, (shift_labels != IGNORE_INDEX).sum()


def sft_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            labels: torch.Tensor, packed: PackedRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_nll` of ``model`` on a batch, with the LM head run on the labelled positions only
    (:func:`chatrl.models.causal_lm.labelled_token_logits`); for bf16 (or fp16) logits the log-probs are taken a
    few positions at a time (:func:`chatrl.logprobs.token_logprobs`: no ``(N, V)`` float32 copy, which for
    a 49K vocabulary would be the step's largest tensor), for fp32 logits by ``cross_entropy`` as
    before (the same bits as earlier runs); the same sum up to float32 rounding.

    Args:
        model: an HF causal LM, possibly under a DeepSpeed engine or peft wrapper.
        input_ids, attention_mask, labels: ``(B, T)``; ``labels`` as in :func:`token_nll`.
        packed: packed rows instead (:class:`chatrl.data.collate.PackedSFTCollator`'s batches):
            ``input_ids`` and ``labels`` are ``(R, W)`` rows, ``attention_mask`` is None; the sum
            and count equal those of the same sequences padded.

    Returns:
        ``(nll_sum, n_tokens)``: a scalar float32 tensor (nats) and a scalar long tensor.
    """
    logits, targets = labelled_token_logits(model, input_ids, attention_mask, labels, IGNORE_INDEX, packed)
    if logits.dtype == torch.float32:  # no copy to avoid: the log-softmax of fp32 logits, as always
        return F.cross_entropy(logits, targets, reduction="sum"), labels.new_tensor(targets.numel())
    # a few positions at a time (token_logprobs): never an (N, V) float32 copy of a bf16 head's logits
    nll = -token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0)).sum()
    return nll, labels.new_tensor(targets.numel())


def full_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_nll` of ``model`` on ``(B, T)`` padded rows with every position's logits computed
    (the definition the loss-scale probe checks :func:`sft_nll` against)."""
    return token_nll(causal_lm_logits(model, input_ids, attention_mask), labels)


def labelled_tokens(labels: torch.Tensor) -> int:
    """How many tokens of ``(B, T)`` ``labels`` (padded or packed rows) carry a loss: every labelled
    position after the first, which no position predicts."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def only_rows(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` ``labels`` with the rows where ``keep`` ``(B,)`` is False carrying no loss (an eval
    batch's padding rows)."""
    return labels.masked_fill(~keep[:, None], IGNORE_INDEX)
