"""The models of step 3 (and the optional EMA actor) as DeepSpeed engines.

* actor: the step-1 model, trained (own ZeRO stage, LoRA, gradient checkpointing, learning rate);
* reference: a frozen copy of the step-1 model (optionally offloaded to CPU under ZeRO-3), unless the
  KL coefficient is 0 (:func:`needs_reference`: nothing would read it but the logged KL);
* critic (algorithms with one, :attr:`chatrl.rl.algorithms.Algorithm.needs_critic`): from the
  step-2 reward model, value head included, trained; or, with a rule reward alone, from the actor
  with a fresh value head;
* reward: the step-2 reward model, frozen (optionally offloaded), unless functions or servers
  alone give the reward;
* EMA actor (``--enable_ema``): a frozen copy averaged after every actor step, held in float32
  (exported in ``--dtype``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from chatrl.checkpoint import resume_path
from chatrl.data.template_check import DEFAULT_CONVERSATIONS, check_startup, startup_conversations
from chatrl.distributed import dist
from chatrl.distributed.weights import save_hf_model
from chatrl.evidence.certificate import LossScaleProbe
from chatrl.models.causal_lm import load_causal_lm, load_tokenizer, torch_dtype
from chatrl.models.reward_model import load_reward_model, save_reward_model
from chatrl.models.trainable import load_trainable
from chatrl.run import Saved
from chatrl.sizes import BatchSizes, PPOPlan
from chatrl.step3_ppo.settings import Step3Settings

log = logging.getLogger(__name__)


@dataclass
class RLHFEngines:
    """The engines of a step-3 run; ``reference``, ``critic``, ``reward`` and ``ema`` are ``None`` when not built.
    ``probes``: the loss-scale probes of the trained models (``actor``, ``critic``), made before
    DeepSpeed wrapped them (:class:`chatrl.evidence.certificate.LossScaleProbe`)."""

    actor: object
    reference: object | None = None
    critic: object | None = None
    reward: object | None = None
    ema: object | None = None
    probes: dict = field(default_factory=dict)

    def saved(self, layout: dict, tokenizer) -> Saved:
        """What the run's checkpoints hold (:class:`chatrl.run.Saved`): the trained engines (actor, and
        critic when built), the batch ``layout``, the EMA actor, and the actor as the HF snapshot."""
        trained = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        return Saved(trained, layout, {"actor_ema": self.ema.module} if self.ema is not None else None,
                     hf_model=(self.actor.module, tokenizer))

    def save_hf(self, output_dir: str, tokenizer, dtype: str) -> None:
        """The HF-format folders at the end of a run: ``actor/``, ``critic/`` (when built) and
        ``actor_ema/`` (``--enable_ema``, exported in ``dtype``, the actor's ``--dtype``) under
        ``output_dir``. A collective under ZeRO-3: every rank calls it."""
        save_hf_model(self.actor.module, tokenizer, f"{output_dir}/actor")
        if self.critic is not None:
            save_reward_model(self.critic.module, tokenizer, f"{output_dir}/critic")
        if self.ema is not None:
            save_hf_model(self.ema.module, tokenizer, f"{output_dir}/actor_ema", dtype=torch_dtype(dtype))


def actor_tokenizer(s: Step3Settings, reward_path: str | None, episodes: bool) -> object:
    """The actor's tokenizer (left padding, for generation), checked at start-up: its chat template on
    a few data rows (and a tool call with ``episodes``: :func:`chatrl.data.template_check.check_startup`,
    ``--skip_template_check``), and against the reward model's at ``reward_path``
    (:func:`check_tokenizers_compatible`).

    Raises:
        ValueError: the template check failed, or the two tokenizers differ.
    """
    path = s.actor.model_name_or_path
    tokenizer = load_tokenizer(path, padding_side="left", trust_remote_code=s.actor.trust_remote_code)
    check_startup(tokenizer, {**startup_conversations(s.data.data_path),
                              **({"tool_calls": DEFAULT_CONVERSATIONS["tool_calls"]} if episodes else {})},
                  "step 3", s.template_check.skip_template_check, logging.getLogger("chatrl.step3"))
    if reward_path:
        check_tokenizers_compatible(tokenizer, load_tokenizer(reward_path), path, reward_path)
    return tokenizer


def needs_reference(s: Step3Settings) -> bool:
    """Whether step 3 builds the frozen reference: only when the KL coefficient ``--init_kl_coef`` is
    above 0. At 0 no KL term is in the reward or in the loss, and it stays 0 (the fixed controller
    keeps it, the adaptive one multiplies it), so the reference would cost one model's weights and a
    forward per buffer for the logged KL alone; without it, ``ref_logp`` and ``kl`` of the experience
    are ``None`` and the metric ``kl`` is absent (as in TRL's GRPO at ``beta`` 0)."""
    return s.ppo.init_kl_coef > 0


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


def build_engines(s: Step3Settings, tokenizer, info: dist.DistInfo, plan: PPOPlan,
                  reward_path: str | None) -> RLHFEngines:
    """Load and wrap the models of a step-3 run (module docstring); every rank calls it.

    The actor's and critic's learning-rate schedules span their optimizer steps over the run
    (``plan.actor_steps``, ``plan.critic_steps``) with the plan's warm-up. ``reward_path``: the
    reward model to load (:meth:`Step3Settings.reward_model_path`), or None. A run that continues
    from a checkpoint (``--resume``, :func:`chatrl.checkpoint.resume_path`) starts no loss-scale probe
    (the first run measured them).
    """
    resuming = resume_path(s.ckpt, s.log.output_dir) is not None
    probe_on = not s.certificate.disable_loss_scale_probe
    probes = {}
    batch = BatchSizes(s.ppo.per_device_training_batch_size, s.actor_optim.gradient_accumulation_steps,
                       info.world_size)
    dtype = s.actor.dtype
    actor, ema_model = load_trainable("causal_lm", tokenizer, s.actor, s.actor_lora,
                                      keep_copy="adapted" if s.ppo.enable_ema else None)
    probes["actor"] = LossScaleProbe.start(actor, dtype, probe_on, resuming, train_mode=False, what="actor")
    actor_engine = dist.trained_engine(actor, s.actor_optim, s.actor_lora, s.actor_zero, dtype, batch,
                                       plan.actor_steps, plan.num_warmup_steps)
    probes["actor"].use_gradient_buffer(getattr(actor_engine, "gradient_buffer", None))
    ref_engine = None
    if needs_reference(s):
        reference = load_causal_lm(s.actor.model_name_or_path, tokenizer, dtype, dropout=s.actor.dropout,
                                   trust_remote_code=s.actor.trust_remote_code, fp32_lm_head=s.actor.fp32_lm_head)
        ref_engine = dist.frozen_engine(reference, s.actor_zero.zero_stage, batch, dtype,
                                        s.actor_zero.partition_frozen_models, s.actor_zero.offload_reference_model)
    else:
        log.info("no reference model: the KL coefficient is 0 (--init_kl_coef 0), so no KL term is in the reward or "
                 "the loss; the KL to the reference is not measured (no 'kl' metric)")
    ema_engine = None
    if ema_model is not None:  # partitioned like the actor under ZeRO-3: the EMA update averages local partitions
        # held in float32 whatever --dtype: an update of (1 - beta) = 0.008 of a bf16 weight's change is
        # mostly below its rounding step (1/256 of it), and a bf16 average would barely move
        ema_engine = dist.frozen_engine(ema_model.float(), s.actor_zero.zero_stage, batch, "fp32", partition="always",
                                        offload=False)
    critic_engine = reward_engine = None
    source = s.critic_source()
    if source is not None:
        path, trained_head = source
        if not trained_head:
            log.info("the critic starts from %s with a fresh value head (no reward model is given)", path)
        critic_cfg = dataclasses.replace(s.critic, model_name_or_path=path)
        critic = load_trainable("reward", tokenizer, critic_cfg, s.critic_lora, require_head=trained_head).model
        probes["critic"] = LossScaleProbe.start(critic, dtype, probe_on, resuming, train_mode=False, what="critic")
        critic_engine = dist.trained_engine(critic, s.critic_optim, s.critic_lora, s.critic_zero, dtype, batch,
                                            plan.critic_steps, plan.num_warmup_steps)
    if reward_path is not None:
        reward = load_reward_model(reward_path, tokenizer, dtype, require_head=True, dropout=0.0,
                                   trust_remote_code=s.actor.trust_remote_code)
        reward_engine = dist.frozen_engine(reward, s.critic_zero.zero_stage, batch, dtype,
                                           s.critic_zero.partition_frozen_models, s.critic_zero.offload_reward_model)
    return RLHFEngines(actor_engine, ref_engine, critic_engine, reward_engine, ema_engine, probes)


def seed_rollouts(seed: int, rank: int) -> int:
    """Seed this rank's sampling RNG (torch, every device) from ``--seed`` and the rank; returns the seed.

    Called once the models are built (their initialisation stays identical on every rank). Ranks
    given the same prompt then draw different answers, so the rollouts of a step are independent;
    the seed is a pure function of ``(seed, rank)`` (numpy's ``SeedSequence``), so a run is
    reproducible, and a resumed run continues from the per-rank RNG state its checkpoint saved.
    """
    rank_seed = int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])
    torch.manual_seed(rank_seed)
    return rank_seed
