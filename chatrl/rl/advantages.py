"""Advantage estimators of step 3's algorithms: PPO's GAE on KL-shaped rewards, and the critic-free
group and batch baselines (GRPO, RLOO, REINFORCE++).

Every estimator has the same signature, ``estimate(inputs: AdvantageInputs, settings) ->
Advantages``, and is named by an :class:`chatrl.rl.algorithms.Algorithm`; the step-3 loop calls
it once per experience buffer, on the rank's whole buffer, before the buffer is cut into
micro-batches (groups and batch statistics see the whole buffer).

Pure tensor functions following :mod:`chatrl.rl.core`'s conventions (per-token tensors are
``(B, A)`` over the answer part, ``action_mask`` non-zero on actions, log-probs in nats). No
torch.distributed call is made here: a cross-rank reduction is passed in as a callable
(``all_reduce_sum(t) -> t`` summing a tensor over the data-parallel ranks), and ``None`` means
one rank.

Group layout (``N = num_samples_per_prompt``)
---------------------------------------------
Each rank generates ``N`` answers to each of its own prompts by repeating every prompt ``N`` times
in a row (:func:`repeat_prompts`), so rows ``[g * N, (g + 1) * N)`` of a rank's buffer are the
group of prompt ``g``. Groups therefore never cross ranks; only REINFORCE++ needs other ranks (its
global whitening), through ``all_reduce_sum``. :func:`chatrl.sizes.plan_ppo` checks the sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatrl.logprobs import float_dtype
from chatrl.rl import core

AllReduce = Callable[[torch.Tensor], torch.Tensor]

#: Added to the group standard deviation in GRPO's denominator.
GRPO_STD_EPS = 1e-6


@dataclass
class AdvantageInputs:
    """What an advantage estimator reads of one rank's experience buffer (``B`` answers, ``A`` tokens).

    Attributes:
        scores: ``(B,)`` each answer's reward (the weighted reward sources, penalty included).
        action_mask: ``(B, A)``, non-zero on the answer's tokens through its first stop token.
        kl: ``(B, A)`` the per-token KL estimate to the reference (``--kl_estimator``), 0 at masked
            positions.
        kl_coef: ``beta`` of the KL penalty inside the reward; 0 when the KL is a loss term
            (``--kl_in loss``) instead.
        values: ``(B, A)`` the critic's values at experience time, or ``None`` without a critic.
        num_samples_per_prompt: ``N``, the group size of the layout above.
        all_reduce_sum: sums a tensor over the data-parallel ranks; ``None`` on one rank.
        turn_rewards: ``(B, A)`` for multi-turn episodes (``docs/multi_turn.md``): the part of
            ``scores`` an environment gave at the end of an assistant turn before the last one, at
            that turn's last token (0 elsewhere); ``None`` for single answers. ``scores`` is the
            whole episode's reward, these included. The critic-free estimators use ``scores``;
            PPO places each part at its turn.
    """

    scores: torch.Tensor
    action_mask: torch.Tensor
    kl: torch.Tensor
    kl_coef: float
    values: torch.Tensor | None = None
    num_samples_per_prompt: int = 1
    all_reduce_sum: AllReduce | None = None
    turn_rewards: torch.Tensor | None = None


@dataclass
class Advantages:
    """An estimator's output, all ``(B, A)``, detached, 0 at masked positions.

    Attributes:
        advantages: the per-token advantages the policy loss weighs.
        returns: the critic's regression targets (``None`` without a critic).
        rewards: the per-token rewards they were computed from, when the estimator builds them
            (PPO's KL-shaped rewards; logged as ``reward/mean``), else ``None``.
    """

    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    rewards: torch.Tensor | None = None


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
    return scores.reshape(-1, n).to(float_dtype(scores))



# ----------------------------------------------------------------------------- outcome advantages


def grpo_outcome_advantages(scores: torch.Tensor, num_samples_per_prompt: int, scale_by_std: bool = True,
                            eps: float = GRPO_STD_EPS) -> torch.Tensor:
    """GRPO's group-relative advantage of each answer, one number per answer.

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the unbiased (Bessel) standard
    deviation of the ``N`` rewards of the answer's group. ``scale_by_std=False`` drops the division
    (Dr. GRPO: ``A_i = r_i - mean(r_group)``), which removes the question-difficulty weighting.
    Computed in float64 around a refined group mean (:func:`chatrl.rl.core.masked_moments`): a
    group whose rewards are all equal gets advantage exactly 0, for any ``N`` and value.

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
        _, adv, n, sum_sq = core.masked_moments(r, torch.ones_like(r, dtype=torch.bool), dim=1)
        if scale_by_std:
            adv = adv / ((sum_sq / (n - 1)).sqrt() + eps)
    return adv.reshape(-1).to(float_dtype(scores))


def rloo_outcome_advantages(scores: torch.Tensor, num_samples_per_prompt: int) -> torch.Tensor:
    """RLOO's leave-one-out advantage: each answer's reward minus the mean of the other ``N - 1``.

    ``A_i = r_i - (sum_j r_j - r_i) / (N - 1) = N / (N - 1) * (r_i - mean(r_group))``, computed as the
    right-hand side in float64 around a refined mean (:func:`chatrl.rl.core.masked_moments`): a group
    of equal rewards gets exactly 0.

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
        _, dev, _, _ = core.masked_moments(r, torch.ones_like(r, dtype=torch.bool), dim=1)
        adv = dev * (n / (n - 1))
    return adv.reshape(-1).to(float_dtype(scores))


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
    core.check_2d("kl_reward_to_go", kl=kl)
    core.check_same_shape("kl_reward_to_go", kl=kl, action_mask=action_mask)
    if kl_coef < 0:
        raise ValueError(f"kl_reward_to_go: kl_coef must be >= 0, got {kl_coef}")
    with torch.no_grad():
        valid = core.valid_mask(action_mask)
        dtype = float_dtype(kl)
        zero = torch.zeros((), dtype=dtype, device=kl.device)
        k = torch.where(valid, kl.to(dtype), zero)
        to_go = k.flip(1).cumsum(1).flip(1)
        return torch.where(valid, -kl_coef * to_go, zero)


def global_masked_whiten(x: torch.Tensor, mask: torch.Tensor, all_reduce_sum: AllReduce | None = None
                         ) -> torch.Tensor:
    """:func:`core.masked_whiten` over the valid tokens of ALL ranks together.

    ``out = (x - mean) / sqrt(var + core.WHITEN_EPS)``, mean and unbiased variance over every valid
    position of every rank's ``x`` (two all-reduces: count and sum, then the mean's correction and
    the squared deviations; :func:`core.masked_moments`). On one rank (``all_reduce_sum=None``) it
    equals :func:`core.masked_whiten`. Masked positions are 0; a constant input gives exactly 0.
    A bf16 ``x`` is whitened in float32 (not rounded back to bf16).

    Args:
        x: ``(B, A)``. mask: ``(B, A)``, non-zero = valid.
        all_reduce_sum: sums a tensor over ranks (returns the sum); ``None`` for one rank. Every
            rank must call this function (it is a collective).

    Raises:
        ValueError: shapes differ.

    Source: REINFORCE++ global advantage normalisation, Hu 2025, section 3.2.
    """
    core.check_same_shape("global_masked_whiten", x=x, mask=mask)
    with torch.no_grad():
        return core.masked_whiten(x, mask, all_reduce_sum=all_reduce_sum)


# ----------------------------------------------------------------------------- estimators


def ppo_advantages(inputs: AdvantageInputs, settings) -> Advantages:
    """PPO's advantages: KL-shaped per-token rewards (:func:`chatrl.rl.core.compute_rewards`: the KL
    penalty on every action, the score clipped to ``±clip_reward_value`` on the last one), then GAE
    on the critic's values (:func:`chatrl.rl.core.gae`, ``gamma``, ``lam``), optionally whitened
    over the rank's buffer (``whiten_advantages``). In a multi-turn episode the environment's
    per-turn rewards (``inputs.turn_rewards``) are added at their turns' last tokens, unclipped, and
    the rest of the score at the last action token (GAE skips the observation tokens between turns).

    Args:
        inputs: with ``values`` (PPO has a critic).
        settings: step 3's :class:`chatrl.config.PPOConfig` (``clip_reward_value``, ``gamma``,
            ``lam``, ``whiten_advantages``).

    Raises:
        ValueError: no values, shape mismatch, bad ``gamma``/``lam``/clip.

    Source: Ziegler et al. 2019, eq. (2); Schulman et al. 2016 (GAE), eq. (16); Ouyang et al. 2022.
    """
    if inputs.values is None:
        raise ValueError("ppo_advantages: PPO's advantages need the critic's values")
    turn = inputs.turn_rewards
    final = inputs.scores if turn is None else inputs.scores - core.masked_sum(turn, inputs.action_mask, dim=1)
    rewards = core.compute_rewards(final, inputs.kl, inputs.action_mask, inputs.kl_coef, settings.clip_reward_value)
    if turn is not None:
        rewards = rewards + core.where_valid(turn.to(rewards.dtype), core.valid_mask(inputs.action_mask))
    advantages, returns = core.gae(inputs.values, rewards, inputs.action_mask, settings.gamma, settings.lam)
    if settings.whiten_advantages:
        advantages = core.masked_whiten(advantages, inputs.action_mask)
    return Advantages(advantages, returns, rewards)


def outcome_per_token(outcome: torch.Tensor, inputs: AdvantageInputs) -> torch.Tensor:
    """A per-answer advantage ``(B,)`` broadcast over the answer's action tokens ``(B, A)``, plus the
    KL penalty's reward-to-go (:func:`kl_reward_to_go`, ``gamma = 1``) when the KL is in the reward."""
    with torch.no_grad():
        valid = core.valid_mask(inputs.action_mask)
        zero = torch.zeros((), dtype=outcome.dtype, device=outcome.device)
        adv = torch.where(valid, outcome.unsqueeze(1).expand(inputs.action_mask.shape), zero)
        if inputs.kl_coef > 0:
            adv = adv + kl_reward_to_go(inputs.kl, inputs.action_mask, inputs.kl_coef).to(adv.dtype)
    return adv


def _check_scores(where: str, inputs: AdvantageInputs) -> None:
    core.check_2d(where, action_mask=inputs.action_mask)
    if tuple(inputs.scores.shape) != (inputs.action_mask.shape[0],):
        raise ValueError(f"{where}: scores must be (B,) = ({inputs.action_mask.shape[0]},), "
                         f"got {tuple(inputs.scores.shape)}")


def grpo_advantages(inputs: AdvantageInputs, settings) -> Advantages:
    """GRPO: each answer's reward against its group's (:func:`grpo_outcome_advantages`; Dr. GRPO with
    ``settings.grpo_no_std_scaling``), on every action token (:func:`outcome_per_token`).

    Raises:
        ValueError: shapes, or scores that do not form groups of ``N >= 2``.
    """
    _check_scores("grpo_advantages", inputs)
    outcome = grpo_outcome_advantages(inputs.scores, inputs.num_samples_per_prompt,
                                      scale_by_std=not settings.grpo_no_std_scaling)
    return Advantages(outcome_per_token(outcome, inputs))


def rloo_advantages(inputs: AdvantageInputs, settings) -> Advantages:
    """RLOO: each answer's reward minus the mean of the other ``N - 1`` of its group
    (:func:`rloo_outcome_advantages`), on every action token (:func:`outcome_per_token`).

    Raises:
        ValueError: shapes, or scores that do not form groups of ``N >= 2``.
    """
    _check_scores("rloo_advantages", inputs)
    return Advantages(outcome_per_token(rloo_outcome_advantages(inputs.scores, inputs.num_samples_per_prompt),
                                        inputs))


def reinforce_pp_advantages(inputs: AdvantageInputs, settings) -> Advantages:
    """REINFORCE++: the reward itself on every action token (with the KL reward-to-go), whitened
    over every valid token of every rank (:func:`global_masked_whiten`).

    Raises:
        ValueError: shapes.

    Source: Hu 2025 (REINFORCE++), sections 3.1-3.2.
    """
    _check_scores("reinforce_pp_advantages", inputs)
    adv = outcome_per_token(inputs.scores.detach().to(float_dtype(inputs.scores)), inputs)
    return Advantages(global_masked_whiten(adv, core.valid_mask(inputs.action_mask), inputs.all_reduce_sum))
