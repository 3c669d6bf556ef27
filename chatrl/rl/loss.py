"""The policy loss of every step-3 algorithm, its aggregation over an optimizer step, and the
sampler/trainer agreement check.

Pure tensor functions following :mod:`chatrl.rl.core`'s conventions (per-token tensors ``(B, A)``
over the answer part, ``action_mask`` non-zero on actions, log-probs in nats). A cross-rank
reduction is passed in as a callable (``None``: one rank).

Loss aggregation (``--loss_agg_mode``)
--------------------------------------
With a *global* mode (``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``) the
loss of one optimizer step is ``sum(per-token or per-sequence terms) / normaliser`` where the
normaliser counts the whole step: every micro-batch of the accumulation on every rank
(:func:`step_normalizers`). Each micro-batch's :func:`policy_loss` divides its LOCAL sum by that
GLOBAL normaliser, so the gradients summed over micro-batches and ranks equal the gradient of the
whole step's loss, whatever the split. DeepSpeed's ``engine.backward`` divides the loss by
``gradient_accumulation_steps`` and its gradient all-reduce averages over ranks; multiply the loss by
:func:`loss_scale` before ``backward`` to undo both.

``micro-batch-token-mean`` is DeepSpeed-Chat's aggregation (kept for parity; every algorithm's
default is ``token-mean``): each micro-batch's loss is the mean over its own action tokens and
DeepSpeed averages the micro-batches and ranks, so a token's weight depends on how many tokens share
its micro-batch, and the gradient on how the buffer is split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatrl.errors import UsageError
from chatrl.logprobs import float_dtype
from chatrl.rl import core

AllReduce = Callable[[torch.Tensor], torch.Tensor]

#: Loss aggregation modes (veRL's names for the global ones): see :func:`policy_loss`.
GLOBAL_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSS_AGG_MODES = ("micro-batch-token-mean", *GLOBAL_LOSS_AGG_MODES)

#: Where the KL to the reference goes: a per-token penalty in the reward, or a term of the loss.
KL_PLACEMENTS = ("reward", "loss")
#: Estimators of the KL loss term (``--kl_loss_estimator``, :func:`kl_loss_term`); the first is the default.
KL_LOSS_ESTIMATORS = ("k3+", "k2", "k3")

#: Importance ratio of the sampler/trainer correction: per token, per answer (the product of its
#: tokens' ratios), or per answer as the geometric mean of its tokens' ratios (:func:`rollout_is_weights`).
ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
#: What happens to a ratio outside the band: capped at the upper bound, or its weight set to 0.
ROLLOUT_IS_MODES = ("truncate", "mask")


def truncated_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, action_mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old_logp - sampler_logp), cap)`` per token, detached.

    ``old_logp`` is the training forward's log-prob of the sampled token at experience time,
    ``sampler_logp`` the generator's. Where they agree the weight is 1. Multiplying the per-token
    policy loss by these weights corrects (with bias bounded by the cap) for sampling from a
    slightly different distribution than the one trained.

    Args:
        old_logp, sampler_logp: ``(B, A)`` nats. action_mask: ``(B, A)``. cap: ``C >= 1``.

    Returns:
        ``(B, A)`` weights in ``(0, cap]``, 0 at masked positions.

    Raises:
        ValueError: shape mismatch or ``cap < 1``.

    Source: Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL
    training", truncated importance sampling); Ionides 2008 (truncated importance sampling).
    """
    return rollout_is_weights(old_logp, sampler_logp, action_mask, level="token", mode="truncate", cap=cap)[0]


def check_rollout_is(level: str, mode: str, cap: float, cap_low: float | None) -> float:
    """Check the importance-weight settings (``--rollout_is_level``, ``--rollout_is_mode``,
    ``--rollout_is_cap``, ``--rollout_is_cap_low``) and return the band's lower bound (``1 / cap`` when
    unset). Step 3 calls it before loading any model.

    Raises:
        UsageError: naming the flag: an unknown level or mode, ``cap < 1`` or ``cap_low`` outside ``(0, 1]``.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise UsageError(f"--rollout_is_level must be one of {ROLLOUT_IS_LEVELS}, got {level!r}")
    if mode not in ROLLOUT_IS_MODES:
        raise UsageError(f"--rollout_is_mode must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
    if not cap >= 1:
        raise UsageError(f"--rollout_is_cap must be >= 1 (the band's upper bound; 0 turns the correction off), "
                         f"got {cap}")
    cap_low = 1.0 / cap if cap_low is None else cap_low
    if not 0 < cap_low <= 1:
        raise UsageError(f"--rollout_is_cap_low must be in (0, 1], got {cap_low}")
    return cap_low


def rollout_is_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, action_mask: torch.Tensor, *,
                       level: str = "token", mode: str = "truncate", cap: float = 2.0,
                       cap_low: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights correcting for the sampler's distribution, per token or per answer, detached.

    With ``d_t = old_logp_t - sampler_logp_t`` on action tokens (the training forward's log-prob of
    the sampled token minus the sampler's), the log-ratio is ``d_t`` (``token``), ``sum_t d_t`` of
    the answer (``sequence``: the answer's probability ratio) or ``mean_t d_t`` (``geometric``: the
    geometric mean of its tokens' ratios, which does not grow with length); an answer's ratio is
    given to each of its tokens. Then, with ``r`` the ratio and the band ``[cap_low, cap]``:

    * ``truncate``: ``w = min(r, cap)`` (a ratio below the band is kept: it only down-weights);
    * ``mask``: ``w = r`` inside the band, ``0`` outside (the token, or the whole answer, is dropped
      from the loss; the loss's normaliser still counts it).

    Computed in log space, so a long answer's ratio cannot overflow. ``token`` with ``truncate`` is
    :func:`truncated_is_weights`.

    Args:
        old_logp, sampler_logp: ``(B, A)`` nats. action_mask: ``(B, A)``.
        level: one of :data:`ROLLOUT_IS_LEVELS`. mode: one of :data:`ROLLOUT_IS_MODES`.
        cap: upper bound ``>= 1`` (``--rollout_is_cap``). cap_low: lower bound in ``(0, 1]``
            (``--rollout_is_cap_low``), default ``1 / cap``; only ``mask`` reads it.

    Returns:
        ``(weights, outside)``: ``(B, A)`` weights (float32 or wider, 0 at masked positions) and a
        ``(B, A)`` bool, True on action tokens whose ratio lies outside the band (``truncate``:
        above ``cap``), for the share that the correction changed.

    Raises:
        ValueError: shape mismatch; :class:`chatrl.errors.UsageError` (a ValueError) from
            :func:`check_rollout_is` for bad settings.

    Source: Yao et al. 2025 (truncated importance sampling, token level); Zheng et al. 2025 (GSPO,
    the length-normalised sequence ratio); veRL's rollout importance sampling (levels token,
    sequence and geometric; modes truncate and mask); Ionides 2008 (truncated importance sampling).
    """
    core.check_same_shape("rollout_is_weights", old_logp=old_logp, sampler_logp=sampler_logp,
                           action_mask=action_mask)
    core.check_2d("rollout_is_weights", old_logp=old_logp)
    cap_low = check_rollout_is(level, mode, cap, cap_low)
    with torch.no_grad():
        valid = core.valid_mask(action_mask)
        dtype = float_dtype(old_logp, sampler_logp)
        zero = torch.zeros((), dtype=dtype, device=old_logp.device)
        d = torch.where(valid, old_logp.to(dtype) - sampler_logp.to(dtype), zero)
        if level == "token":
            log_r = d
        else:
            total = d.sum(dim=1, keepdim=True)
            if level == "geometric":
                total = total / valid.sum(dim=1, keepdim=True).clamp(min=1).to(dtype)
            log_r = total.expand_as(d)
        hi, lo = math.log(cap), math.log(cap_low)
        if mode == "truncate":
            outside = valid & (log_r > hi)
            w = torch.exp(log_r.clamp(max=hi))
        else:
            outside = valid & ((log_r > hi) | (log_r < lo))
            w = torch.where(outside, zero, torch.exp(log_r.clamp(min=lo, max=hi)))
        return torch.where(valid, w, zero), outside


def kl_loss_term(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3+") -> torch.Tensor:
    """Per-token KL loss term on tokens sampled from the policy: its value, and the gradient that flows
    through ``logp``.

    With ``d = logp - ref_logp`` at the sampled token (``ref_logp`` is a constant) and ``r = exp(-d)``:

    * ``"k2"``: ``0.5 d**2``; gradient ``d * grad(logp)``, whose expectation over tokens drawn from the
      policy pi is ``grad KL(pi || pi_ref)`` (the mode-seeking KL the penalty means). Its value is a
      biased estimate of the KL (the second-order term).
    * ``"k3+"`` (the default): the value of k3, ``(r - 1) - log r`` (an unbiased estimate of
      ``KL(pi || pi_ref)``), with k2's gradient taken straight through (``k3 + k2 - stop_grad(k2)``):
      the logged value is the KL and the expected gradient is ``grad KL(pi || pi_ref)``.
    * ``"k3"``: k3 differentiated as written (GRPO's loss term); gradient ``(1 - r) * grad(logp)``,
      whose expectation is ``grad KL(pi_ref || pi)``, the mass-covering direction: the right value,
      pulled by the other KL. Kept for comparison with runs that used it.

    All three are 0 with gradient 0 where ``logp == ref_logp``. The expectations hold for on-policy
    tokens (the first pass over a buffer); after an update inside the buffer the tokens come from the
    older policy, as for the rest of the PPO loss.

    Args:
        logp: ``(B, A)`` the policy's log-probs of the sampled tokens (nats, with grad).
        ref_logp: ``(B, A)`` the reference's (detached here).
        kind: one of :data:`KL_LOSS_ESTIMATORS`.

    Returns:
        ``(B, A)`` per-token term in nats, float32 or wider; the caller masks it.

    Raises:
        ValueError: unknown ``kind`` or shape mismatch.

    Source: J. Schulman, "Approximating KL divergence" (2020), k2 and k3; the gradient analysis of
    the KL loss term as in Tang & Munos 2025 ("On a few pitfalls in KL divergence gradient estimation
    for RL"); Shao et al. 2024 (GRPO), eq. (4), for k3 as a loss term.
    """
    if kind not in KL_LOSS_ESTIMATORS:
        raise ValueError(f"kl_loss_term: unknown kind {kind!r}; expected one of {KL_LOSS_ESTIMATORS}")
    ref_logp = ref_logp.detach()
    if kind == "k3":
        return core.kl_penalty(logp, ref_logp, "k3")
    k2 = core.kl_penalty(logp, ref_logp, "k2")
    if kind == "k2":
        return k2
    return core.kl_penalty(logp.detach(), ref_logp, "k3") + (k2 - k2.detach())


def _local_count(action_mask: torch.Tensor, loss_agg_mode: str, constant: float | None) -> torch.Tensor:
    valid = core.valid_mask(action_mask)
    if loss_agg_mode in ("token-mean", "micro-batch-token-mean"):
        return valid.sum().to(torch.float64)
    seqs = valid.any(dim=1).sum().to(torch.float64)
    if loss_agg_mode == "seq-mean-token-mean":
        return seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if constant is None or not constant > 0:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs a constant > 0 (usually the maximum "
                             f"answer length, --max_answer_seq_len), got {constant}")
        return seqs * float(constant)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")


def step_normalizers(action_mask: torch.Tensor, micro_batch: int, gradient_accumulation_steps: int,
                     loss_agg_mode: str, constant: float | None = None,
                     all_reduce_sum: AllReduce | None = None) -> list[torch.Tensor]:
    """The normaliser of every micro-batch of a rank's buffer: the count of its whole optimizer step.

    Micro-batch ``i`` holds rows ``[i * micro_batch, (i + 1) * micro_batch)``; optimizer step ``k``
    holds micro-batches ``[k * gas, (k + 1) * gas)`` on every rank. The normaliser of a step is,
    summed over its micro-batches and over all ranks:

    * ``token-mean``: the number of action tokens;
    * ``seq-mean-token-mean``: the number of answers with at least one action token;
    * ``seq-mean-token-sum-norm``: that number of answers × ``constant``;

    and for ``micro-batch-token-mean`` each micro-batch's own number of action tokens (no sum, no
    collective). One all-reduce for the whole buffer otherwise (every rank must call it; all ranks
    have the same number of micro-batches, :func:`chatrl.sizes.plan_ppo`).

    Args:
        action_mask: ``(R, A)`` the rank's whole buffer.
        micro_batch: rows per micro-batch. gradient_accumulation_steps: micro-batches per step.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`. constant: for ``seq-mean-token-sum-norm``.
        all_reduce_sum: sums a tensor over ranks; ``None`` for one rank.

    Returns:
        One 0-dim float64 tensor per micro-batch (micro-batches of a step share a value), each >= 1
        (clamped, so a step without a valid token divides 0 by 1).

    Raises:
        ValueError: ``micro_batch`` does not divide ``R``, unknown mode, missing constant.
    """
    core.check_2d("step_normalizers", action_mask=action_mask)
    rows = action_mask.shape[0]
    if micro_batch < 1 or rows % micro_batch:
        raise ValueError(f"step_normalizers: micro_batch {micro_batch} does not divide the buffer's {rows} rows")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"step_normalizers: gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    n_micro = rows // micro_batch
    if loss_agg_mode == "micro-batch-token-mean":
        return [_local_count(action_mask[i * micro_batch:(i + 1) * micro_batch], loss_agg_mode, constant).clamp(min=1)
                for i in range(n_micro)]
    n_steps = -(-n_micro // gradient_accumulation_steps)
    counts = torch.zeros(n_steps, dtype=torch.float64, device=action_mask.device)
    for i in range(n_micro):
        counts[i // gradient_accumulation_steps] += _local_count(
            action_mask[i * micro_batch:(i + 1) * micro_batch], loss_agg_mode, constant)
    if all_reduce_sum is not None:
        counts = all_reduce_sum(counts)
    counts = counts.clamp(min=1)
    return [counts[i // gradient_accumulation_steps] for i in range(n_micro)]


def loss_scale(loss_agg_mode: str, gradient_accumulation_steps: int, world_size: int) -> float:
    """Factor for the loss handed to a DeepSpeed engine's ``backward``.

    DeepSpeed divides the loss by ``gradient_accumulation_steps`` in ``engine.backward`` and
    averages gradients over the data-parallel ranks. A global mode's :func:`policy_loss` already
    divides by the whole step's count, so ``engine.backward(loss * gas * world_size)`` yields
    exactly the gradient of the whole step's loss (the gradients are SUMS). For
    ``micro-batch-token-mean`` DeepSpeed's averaging is the aggregation itself: the factor is 1.

    Raises:
        ValueError: an unknown mode.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if loss_agg_mode == "micro-batch-token-mean":
        return 1.0
    return float(gradient_accumulation_steps * world_size)


@dataclass(frozen=True)
class PolicyLossSettings:
    """How :func:`policy_loss` forms and averages the clipped loss: the aggregation
    (``--loss_agg_mode``, one of :data:`LOSS_AGG_MODES`), the ratio clip ``(1 - cliprange_low,
    1 + cliprange_high)`` (``cliprange_high`` None: ``cliprange_low``, the symmetric PPO clip; DAPO's
    "clip-higher" uses e.g. 0.28 with 0.2) and the estimator of the KL loss term
    (``--kl_loss_estimator``, a :data:`KL_LOSS_ESTIMATORS` name). Checked by :func:`policy_loss`."""

    loss_agg_mode: str = "token-mean"
    cliprange_low: float = 0.2
    cliprange_high: float | None = None
    kl_loss_kind: str = "k3+"


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor,
                normalizer: float | torch.Tensor, settings: PolicyLossSettings = PolicyLossSettings(), *,
                is_weights: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                kl_loss_coef: float = 0.0, token_stats: dict | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss of one micro-batch, its share of the optimizer step's loss.

    Per action token, with ``ratio = exp(logp - old_logp)``:

    ``l_t = max(-A_t * ratio, -A_t * clip(ratio, 1 - cliprange_low, 1 + cliprange_high))``,
    times ``is_weights`` if given, plus ``kl_loss_coef * KL_t(logp, ref_logp)`` (:func:`kl_loss_term`:
    by default k3's value with k2's gradient, whose expectation is ``grad KL(pi || pi_ref)``) if
    ``ref_logp`` is given and the coefficient is non-zero.

    Aggregation, with ``normalizer`` from :func:`step_normalizers` (the GLOBAL count of the step):

    * ``token-mean``: ``sum_{b,t} l_bt / normalizer`` (every token of the step weighs the same);
    * ``micro-batch-token-mean``: the same formula with the micro-batch's own token count as
      ``normalizer`` (DeepSpeed-Chat's per-micro-batch mean);
    * ``seq-mean-token-mean``: ``sum_b mean_t(l_bt) / normalizer`` (every answer weighs the same);
    * ``seq-mean-token-sum-norm``: ``sum_{b,t} l_bt / normalizer`` with
      ``normalizer = answers × constant`` (Dr. GRPO; no length bias).

    Summing the returned losses' gradients over the micro-batches and ranks of the step gives the
    gradient of the whole step's loss, independent of the split.

    Args:
        logp: ``(B, A)`` current log-probs (with grad).
        old_logp: ``(B, A)`` training-forward log-probs at experience time (constants).
        advantages: ``(B, A)`` from the algorithm's estimator (:mod:`chatrl.rl.advantages`; constants).
        action_mask: ``(B, A)``; masked positions of every input are ignored.
        normalizer: > 0, see above.
        settings: the aggregation, the clip range (``eps_low``, ``eps_high`` > 0) and the KL loss
            term's estimator (:class:`PolicyLossSettings`).
        is_weights: optional ``(B, A)`` from :func:`rollout_is_weights` (or :func:`truncated_is_weights`).
        ref_logp: ``(B, A)`` reference log-probs, for the KL loss term.
        kl_loss_coef: beta >= 0 of the KL loss term (the KL controller's value now, so not a setting).
        token_stats: if given, filled with detached per-token ``(B, A)`` tensors: ``ratio`` (1 at
            masked positions) and ``clip`` (int8: -1 where the lower clip removes the token's
            gradient, +1 where the upper one does, else 0); the rollout records keep them.

    Returns:
        ``(loss, stats)``: 0-dim loss, float32 or wider; detached local stats (masked means over the micro-batch):
        ``clip_frac`` (tokens whose gradient a clip removes), of which ``clip_frac_low`` /
        ``clip_frac_high`` by the lower / upper clip,
        ``approx_kl`` (k3 of KL(old || new)), ``ratio_mean``, and ``kl_loss`` (the KL term's value per
        token) / ``is_weight_mean`` when used.

    Raises:
        ValueError: shape mismatch, bad clip range, unknown mode, ``normalizer <= 0``, negative
            ``kl_loss_coef``, ``kl_loss_coef > 0`` without ``ref_logp``, an unknown ``kl_loss_kind``.

    Source: Schulman et al. 2017 (PPO), eq. (7); Yu et al. 2025 (DAPO), eq. (10) clip-higher and
    the token-level loss; Liu et al. 2025 (Dr. GRPO), eq. (3); Shao et al. 2024 (GRPO), eq. (3)-(4)
    for the KL loss term; Schulman, "Approximating KL divergence" (k2, k3).
    """
    core.check_2d("policy_loss", logp=logp)
    core.check_same_shape("policy_loss", logp=logp, old_logp=old_logp, advantages=advantages,
                           action_mask=action_mask)
    loss_agg_mode, kl_loss_kind = settings.loss_agg_mode, settings.kl_loss_kind
    cliprange_low = settings.cliprange_low
    cliprange_high = cliprange_low if settings.cliprange_high is None else settings.cliprange_high
    if not (cliprange_low > 0 and cliprange_high > 0):
        raise ValueError(f"policy_loss: cliprange_low and cliprange_high must be > 0, got {cliprange_low}, "
                         f"{cliprange_high}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"policy_loss: unknown loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if not float(normalizer) > 0:
        raise ValueError(f"policy_loss: normalizer must be > 0, got {float(normalizer)}")
    if kl_loss_coef < 0:
        raise ValueError(f"policy_loss: kl_loss_coef must be >= 0, got {kl_loss_coef}")
    if kl_loss_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: kl_loss_coef > 0 needs ref_logp")
    valid = core.valid_mask(action_mask)
    logp = logp.to(float_dtype(logp, old_logp))  # bf16 log-probs are promoted: the loss is float32 or wider
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - old_logp.detach().to(logp.dtype), zero)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cliprange_low, 1.0 + cliprange_high)
    per_token = torch.maximum(unclipped, clipped)
    stats: dict[str, torch.Tensor] = {}
    if is_weights is not None:
        core.check_same_shape("policy_loss", logp=logp, is_weights=is_weights)
        w = torch.where(valid, is_weights.detach().to(logp.dtype), zero)
        per_token = per_token * w
        stats["is_weight_mean"] = core.masked_mean(w, valid)
    if ref_logp is not None and kl_loss_coef > 0:
        core.check_same_shape("policy_loss", logp=logp, ref_logp=ref_logp)
        ref = torch.where(valid, ref_logp.detach().to(logp.dtype), zero)
        kl = kl_loss_term(torch.where(valid, logp, zero), ref, kl_loss_kind)
        per_token = per_token + kl_loss_coef * kl
        stats["kl_loss"] = core.masked_mean(kl, valid)
    if loss_agg_mode == "seq-mean-token-mean":
        total = core.masked_mean(per_token, valid, dim=1).sum()
    else:
        total = core.masked_sum(per_token, valid)
    loss = total / torch.as_tensor(normalizer, dtype=total.dtype, device=total.device)
    with torch.no_grad():
        # A clip removes the gradient where the clipped term is strictly larger.
        removed = clipped > unclipped
        stats["clip_frac"] = core.masked_mean(removed.to(ratio.dtype), valid)
        stats["clip_frac_low"] = core.masked_mean((removed & (ratio < 1.0)).to(ratio.dtype), valid)
        stats["clip_frac_high"] = core.masked_mean((removed & (ratio > 1.0)).to(ratio.dtype), valid)
        stats["approx_kl"] = core.masked_mean((ratio - 1.0) - log_ratio, valid)
        stats["ratio_mean"] = core.masked_mean(ratio, valid)
        if token_stats is not None:
            token_stats["ratio"] = torch.where(valid, ratio, torch.ones_like(ratio)).detach()
            token_stats["clip"] = (torch.where(removed & valid & (ratio > 1.0), 1, 0)
                                   - torch.where(removed & valid & (ratio < 1.0), 1, 0)).to(torch.int8)
    return loss, {k: v.detach() for k, v in stats.items()}


# ----------------------------------------------------------------------------- agreement check


def logp_diff(sampler_logp: torch.Tensor, train_logp: torch.Tensor, action_mask: torch.Tensor,
              all_reduce_sum: AllReduce | None = None, all_reduce_max: AllReduce | None = None
              ) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs of the sampled tokens are from the training forward's.

    ``d_t = |sampler_logp_t - train_logp_t|`` on action tokens; returns
    ``rollout/logp_diff_max`` (max over all ranks' tokens) and ``rollout/logp_diff_mean`` (mean over
    all ranks' tokens), both 0 with no valid token. Pass both reductions, or neither (one rank).

    Args:
        sampler_logp: ``(B, A)`` log-softmax of the generator's logits at the sampled tokens.
        train_logp: ``(B, A)`` the same from the training forward (the experience pass).
        action_mask: ``(B, A)``.
        all_reduce_sum, all_reduce_max: cross-rank reductions (collectives: every rank calls).

    Returns:
        dict of detached 0-dim float64 tensors, in nats.

    Raises:
        ValueError: shape mismatch, or only one of the two reductions given.
    """
    core.check_same_shape("logp_diff", sampler_logp=sampler_logp, train_logp=train_logp, action_mask=action_mask)
    if (all_reduce_sum is None) != (all_reduce_max is None):
        raise ValueError("logp_diff: give both all_reduce_sum and all_reduce_max, or neither")
    with torch.no_grad():
        valid = core.valid_mask(action_mask)
        zero = torch.zeros((), dtype=torch.float64, device=sampler_logp.device)
        d = torch.where(valid, (sampler_logp.to(torch.float64) - train_logp.to(torch.float64)).abs(), zero)
        s = torch.stack([d.sum(), valid.sum().to(torch.float64)])
        m = d.amax() if d.numel() else zero
        if all_reduce_sum is not None:
            s = all_reduce_sum(s)
            m = all_reduce_max(m.reshape(1))[0]
        return {"rollout/logp_diff_max": m, "rollout/logp_diff_mean": s[0] / s[1].clamp(min=1)}
