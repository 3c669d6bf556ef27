"""The sizes of a run: every derived size is computed and checked in one place.

Batch sizes (:class:`BatchSizes`: per device, gradient accumulation, ranks, global batch), the
length of a step-1/2 run in optimizer steps (:func:`plan_steps` → :class:`StepPlan`) and every
size of a step-3 run (:func:`plan_ppo` → :class:`PPOPlan`; multi-turn episodes:
:func:`plan_episodes`). A training loop reads its plan and never re-derives a count; a size that
does not fit raises ``ValueError`` here, naming the flags and a fix, before any model is loaded.
Pure arithmetic: no DeepSpeed, no model.

Settings whose default depends on the run's length are unset (``None``) in their blocks, and the
plan computes their effective value: the warm-up (:func:`warmup_steps`), step 3's KL horizon and
its report sampling (``--print_answers_interval``). A default that does not fit a short run
adapts, and the plan's ``notes`` say so (the program prints them once); only a value the user
gave is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chatrl.config import OptimConfig, PackingConfig, PPOConfig, RolloutConfig
from chatrl.errors import UsageError
from chatrl.rl.loss import GLOBAL_LOSS_AGG_MODES


@dataclass(frozen=True)
class BatchSizes:
    """Every batch size of a run, derived and checked in one place.

    ``global_batch = per_device_batch × gradient_accumulation_steps × world_size`` samples per
    optimizer step.
    """

    per_device_batch: int
    gradient_accumulation_steps: int
    world_size: int

    def __post_init__(self):
        for name in ("per_device_batch", "gradient_accumulation_steps", "world_size"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every rank."""
        return self.per_device_batch * self.gradient_accumulation_steps * self.world_size

    def layout(self) -> dict:
        """The batch layout of a step-1/2 run, named by its flags: which samples each rank sees at
        each step (recorded in every checkpoint, checked on resume: :mod:`chatrl.checkpoint`)."""
        return {"world_size": self.world_size, "per_device_train_batch_size": self.per_device_batch,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}


#: Step 3's warm-up when ``--num_warmup_steps`` is unset: DeepSpeed-Chat's step-3 default.
PPO_WARMUP_STEPS = 100
#: Step 3's adaptive-KL horizon when ``--kl_horizon`` is unset (Ziegler et al., 2019), in rollouts.
KL_HORIZON = 10000.0
#: Steps between the rollouts step 3 records for the report when ``--print_answers_interval`` is unset.
PRINT_ANSWERS_INTERVAL = 10


@dataclass(frozen=True)
class StepPlan:
    """The length of a step-1/2 run in optimizer steps, derived and checked by :func:`plan_steps`.
    ``notes``: what adapted to the run (print once)."""

    steps_per_epoch: int
    total_steps: int
    num_warmup_steps: int
    notes: tuple[str, ...] = ()
    cap_note: str | None = None  # the run ends before --max_steps: said once at its end


def plan_steps(n_batches: int, n_samples: int, batch: BatchSizes, num_train_epochs: int, max_steps: int,
               num_warmup_steps: float | None, what: str = "samples", default_warmup: int = 0) -> StepPlan:
    """Optimizer steps of steps 1-2: ``n_batches`` micro-batches per rank and epoch (a loader's
    length), ``batch.gradient_accumulation_steps`` per step; the epoch's trailing partial step is
    dropped. ``max_steps`` (> 0) caps the total (``cap_note`` says so when the run ends before it).
    The warm-up is :func:`warmup_steps` of
    ``num_warmup_steps`` (None: ``default_warmup``, adapted to a short run).

    Raises:
        UsageError: no full optimizer step per epoch, or a given warm-up that does not fit the run
            (naming the flags and a fix).
    """
    steps_per_epoch = n_batches // batch.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise UsageError(f"{n_samples} training {what} give no full optimizer step of global batch "
                         f"{batch.global_batch}; lower --per_device_train_batch_size or "
                         "--gradient_accumulation_steps")
    total = steps_per_epoch * num_train_epochs
    if max_steps:
        total = min(total, max_steps)
    warmup, note = warmup_steps(num_warmup_steps, default_warmup, total, "optimizer steps")
    cap = (f"--max_steps {max_steps} is a cap: this run ended after {total} optimizer steps, when its "
           f"{num_train_epochs} epoch{'s' if num_train_epochs != 1 else ''} of {n_samples} {what} ran out "
           f"(--num_train_epochs, or more data, for a longer run)"
           if max_steps and total < max_steps else None)
    return StepPlan(steps_per_epoch, total, warmup, (note,) if note else (), cap)


def warmup_steps(given: float | None, default: int, total: int, unit: str) -> tuple[int, str | None]:
    """The warm-up of a ``total``-step run (in ``unit``) and a note when a default adapted.

    ``given`` is ``--num_warmup_steps``: a whole number of steps, or a fraction of the run below 1
    (``ceil(fraction × total)``, at most ``total - 1``; transformers' ``warmup_ratio``). Unset
    (None), the program's ``default`` is cut to a tenth of a shorter run (rounded down), and the
    note says so.

    Raises:
        UsageError: a given warm-up that is negative, a non-whole number of steps above 1, or not
            shorter than the run; the message names the flag and a fix.
    """
    if given is None:
        if default <= total // 10:
            return default, None
        used = total // 10
        return used, (f"--num_warmup_steps unset: the default {default} is longer than a tenth of this run "
                      f"({total} {unit}); using {used}. Set it to choose another")
    if given < 0 or (given >= 1 and given != int(given)):
        raise UsageError(f"--num_warmup_steps {given:g} must be >= 0 and a whole number of steps (or a "
                         "fraction of the run below 1, e.g. 0.1)")
    if given < 1:
        return (min(math.ceil(given * total), total - 1) if given else 0), None
    if given >= total:
        raise UsageError(f"--num_warmup_steps {int(given)} must be shorter than the run ({total} {unit}); "
                         "lower --num_warmup_steps (or give a fraction of the run, e.g. 0.1) or train longer "
                         "(--num_train_epochs, --max_steps)")
    return int(given), None


@dataclass(frozen=True)
class PPOPlan:
    """Every derived size of a step-3 run, checked by :func:`plan_ppo`. Per rank unless said.

    One *experience buffer* (a training step of step 3) is ``generation_batches`` generation
    batches of ``per_device_generation_batch_size`` prompts; each generation batch is learned
    from in ``ppo_epochs`` passes of ``micro_batches_per_generation`` micro-batches of
    ``per_device_training_batch_size`` rollouts.
    """

    buffers_per_epoch: int
    total_buffers: int
    rollouts_per_buffer: int  # all ranks
    micro_batches_per_generation: int
    micro_batches_per_buffer: int  # PPO micro-batches per buffer, PPO epochs included
    critic_steps: int  # optimizer steps of the critic over the run (0: critic-free)
    actor_steps: int  # optimizer steps of the actor over the run (doubled by the PTX loss)
    num_warmup_steps: int
    layout: dict  # which rollouts each rank makes at each step, by flag (recorded in checkpoints)
    loss_agg_mode: str = "token-mean"  # the policy loss's aggregation (:func:`loss_aggregation`)
    kl_horizon: float = KL_HORIZON  # the adaptive KL controller's horizon (rollouts)
    print_answers_interval: int = PRINT_ANSWERS_INTERVAL  # steps between recorded rollouts
    notes: tuple[str, ...] = ()  # what adapted to the run (print once)
    cap_note: str | None = None  # the run ends before --max_steps: said once at its end


@dataclass(frozen=True)
class PromptCounts:
    """What step 3's data and launch give its planner: ``n_generation_batches`` full prompt batches per
    rank and epoch (the prompt loader's length), ``n_prompts`` prompts, ``world_size`` ranks."""

    n_generation_batches: int
    n_prompts: int
    world_size: int


def loss_aggregation(ppo: PPOConfig, optim: OptimConfig, packing: PackingConfig,
                     ptx: bool) -> tuple[str, str | None]:
    """The policy loss's aggregation of a step-3 run (:data:`chatrl.rl.loss.LOSS_AGG_MODES`) and a note
    when an unset ``--loss_agg_mode`` adapted (None otherwise); ``ppo`` (the PPO block) is not changed.

    Unset, it is the algorithm's default, except in two cases where that default does not fit:

    * with ``--max_tokens_per_micro_batch``, ``micro-batch-token-mean`` (which weighs a token by the
      number of tokens sharing its micro-batch, so micro-batches cut by token budget would change the
      gradient) becomes ``token-mean``, a global mode (:mod:`chatrl.rl.loss`);
    * the PTX loss with ``--gradient_accumulation_steps`` > 1 needs a per-micro-batch aggregation:
      ``micro-batch-token-mean``.

    A given ``--loss_agg_mode`` is kept (:func:`plan_ppo` refuses ``micro-batch-token-mean`` with a
    token budget).
    """
    algorithm, mode = ppo.algorithm, ppo.loss_aggregation
    if packing.max_tokens_per_micro_batch and mode == "micro-batch-token-mean" and ppo.loss_agg_mode is None:
        return "token-mean", (
            "--max_tokens_per_micro_batch: the loss aggregation is token-mean (every action token of an "
            "optimizer step weighs the same, whatever the micro-batches) instead of "
            f"{ppo.rl_algorithm}'s default micro-batch-token-mean, whose weights depend on the micro-batches")
    if (ppo.loss_agg_mode is None and ptx and algorithm.loss_agg_mode != "micro-batch-token-mean"
            and optim.gradient_accumulation_steps > 1):
        return "micro-batch-token-mean", (
            "the PTX loss with --gradient_accumulation_steps > 1 needs a per-micro-batch aggregation: "
            "--loss_agg_mode micro-batch-token-mean is used (the policy and value losses then depend on the "
            "micro-batch split; see docs/ppo.md)")
    return mode, None


def plan_ppo(counts: PromptCounts, rollout: RolloutConfig, ppo: PPOConfig, optim: OptimConfig,
             packing: PackingConfig, ptx: bool) -> PPOPlan:
    """Step 3's sizes from its blocks: the rollout block (generation batch, generation batches per
    buffer, report interval), the PPO block (training micro-batch, PPO epochs, the algorithm and its
    group size, loss aggregation, KL horizon), the actor's optimizer block (gradient accumulation,
    epochs, ``--max_steps``, warm-up) and the packing block (token budget); ``counts`` are the data's
    and the launch's, ``ptx`` whether the PTX loss is on (``--unsupervised_dataset_name``).

    Each prompt gives ``num_samples_per_prompt`` answers (a group, kept whole on one rank and in
    one buffer), so a generation batch holds ``per_device_generation_batch_size × N`` rollouts; the
    ``algorithm`` (:class:`chatrl.rl.algorithms.Algorithm`) sets the smallest group and whether a
    critic makes optimizer steps. With a global ``loss_agg_mode`` (:mod:`chatrl.rl.loss`) an
    optimizer step must not straddle two passes over the buffer (its loss normaliser is counted per
    step before the first backward pass, :func:`chatrl.rl.loss.step_normalizers`).

    The PTX loss (``--unsupervised_dataset_name``) adds one actor micro-step after every PPO
    micro-batch, so the actor makes twice the critic's optimizer steps; its learning-rate schedule
    is sized for that (Ouyang et al., 2022, eq. 2 mixes the two losses per step). With a global
    ``loss_agg_mode`` an actor step must then hold one micro-batch (no accumulation), so that its
    policy micro-batches are the ones its normaliser counts.

    Defaults that depend on the run's length (unset: None) adapt to it, with a note each: the
    warm-up (:data:`PPO_WARMUP_STEPS`, :func:`warmup_steps`, counted in the policy's optimizer
    steps), the adaptive KL controller's horizon (:data:`KL_HORIZON` rollouts, or the run's rollouts
    when fewer; noted with ``adaptive_kl``) and the report's sampling interval
    (:data:`PRINT_ANSWERS_INTERVAL` steps, or a quarter of a shorter run).

    With ``max_tokens_per_micro_batch`` (micro-batches cut by token budget within each optimizer
    step, :mod:`chatrl.packing`) the sizes above still define the steps (``gradient_accumulation_steps
    × per_device_training_batch_size`` rollouts each); the loss aggregation must be a global one
    (the step settings adapt an unset one) and the PTX loss, whose micro-steps interleave the
    policy's, is not supported.

    The loss aggregation is :func:`loss_aggregation`'s (its note, if any, is the first of ``notes``).

    Raises:
        UsageError: a size below 1, a group smaller than the algorithm needs, an inexact division (a
            generation batch not made of whole micro-batches; a buffer not made of whole optimizer
            steps), no full buffer per epoch, a given warm-up that does not fit the run, a
            ``kl_horizon`` <= 0 or a ``print_answers_interval`` < 1; the message names the flags
            and a fix.
    """
    n_generation_batches, n_prompts, world_size = (counts.n_generation_batches, counts.n_prompts,
                                                   counts.world_size)
    per_device_generation_batch_size, generation_batches = rollout.per_device_generation_batch_size, \
        rollout.generation_batches
    per_device_training_batch_size, ppo_epochs = ppo.per_device_training_batch_size, ppo.ppo_epochs
    gradient_accumulation_steps, num_train_epochs = optim.gradient_accumulation_steps, optim.num_train_epochs
    max_steps, num_warmup_steps = optim.max_steps, optim.num_warmup_steps
    algorithm, num_samples_per_prompt = ppo.algorithm, ppo.samples_per_prompt
    kl_horizon, adaptive_kl, print_answers_interval = ppo.kl_horizon, ppo.kl_ctl == "adaptive", \
        rollout.print_answers_interval
    max_tokens_per_micro_batch = packing.max_tokens_per_micro_batch
    loss_agg_mode, adapted = loss_aggregation(ppo, optim, packing, ptx)
    for flag, v in (("per_device_generation_batch_size", per_device_generation_batch_size),
                    ("per_device_training_batch_size", per_device_training_batch_size),
                    ("generation_batches", generation_batches), ("ppo_epochs", ppo_epochs),
                    ("gradient_accumulation_steps", gradient_accumulation_steps),
                    ("num_train_epochs", num_train_epochs),
                    ("num_samples_per_prompt", num_samples_per_prompt),
                    ("print_answers_interval",
                     1 if print_answers_interval is None else print_answers_interval)):
        if v < 1:
            raise UsageError(f"--{flag} must be >= 1, got {v}")
    if kl_horizon is not None and not kl_horizon > 0:
        raise UsageError(f"--kl_horizon must be > 0 rollouts, got {kl_horizon}")
    if num_samples_per_prompt < algorithm.min_samples_per_prompt:
        raise UsageError(f"--rl_algorithm {algorithm.name} needs --num_samples_per_prompt >= "
                         f"{algorithm.min_samples_per_prompt} (a group of one answer has no baseline), got "
                         f"{num_samples_per_prompt}")
    global_mode = loss_agg_mode in GLOBAL_LOSS_AGG_MODES
    per_generation = per_device_generation_batch_size * num_samples_per_prompt
    if per_generation % per_device_training_batch_size:
        times_n = (f" × --num_samples_per_prompt {num_samples_per_prompt} = {per_generation} rollouts"
                   if num_samples_per_prompt > 1 else "")
        raise UsageError(f"--per_device_generation_batch_size {per_device_generation_batch_size}{times_n} "
                         "is not a multiple of --per_device_training_batch_size "
                         f"{per_device_training_batch_size}: each rollout batch must split into whole "
                         "training micro-batches; make the generation batch a multiple of the training one")
    micro_per_gen = per_generation // per_device_training_batch_size
    micro_per_buffer = generation_batches * ppo_epochs * micro_per_gen
    if global_mode and (generation_batches * micro_per_gen) % gradient_accumulation_steps:
        raise UsageError(f"--gradient_accumulation_steps {gradient_accumulation_steps} does not divide the "
                         f"{generation_batches * micro_per_gen} micro-batches of one pass over a buffer "
                         f"(--generation_batches {generation_batches} x {micro_per_gen} micro-batches per "
                         f"generation batch): with --loss_agg_mode {loss_agg_mode} an optimizer step would "
                         "straddle two passes; choose a divisor")
    if micro_per_buffer % gradient_accumulation_steps:
        raise UsageError(f"--gradient_accumulation_steps {gradient_accumulation_steps} does not divide the "
                         f"{micro_per_buffer} training micro-batches of an experience buffer "
                         f"(--generation_batches {generation_batches} x --ppo_epochs {ppo_epochs} x "
                         f"{micro_per_gen} micro-batches per generation batch): an optimizer step would "
                         "straddle two buffers; choose a divisor")
    if max_tokens_per_micro_batch and not global_mode:
        raise UsageError("--max_tokens_per_micro_batch needs a global --loss_agg_mode "
                         f"({', '.join(GLOBAL_LOSS_AGG_MODES)}), got {loss_agg_mode}: a per-micro-batch mean "
                         "depends on how the step is cut")
    if max_tokens_per_micro_batch and ptx:
        raise UsageError("--max_tokens_per_micro_batch does not combine with the PTX loss "
                         "(--unsupervised_dataset_name): its micro-steps interleave the policy's; drop one "
                         "of them")
    if ptx and global_mode and gradient_accumulation_steps > 1:
        raise UsageError(f"the PTX loss (--unsupervised_dataset_name) with --loss_agg_mode {loss_agg_mode} "
                         f"needs --gradient_accumulation_steps 1 (got {gradient_accumulation_steps}): a PTX "
                         "micro-step follows every policy micro-batch, so an accumulated actor step would "
                         "hold fewer policy micro-batches than its loss normaliser counts")
    buffers_per_epoch = n_generation_batches // generation_batches
    if buffers_per_epoch == 0:
        raise UsageError(f"{n_prompts} step-3 prompts give no experience buffer of {generation_batches} x "
                         f"{per_device_generation_batch_size} per rank x {world_size} ranks; lower "
                         "--per_device_generation_batch_size or --generation_batches")
    total = buffers_per_epoch * num_train_epochs
    if max_steps:
        total = min(total, max_steps)
    policy_steps = total * micro_per_buffer // gradient_accumulation_steps
    actor_steps = policy_steps * (2 if ptx else 1)
    critic_steps = policy_steps if algorithm.needs_critic else 0
    warmup, note = warmup_steps(
        num_warmup_steps, PPO_WARMUP_STEPS, policy_steps,
        "critic optimizer steps" if algorithm.needs_critic else "actor optimizer steps")
    notes = [n for n in (adapted, note) if n]
    rollouts_per_buffer = generation_batches * per_generation * world_size
    horizon = kl_horizon
    if horizon is None:
        horizon = min(KL_HORIZON, float(total * rollouts_per_buffer))
        if adaptive_kl and horizon < KL_HORIZON:
            notes.append(f"--kl_horizon unset: the default {KL_HORIZON:g} rollouts is longer than this run "
                         f"({total} steps of {rollouts_per_buffer} rollouts); using {horizon:g}")
    interval = print_answers_interval
    if interval is None:
        interval = max(1, min(PRINT_ANSWERS_INTERVAL, total // 4))
        if interval < PRINT_ANSWERS_INTERVAL:
            notes.append(f"--print_answers_interval unset: a rollout is recorded every {interval} step(s) of "
                         f"this {total}-step run (default {PRINT_ANSWERS_INTERVAL})")
    layout = {"world_size": world_size, "gradient_accumulation_steps": gradient_accumulation_steps,
              "per_device_generation_batch_size": per_device_generation_batch_size,
              "generation_batches": generation_batches,
              "per_device_training_batch_size": per_device_training_batch_size}
    cap = (f"--max_steps {max_steps} is a cap: this run ended after {total} steps (experience buffers), "
           f"when its {num_train_epochs} epoch{'s' if num_train_epochs != 1 else ''} of {n_prompts} prompts "
           "ran out (--num_train_epochs, or more prompts, for a longer run)"
           if max_steps and total < max_steps else None)
    return PPOPlan(buffers_per_epoch, total, rollouts_per_buffer, micro_per_gen, micro_per_buffer,
                   critic_steps, actor_steps, warmup, layout, loss_agg_mode, horizon, interval, tuple(notes),
                   cap)


#: ``--max_turns`` when ``--env`` is given without it.
DEFAULT_MAX_TURNS = 4


@dataclass(frozen=True)
class EpisodePlan:
    """The sizes of step 3's multi-turn episodes (``--env``): assistant turns per episode, the bound
    on an episode's tokens, and the opening turns' bound (``--max_prompt_seq_len``: their ids are cut
    from the left to it)."""

    max_turns: int
    max_total_tokens: int
    max_prompt_len: int

    @property
    def max_region_tokens(self) -> int:
        """The widest answer region (turns and observations after the prompt): at least one prompt token
        leaves ``max_total_tokens - 1``."""
        return self.max_total_tokens - 1


def plan_episodes(max_prompt_seq_len: int, max_answer_seq_len: int, max_turns: int | None,
                  max_total_tokens: int | None) -> EpisodePlan:
    """``--max_turns`` (default :data:`DEFAULT_MAX_TURNS`) and ``--max_total_tokens`` (default
    ``max_prompt + (2 max_turns - 1) max_answer``: every observation given as much room as a turn).

    Raises:
        UsageError: ``--max_turns`` < 1, or ``--max_total_tokens`` that leaves no room for one
            answer token after a full-length prompt.
    """
    turns = DEFAULT_MAX_TURNS if max_turns is None else max_turns
    if turns < 1:
        raise UsageError(f"--max_turns must be >= 1, got {turns}")
    total = (max_prompt_seq_len + (2 * turns - 1) * max_answer_seq_len if max_total_tokens is None
             else max_total_tokens)
    if total <= max_prompt_seq_len:
        raise UsageError(f"--max_total_tokens {total} leaves no room for an answer after "
                         f"--max_prompt_seq_len {max_prompt_seq_len}")
    return EpisodePlan(turns, total, max_prompt_seq_len)
