"""Step 3's RL algorithms, declared once: each is a name, an advantage estimator and what it needs.

The step-3 loop (:mod:`chatrl.step3_ppo`) is the same for every algorithm: make experience, estimate
advantages, learn (the critic too when there is one), EMA and PTX, checkpoint. An
:class:`Algorithm` chooses what differs: the advantage estimator, whether a critic exists, the
group size it needs and its default loss aggregation. ``--rl_algorithm``'s choices, the size
planning (:func:`chatrl.sizes.plan_ppo`), ``train.py`` and the docs read this registry.

Adding an algorithm (``docs/architecture.md``, "Where to add")::

    from chatrl.rl import algorithms
    from chatrl.rl.advantages import Advantages, outcome_per_token

    def my_advantages(inputs, settings):          # inputs: AdvantageInputs; settings: PPOConfig
        baseline = inputs.scores.mean()
        return Advantages(outcome_per_token(inputs.scores - baseline, inputs))

    algorithms.register(algorithms.Algorithm(
        "mean_baseline", my_advantages, "REINFORCE with the batch mean as baseline"))

Registered before step 3's parser is built (an import in this module, or in the program that
calls :func:`chatrl.step3_ppo.main.main`), it is a valid ``--rl_algorithm``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from chatrl.errors import UsageError
from chatrl.rl.advantages import (
    AdvantageInputs,
    Advantages,
    grpo_advantages,
    ppo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from chatrl.rl.loss import LOSS_AGG_MODES

Estimator = Callable[[AdvantageInputs, object], Advantages]
"""``estimate(inputs, settings) -> Advantages``; ``settings`` is step 3's ``config.PPOConfig``."""


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm of step 3.

    Attributes:
        name: the ``--rl_algorithm`` value.
        estimate: its advantage estimator (:data:`Estimator`, see :mod:`chatrl.rl.advantages`).
        summary: one line for ``--help`` and the docs.
        needs_critic: train a critic (value model); its values reach the estimator and its loss
            is minimised beside the policy's.
        min_samples_per_prompt: the smallest group ``N`` the estimator works with (a group of one
            answer has no group baseline).
        default_samples_per_prompt: ``N`` when ``--num_samples_per_prompt`` is not given.
        loss_agg_mode: the policy loss's aggregation when ``--loss_agg_mode`` is not given
            (:data:`chatrl.rl.loss.LOSS_AGG_MODES`).

    Raises:
        ValueError: an empty or non-identifier name, a group size below 1, an unknown mode.
    """

    name: str
    estimate: Estimator
    summary: str
    needs_critic: bool = False
    min_samples_per_prompt: int = 1
    default_samples_per_prompt: int = 1
    loss_agg_mode: str = "token-mean"

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"algorithm name {self.name!r} must be a Python identifier (it is a flag value)")
        if not 1 <= self.min_samples_per_prompt <= self.default_samples_per_prompt:
            raise ValueError(f"algorithm {self.name}: need 1 <= min_samples_per_prompt "
                             f"({self.min_samples_per_prompt}) <= default_samples_per_prompt "
                             f"({self.default_samples_per_prompt})")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm {self.name}: loss_agg_mode {self.loss_agg_mode!r} is not one of "
                             f"{LOSS_AGG_MODES}")


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry (replacing one of the same name); returns it."""
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def names() -> tuple[str, ...]:
    """The registered names, in registration order (``--rl_algorithm``'s choices)."""
    return tuple(ALGORITHMS)


def get(name: str) -> Algorithm:
    """The algorithm called ``name``.

    Raises:
        UsageError: no such algorithm (names ``--rl_algorithm`` and the choices).
    """
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UsageError(f"--rl_algorithm {name!r}: choose one of {', '.join(ALGORITHMS)}") from None


register(Algorithm("ppo", ppo_advantages, "actor-critic PPO: GAE on KL-shaped rewards and a learned critic",
                   needs_critic=True))
register(Algorithm("grpo", grpo_advantages, "group-relative: each answer against its group's mean and std",
                   min_samples_per_prompt=2, default_samples_per_prompt=4))
register(Algorithm("rloo", rloo_advantages, "leave-one-out: each answer against the mean of the others",
                   min_samples_per_prompt=2, default_samples_per_prompt=4))
register(Algorithm("reinforce_pp", reinforce_pp_advantages,
                   "REINFORCE++: the reward whitened over the global batch"))
