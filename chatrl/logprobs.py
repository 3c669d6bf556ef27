"""Token maths shared by every step that reads a causal LM's distribution: the log-probability
of given tokens and the entropy of each position's distribution, computed from logits.

Below the hybrid engine (its sampler reports each sampled token's log-prob with the training
forward's own formula, so that ``rollout/logp_diff`` measures the forward passes only) and the RL
maths (:mod:`chatrl.rl`). Pure tensor functions; log-probabilities are in nats; work is done one
row at a time so that a bf16 ``(B, T, V)`` batch is never up-cast to float32 whole.
"""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "float_dtype", "logprobs_from_logits", "entropy_from_logits", "logprobs_and_entropy"]

#: A label that carries no loss (PyTorch's ``cross_entropy`` default): prompt tokens, padding.
IGNORE_INDEX = -100


def float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype RL maths computes in: at least float32, float64 if any input is float64."""
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_logits_labels(where: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 3:
        raise ValueError(f"{where}: logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"{where}: labels must be (B, T) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"{where}: labels must be integer ids, got {labels.dtype}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[-1]):
        raise ValueError(
            f"{where}: labels must lie in [0, {logits.shape[-1]}), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under the softmax of its logits, in float32.

    ``out[b, t] = logits[b, t, labels[b, t]] - logsumexp(logits[b, t, :])``. No shift is applied:
    ``logits[:, t]`` must already be the prediction for ``labels[:, t]`` (for answer tokens, slice
    full-sequence logits as ``logits[:, P - 1 : P + A - 1]``; see the module docstring).

    Memory: works one row at a time, so at most one ``(T, V)`` float32 copy exists beside the
    input (a bf16 ``(B, T, V)`` batch is never up-cast whole). Differentiable.

    Args:
        logits: ``(B, T, V)`` any floating dtype.
        labels: ``(B, T)`` integer ids in ``[0, V)``.

    Returns:
        ``(B, T)`` float32 (float64 if ``logits`` is float64) log-probabilities, in nats, <= 0.

    Raises:
        ValueError: wrong ranks, shape mismatch, non-integer labels or labels out of ``[0, V)``.

    Source: log pi(a|s) of the policy-gradient objective, Schulman et al. 2017, eq. (7).
    """
    _check_logits_labels("logprobs_from_logits", logits, labels)
    dtype = float_dtype(logits)
    rows = []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        row = row_logits.to(dtype)
        picked = row.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row, dim=-1))
    if not rows:
        return logits.new_zeros(labels.shape, dtype=dtype)
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at every position, in nats, float32.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` per position. Row-at-a-time like
    :func:`logprobs_from_logits`. Mask the result with the action mask before averaging.

    Args:
        logits: ``(B, T, V)`` any floating dtype.

    Returns:
        ``(B, T)`` entropies in ``[0, log V]``.

    Raises:
        ValueError: ``logits`` not 3-D.

    Source: the entropy bonus term S of Schulman et al. 2017, eq. (9) (logged, not optimised here).
    """
    if logits.dim() != 3:
        raise ValueError(f"entropy_from_logits: logits must be (B, T, V), got shape {tuple(logits.shape)}")
    dtype = float_dtype(logits)
    rows = []
    for row_logits in logits:
        row = row_logits.to(dtype)
        probs = torch.softmax(row, dim=-1)
        rows.append(torch.logsumexp(row, dim=-1) - (probs * row).sum(-1))
    if not rows:
        return logits.new_zeros(logits.shape[:2], dtype=dtype)
    return torch.stack(rows)


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` in one pass per row, sharing ``logsumexp``.

    The log-probabilities are computed by the same operations as :func:`logprobs_from_logits` (equal
    to it bit for bit); the entropy ``H = lse - sum_v p_v z_v`` reuses ``lse`` and takes
    ``p = exp(z - lse)`` in place, so one ``(T, V)`` float32 temporary exists beside the input
    instead of the three of the separate functions. For the experience pass, where the entropy
    is only logged.

    Args:
        logits: ``(B, T, V)`` any floating dtype. labels: ``(B, T)`` integer ids in ``[0, V)``.

    Returns:
        ``(logp, entropy)``, both ``(B, T)`` float32 (float64 for float64 logits), in nats.

    Raises:
        ValueError: as :func:`logprobs_from_logits`.
    """
    _check_logits_labels("logprobs_and_entropy", logits, labels)
    dtype = float_dtype(logits)
    logp, entropy = [], []
    for row_logits, row_labels in zip(logits, labels, strict=True):
        row = row_logits.to(dtype)
        lse = torch.logsumexp(row, dim=-1)
        logp.append(row.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1) - lse)
        probs = (row - lse.unsqueeze(-1)).exp_()
        entropy.append(lse - torch.linalg.vecdot(probs, row))
    if not logp:
        empty = logits.new_zeros(labels.shape, dtype=dtype)
        return empty, empty.clone()
    return torch.stack(logp), torch.stack(entropy)


