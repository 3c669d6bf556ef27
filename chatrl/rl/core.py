"""Pure RLHF maths shared by every step-3 algorithm: masks, masked statistics, KL, PPO's KL-shaped
rewards and GAE, the value loss, the PTX loss, KL control (log-probs: :mod:`chatrl.logprobs`).

Every function here takes and returns tensors (or plain numbers): no I/O, no torch.distributed,
no config objects. The experience maker and the trainer own those concerns.

Conventions (docs/ppo.md lists them with their sources)
-------------------------------------------------------
* Per-token tensors live on the ANSWER part only, shape ``(B, A)``: ``B`` sequences in the batch,
  ``A`` generated positions. Column ``j`` refers to generated token ``j``.
* ``action_mask (B, A)``: 1 on generated tokens up to and including the first EOS, 0 after it and
  on padding. Any dtype; a position is valid where the mask is non-zero. Masked positions may hold
  any finite garbage in every other input: no output, loss, gradient or statistic depends on it.
* ``logp[:, j] = log pi(answer token j | prompt, answer tokens < j)``. With full-sequence logits
  ``(B, P + A, V)`` for a prompt block of length ``P`` that is ``logits[:, P - 1 : P + A - 1]``.
* ``values[:, j] = V(state before answer token j)``: the critic's output at the same positions.
* Log-probabilities are in nats.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from chatrl.logprobs import IGNORE_INDEX, float_dtype, logprobs_from_logits

__all__ = [
    "action_mask_from_tokens",
    "has_stop_token",
    "check_same_shape",
    "check_2d",
    "valid_mask",
    "where_valid",
    "masked_sum",
    "masked_mean",
    "masked_moments",
    "masked_var",
    "masked_whiten",
    "kl_penalty",
    "masked_kl",
    "compute_rewards",
    "gae",
    "critic_loss",
    "explained_variance",
    "ptx_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "KL_KINDS",
    "WHITEN_EPS",
]

#: Names accepted by :func:`kl_penalty` (``"k2"`` is an alias of ``"mse"``).
KL_KINDS = ("k1", "k3", "abs", "mse", "k2")

#: Added to the variance before the inverse square root in :func:`masked_whiten`.
WHITEN_EPS = 1e-8


# ----------------------------------------------------------------------------- validation helpers


def check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError, naming ``where`` and each tensor's shape, unless all ``tensors`` share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{shape}" for name, shape in shapes.items())
        raise ValueError(f"{where}: shapes must match, got {listed}")


def check_2d(where: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError, naming ``where`` and the tensor, unless every one of ``tensors`` is ``(B, A)``."""
    for name, t in tensors.items():
        if t.dim() != 2:
            raise ValueError(f"{where}: {name} must be (B, A), got shape {tuple(t.shape)}")


def where_valid(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` where ``valid`` (a boolean mask of its shape), 0 elsewhere: masked positions are selected
    out, not multiplied by 0, so inf or NaN there reaches neither the result nor its gradient."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def valid_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean view of a 0/1 mask of any dtype."""
    return mask if mask.dtype == torch.bool else mask != 0


# ----------------------------------------------------------------------------- masks


def has_stop_token(answer_ids: torch.Tensor, action_mask: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """``(B,)`` bool: the answer holds a stop token (``eos_token_id``, one id or several) under a
    non-zero of ``action_mask``. ``answer_ids`` and ``action_mask`` are ``(B, A)``; padding after the
    answer never counts (masks come from the action mask, not from pad ids)."""
    eos = torch.as_tensor(eos_token_id, device=answer_ids.device)
    return (torch.isin(answer_ids, eos) & (action_mask > 0)).any(dim=1)


def action_mask_from_tokens(
    answer_ids: torch.Tensor,
    eos_token_id: int | Sequence[int],
    answer_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask of the actions in generated answers: 1 up to and including the first EOS, 0 after.

    Args:
        answer_ids: ``(B, A)`` integer ids of the generated tokens only (prompt removed).
        eos_token_id: the EOS id, or several ids that all end an answer (e.g. Llama 3's
            ``<|eot_id|>`` and ``<|end_of_text|>``).
        answer_attention_mask: optional ``(B, A)`` mask, non-zero on real generated tokens and 0 on
            padding. An EOS under a 0 of this mask does not count. Use it when padding could be
            confused with tokens; never compare ids with the pad id to find padding.

    Returns:
        ``(B, A)`` float32 mask. Row ``[x, x, EOS, pad, pad]`` gives ``[1, 1, 1, 0, 0]``; an answer
        that is EOS at ``j = 0`` gives ``[1, 0, ...]`` (one action: the EOS); a row without EOS is
        all ones (or equals ``answer_attention_mask``). This is correct when pad == EOS too: only
        the first EOS counts.

    Raises:
        ValueError: ``answer_ids`` not 2-D or not integer, attention-mask shape mismatch, or no EOS id.

    Source: the "action mask" of PPO for language models, Ziegler et al. 2019 (fine-tuning LMs
    from human preferences), section 2; ``docs/ppo.md``, detail 3.
    """
    check_2d("action_mask_from_tokens", answer_ids=answer_ids)
    if answer_ids.is_floating_point() or answer_ids.dtype == torch.bool:
        raise ValueError(f"action_mask_from_tokens: answer_ids must be integer, got {answer_ids.dtype}")
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not eos_ids:
        raise ValueError("action_mask_from_tokens: eos_token_id is empty")
    is_eos = torch.isin(answer_ids, torch.tensor(eos_ids, dtype=answer_ids.dtype, device=answer_ids.device))
    real = torch.ones_like(is_eos)
    if answer_attention_mask is not None:
        check_same_shape(
            "action_mask_from_tokens", answer_ids=answer_ids, answer_attention_mask=answer_attention_mask
        )
        real = valid_mask(answer_attention_mask)
        is_eos = is_eos & real
    # Number of EOS tokens strictly before position j; positions after the first EOS see >= 1.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return ((eos_before == 0) & real).float()


# ----------------------------------------------------------------------------- masked statistics


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the positions where ``mask`` is non-zero.

    Masked positions are selected out (``torch.where``), not multiplied by 0, so even inf/NaN
    there neither reaches the result nor its gradient.

    Args:
        x: any shape, e.g. ``(B, A)``.
        mask: same shape as ``x``; non-zero = valid.
        dim: reduce over this dimension only; ``None`` reduces over everything (a scalar).

    Raises:
        ValueError: shapes differ.
    """
    check_same_shape("masked_sum", x=x, mask=mask)
    kept = torch.where(valid_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is non-zero.

    With ``dim=None`` this is the mean over all valid tokens of the batch (every token weighs the
    same, long answers weigh more). With ``dim=1`` it is a per-row mean. A reduction with no valid
    element gives 0 (not NaN), so an all-masked batch yields a zero loss with zero gradient.

    Args:
        x: any shape, e.g. ``(B, A)``.
        mask: same shape as ``x``; non-zero = valid.
        dim: as in :func:`masked_sum`.

    Raises:
        ValueError: shapes differ.
    """
    total = masked_sum(x, mask, dim)
    count = valid_mask(mask).sum() if dim is None else valid_mask(mask).sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_moments(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                   all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, deviations and squared deviations of ``x`` over the valid positions, in float64.

    The mean is refined by one correction pass: ``m0 = sum(x) / n``, then
    ``mean = m0 + sum(x - m0) / n``. For a constant input the refined mean equals the value
    exactly (``x - m0`` is exact near ``m0`` and the correction is far below half an ulp), so
    every deviation is exactly 0 for any ``n`` and value; the plain mean of ``n`` equal numbers can
    be off by a few ulps, and a normalisation that divides that error by a near-zero spread turns
    it into an O(1) advantage (8 rewards of 3.217 in float32 gave +0.477 each).

    Args:
        x: any shape, e.g. ``(B, A)`` or ``(groups, N)``.
        mask: same shape; non-zero = valid.
        dim: reduce over this dimension only (kept, size 1), or everything (``None``).
        all_reduce_sum: with ``dim=None``, sums a tensor over the data-parallel ranks (a
            collective: every rank calls this function); the moments are then those of all ranks'
            valid positions together. ``None``: this rank only.

    Returns:
        ``(mean, deviations, n, sum_sq)``: ``mean`` and ``n`` (the valid count) reduced over
        ``dim``; ``deviations`` ``x - mean`` of ``x``'s shape, 0 at masked positions;
        ``sum_sq`` the sum of squared deviations (>= 0). All float64; differentiable in ``x``.

    Raises:
        ValueError: shapes differ, or ``all_reduce_sum`` with a ``dim``.

    Source: the corrected two-pass algorithm, Chan, Golub & LeVeque (1983), "Algorithms for
    computing the sample variance", eq. 1.7.
    """
    check_same_shape("masked_moments", x=x, mask=mask)
    if all_reduce_sum is not None and dim is not None:
        raise ValueError("masked_moments: all_reduce_sum reduces over everything (dim=None)")
    reduce = all_reduce_sum or (lambda t: t)
    valid = valid_mask(mask)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    x64 = torch.where(valid, x.to(torch.float64), zero)

    def total(t: torch.Tensor) -> torch.Tensor:
        return t.sum() if dim is None else t.sum(dim=dim, keepdim=True)

    first = torch.stack([total(valid.to(torch.float64)), total(x64)])
    first = reduce(first) if dim is None else first
    n, m0 = first[0], first[1] / first[0].clamp(min=1)
    d0 = torch.where(valid, x64 - m0, zero)
    second = torch.stack([total(d0), total(d0 * d0)])
    second = reduce(second) if dim is None else second
    correction = second[0] / n.clamp(min=1)
    mean = m0 + correction
    sum_sq = (second[1] - n * correction * correction).clamp(min=0)
    return mean, torch.where(valid, x64 - mean, zero), n, sum_sq


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all positions where ``mask`` is non-zero (a scalar, in ``x``'s dtype).

    ``unbiased=True`` applies Bessel's correction ``n / (n - 1)``. It is undefined for ``n = 1``;
    this function then returns the biased value, 0, instead of dividing by zero (TRL and
    DeepSpeed-Chat raise or produce NaN there). No valid element also gives 0. Computed in
    float64 around a refined mean (:func:`masked_moments`): a constant input gives exactly 0.

    Args:
        x: any shape, e.g. ``(B, A)``.
        mask: same shape as ``x``; non-zero = valid.
        unbiased: Bessel-correct when at least two elements are valid.

    Raises:
        ValueError: shapes differ.
    """
    _, _, n, sum_sq = masked_moments(x, mask)
    dof = torch.where(n > 1, n - 1, n) if unbiased else n
    return (sum_sq / dof.clamp(min=1)).to(float_dtype(x) if x.is_floating_point() else torch.float32)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Normalise ``x`` to unit variance (and zero mean) using valid positions only.

    ``out = (x - mean) / sqrt(var + 1e-8)`` with the masked mean and the masked unbiased variance
    over the whole tensor (all rows together; with ``all_reduce_sum``, over every rank's valid
    positions). With ``shift_mean=False`` the mean is added back (only the scale changes). Masked
    positions of the output are 0. Computed in float64 around a refined mean
    (:func:`masked_moments`), so a constant input gives exactly 0 (``shift_mean=True``) whatever
    its size and value.

    With one valid token the variance is 0 and the result is finite: 0 (``shift_mean=True``) or
    the token itself (``shift_mean=False``). With none, the output is all zeros.

    Args:
        x: ``(B, A)`` (any shape), e.g. advantages.
        mask: same shape; non-zero = valid (the action mask).
        shift_mean: subtract the mean (True) or keep it (False).
        all_reduce_sum: sums a tensor over ranks (a collective; every rank must call this
            function); ``None``: this rank's positions only.

    Returns:
        Same shape as ``x``; float32 or wider (a bf16 ``x`` is promoted before the statistics).

    Raises:
        ValueError: shapes differ.

    Source: advantage normalisation, one of the PPO implementation details of Engstrom et al.
    2020 / Huang et al. 2022 ("The 37 implementation details of PPO", detail 7).
    """
    valid = valid_mask(mask)
    x = x.to(float_dtype(x))
    mean, dev, n, sum_sq = masked_moments(x, mask, all_reduce_sum=all_reduce_sum)
    var = sum_sq / torch.where(n > 1, n - 1, n).clamp(min=1)
    out = dev * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    out = out.to(x.dtype)
    return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


# ----------------------------------------------------------------------------- KL and rewards


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, elementwise.

    With ``log r = ref_logp - logp`` (the log ratio ref / policy at the sampled token):

    * ``"k1"``: ``logp - ref_logp = -log r``. Unbiased, can be negative per token.
    * ``"k3"``: ``(r - 1) - log r``. Unbiased, always >= 0, lower variance when pi is near pi_ref.
    * ``"mse"`` (alias ``"k2"``): ``0.5 * (logp - ref_logp) ** 2``. Biased, >= 0.
    * ``"abs"``: ``|logp - ref_logp|``. Biased, >= 0.

    All are exactly 0 where ``logp == ref_logp``. The caller masks the result.

    Args:
        logp: ``(B, A)`` log-probs of the sampled tokens under the policy (nats).
        ref_logp: ``(B, A)`` the same under the frozen reference.
        kind: one of :data:`KL_KINDS`.

    Returns:
        ``(B, A)`` in nats, float32 or wider (bf16 inputs are promoted first).

    Raises:
        ValueError: unknown ``kind`` or shape mismatch.

    Source: J. Schulman, "Approximating KL divergence" (2020 blog post), estimators k1, k2, k3.
    """
    check_same_shape("kl_penalty", logp=logp, ref_logp=ref_logp)
    dtype = float_dtype(logp, ref_logp)
    diff = logp.to(dtype) - ref_logp.to(dtype)
    if kind == "k1":
        return diff
    if kind == "k3":
        log_r = -diff
        return torch.expm1(log_r) - log_r
    if kind in ("mse", "k2"):
        return 0.5 * diff**2
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"kl_penalty: unknown kind {kind!r}; expected one of {KL_KINDS}")


def masked_kl(logp: torch.Tensor, ref_logp: torch.Tensor, action_mask: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """The per-token KL estimate :func:`kl_penalty` on action tokens, 0 elsewhere, detached.

    Masked positions are selected out before estimating, so garbage there can never overflow
    (``k3``'s exponential).

    Args:
        logp: ``(B, A)`` policy log-probs of the generated tokens at experience time.
        ref_logp: ``(B, A)`` reference log-probs of the same tokens.
        action_mask: ``(B, A)``, non-zero on actions.
        kind: one of :data:`KL_KINDS`.

    Returns:
        ``(B, A)``, float32 or wider, in nats (log its masked per-row sum as "kl").

    Raises:
        ValueError: shape mismatch or an unknown ``kind``.
    """
    check_2d("masked_kl", logp=logp)
    check_same_shape("masked_kl", logp=logp, ref_logp=ref_logp, action_mask=action_mask)
    dtype = float_dtype(logp, ref_logp)
    with torch.no_grad():
        valid = valid_mask(action_mask)
        lp, ref = where_valid(logp.to(dtype), valid), where_valid(ref_logp.to(dtype), valid)
        return where_valid(kl_penalty(lp, ref, kind), valid)


def compute_rewards(
    score: torch.Tensor,
    kl: torch.Tensor,
    action_mask: torch.Tensor,
    kl_coef: float = 0.1,
    clip_reward_value: float | None = 5.0,
) -> torch.Tensor:
    """Per-token rewards: a KL penalty on every action plus the clipped score on the last action.

    ``rewards[b, t] = -kl_coef * kl[b, t]`` on action tokens, 0 elsewhere, and
    ``clip(score[b], -c, c)`` is added at the LAST action token of row ``b`` (the largest ``t``
    with ``action_mask[b, t] != 0``), never at a later position. A row with no action token gets
    no reward at all (all zeros).

    Args:
        score: ``(B,)`` reward of each full sequence (prompt + answer).
        kl: ``(B, A)`` per-token KL estimate, 0 at masked positions (:func:`masked_kl`).
        action_mask: ``(B, A)``, 1 on actions (generated tokens through the first EOS).
        kl_coef: beta >= 0 (DeepSpeed-Chat default 0.1); take it from a KL controller's ``.value``
            (0 when the KL is a loss term instead).
        clip_reward_value: c > 0 (default 5.0); ``None`` or ``inf`` disables the clip.

    Returns:
        ``(B, A)`` rewards, float32 or wider, detached, 0 at masked positions.

    Raises:
        ValueError: shape mismatch, negative ``kl_coef``, non-positive ``clip_reward_value``.

    Source: Ziegler et al. 2019, eq. (2) (R = r - beta * KL), Ouyang et al. 2022, eq. (2)
    (per-token KL against the SFT reference); score clipping as in DeepSpeed-Chat.
    """
    check_2d("compute_rewards", kl=kl)
    check_same_shape("compute_rewards", kl=kl, action_mask=action_mask)
    if tuple(score.shape) != (kl.shape[0],):
        raise ValueError(f"compute_rewards: score must be (B,) = ({kl.shape[0]},), got {tuple(score.shape)}")
    if kl_coef < 0:
        raise ValueError(f"compute_rewards: kl_coef must be >= 0, got {kl_coef}")
    if clip_reward_value is not None and not clip_reward_value > 0:
        raise ValueError(f"compute_rewards: clip_reward_value must be > 0 or None, got {clip_reward_value}")
    dtype = float_dtype(kl, score)
    with torch.no_grad():
        valid = valid_mask(action_mask)
        zero = torch.zeros((), dtype=dtype, device=kl.device)
        rewards = -kl_coef * torch.where(valid, kl.to(dtype), zero)
        s = score.to(dtype)
        if clip_reward_value is not None and math.isfinite(clip_reward_value):
            s = s.clamp(-clip_reward_value, clip_reward_value)
        positions = torch.arange(kl.shape[1], device=kl.device)
        last = torch.where(valid, positions, -1).amax(dim=1) if kl.shape[1] else None
        if last is not None:
            at_last = (positions.unsqueeze(0) == last.unsqueeze(1)) & valid
            rewards = rewards + torch.where(at_last, s.unsqueeze(1), zero)
    return rewards


# ----------------------------------------------------------------------------- advantages


def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action tokens of each row.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    ``t + 1`` is the NEXT ACTION token of the row: masked positions are skipped, not steps of the
    episode. Beyond the last action token ``V`` and ``A`` are 0 (the episode ends with the
    answer). A masked position's value and reward are never read, so garbage there cannot leak
    into any advantage.

    Single-turn action masks are prefixes (masked positions only after the answer). In a
    multi-turn episode (``docs/multi_turn.md``) the observation tokens an environment appended
    between two assistant turns are masked holes inside the answer region: the agent did not act
    there, so the bootstrap from the last token of turn ``k`` goes to the first token of turn
    ``k + 1`` (its value is the value of the state after the observation), discounted once.
    Stopping at the hole instead would cut the episode into independent ones and drop the final
    reward from every earlier turn's advantage.

    Args:
        values: ``(B, A)`` critic values ``V(state before token t)`` recorded at experience time.
        rewards: ``(B, A)`` per-token rewards from :func:`compute_rewards`.
        action_mask: ``(B, A)``, non-zero on actions.
        gamma: discount in [0, 1] (default 1.0).
        lam: GAE lambda in [0, 1] (default 0.95). ``lam = 1`` gives Monte-Carlo returns.

    Returns:
        ``(advantages, returns)``, both ``(B, A)``, detached, float32 or wider;
        ``returns = advantages + values`` on action tokens; both are 0 at masked positions.
        Advantages are not whitened: see :func:`masked_whiten`.

    Raises:
        ValueError: shape mismatch or gamma / lam outside [0, 1].

    Source: Schulman et al. 2016 (High-dimensional continuous control using GAE), eq. (16); the
    skipped observation tokens as in veRL's multi-turn GAE (``response_mask``).
    """
    check_2d("gae", values=values)
    check_same_shape("gae", values=values, rewards=rewards, action_mask=action_mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gae: gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"gae: lam must be in [0, 1], got {lam}")
    dtype = float_dtype(values, rewards)
    with torch.no_grad():
        valid = valid_mask(action_mask)
        zero = torch.zeros((), dtype=dtype, device=values.device)
        v = torch.where(valid, values.to(dtype), zero)
        r = torch.where(valid, rewards.to(dtype), zero)
        m = valid.to(dtype)
        batch, length = v.shape
        next_value = torch.zeros(batch, dtype=dtype, device=v.device)
        next_adv = torch.zeros(batch, dtype=dtype, device=v.device)
        columns = []
        for t in reversed(range(length)):
            delta = r[:, t] + gamma * next_value - v[:, t]
            adv_t = (delta + gamma * lam * next_adv) * m[:, t]
            # a masked position is skipped: the next action's value and advantage carry over it
            next_adv = torch.where(valid[:, t], adv_t, next_adv)
            next_value = torch.where(valid[:, t], v[:, t], next_value)
            columns.append(adv_t)
        if columns:
            advantages = torch.stack(columns[::-1], dim=1)
        else:
            advantages = v.new_zeros(v.shape)
        returns = torch.where(valid, advantages + v, zero)
    return advantages, returns


# ----------------------------------------------------------------------------- losses


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip_value: float | None = 0.2,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: a masked mean over the batch's action tokens, or the batch's share of an
    optimizer step's token mean.

    ``v_clip = old_values + clip(values - old_values, -eps, eps)``;
    ``loss_t = 0.5 * max((values - R)^2, (v_clip - R)^2)``; ``loss = masked_mean(loss_t)``, or with
    ``normalizer`` ``loss = masked_sum(loss_t) / normalizer``: given the action-token count of the
    whole optimizer step (every micro-batch, every rank: :func:`chatrl.rl.loss.step_normalizers`),
    the micro-batches' gradients sum to the gradient of the step's token mean, whatever the split
    (the policy loss's ``token-mean``).

    Args:
        values: ``(B, A)`` current critic values (with grad).
        old_values: ``(B, A)`` values recorded when the experience was made.
        returns: ``(B, A)`` targets R from :func:`gae` (constants).
        action_mask: ``(B, A)``, non-zero on actions. Masked positions of every input are ignored.
        clip_value: epsilon > 0 in the units of the value (default 0.2); ``None`` disables
            clipping (plain 0.5 * squared error).
        normalizer: > 0, the token count the sum is divided by; ``None``: this batch's own count.

    Returns:
        ``(loss, stats)``: 0-dim loss, float32 or wider (0 when no token is valid); ``stats["value_clip_frac"]``,
        detached: fraction of action tokens where the clipped term is strictly larger (its
        gradient is then 0).

    Raises:
        ValueError: shape mismatch, ``clip_value <= 0`` or ``normalizer <= 0``.

    Source: value-function clipping of the OpenAI baselines PPO2 implementation, described in
    Huang et al. 2022 ("The 37 implementation details of PPO", detail 9); squared-error value loss
    of Schulman et al. 2017, eq. (9).
    """
    check_2d("critic_loss", values=values)
    check_same_shape(
        "critic_loss", values=values, old_values=old_values, returns=returns, action_mask=action_mask
    )
    if clip_value is not None and not clip_value > 0:
        raise ValueError(f"critic_loss: clip_value must be > 0 or None, got {clip_value}")
    if normalizer is not None and not float(normalizer) > 0:
        raise ValueError(f"critic_loss: normalizer must be > 0, got {float(normalizer)}")
    valid = valid_mask(action_mask)
    dtype = float_dtype(values, old_values, returns)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    v = torch.where(valid, values.to(dtype), zero)
    old = torch.where(valid, old_values.detach().to(dtype), zero)
    ret = torch.where(valid, returns.detach().to(dtype), zero)
    unclipped = (v - ret) ** 2
    if clip_value is None:
        clipped = unclipped
    else:
        clipped = (old + (v - old).clamp(-clip_value, clip_value) - ret) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    if normalizer is None:
        loss = masked_mean(per_token, valid)
    else:
        total = masked_sum(per_token, valid)
        loss = total / torch.as_tensor(normalizer, dtype=total.dtype, device=total.device)
    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).to(unclipped.dtype), valid)
    return loss, {"value_clip_frac": clip_frac.detach()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How much of the variance of the returns the values explain: ``1 - Var(R - V) / Var(R)``.

    Masked (biased) variances over all valid positions. 1 = perfect critic, 0 = no better than a
    constant, < 0 = worse than a constant. NaN when ``Var(R) == 0`` (fewer than two distinct
    valid returns), as in cleanrl.

    Args:
        values: ``(B, A)`` critic values.
        returns: ``(B, A)`` GAE returns.
        mask: ``(B, A)`` action mask; non-zero = valid.

    Returns:
        Detached 0-dim float tensor.

    Raises:
        ValueError: shape mismatch.
    """
    check_same_shape("explained_variance", values=values, returns=returns, mask=mask)
    with torch.no_grad():
        dtype = float_dtype(values, returns)
        valid = valid_mask(mask)
        zero = torch.zeros((), dtype=dtype, device=values.device)
        v = torch.where(valid, values.to(dtype), zero)
        ret = torch.where(valid, returns.to(dtype), zero)
        var_r = masked_var(ret, valid, unbiased=False)
        var_res = masked_var(ret - v, valid, unbiased=False)
        nan = torch.full((), float("nan"), dtype=dtype, device=values.device)
        return torch.where(var_r > 0, 1.0 - var_res / torch.where(var_r > 0, var_r, 1.0), nan)


def ptx_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Plain language-modelling loss (mean token negative log-likelihood) for PPO-ptx.

    No shift is applied: ``logits[:, t]`` predicts ``labels[:, t]`` (pass ``logits[:, :-1]`` and
    ``input_ids[:, 1:]`` for next-token prediction). Labels equal to ``ignore_index`` (padding,
    from the attention mask) are ignored; the mean is over the remaining tokens of the batch, 0
    if there are none. The trainer takes a separate actor micro-step on ``unsup_coef * ptx_loss``.

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` integer ids in ``[0, V)`` or ``ignore_index``.
        ignore_index: label value that marks positions without a target.

    Returns:
        0-dim float32 loss in nats per token.

    Raises:
        ValueError: as :func:`logprobs_from_logits` for the non-ignored labels.

    Source: Ouyang et al. 2022 (InstructGPT), eq. (2), the gamma * E_pretrain[log pi] term.
    """
    if labels.dim() != 2:
        raise ValueError(f"ptx_loss: labels must be (B, T), got shape {tuple(labels.shape)}")
    keep = labels != ignore_index
    logp = logprobs_from_logits(logits, torch.where(keep, labels, torch.zeros_like(labels)))
    return -masked_mean(logp, keep)


# ----------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant KL coefficient beta.

    ``value`` is beta; ``update`` does nothing. ``state_dict`` / ``load_state_dict`` round-trip
    the value like the adaptive controller, so the two are interchangeable in a checkpoint.

    Raises:
        ValueError: ``kl_coef < 0``.

    Source: Ziegler et al. 2019, section 2.2 (fixed beta).
    """

    kind = "fixed"

    def __init__(self, kl_coef: float = 0.1):
        if kl_coef < 0:
            raise ValueError(f"FixedKLController: kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for interface parity with :class:`AdaptiveKLController`)."""

    def state_dict(self) -> dict:
        """The controller's state for a checkpoint: ``{kind, value}``."""
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``value``. Raises ValueError if ``state`` came from another controller kind."""
        _check_kind(self.kind, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient that steers the measured KL toward a target.

    ``e = clip(current_kl / target - 1, -0.2, 0.2)`` and ``value *= 1 + e * n_steps / horizon``.

    Args:
        init_kl_coef: initial beta >= 0.
        target: KL target > 0, in the units of ``current_kl`` (chatrl passes the batch mean of
            the per-sequence summed KL, nats per answer).
        horizon: > 0, the number of samples (``n_steps``) over which beta adapts by ~e.

    ``state_dict`` holds ``value`` (the only state); ``target`` and ``horizon`` come from the
    constructor so a resumed run follows the current configuration.

    Raises:
        ValueError: invalid arguments.

    Source: Ziegler et al. 2019 (Fine-tuning language models from human preferences), section 2.2
    (log-space proportional controller), as in their lm-human-preferences code.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if init_kl_coef < 0:
            raise ValueError(f"AdaptiveKLController: init_kl_coef must be >= 0, got {init_kl_coef}")
        if not target > 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Update ``value`` after a batch of ``n_steps`` samples whose mean KL is ``current_kl``.

        Raises:
            ValueError: ``n_steps < 0`` or a non-finite ``current_kl``.
        """
        current_kl = float(current_kl)
        if n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be >= 0, got {n_steps}")
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl is not finite ({current_kl})")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """The controller's state for a checkpoint: ``{kind, value, target, horizon}``."""
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``value``. Raises ValueError if ``state`` came from another controller kind."""
        _check_kind(self.kind, state)
        self.value = float(state["value"])


def _check_kind(kind: str, state: dict) -> None:
    if state.get("kind", kind) != kind or "value" not in state:
        raise ValueError(f"KL controller state {state!r} does not belong to a {kind!r} controller")
