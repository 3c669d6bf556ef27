"""Token maths shared by every step that reads a causal LM's distribution: the log-probability
of given tokens and the entropy of each position's distribution, computed from logits.

Below the hybrid engine (its sampler reports each sampled token's log-prob with the training
forward's own formula, so that ``rollout/logp_diff`` measures the forward passes only) and the RL
maths (:mod:`chatrl.rl`). Pure tensor functions; log-probabilities are in nats; the log-probs are
computed a few positions at a time with a backward of their own (:func:`token_logprobs`), so that a
bf16 ``(B, T, V)`` batch is never up-cast to float32 whole, forward or backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["IGNORE_INDEX", "float_dtype", "logprobs_from_logits", "token_logprobs", "entropy_from_logits",
           "logprobs_and_entropy"]

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
    :func:`token_logprobs` at temperature 1, whose chunks keep the float32 work small.
    Differentiable.

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
    return token_logprobs(logits, labels)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``labels`` under ``softmax(logits / temperature)`` (and, with ``entropy``,
    each position's entropy), a few positions at a time, with a backward of its own.

    Per chunk of positions: ``z = logits.to(float32) / temperature`` (no division at 1),
    ``logp = z[label] - logsumexp(z)``, ``H = logsumexp(z) - sum_v softmax(z)_v z_v``. The backward
    is the closed form ``d logp / d logits = (onehot(label) - softmax(z)) / temperature`` times the
    incoming gradient, computed chunk by chunk from the saved logits and ``logsumexp`` and cast
    to the logits' dtype. The numbers are those of autograd through the plain formula (up-cast the
    whole tensor, divide, gather minus logsumexp), to the bit on CPU in bf16 and fp32
    (``tests/unit/test_logprobs.py``); what changes is the work: the plain formula's backward
    makes five full-size float32 temporaries (the up-cast, the division, the gather's zeros,
    ``exp(z - lse)`` and the sum of the two gradients) and streams each through memory, where this
    one's temporaries are a chunk each: on CPU about 1 MiB (about 5 positions of a 50k vocabulary),
    which stays in the core's cache; elsewhere 64 MiB. Off CPU, contiguous logits are taken as one
    row of ``B * T`` positions, so a decoding step's ``(B, 1, V)`` scores are one chunk, not ``B``
    rounds of small kernels; on CPU chunks stay within a row (a reduction's bits can depend on how
    many rows it is given when it has several threads, and the row is what the plain formula gives it).
    ``bench/token_logprobs.py`` measures it. The backward is once-differentiable (no double backward).

    Args:
        logits: ``(B, T, V)`` any floating dtype (the work is in float32, float64 for float64).
        labels: ``(B, T)`` integer ids in ``[0, V)`` (not checked here; :func:`logprobs_from_logits`
            checks them).
        temperature: > 0; the sampler's (step 3 scores its rollouts at it).
        entropy: also return the entropy; it is not differentiable (logged, not optimised).

    Returns:
        ``logp`` ``(B, T)`` in nats, float32 (float64 for float64 logits); with ``entropy``,
        ``(logp, entropy)``, both ``(B, T)``.

    Raises:
        ValueError: ``temperature`` not > 0, ``logits`` not 3-D. Labels out of range fail in
        ``gather`` (an index error on CPU, a device assert on CUDA).

    Source: log pi(a|s), Schulman et al. 2017, eq. (7); the softmax's gradient
    ``d log softmax(z)_y / d z = onehot(y) - softmax(z)``.
    """
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if logits.dim() != 3:
        raise ValueError(f"token_logprobs: logits must be (B, T, V), got shape {tuple(logits.shape)}")
    shape = labels.shape
    if logits.device.type != "cpu" and logits.is_contiguous() and labels.is_contiguous():  # fewer kernel launches
        logits, labels = logits.view(1, -1, logits.shape[-1]), labels.view(1, -1)
    logp, ent = _TokenLogprobs.apply(logits, labels, float(temperature), entropy)
    return (logp.view(shape), ent.view(shape)) if entropy else logp.view(shape)


def _chunk_positions(logits: torch.Tensor, dtype: torch.dtype) -> int:
    """Positions per chunk of :func:`token_logprobs`: about 1 MiB of ``dtype`` work per chunk on CPU
    (the per-core cache), 64 MiB elsewhere."""
    budget = (1 << 20) if logits.device.type == "cpu" else (64 << 20)
    return max(1, budget // max(1, logits.shape[-1] * torch.finfo(dtype).bits // 8))


def _chunks(logits: torch.Tensor, dtype: torch.dtype):
    step = _chunk_positions(logits, dtype)
    for b in range(logits.shape[0]):
        for t in range(0, logits.shape[1], step):
            yield b, slice(t, t + step)


def _scaled(chunk: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    z = chunk.to(dtype)
    return z / temperature if temperature != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    """:func:`token_logprobs`' forward and closed-form backward."""

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, entropy: bool):
        dtype = float_dtype(logits)
        logp = torch.empty(labels.shape, dtype=dtype, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else None
        for b, t in _chunks(logits, dtype):
            z = _scaled(logits[b, t], dtype, temperature)
            lse[b, t] = torch.logsumexp(z, dim=-1)
            logp[b, t] = z.gather(-1, labels[b, t].unsqueeze(-1)).squeeze(-1) - lse[b, t]
            if entropy:
                probs = (z - lse[b, t].unsqueeze(-1)).exp_()
                ent[b, t] = lse[b, t] - torch.linalg.vecdot(probs, z)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        if ent is None:
            ent = logp.new_zeros(())
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        logits, labels, lse = ctx.saved_tensors
        temperature, dtype = ctx.temperature, grad_logp.dtype
        grad = torch.empty_like(logits)
        for b, t in _chunks(logits, dtype):
            g = grad_logp[b, t].unsqueeze(-1)
            z = _scaled(logits[b, t], dtype, temperature)
            gz = (z - lse[b, t].unsqueeze(-1)).exp_().mul_(-g)  # the logsumexp's share: -g softmax(z)
            gz.scatter_add_(-1, labels[b, t].unsqueeze(-1), g)  # the label's: + g
            grad[b, t] = gz.div_(temperature) if temperature != 1.0 else gz
        return grad, None, None, None


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at every position, in nats.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` per position, one row at a time (a
    float32 copy of one row beside the input). Mask the result with the action mask before averaging.

    Args:
        logits: ``(B, T, V)`` any floating dtype.

    Returns:
        ``(B, T)`` entropies in ``[0, log V]``, float32 (float64 for float64 logits).

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
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` in one pass, sharing ``logsumexp``
    (:func:`token_logprobs` with ``entropy``).

    The log-probabilities equal :func:`logprobs_from_logits`' bit for bit; the entropy
    ``H = lse - sum_v p_v z_v`` reuses ``lse`` and takes ``p = exp(z - lse)`` in place, one chunk of
    positions at a time. For the experience pass, where the entropy is only logged (it is not
    differentiable).

    Args:
        logits: ``(B, T, V)`` any floating dtype. labels: ``(B, T)`` integer ids in ``[0, V)``.

    Returns:
        ``(logp, entropy)``, both ``(B, T)`` float32 (float64 for float64 logits), in nats.

    Raises:
        ValueError: as :func:`logprobs_from_logits`.
    """
    _check_logits_labels("logprobs_and_entropy", logits, labels)
    return token_logprobs(logits, labels, entropy=True)
