"""The four models of step 3 (and the optional EMA actor) as DeepSpeed engines.

* actor: the step-1 model, trained (own ZeRO stage, LoRA, gradient checkpointing, learning rate);
* reference: a frozen copy of the step-1 model (optionally offloaded to CPU under ZeRO-3);
* critic: initialised from the step-2 reward model, value head included, trained;
* reward: the step-2 reward model, frozen (optionally offloaded);
* EMA actor (``--enable_ema``): a frozen copy averaged after every actor step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass
class RLHFEngines:
    actor: object
    reference: object
    critic: object
    reward: object
    ema: object | None
    total_actor_steps: int
    total_critic_steps: int


def check_tokenizers_compatible(actor_tok, reward_tok, actor_path: str, reward_path: str) -> None:
    """The reward model reads the actor's token ids directly, so both tokenizers must map text alike.

    Raises:
        ValueError: naming both folders, when vocabularies or EOS ids differ.
    """
    if actor_tok.get_vocab() != reward_tok.get_vocab() or actor_tok.eos_token_id != reward_tok.eos_token_id:
        raise ValueError(
            f"actor tokenizer ({actor_path}) and reward tokenizer ({reward_path}) differ (vocabulary or EOS): "
            "train the reward model from a model of the actor's family, or pass a --critic_model_name_or_path "
            "trained with the actor's tokenizer")


def _scheduler_and_optimizer(model, lr: float, weight_decay: float, lora_lr: float | None, offload: bool,
                             scheduler_type: str, warmup: int, total: int):
    from transformers import get_scheduler

    from chatrl import dist
    from chatrl.models import optimizer_param_groups

    opt = dist.make_optimizer(optimizer_param_groups(model, weight_decay, lora_lr), lr=lr, offload=offload)
    return opt, get_scheduler(scheduler_type, opt, num_warmup_steps=warmup, num_training_steps=max(total, 1))


def build_engines(args, tokenizer, info, actor_steps: int, critic_steps: int | None = None, *,
                  with_critic: bool = True, with_reward_model: bool = True) -> RLHFEngines:
    """Load and wrap the four (five) models.

    ``actor_steps``, ``critic_steps`` (default: the actor's): optimizer steps of each trained model
    over the run (:class:`chatrl.sizes.PPOPlan`), the horizon of its learning-rate schedule.
    ``with_critic=False`` (a critic-free algorithm) builds no critic and no critic optimizer;
    ``with_reward_model=False`` (rewards from functions or URLs only) loads no reward model; the
    missing engines are ``None``.
    """
    critic_steps = actor_steps if critic_steps is None else critic_steps
    from chatrl import dist
    from chatrl.models import LoraSettings, apply_lora, enable_gradient_checkpointing, load_causal_lm
    from chatrl.sizes import BatchSizes
    from chatrl.step2_reward.model import load_reward_model

    batch = BatchSizes(args.per_device_training_batch_size, args.gradient_accumulation_steps, info.world_size)

    actor = load_causal_lm(args.actor_model_name_or_path, tokenizer, args.dtype, dropout=args.actor_dropout,
                           trust_remote_code=args.trust_remote_code)
    actor_lora = LoraSettings(args.actor_lora_dim, args.actor_lora_module_name, args.only_optimize_lora,
                              args.actor_lora_learning_rate)
    actor = apply_lora(actor, actor_lora)
    ema_model = copy.deepcopy(actor) if args.enable_ema else None
    if args.actor_gradient_checkpointing:
        enable_gradient_checkpointing(actor)
    opt, sched = _scheduler_and_optimizer(actor, args.actor_learning_rate, args.actor_weight_decay,
                                          args.actor_lora_learning_rate if actor_lora.enabled else None,
                                          args.offload, args.lr_scheduler_type, args.num_warmup_steps, actor_steps)
    actor_engine = dist.initialize(actor, dist.deepspeed_config(batch, args.actor_zero_stage, args.offload, args.dtype,
                                                                args.gradient_clipping), opt, sched)

    reference = load_causal_lm(args.actor_model_name_or_path, tokenizer, args.dtype, dropout=args.actor_dropout,
                               trust_remote_code=args.trust_remote_code)
    ref_engine = dist.frozen_engine(reference, args.actor_zero_stage, batch, args.dtype, args.partition_frozen_models,
                                    args.offload_reference_model)
    ema_engine = None
    if ema_model is not None:  # partitioned like the actor under ZeRO-3: the EMA update averages local partitions
        ema_engine = dist.frozen_engine(ema_model, args.actor_zero_stage, batch, args.dtype, partition="always",
                                         offload=False)

    critic_engine = reward_engine = None
    if with_critic:
        critic_engine = _critic_engine(args, tokenizer, batch, critic_steps)
    if with_reward_model:
        reward = load_reward_model(args.reward_model_name_or_path or args.critic_model_name_or_path, tokenizer,
                                   args.dtype, require_head=True, dropout=0.0, trust_remote_code=args.trust_remote_code)
        reward_engine = dist.frozen_engine(reward, args.critic_zero_stage, batch, args.dtype,
                                           args.partition_frozen_models, args.offload_reward_model)
    return RLHFEngines(actor_engine, ref_engine, critic_engine, reward_engine, ema_engine, actor_steps, critic_steps)


def _critic_engine(args, tokenizer, batch, critic_steps: int):
    """The critic (step-2 reward model, value head included) with its optimizer, as a DeepSpeed engine."""
    from chatrl import dist
    from chatrl.models import LoraSettings, enable_gradient_checkpointing
    from chatrl.step2_reward.model import load_reward_model, with_lora

    critic = load_reward_model(args.critic_model_name_or_path, tokenizer, args.dtype, require_head=True,
                               dropout=args.critic_dropout, trust_remote_code=args.trust_remote_code)
    critic = with_lora(critic, LoraSettings(args.critic_lora_dim, args.critic_lora_module_name,
                                            args.only_optimize_lora, args.critic_lora_learning_rate))
    if args.critic_gradient_checkpointing:
        enable_gradient_checkpointing(critic.hf)
    opt, sched = _scheduler_and_optimizer(critic, args.critic_learning_rate, args.critic_weight_decay,
                                          args.critic_lora_learning_rate if args.critic_lora_dim else None,
                                          args.offload, args.lr_scheduler_type, args.num_warmup_steps, critic_steps)
    return dist.initialize(critic, dist.deepspeed_config(batch, args.critic_zero_stage, args.offload, args.dtype,
                                                         args.gradient_clipping), opt, sched)


def seed_rollouts(seed: int, rank: int) -> int:
    """Seed this rank's sampling RNG (torch, every device) from ``--seed`` and the rank; returns the seed.

    Called once the models are built (their initialisation stays identical on every rank). Ranks
    given the same prompt then draw different answers, so the rollouts of a step are independent;
    the seed is a pure function of ``(seed, rank)`` (numpy's ``SeedSequence``), so a run is
    reproducible, and a resumed run continues from the per-rank RNG state its checkpoint saved.
    """
    import numpy as np
    import torch

    rank_seed = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
    torch.manual_seed(rank_seed)
    return rank_seed
