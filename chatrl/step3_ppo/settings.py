"""Step 3's settings: the blocks of :mod:`chatrl.config` it composes, per-model ones for the actor
and the critic (``--actor_learning_rate``, ``--critic_zero_stage``), and which models it loads."""

from __future__ import annotations

from dataclasses import dataclass

from chatrl import config
from chatrl.config import setting, uses
from chatrl.errors import UsageError
from chatrl.rl.algorithms import ALGORITHMS, Algorithm
from chatrl.sizes import EpisodePlan, plan_episodes


@dataclass
class Step3ModelsConfig:
    """The frozen reward model."""

    reward_model_name_or_path: str | None = setting(None, "frozen reward model (unset: the critic's step-2 folder, "
                                                          "unless --reward_fn/--reward_url/--env give the reward)",
                                                    type=str, path="model")


@dataclass
class Step3Settings:
    """Step 3's blocks (:func:`chatrl.config.uses`)."""

    actor: config.ModelConfig = uses(config.ModelConfig, prefix="actor_", exclude=("disable_dropout",),
                                     title="models")
    critic: config.ModelConfig = uses(config.ModelConfig, prefix="critic_", exclude=("disable_dropout",),
                                      defaults={"model_name_or_path": None}, title="models")
    models: Step3ModelsConfig = uses(Step3ModelsConfig)
    reward: config.RewardConfig = uses(config.RewardConfig)
    actor_lora: config.LoraConfig = uses(config.LoraConfig, prefix="actor_")
    critic_lora: config.LoraConfig = uses(config.LoraConfig, prefix="critic_")
    data: config.DataConfig = uses(config.DataConfig, only=("data_path", "data_split", "data_output_path",
                                                             "unsupervised_dataset_name"))
    rollout: config.RolloutConfig = uses(config.RolloutConfig)
    env: config.EnvConfig = uses(config.EnvConfig)
    actor_optim: config.OptimConfig = uses(config.OptimConfig, prefix="actor_",
                                           defaults={"learning_rate": 9.65e-6})
    critic_optim: config.OptimConfig = uses(config.OptimConfig, prefix="critic_", defaults={"learning_rate": 5e-6})
    ppo: config.PPOConfig = uses(config.PPOConfig)
    sampling: config.SamplingConfig = uses(config.SamplingConfig)
    actor_zero: config.ZeroConfig = uses(config.ZeroConfig, prefix="actor_")
    critic_zero: config.ZeroConfig = uses(config.ZeroConfig, prefix="critic_")
    hybrid: config.HybridEngineConfig = uses(config.HybridEngineConfig)
    packing: config.PackingConfig = uses(config.PackingConfig)
    log: config.LogConfig = uses(config.LogConfig)
    ckpt: config.CheckpointConfig = uses(config.CheckpointConfig)
    snapshots: config.SnapshotConfig = uses(config.SnapshotConfig)
    template_check: config.TemplateCheckConfig = uses(config.TemplateCheckConfig)
    certificate: config.CertificateConfig = uses(config.CertificateConfig)

    @property
    def algorithm(self) -> Algorithm:
        """The RL algorithm (``--rl_algorithm``)."""
        return self.ppo.algorithm

    @property
    def rule_rewards(self) -> bool:
        """Whether ``--reward_fn``, ``--reward_url`` or an environment (``--env``) give (part of) the reward."""
        return bool(self.reward.reward_fn or self.reward.reward_url or self.env.env)

    def episodes(self) -> EpisodePlan | None:
        """The multi-turn episodes' sizes with ``--env`` (:func:`chatrl.sizes.plan_episodes`), else None.

        Raises:
            UsageError: ``--max_turns`` or ``--max_total_tokens`` without ``--env``, or bad sizes.
        """
        e = self.env
        if not e.env:
            for flag in ("max_turns", "max_total_tokens"):
                if getattr(e, flag) is not None:
                    raise UsageError(f"--{flag} needs --env (an environment plays the turns between answers)")
            return None
        return plan_episodes(self.rollout.max_prompt_seq_len, self.rollout.max_answer_seq_len, e.max_turns,
                             e.max_total_tokens)

    def reward_model_path(self) -> str | None:
        """The reward model to load, or None: ``--reward_model_name_or_path``, else (when no
        ``--reward_fn``/``--reward_url`` gives the reward) the critic's step-2 folder.

        Raises:
            UsageError: the reward needs a reward model and no flag names one (``--reward_fn``,
                ``--reward_url`` or ``--env`` give a reward without one).
        """
        explicit = self.models.reward_model_name_or_path
        if self.rule_rewards and not explicit:
            return None
        path = explicit or self.critic.model_name_or_path
        if not path:
            raise UsageError(f"--rl_algorithm {self.ppo.rl_algorithm} needs a reward: --reward_fn, --reward_url, --env "
                             "or --reward_model_name_or_path (or --critic_model_name_or_path, a step-2 reward model)")
        return path

    def critic_source(self) -> tuple[str, bool] | None:
        """Where the critic starts, as ``(folder, holds a trained head)``, or None without a critic.

        ``--critic_model_name_or_path`` (a step-2 reward model, head included, as DeepSpeed-Chat),
        else ``--reward_model_name_or_path``; with the reward from ``--reward_fn``/``--reward_url``
        alone, the actor's folder with a fresh value head.

        Raises:
            UsageError: a critic is needed and neither a reward model nor a rule reward is given.
        """
        if not self.algorithm.needs_critic:
            return None
        path = self.critic.model_name_or_path or self.models.reward_model_name_or_path
        if path:
            return path, True
        if self.rule_rewards:
            return self.actor.model_name_or_path, False
        raise UsageError(f"--rl_algorithm {self.ppo.rl_algorithm} needs --critic_model_name_or_path (the step-2 "
                         "reward model that initialises the critic), or a --reward_fn/--reward_url/--env reward (the critic "
                         "then starts from the actor with a fresh value head); or choose a critic-free "
                         f"--rl_algorithm ({', '.join(n for n, a in ALGORITHMS.items() if not a.needs_critic)})")
