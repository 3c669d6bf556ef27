"""Critic-free RL maths for step 3: GRPO, RLOO and REINFORCE++ advantages, the policy loss with its
aggregation modes, and the sampler/trainer agreement check.

Pure tensor functions like :mod:`chatrl.step3_ppo.core` (whose conventions they follow: per-token
tensors are ``(B, A)`` over the answer part, ``action_mask`` non-zero on actions, log-probs in
nats). No torch.distributed call is made here: a cross-rank reduction is passed in as a callable
(``all_reduce_sum(t) -> t`` summing a tensor over the data-parallel ranks, in place or not), and
``None`` means one rank.

Group layout (``N = num_samples_per_prompt``)
---------------------------------------------
Each rank generates ``N`` answers to each of its own prompts by repeating every prompt ``N`` times
in a row (``prompt_ids.repeat_interleave(N, dim=0)``), so rows ``[g * N, (g + 1) * N)`` of a rank's
buffer are the group of prompt ``g``. Groups therefore never cross ranks. Advantages are computed
once on a rank's whole buffer, before it is cut into micro-batches, so the micro-batch split cannot
change them; only REINFORCE++ needs other ranks (its global whitening), through ``all_reduce_sum``.
:func:`derive_group_layout` checks the batch sizes and derives the counts.

Loss normalisation
------------------
The loss of one optimizer step is ``sum(per-token or per-sequence terms) / normaliser`` where the
normaliser counts the whole step: every micro-batch of the accumulation on every rank
(:func:`step_normalizers`). Each micro-batch's :func:`policy_loss` divides its LOCAL sum by that
GLOBAL normaliser, so the gradients summed over micro-batches and ranks equal the gradient of the
whole step's loss, whatever the split. DeepSpeed's ``engine.backward`` divides the loss by
``gradient_accumulation_steps`` and its gradient all-reduce averages over ranks; multiply the loss by
:func:`deepspeed_loss_scale` before ``backward`` to undo both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatrl.step3_ppo import core

__all__ = [
    "RL_ALGORITHMS",
    "CRITIC_FREE_ALGORITHMS",
    "LOSS_AGG_MODES",
    "KL_PLACEMENTS",
    "GRPO_STD_EPS",
    "GroupLayout",
    "derive_group_layout",
    "repeat_prompts",
    "grpo_outcome_advantages",
    "rloo_outcome_advantages",
    "kl_reward_to_go",
    "global_masked_whiten",
    "critic_free_advantages",
    "truncated_is_weights",
    "step_normalizers",
    "deepspeed_loss_scale",
    "policy_loss",
    "logp_diff",
]

AllReduce = Callable[[torch.Tensor], torch.Tensor]

#: Values of ``--rl_algorithm``; ``ppo`` is the actor-critic path of :mod:`chatrl.step3_ppo.trainer`.
RL_ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp")
CRITIC_FREE_ALGORITHMS = ("grpo", "rloo", "reinforce_pp")

#: Loss aggregation modes (veRL's names): see :func:`policy_loss`.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: Where the KL to the reference goes: a per-token penalty in the reward, or a term of the loss.
KL_PLACEMENTS = ("reward", "loss")

#: Added to the group standard deviation in GRPO's denominator.
GRPO_STD_EPS = 1e-6


# ----------------------------------------------------------------------------- group layout


@dataclass(frozen=True)
class GroupLayout:
    """How one rank's experience buffer is laid out (all counts per rank unless named global).

    Attributes:
        num_samples_per_prompt: ``N``, answers per prompt; rows ``[g*N, (g+1)*N)`` are group ``g``.
        prompts_per_buffer: prompts per rank per buffer (generation batch × generation batches).
        rows_per_buffer: answers per rank per buffer (``prompts_per_buffer * N``).
        micro_batch: answers per training micro-batch.
        micro_batches_per_buffer: ``rows_per_buffer / micro_batch``.
        gradient_accumulation_steps: micro-batches per optimizer step.
        optimizer_steps_per_buffer: per PPO epoch over the buffer.
        global_rows_per_step: answers in one optimizer step over all ranks.
    """

    num_samples_per_prompt: int
    prompts_per_buffer: int
    rows_per_buffer: int
    micro_batch: int
    micro_batches_per_buffer: int
    gradient_accumulation_steps: int
    optimizer_steps_per_buffer: int
    global_rows_per_step: int


def derive_group_layout(algorithm: str, num_samples_per_prompt: int, per_device_generation_batch_size: int,
                        generation_batches: int, per_device_training_batch_size: int,
                        gradient_accumulation_steps: int, world_size: int) -> GroupLayout:
    """Check the batch sizes of a step-3 run and derive its :class:`GroupLayout`.

    ``per_device_generation_batch_size`` counts PROMPTS per rank per generation; each gives
    ``num_samples_per_prompt`` answers. ``per_device_training_batch_size`` counts ANSWERS per
    micro-batch.

    Rules (each broken one raises with the flags to change):

    * every size >= 1, ``algorithm`` in :data:`RL_ALGORITHMS`;
    * GRPO and RLOO need ``N >= 2`` (a group of one has no baseline: RLOO's leave-one-out mean is
      undefined, GRPO's advantage is always 0);
    * the micro-batch divides the rank's buffer, and the accumulation divides the micro-batches of
      a buffer, so that every optimizer step lies inside one buffer and its normaliser
      (:func:`step_normalizers`) is known before its first backward pass, and every rank makes the
      same number of steps.

    Raises:
        ValueError: a rule above is broken; the message names the flags and their values.
    """
    if algorithm not in RL_ALGORITHMS:
        raise ValueError(f"--rl_algorithm {algorithm!r}: choose one of {RL_ALGORITHMS}")
    sizes = {"--num_samples_per_prompt": num_samples_per_prompt,
             "--per_device_generation_batch_size": per_device_generation_batch_size,
             "--generation_batches": generation_batches,
             "--per_device_training_batch_size": per_device_training_batch_size,
             "--gradient_accumulation_steps": gradient_accumulation_steps, "world size": world_size}
    for name, value in sizes.items():
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value}")
    n = num_samples_per_prompt
    if algorithm in ("grpo", "rloo") and n < 2:
        raise ValueError(f"--rl_algorithm {algorithm} needs --num_samples_per_prompt >= 2 (a group of one answer "
                         f"has no baseline), got {n}")
    prompts = per_device_generation_batch_size * generation_batches
    rows = prompts * n
    mb = per_device_training_batch_size
    if rows % mb:
        raise ValueError(f"--per_device_training_batch_size {mb} must divide the answers per rank per buffer: "
                         f"{per_device_generation_batch_size} prompts × {generation_batches} generation batches × "
                         f"{n} samples per prompt = {rows}")
    micro = rows // mb
    if micro % gradient_accumulation_steps:
        raise ValueError(f"--gradient_accumulation_steps {gradient_accumulation_steps} must divide the "
                         f"{micro} micro-batches of a buffer ({rows} answers / micro-batch {mb}), so that no "
                         "optimizer step spans two buffers")
    return GroupLayout(n, prompts, rows, mb, micro, gradient_accumulation_steps,
                       micro // gradient_accumulation_steps, mb * gradient_accumulation_steps * world_size)


def repeat_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_samples_per_prompt: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt row repeated ``N`` times in a row: ``(B, P) -> (B * N, P)``, the group layout."""
    return (prompt_ids.repeat_interleave(num_samples_per_prompt, dim=0),
            prompt_mask.repeat_interleave(num_samples_per_prompt, dim=0))


def _groups(scores: torch.Tensor, n: int, where: str) -> torch.Tensor:
    if scores.dim() != 1:
        raise ValueError(f"{where}: scores must be (B,), got shape {tuple(scores.shape)}")
    if n < 1 or scores.shape[0] % n:
        raise ValueError(f"{where}: {scores.shape[0]} scores do not form groups of num_samples_per_prompt={n}")
    return scores.reshape(-1, n).to(core._float_dtype(scores))


# ----------------------------------------------------------------------------- advantages


def grpo_outcome_advantages(scores: torch.Tensor, num_samples_per_prompt: int, scale_by_std: bool = True,
                            eps: float = GRPO_STD_EPS) -> torch.Tensor:
    """GRPO's group-relative advantage of each answer, one number per answer.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the unbiased (Bessel) standard
    deviation of the ``N`` rewards of the answer's group. ``scale_by_std=False`` drops the division
    (Dr. GRPO: ``A_i = r_i - mean(r_group)``), which removes the question-difficulty weighting.
    A group whose rewards are all equal gets advantage 0.

    Args:
        scores: ``(B,)`` rewards, ``B = G * N`` in the group layout (module docstring).
        num_samples_per_prompt: ``N >= 2``.
        scale_by_std: divide by the group standard deviation (GRPO) or not (Dr. GRPO).
        eps: added to the standard deviation.

    Returns:
        ``(B,)`` float32 (or wider) advantages, detached.

    Raises:
        ValueError: ``scores`` not 1-D, ``B`` not a multiple of ``N``, or ``N < 2``.

    Source: Shao et al. 2024 (DeepSeekMath), section 4.1.2 "outcome supervision";
    Liu et al. 2025 (Understanding R1-Zero-like training, "Dr. GRPO"), section 3.1.
    """
    if num_samples_per_prompt < 2:
        raise ValueError(f"grpo_outcome_advantages: num_samples_per_prompt must be >= 2, got {num_samples_per_prompt}")
    with torch.no_grad():
        r = _groups(scores, num_samples_per_prompt, "grpo_outcome_advantages")
        adv = r - r.mean(dim=1, keepdim=True)
        if scale_by_std:
            adv = adv / (r.std(dim=1, unbiased=True, keepdim=True) + eps)
    return adv.reshape(-1)


def rloo_outcome_advantages(scores: torch.Tensor, num_samples_per_prompt: int) -> torch.Tensor:
    """RLOO's leave-one-out advantage: each answer's reward minus the mean of the other ``N - 1``.

    ``A_i = r_i - (sum_j r_j - r_i) / (N - 1) = N / (N - 1) * (r_i - mean(r_group))``.

    Args:
        scores: ``(B,)`` rewards in the group layout. num_samples_per_prompt: ``N >= 2``.

    Returns:
        ``(B,)`` float32 (or wider) advantages, detached.

    Raises:
        ValueError: as :func:`grpo_outcome_advantages`.

    Source: Ahmadian et al. 2024 (Back to Basics: REINFORCE style optimization for RLHF), eq. (9);
    Kool et al. 2019 (Buy 4 REINFORCE samples, get a baseline for free).
    """
    n = num_samples_per_prompt
    if n < 2:
        raise ValueError(f"rloo_outcome_advantages: num_samples_per_prompt must be >= 2, got {n}")
    with torch.no_grad():
        r = _groups(scores, n, "rloo_outcome_advantages")
        adv = r - (r.sum(dim=1, keepdim=True) - r) / (n - 1)
    return adv.reshape(-1)


def kl_reward_to_go(kl: torch.Tensor, action_mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """The KL part of the return: ``-kl_coef * sum_{s >= t} KL_s`` over the action tokens of each row.

    With per-token rewards ``r_t = -beta * KL_t`` (plus the score on the last action) and
    ``gamma = 1``, the return from token ``t`` is the score minus this reward-to-go of the penalty.

    Args:
        kl: ``(B, A)`` per-token KL estimate (e.g. ``core.kl_penalty(logp, ref_logp, "k1")``).
        action_mask: ``(B, A)``. kl_coef: beta >= 0.

    Returns:
        ``(B, A)`` detached, 0 at masked positions.

    Raises:
        ValueError: shape mismatch or ``kl_coef < 0``.

    Source: Ziegler et al. 2019, eq. (2); Hu 2025 (REINFORCE++), eq. (3)-(4).
    """
    core._check_2d("kl_reward_to_go", kl=kl)
    core._check_same_shape("kl_reward_to_go", kl=kl, action_mask=action_mask)
    if kl_coef < 0:
        raise ValueError(f"kl_reward_to_go: kl_coef must be >= 0, got {kl_coef}")
    with torch.no_grad():
        valid = core._valid(action_mask)
        dtype = core._float_dtype(kl)
        zero = torch.zeros((), dtype=dtype, device=kl.device)
        k = torch.where(valid, kl.to(dtype), zero)
        to_go = k.flip(1).cumsum(1).flip(1)
        return torch.where(valid, -kl_coef * to_go, zero)


def global_masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce_sum: AllReduce | None = None
                         ) -> torch.Tensor:
    """:func:`core.masked_whiten` over the valid tokens of ALL ranks together.

    ``out = (x - mean) / sqrt(var + core.WHITEN_EPS)``, mean and unbiased variance over every valid
    position of every rank's ``x`` (two all-reduces: count and sum, then squared deviations). On
    one rank (``all_reduce_sum=None``) it equals :func:`core.masked_whiten`. Masked positions are 0.

    Args:
        x: ``(B, A)``. mask: ``(B, A)``, non-zero = valid.
        all_reduce_sum: sums a tensor over ranks (returns the sum); ``None`` for one rank. Every
            rank must call this function (it is a collective).

    Raises:
        ValueError: shapes differ.

    Source: REINFORCE++ global advantage normalisation, Hu 2025, section 3.2.
    """
    core._check_same_shape("global_masked_whiten", x=x, mask=mask)
    reduce = all_reduce_sum or (lambda t: t)
    with torch.no_grad():
        dtype = torch.float64  # sums over a whole global batch
        valid = core._valid(mask)
        s = reduce(torch.stack([valid.sum().to(dtype), core.masked_sum(x.to(dtype), valid)]))
        n, mean = s[0], s[1] / s[0].clamp(min=1)
        sq = reduce(core.masked_sum((x.to(dtype) - mean) ** 2, valid).reshape(1))[0]
        var = torch.where(n > 1, sq / (n - 1).clamp(min=1), sq / n.clamp(min=1))
        out = ((x.to(dtype) - mean) * torch.rsqrt(var + core.WHITEN_EPS)).to(x.dtype)
        return torch.where(valid, out, torch.zeros((), dtype=out.dtype, device=out.device))


def critic_free_advantages(algorithm: str, scores: torch.Tensor, action_mask: torch.Tensor,
                           num_samples_per_prompt: int, *, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
                           scale_by_std: bool = True, all_reduce_sum: AllReduce | None = None) -> torch.Tensor:
    """Per-token advantages ``(B, A)`` of GRPO, RLOO or REINFORCE++ for one rank's whole buffer.

    1. Outcome term per answer: GRPO :func:`grpo_outcome_advantages`, RLOO
       :func:`rloo_outcome_advantages`, REINFORCE++ the score itself.
    2. Broadcast over the answer's action tokens, plus, when the KL goes into the reward
       (``kl`` given), :func:`kl_reward_to_go` (``gamma = 1``).
    3. REINFORCE++ only: :func:`global_masked_whiten` over the global batch (all ranks).

    Call it on the buffer BEFORE cutting micro-batches (groups and the whitening see the whole
    buffer). For the KL as a loss term instead, pass ``kl=None`` and give ``ref_logp`` and
    ``kl_loss_coef`` to :func:`policy_loss`.

    Args:
        algorithm: one of :data:`CRITIC_FREE_ALGORITHMS`.
        scores: ``(B,)`` rewards of the answers in the group layout (module docstring).
        action_mask: ``(B, A)``.
        num_samples_per_prompt: ``N``.
        kl: optional ``(B, A)`` per-token KL (k1: ``logp - ref_logp``) put into the reward.
        kl_coef: beta of that penalty.
        scale_by_std: GRPO only; ``False`` is Dr. GRPO.
        all_reduce_sum: REINFORCE++ only, see :func:`global_masked_whiten`.

    Returns:
        ``(B, A)`` detached advantages, 0 at masked positions.

    Raises:
        ValueError: unknown algorithm, shape mismatch, bad group size.
    """
    core._check_2d("critic_free_advantages", action_mask=action_mask)
    if tuple(scores.shape) != (action_mask.shape[0],):
        raise ValueError(f"critic_free_advantages: scores must be (B,) = ({action_mask.shape[0]},), "
                         f"got {tuple(scores.shape)}")
    if algorithm == "grpo":
        outcome = grpo_outcome_advantages(scores, num_samples_per_prompt, scale_by_std)
    elif algorithm == "rloo":
        outcome = rloo_outcome_advantages(scores, num_samples_per_prompt)
    elif algorithm == "reinforce_pp":
        outcome = scores.detach().to(core._float_dtype(scores))
    else:
        raise ValueError(f"critic_free_advantages: unknown algorithm {algorithm!r}; expected one of "
                         f"{CRITIC_FREE_ALGORITHMS}")
    with torch.no_grad():
        valid = core._valid(action_mask)
        zero = torch.zeros((), dtype=outcome.dtype, device=outcome.device)
        adv = torch.where(valid, outcome.unsqueeze(1).expand(action_mask.shape), zero)
        if kl is not None:
            adv = adv + kl_reward_to_go(kl, action_mask, kl_coef).to(adv.dtype)
        if algorithm == "reinforce_pp":
            adv = global_masked_whiten(adv, valid, all_reduce_sum)
    return adv


# ----------------------------------------------------------------------------- loss


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
    core._check_same_shape("truncated_is_weights", old_logp=old_logp, sampler_logp=sampler_logp,
                           action_mask=action_mask)
    if not cap >= 1:
        raise ValueError(f"truncated_is_weights: cap (--rollout_is_cap) must be >= 1, got {cap}")
    with torch.no_grad():
        valid = core._valid(action_mask)
        dtype = core._float_dtype(old_logp, sampler_logp)
        zero = torch.zeros((), dtype=dtype, device=old_logp.device)
        d = torch.where(valid, old_logp.to(dtype) - sampler_logp.to(dtype), zero)
        return torch.where(valid, torch.exp(d).clamp(max=cap), zero)


def _local_count(action_mask: torch.Tensor, loss_agg_mode: str, constant: float | None) -> torch.Tensor:
    valid = core._valid(action_mask)
    if loss_agg_mode == "token-mean":
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
    * ``seq-mean-token-sum-norm``: that number of answers × ``constant``.

    One all-reduce for the whole buffer (every rank must call it; all ranks have the same number of
    micro-batches, see :func:`derive_group_layout`).

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
    core._check_2d("step_normalizers", action_mask=action_mask)
    rows = action_mask.shape[0]
    if micro_batch < 1 or rows % micro_batch:
        raise ValueError(f"step_normalizers: micro_batch {micro_batch} does not divide the buffer's {rows} rows")
    if gradient_accumulation_steps < 1:
        raise ValueError(f"step_normalizers: gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    n_micro = rows // micro_batch
    n_steps = -(-n_micro // gradient_accumulation_steps)
    counts = torch.zeros(n_steps, dtype=torch.float64, device=action_mask.device)
    for i in range(n_micro):
        counts[i // gradient_accumulation_steps] += _local_count(
            action_mask[i * micro_batch:(i + 1) * micro_batch], loss_agg_mode, constant)
    if all_reduce_sum is not None:
        counts = all_reduce_sum(counts)
    counts = counts.clamp(min=1)
    return [counts[i // gradient_accumulation_steps] for i in range(n_micro)]


def deepspeed_loss_scale(gradient_accumulation_steps: int, world_size: int) -> float:
    """Factor for the loss handed to a DeepSpeed engine's ``backward`` so gradients are SUMS.

    DeepSpeed divides the loss by ``gradient_accumulation_steps`` in ``engine.backward`` and
    averages gradients over the data-parallel ranks; :func:`policy_loss` already divides by the
    global normaliser, so ``engine.backward(loss * gas * world_size)`` yields exactly the gradient
    of the whole step's loss.
    """
    return float(gradient_accumulation_steps * world_size)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor,
                normalizer: float | torch.Tensor, *, loss_agg_mode: str = "token-mean",
                cliprange_low: float = 0.2, cliprange_high: float | None = None,
                is_weights: torch.Tensor | None = None, ref_logp: torch.Tensor | None = None,
                kl_loss_coef: float = 0.0, kl_loss_kind: str = "k3"
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss of one micro-batch, its share of the optimizer step's loss.

    Per action token, with ``ratio = exp(logp - old_logp)``:

    ``l_t = max(-A_t * ratio, -A_t * clip(ratio, 1 - cliprange_low, 1 + cliprange_high))``,
    times ``is_weights`` if given, plus ``kl_loss_coef * KL_t(logp, ref_logp)`` (k3 by default;
    its gradient flows through ``logp``) if ``ref_logp`` is given and the coefficient is non-zero.

    Aggregation, with ``normalizer`` from :func:`step_normalizers` (the GLOBAL count of the step):

    * ``token-mean``: ``sum_{b,t} l_bt / normalizer`` (every token of the step weighs the same);
    * ``seq-mean-token-mean``: ``sum_b mean_t(l_bt) / normalizer`` (every answer weighs the same);
    * ``seq-mean-token-sum-norm``: ``sum_{b,t} l_bt / normalizer`` with
      ``normalizer = answers × constant`` (Dr. GRPO; no length bias).

    Summing the returned losses' gradients over the micro-batches and ranks of the step gives the
    gradient of the whole step's loss, independent of the split.

    Args:
        logp: ``(B, A)`` current log-probs (with grad).
        old_logp: ``(B, A)`` training-forward log-probs at experience time (constants).
        advantages: ``(B, A)`` from :func:`critic_free_advantages` (constants).
        action_mask: ``(B, A)``; masked positions of every input are ignored.
        normalizer: > 0, see above.
        loss_agg_mode: one of :data:`LOSS_AGG_MODES`.
        cliprange_low: ``eps_low > 0``. cliprange_high: ``eps_high > 0``, default ``cliprange_low``
            (symmetric PPO clip); DAPO's "clip-higher" uses e.g. 0.28 with 0.2.
        is_weights: optional ``(B, A)`` from :func:`truncated_is_weights`.
        ref_logp: ``(B, A)`` reference log-probs, for the KL loss term.
        kl_loss_coef: beta >= 0 of the KL loss term. kl_loss_kind: a :data:`core.KL_KINDS` name.

    Returns:
        ``(loss, stats)``: 0-dim loss; detached local stats (masked means over the micro-batch):
        ``clip_frac_low`` / ``clip_frac_high`` (tokens whose gradient the lower / upper clip removes),
        ``approx_kl`` (k3 of KL(old || new)), ``ratio_mean``, and ``kl_loss`` / ``is_weight_mean``
        when used.

    Raises:
        ValueError: shape mismatch, bad clip range, unknown mode, ``normalizer <= 0``, negative
            ``kl_loss_coef`` or ``kl_loss_coef > 0`` without ``ref_logp``.

    Source: Schulman et al. 2017 (PPO), eq. (7); Yu et al. 2025 (DAPO), eq. (10) clip-higher and
    the token-level loss; Liu et al. 2025 (Dr. GRPO), eq. (3); Shao et al. 2024 (GRPO), eq. (3)-(4)
    for the k3 KL loss; Schulman, "Approximating KL divergence" (k3).
    """
    core._check_2d("policy_loss", logp=logp)
    core._check_same_shape("policy_loss", logp=logp, old_logp=old_logp, advantages=advantages,
                           action_mask=action_mask)
    if cliprange_high is None:
        cliprange_high = cliprange_low
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
    valid = core._valid(action_mask)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - old_logp.detach(), zero)
    adv = torch.where(valid, advantages.detach().to(logp.dtype), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cliprange_low, 1.0 + cliprange_high)
    per_token = torch.maximum(unclipped, clipped)
    stats: dict[str, torch.Tensor] = {}
    if is_weights is not None:
        core._check_same_shape("policy_loss", logp=logp, is_weights=is_weights)
        w = torch.where(valid, is_weights.detach().to(logp.dtype), zero)
        per_token = per_token * w
        stats["is_weight_mean"] = core.masked_mean(w, valid)
    if ref_logp is not None and kl_loss_coef > 0:
        core._check_same_shape("policy_loss", logp=logp, ref_logp=ref_logp)
        kl = core.kl_penalty(torch.where(valid, logp, zero),
                             torch.where(valid, ref_logp.detach().to(logp.dtype), zero), kl_loss_kind)
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
        stats["clip_frac_low"] = core.masked_mean((removed & (ratio < 1.0)).to(ratio.dtype), valid)
        stats["clip_frac_high"] = core.masked_mean((removed & (ratio > 1.0)).to(ratio.dtype), valid)
        stats["approx_kl"] = core.masked_mean((ratio - 1.0) - log_ratio, valid)
        stats["ratio_mean"] = core.masked_mean(ratio, valid)
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
    core._check_same_shape("logp_diff", sampler_logp=sampler_logp, train_logp=train_logp, action_mask=action_mask)
    if (all_reduce_sum is None) != (all_reduce_max is None):
        raise ValueError("logp_diff: give both all_reduce_sum and all_reduce_max, or neither")
    with torch.no_grad():
        valid = core._valid(action_mask)
        zero = torch.zeros((), dtype=torch.float64, device=sampler_logp.device)
        d = torch.where(valid, (sampler_logp.to(torch.float64) - train_logp.to(torch.float64)).abs(), zero)
        s = torch.stack([d.sum(), valid.sum().to(torch.float64)])
        m = d.amax() if d.numel() else zero
        if all_reduce_sum is not None:
            s = all_reduce_sum(s)
            m = all_reduce_max(m.reshape(1))[0]
        return {"rollout/logp_diff_max": m, "rollout/logp_diff_mean": s[0] / s[1].clamp(min=1)}
