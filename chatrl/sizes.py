"""The sizes of a run: every derived size is computed and checked in one place.

Batch sizes (:class:`BatchSizes`: per device, gradient accumulation, ranks, global batch), the
length of a step-1/2 run in optimizer steps (:func:`plan_steps` → :class:`StepPlan`) and every
size of a step-3 run (:func:`plan_ppo` → :class:`PPOPlan`). A training loop reads its plan and
never re-derives a count; a size that does not fit raises ``ValueError`` here, naming the flags
and a fix, before any model is loaded. Pure arithmetic: no DeepSpeed, no model.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatrl.rl.algorithms import Algorithm
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
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every rank."""
        return self.per_device_batch * self.gradient_accumulation_steps * self.world_size

    def layout(self) -> dict:
        """The batch layout of a step-1/2 run, named by its flags: which samples each rank sees at
        each step (recorded in every checkpoint, checked on resume: :mod:`chatrl.checkpoint`)."""
        return {"world_size": self.world_size, "per_device_train_batch_size": self.per_device_batch,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}


@dataclass(frozen=True)
class StepPlan:
    """The length of a step-1/2 run in optimizer steps, derived and checked by :func:`plan_steps`."""

    steps_per_epoch: int
    total_steps: int
    num_warmup_steps: int


def plan_steps(n_batches: int, n_samples: int, batch: BatchSizes, num_train_epochs: int, max_steps: int,
               num_warmup_steps: int, what: str = "samples") -> StepPlan:
    """Optimizer steps of steps 1-2: ``n_batches`` micro-batches per rank and epoch (a loader's
    length), ``batch.gradient_accumulation_steps`` per step; the epoch's trailing partial step is
    dropped. ``max_steps`` (> 0) caps the total.

    Raises:
        ValueError: no full optimizer step per epoch, or a warm-up not shorter than the run (naming
            the flags and a fix).
    """
    steps_per_epoch = n_batches // batch.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ValueError(f"{n_samples} training {what} give no full optimizer step of global batch "
                         f"{batch.global_batch}; lower --per_device_train_batch_size or --gradient_accumulation_steps")
    total = steps_per_epoch * num_train_epochs
    if max_steps:
        total = min(total, max_steps)
    _check_warmup(num_warmup_steps, total, "optimizer steps")
    return StepPlan(steps_per_epoch, total, num_warmup_steps)


def _check_warmup(num_warmup_steps: int, total: int, unit: str) -> None:
    if num_warmup_steps < 0 or (num_warmup_steps and num_warmup_steps >= total):
        raise ValueError(f"--num_warmup_steps {num_warmup_steps} must be >= 0 and shorter than the run "
                         f"({total} {unit}); lower --num_warmup_steps or train longer (--num_train_epochs, --max_steps)")


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


def plan_ppo(n_generation_batches: int, n_prompts: int, world_size: int, per_device_generation_batch_size: int,
             per_device_training_batch_size: int, generation_batches: int, ppo_epochs: int,
             gradient_accumulation_steps: int, num_train_epochs: int, max_steps: int, num_warmup_steps: int,
             ptx: bool, algorithm: Algorithm, num_samples_per_prompt: int = 1,
             loss_agg_mode: str = "micro-batch-token-mean") -> PPOPlan:
    """Step 3's sizes from its flags. ``n_generation_batches``: full prompt batches per rank and epoch.

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

    Raises:
        ValueError: a size below 1, a group smaller than the algorithm needs, an inexact division (a
            generation batch not made of whole micro-batches; a buffer not made of whole optimizer
            steps), no full buffer per epoch, or a warm-up not shorter than the run; the message
            names the flags and a fix.
    """
    for flag, v in (("per_device_generation_batch_size", per_device_generation_batch_size),
                    ("per_device_training_batch_size", per_device_training_batch_size),
                    ("generation_batches", generation_batches), ("ppo_epochs", ppo_epochs),
                    ("gradient_accumulation_steps", gradient_accumulation_steps),
                    ("num_train_epochs", num_train_epochs), ("num_samples_per_prompt", num_samples_per_prompt)):
        if v < 1:
            raise ValueError(f"--{flag} must be >= 1, got {v}")
    if num_samples_per_prompt < algorithm.min_samples_per_prompt:
        raise ValueError(f"--rl_algorithm {algorithm.name} needs --num_samples_per_prompt >= "
                         f"{algorithm.min_samples_per_prompt} (a group of one answer has no baseline), got "
                         f"{num_samples_per_prompt}")
    global_mode = loss_agg_mode in GLOBAL_LOSS_AGG_MODES
    per_generation = per_device_generation_batch_size * num_samples_per_prompt
    if per_generation % per_device_training_batch_size:
        times_n = (f" × --num_samples_per_prompt {num_samples_per_prompt} = {per_generation} rollouts"
                   if num_samples_per_prompt > 1 else "")
        raise ValueError(f"--per_device_generation_batch_size {per_device_generation_batch_size}{times_n} is not a "
                         f"multiple of --per_device_training_batch_size {per_device_training_batch_size}: each rollout "
                         "batch must split into whole PPO micro-batches; make the generation batch a multiple of the "
                         "training one")
    micro_per_gen = per_generation // per_device_training_batch_size
    micro_per_buffer = generation_batches * ppo_epochs * micro_per_gen
    if global_mode and (generation_batches * micro_per_gen) % gradient_accumulation_steps:
        raise ValueError(f"--gradient_accumulation_steps {gradient_accumulation_steps} does not divide the "
                         f"{generation_batches * micro_per_gen} micro-batches of one pass over a buffer "
                         f"(--generation_batches {generation_batches} x {micro_per_gen} micro-batches per generation "
                         f"batch): with --loss_agg_mode {loss_agg_mode} an optimizer step would straddle two passes; "
                         "choose a divisor")
    if micro_per_buffer % gradient_accumulation_steps:
        raise ValueError(f"--gradient_accumulation_steps {gradient_accumulation_steps} does not divide the "
                         f"{micro_per_buffer} PPO micro-batches of an experience buffer (--generation_batches "
                         f"{generation_batches} x --ppo_epochs {ppo_epochs} x {micro_per_gen} micro-batches per "
                         "generation batch): an optimizer step would straddle two buffers; choose a divisor")
    if ptx and global_mode and gradient_accumulation_steps > 1:
        raise ValueError(f"the PTX loss (--unsupervised_dataset_name) with --loss_agg_mode {loss_agg_mode} needs "
                         f"--gradient_accumulation_steps 1 (got {gradient_accumulation_steps}): a PTX micro-step "
                         "follows every policy micro-batch, so an accumulated actor step would hold fewer policy "
                         "micro-batches than its loss normaliser counts")
    buffers_per_epoch = n_generation_batches // generation_batches
    if buffers_per_epoch == 0:
        raise ValueError(f"{n_prompts} step-3 prompts give no experience buffer of {generation_batches} x "
                         f"{per_device_generation_batch_size} per rank x {world_size} ranks; lower "
                         "--per_device_generation_batch_size or --generation_batches")
    total = buffers_per_epoch * num_train_epochs
    if max_steps:
        total = min(total, max_steps)
    policy_steps = total * micro_per_buffer // gradient_accumulation_steps
    actor_steps = policy_steps * (2 if ptx else 1)
    critic_steps = policy_steps if algorithm.needs_critic else 0
    _check_warmup(num_warmup_steps, policy_steps,
                  "critic optimizer steps" if algorithm.needs_critic else "actor optimizer steps")
    layout = {"world_size": world_size, "gradient_accumulation_steps": gradient_accumulation_steps,
              "per_device_generation_batch_size": per_device_generation_batch_size,
              "generation_batches": generation_batches, "per_device_training_batch_size": per_device_training_batch_size}
    return PPOPlan(buffers_per_epoch, total, generation_batches * per_generation * world_size,
                   micro_per_gen, micro_per_buffer, critic_steps, actor_steps, num_warmup_steps, layout)
