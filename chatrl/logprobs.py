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
           "logprobs_and_entropy", "sampling_filter"]

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


def sampling_filter(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``scores`` with the tokens that top-k and then top-p (nucleus) sampling drop set to ``-inf``.

    Hugging Face ``generate``'s warpers, in their order and with their ties: top-k keeps every
    token whose score is at least the k-th largest; top-p sorts the (top-k filtered) scores in
    ascending order and drops the tokens whose cumulative softmax mass is ``<= 1 - top_p``, always
    keeping the likeliest. The sampler (:func:`chatrl.hybrid_engine.decode.process_logits`) and the
    trainer (:func:`token_logprobs`) both call this, so they filter alike.

    Args:
        scores: ``(..., V)`` float scores (logits already divided by the temperature).
        top_k: ``>= 0``; 0 disables it. top_p: in ``(0, 1]``; 1 disables it.

    Returns:
        ``scores`` itself when both filters are off, else a new tensor of its shape and dtype.

    Source: Fan et al. 2018 (top-k sampling); Holtzman et al. 2020 (nucleus sampling).
    """
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    return scores


def _filtered(z: torch.Tensor, labels: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`sampling_filter` of ``z`` ``(T, V)`` with each position's label kept (its own score)."""
    if top_k <= 0 and top_p >= 1.0:
        return z
    index = labels.unsqueeze(-1)
    return sampling_filter(z, top_k, top_p).scatter(-1, index, z.gather(-1, index))


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   entropy: bool = False, top_k: int = 0, top_p: float = 1.0
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``labels`` under ``softmax(logits / temperature)`` (and, with ``entropy``,
    each position's entropy), a few positions at a time, with a backward of its own; with ``top_k``
    or ``top_p``, under the distribution those filters leave (the one a sampler with them draws from).

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

    With a filter, the softmax is taken over the tokens :func:`sampling_filter` keeps at each
    position plus that position's label (so the log-prob is finite even where the label fell outside,
    after the weights moved): ``logp = z[label] - logsumexp(z over kept)``, its gradient
    ``onehot(label) - softmax over kept`` (0 on the dropped tokens; the kept set is piecewise constant
    in the logits), and the entropy that of the filtered distribution. On the logits a sampler drew
    from, the label is always kept and this is exactly the sampler's distribution.

    Args:
        logits: ``(B, T, V)`` any floating dtype (the work is in float32, float64 for float64).
        labels: ``(B, T)`` integer ids in ``[0, V)`` (not checked here; :func:`logprobs_from_logits`
            checks them).
        temperature: > 0; the sampler's (step 3 scores its rollouts at it).
        entropy: also return the entropy; it is not differentiable (logged, not optimised).
        top_k, top_p: the sampler's filters (0 and 1: off), applied after the temperature.

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
    logp, ent = _TokenLogprobs.apply(logits, labels, float(temperature), entropy, int(top_k), float(top_p))
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
    def forward(ctx, logits, labels, temperature: float, entropy: bool, top_k: int, top_p: float):
        dtype = float_dtype(logits)
        logp = torch.empty(labels.shape, dtype=dtype, device=logits.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else None
        for b, t in _chunks(logits, dtype):
            z = _scaled(logits[b, t], dtype, temperature)
            kept = _filtered(z, labels[b, t], top_k, top_p)
            lse[b, t] = torch.logsumexp(kept, dim=-1)
            logp[b, t] = z.gather(-1, labels[b, t].unsqueeze(-1)).squeeze(-1) - lse[b, t]
            if entropy:
                probs = (kept - lse[b, t].unsqueeze(-1)).exp_()  # 0 on dropped tokens, whose z is finite
                ent[b, t] = lse[b, t] - torch.linalg.vecdot(probs, z)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.top_k, ctx.top_p = temperature, top_k, top_p
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
            z = _filtered(_scaled(logits[b, t], dtype, temperature), labels[b, t], ctx.top_k, ctx.top_p)
            gz = (z - lse[b, t].unsqueeze(-1)).exp_().mul_(-g)  # the logsumexp's share: -g softmax(z)
            gz.scatter_add_(-1, labels[b, t].unsqueeze(-1), g)  # the label's: + g
            grad[b, t] = gz.div_(temperature) if temperature != 1.0 else gz
        return grad, None, None, None, None, None


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
