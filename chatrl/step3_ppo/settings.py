"""Step 3's settings: the blocks of :mod:`chatrl.config` it composes, per-model ones for the actor
and the critic (``--actor_learning_rate``, ``--critic_zero_stage``), and which models it loads."""

from __future__ import annotations

from dataclasses import dataclass

from chatrl import cli, config
from chatrl.config import setting, uses
from chatrl.envs import load_environment
from chatrl.envs.rollout import Episodes
from chatrl.errors import UsageError
from chatrl.hybrid_engine.tp_plan import check_inference_tp
from chatrl.models.causal_lm import check_context_window, check_packing, sampling_settings
from chatrl.rl.algorithms import ALGORITHMS, Algorithm
from chatrl.rl.loss import check_rollout_is
from chatrl.sizes import EpisodePlan, PPOPlan, PromptCounts, plan_episodes, plan_ppo


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

    @classmethod
    def parser(cls):
        """Step 3's command-line parser, generated from its blocks (:func:`chatrl.config.program_parser`)."""
        return config.program_parser(cls, "chatrl step 3: RLHF fine-tuning of the actor (PPO, GRPO, RLOO, "
                                          "REINFORCE++)", prog="python -m chatrl.step3_ppo")

    @classmethod
    def parse(cls, argv: list[str] | None = None):
        """Step 3's parsed flags (:func:`chatrl.cli.parse`; a usage error exits with code 2)."""
        return cli.parse(cls.parser(), argv)

    @classmethod
    def read(cls, args) -> Step3Settings:
        """The typed blocks of parsed flags (:func:`chatrl.config.read`)."""
        return config.read(cls, args)

    @property
    def algorithm(self) -> Algorithm:
        """The RL algorithm (``--rl_algorithm``)."""
        return self.ppo.algorithm

    def check_flags(self) -> None:
        """Refuse bad sampling and ``--rollout_is_*`` flags and a run without a critic source it needs,
        before anything loads (the critic is named before the reward: PPO without any reward names it).

        Raises:
            UsageError: naming the flag.
        """
        sampling_settings(self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)
        p = self.ppo
        if p.rollout_is_cap:
            check_rollout_is(p.rollout_is_level, p.rollout_is_mode, p.rollout_is_cap, p.rollout_is_cap_low)
        self.critic_source()

    def check_models(self, reward_path: str | None, episodes: Episodes | None) -> None:
        """Before any rank loads a model: the sequence budget (the episodes' token bound, or prompt +
        answer) within the context window of the actor, the critic's source and ``reward_path``,
        ``--packing`` for their families, and ``--inference_tp_size`` for the actor.

        Raises:
            UsageError: naming the flag and the model.
        """
        r, actor = self.rollout, self.actor
        budget = ({"--max_total_tokens": episodes.plan.max_total_tokens} if episodes else
                  {"--max_prompt_seq_len + --max_answer_seq_len": r.max_prompt_seq_len + r.max_answer_seq_len})
        critic_source = self.critic_source()
        models = [actor.model_name_or_path, critic_source and critic_source[0], reward_path]
        check_context_window(models, budget, actor.trust_remote_code)
        check_packing(self.packing, models, actor.trust_remote_code)
        if self.hybrid.enable_hybrid_engine and self.hybrid.inference_tp_size > 1:
            check_inference_tp(actor.model_name_or_path, self.hybrid.inference_tp_size, actor.trust_remote_code)

    def plan(self, n_generation_batches: int, n_prompts: int, world_size: int) -> PPOPlan:
        """Every derived size of the run (:func:`chatrl.sizes.plan_ppo`), and the loss aggregation
        where an unset default does not fit (said in ``plan.notes``), from the prompt loader's batches
        per rank, the prompts and the ranks."""
        return plan_ppo(PromptCounts(n_generation_batches, n_prompts, world_size), self.rollout, self.ppo,
                        self.actor_optim, self.packing, ptx=bool(self.data.unsupervised_dataset_name))

    def opening(self, plan: PPOPlan, world_size: int, n_prompts: int, reward_names: list[str],
                reward_path: str | None, with_critic: bool, episodes: Episodes | None) -> str:
        """The run's opening line: prompts, buffers and their shape, optimizer steps, ZeRO stages, the
        hybrid engine, the dtype, the reward's sources and the episodes."""
        r, e = self.rollout, episodes.plan if episodes else None
        critic = (f"{plan.critic_steps} critic optimizer steps; critic ZeRO-{self.critic_zero.zero_stage}"
                  if with_critic else "no critic")
        return (f"step 3 ({self.algorithm.name}): {n_prompts} prompts, {plan.total_buffers} experience buffers "
                f"of {r.generation_batches}×{r.per_device_generation_batch_size} prompts × "
                f"{self.ppo.samples_per_prompt} answers per rank × {world_size} ranks, {self.ppo.ppo_epochs} "
                f"epoch(s), {plan.actor_steps} actor optimizer steps, {critic}; actor "
                f"ZeRO-{self.actor_zero.zero_stage}, hybrid engine "
                f"{'on' if self.hybrid.enable_hybrid_engine else 'off'}; "
                f"{self.actor.dtype_note}{', fp32 LM head' if self.actor.fp32_lm_head else ''}; "
                f"reward: {' + '.join(reward_names)}" + (f" (reward model {reward_path})" if reward_path else "")
                + (f"; episodes of --env {self.env.env}: up to {e.max_turns} assistant turns, "
                   f"{e.max_total_tokens} tokens" if e else ""))

    @property
    def rule_rewards(self) -> bool:
        """Whether ``--reward_fn``, ``--reward_url`` or an environment (``--env``) give (part of) the reward."""
        return bool(self.reward.reward_fn or self.reward.reward_url or self.env.env)

    def episodes(self) -> Episodes | None:
        """The multi-turn episodes with ``--env``: the environment (:func:`chatrl.envs.load_environment`,
        which builds one to fail at start-up) and their sizes (:meth:`episodes_plan`), else None.

        Raises:
            UsageError: as :meth:`episodes_plan`, or an environment that does not load.
        """
        plan = self.episodes_plan()
        return Episodes(load_environment(self.env.env, self.env.env_args), plan) if plan is not None else None

    def episodes_plan(self) -> EpisodePlan | None:
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
