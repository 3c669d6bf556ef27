"""One owner for a training run's lifecycle, the same for every step program.

A program builds its data, models and engines, then a :class:`Run`, and iterates it; the step's
maths stays written out in the program's loop, top to bottom::

    run = Run(s, info, Schedule(total_steps, steps_per_epoch, gas, "step 1 SFT", plan.notes, plan.cap_note),
              loader, Saved({"model": engine}, batch.layout(), hf_model=(engine.module, tokenizer)), evidence,
              opening="step 1: ...", evaluation=Evaluation(evaluate, describe))
    engine.train()
    for step in run:                       # start or resume, the bar, the data position, stopping
        micro = micro_batches(step.samples())
        for m in micro:
            step.account(m)                # the data accounting of the certificate
            loss = step.nonfinite(loss_of(m))  # --debug_nonfinite_steps (a testing hook)
            ...
        step.done(figures, step_nll)       # figures(step_nll) after the non-finite guard, logged when due
    run.finish(1, vars(args))                  # the certificate, the HF folder, the run marker

The run owns, in this order, after each step's body: the progress (bar, failure reports), the
non-finite guard (``--max_nonfinite_steps``: :class:`chatrl.checkpoint.LoopCheckpoints`), the
step's figures, the observer's ``after_step`` (the certificate: :class:`chatrl.evidence.certificate.RunObserver`),
logging every ``--log_interval`` steps, evaluation every ``--eval_interval`` steps, at each epoch's
end and at the last step, checkpoints (``--save_interval``, and those the observer needs), HF
snapshots (``--save_hf_interval``) and ``--stop_after_steps``; at :meth:`Run.finish`, the
certificate, the final save and the run marker. Before the first step it resumes from the
checkpoint ``--resume`` / ``--resume_from_checkpoint`` names (weights, optimizer, RNG, data
position, data accounting, certificate) or evaluates the initial model.

No program subclasses it, and only this module writes run markers, builds checkpoint schedules or
stops a run (``tests/unit/test_run_lifecycle.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from chatrl.checkpoint import LoopCheckpoints, batches_from, resume_path, write_run_marker
from chatrl.data.collate import MicroBatches
from chatrl.distributed import dist
from chatrl.distributed.resilience import set_progress
from chatrl.distributed.weights import save_hf_model, save_snapshot_if_due
from chatrl.evidence.certificate import SupervisedEvidence
from chatrl.sizes import BatchSizes, StepPlan, plan_steps
from chatrl.tracking import Tracker

#: Sequences (or pairs) per part of the loss-scale probe's reference (``Step.probe``): the programs sum its
#: one-micro-batch loss part by part, each part's gradient taken before the next (the same gradient up to
#: rounding), so rank 0 never holds a whole global batch's activations and logits (on a 135M model with a
#: 49K vocabulary, a global batch of 16 × 256 tokens in one piece took rank 0 from 5 to 11 GiB).
PROBE_CHUNK = 4


def sequence_chunks(n: int, size: int = PROBE_CHUNK) -> list[range]:
    """``range(n)`` cut into consecutive ranges of at most ``size`` (the loss-scale probe's parts)."""
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass(frozen=True)
class Schedule:
    """How many training steps a run takes and how they meet the data.

    ``total_steps``: training steps (optimizer steps in steps 1, 2 and DPO; experience buffers in
    step 3). ``steps_per_epoch``: steps per pass over the loader. ``batches_per_step``: loader
    batches per step (gradient accumulation; step 3's generation batches). ``title``: the progress
    bar's label. ``notes``: settings that adapted to the run, said once at the start; ``cap_note``:
    said once at the end (the run ended before ``--max_steps``). ``unit``: what a step is called in
    the resume line.
    """

    total_steps: int
    steps_per_epoch: int
    batches_per_step: int
    title: str
    notes: tuple[str, ...] = ()
    cap_note: str | None = None
    unit: str = "optimizer step"


@dataclass
class Saved:
    """What a checkpoint of the run holds: ``engines`` (name → DeepSpeed engine, with its optimizer),
    the batch ``layout`` checked on resume (:func:`chatrl.checkpoint.check_resume_layout`),
    ``modules`` (name → ``torch.nn.Module`` without an optimizer: step 3's EMA actor) and the model
    saved as an HF folder (``hf_model``: ``(module, tokenizer)``): every ``--save_hf_interval`` steps
    as a snapshot, and at the end into ``--output_dir`` unless the program saves its own way."""

    engines: dict
    layout: dict
    modules: dict | None = None
    hf_model: tuple | None = None


@dataclass
class Evaluation:
    """A program's evaluation: ``evaluate(step) -> {"eval/...": number}`` after ``step`` training
    steps (0: before training; a collective), and ``describe(metrics) -> str``, its one-line summary."""

    evaluate: Callable[[int], dict]
    describe: Callable[[dict], str]


class Step:
    """One training step of a :class:`Run`, handed to the program's loop body.

    ``number``: the step being taken (1-based); ``epoch``: its epoch (0-based). The body draws its
    data with :meth:`batches` or :meth:`samples`, counts what reaches the loss with :meth:`account`,
    passes its loss through :meth:`nonfinite`, and hands its figures to :meth:`done`. After the body
    the run sets ``skipped`` (the non-finite guard's verdict) and ``figures``.
    """

    def __init__(self, run: Run, number: int, batches: Iterator):
        self.run, self.number = run, number
        self.epoch = (number - 1) // run.schedule.steps_per_epoch
        self._batches = batches
        self._figures: Callable[[], dict] | None = None
        self.skipped = False
        self.figures: dict = {}
        self.result = None  # what the step produced for the observer (step 3: the experience)
        self.probe_input: tuple | None = None  # (items, reference_loss) of the loss-scale probe

    def batches(self) -> Iterator:
        """This step's loader batches, one after the other (``batches_per_step`` of them)."""
        for _ in range(self.run.schedule.batches_per_step):
            yield next(self._batches)

    def samples(self) -> list:
        """This step's samples, every batch's in order (loaders that collate to lists)."""
        return [x for b in self.batches() for x in b]

    def account(self, batch: dict) -> None:
        """Count ``batch`` (it carries ``sample_index``) as fed to the loss in this step's epoch."""
        self.run.observer.accounting.record(self.epoch, batch)

    def nonfinite(self, value):
        """``--debug_nonfinite_steps`` (a testing hook): :meth:`Run.nonfinite`."""
        return self.run.nonfinite(value)

    @property
    def probing(self) -> bool:
        """Whether the certificate's loss-scale probe runs after this step (give it :meth:`probe`)."""
        return self.run.observer.probing()

    def probe(self, items, reference_loss: Callable) -> None:
        """The loss-scale probe's inputs: this rank's ``items`` of the step's global batch and
        ``reference_loss(model, items_of_every_rank)`` (:meth:`chatrl.evidence.certificate.LossScaleProbe.check`)."""
        self.probe_input = (items, reference_loss)

    def grad_norm(self, engine: str = "model") -> float | None:
        """The gradient norm of the step's last optimizer step of engine ``engine`` (DeepSpeed's)."""
        return self.run.saved.engines[engine].get_global_grad_norm()

    def done(self, figures: Callable[..., dict], *args, result=None) -> None:
        """End the body: ``figures(*args) -> {name: number}`` is called after the non-finite guard (it
        may read :attr:`skipped`) and logged when due; ``result`` goes to the observer."""
        self._figures, self._args, self.result = figures, args, result


@dataclass
class Run:
    """A training run's lifecycle (module docstring). Iterate it for the steps; then :meth:`finish`.

    Args:
        settings: the program's settings, with ``log`` (:class:`chatrl.config.LogConfig`), ``ckpt``
            (:class:`chatrl.config.CheckpointConfig`) and optionally ``snapshots``.
        info: this rank (:class:`chatrl.distributed.dist.DistInfo`).
        schedule: :class:`Schedule`. loader: the training loader (``dist.seeded_loader``).
        saved: :class:`Saved`, what checkpoints hold.
        observer: the certificate (:class:`chatrl.evidence.certificate.RunObserver`).
        opening: the line that describes the run, written first (then the schedule's notes).
        evaluation: :class:`Evaluation`, or None (no eval split).
        state: ``state() -> dict``, the program's own part of a checkpoint (JSON; step 3's KL
            controller and counters).
    """

    settings: object
    info: object
    schedule: Schedule
    loader: object
    saved: Saved
    observer: object
    opening: str = ""
    evaluation: Evaluation | None = None
    state: Callable[[], dict] | None = None
    step: int = field(default=0, init=False)
    metrics: dict = field(default_factory=dict, init=False)
    initial: dict = field(default_factory=dict, init=False)
    resumed: dict | None = field(default=None, init=False)
    stopped: bool = field(default=False, init=False)

    def __post_init__(self):
        s = self.settings
        self.log, self.cfg = s.log, s.ckpt
        self.nonfinite_steps = tuple(self.cfg.debug_nonfinite_steps)
        self.tracker = Tracker.for_run(self.log, self.info.is_main)
        if self.opening:
            self.tracker.write(self.opening)
        for note in self.schedule.notes:  # defaults that adapted to a short run, said once
            self.tracker.write(note)
        total = self.schedule.total_steps
        saved = self.saved
        accounting = {"data_accounting": self.observer.accounting}
        self.checkpoints = LoopCheckpoints(self.cfg, self.log.output_dir, saved.engines, saved.layout,
                                           saved.modules, extra_state=accounting,
                                           spare=lambda step: self.observer.needs_checkpoint(step, total))
        self._started = False

    def nonfinite(self, value):
        """``--debug_nonfinite_steps`` (a testing hook, the one for every program): ``value`` (a loss;
        step 3: the rewards) times NaN while the step being taken is listed, else ``value`` itself."""
        return value * float("nan") if self.step + 1 in self.nonfinite_steps else value

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped so far for non-finite loss or gradients (this run)."""
        return self.checkpoints.skipped

    def checkpoint_state(self) -> dict:
        """What a checkpoint of the run at its current step keeps besides the weights (JSON)."""
        return {"epoch": self.step // self.schedule.steps_per_epoch,
                "initial_metrics": self.initial, "certificate": self.observer.state(),
                **(self.state() if self.state is not None else {})}

    def start(self) -> dict | None:
        """Resume from the named checkpoint, or evaluate the initial model; returns the checkpoint's
        state (None when starting from scratch). Called once (iterating calls it)."""
        if self._started:
            return self.resumed
        self._started = True
        self.resumed = resumed = self.checkpoints.resume()
        if resumed:
            self.step = resumed["step"]
            self.initial = dict(resumed.get("initial_metrics") or {})
            self.metrics = dict(self.initial)
            self.observer.started(resumed)
            self.tracker.resumed_at(self.step)
            self.tracker.write(f"resumed from {resumed['path']} at {self.schedule.unit} {self.step}")
        else:
            self.observer.started(None)
            if self.evaluation is not None:  # else the data layer said once that there is no evaluation
                self.metrics = self.evaluation.evaluate(0)
                self.initial = dict(self.metrics)
                self.tracker.log(self.metrics, step=0)
                self.tracker.write(f"eval before training: {self.evaluation.describe(self.metrics)}")
        return resumed

    def per_second(self, per_step: float) -> float:
        """``per_step`` (samples, pairs) times the steps taken by this process, per second since its first."""
        return (self.step - self._first) * per_step / (time.time() - self._t0)

    def __iter__(self) -> Iterator[Step]:
        self.start()
        sch = self.schedule
        self.tracker.bar(sch.total_steps, sch.title, initial=self.step)
        self._t0, self._first = time.time(), self.step
        while self.step < sch.total_steps:
            it = batches_from(self.loader, self.step, sch.steps_per_epoch, sch.batches_per_step)
            for _ in range(sch.steps_per_epoch - self.step % sch.steps_per_epoch):
                step = Step(self, self.step + 1, it)
                self.observer.before_step(step)
                yield step
                self._after(step)
                if self.step >= sch.total_steps or self.checkpoints.stop_here(self.step):
                    break
            if self.checkpoints.stop_here(self.step):
                self.checkpoints.note_stop(self.step, self.tracker)
                self.stopped = True
                return

    def _after(self, step: Step) -> None:
        n, total = step.number, self.schedule.total_steps
        self.step = n
        set_progress(optimizer_step=n)
        self.tracker.advance()
        step.skipped = self.checkpoints.after_step(n, self.checkpoint_state())
        step.figures = step._figures(*step._args) if step._figures is not None else {}
        self.observer.after_step(step)
        if step.figures and (n % self.log.log_interval == 0 or n == total):
            self.tracker.log(step.figures, n)
        epoch_end = n % self.schedule.steps_per_epoch == 0
        if self.evaluation is not None and ((self.log.eval_interval and n % self.log.eval_interval == 0)
                                            or epoch_end or n == total):
            self.metrics = self.evaluation.evaluate(n)
            self.tracker.log(self.metrics, n)
            self.tracker.write(f"step {n}: eval {self.evaluation.describe(self.metrics)}")
        if self.checkpoints.due(n, total) or self.observer.needs_checkpoint(n, total):
            self.checkpoints.save(n, self.checkpoint_state())
        snapshots = getattr(self.settings, "snapshots", None)
        if snapshots is not None and self.saved.hf_model is not None:  # for python -m chatrl.eval
            module, tokenizer = self.saved.hf_model
            save_snapshot_if_due(snapshots.save_hf_interval, n, total, module, tokenizer, self.log.output_dir)

    def finish(self, step_id, args: dict, save: Callable[[], None] | None = None,
               before_save: Callable[[], None] | None = None) -> bool:
        """After the loop: unless the run stopped early (``--stop_after_steps``), the certificate
        (the observer's ``finish``, a collective), ``before_save()`` (a program's last checks), the
        HF folders (``save()``, or ``Saved.hf_model`` into ``--output_dir``) and the run marker
        (``step_id``, the steps, the metrics, ``args``), the last file written. Returns whether the
        run finished."""
        if self.stopped:
            return False
        self.observer.finish(self.step)
        if before_save is not None:
            before_save()
        if self.schedule.cap_note:
            self.tracker.write(self.schedule.cap_note)
        self.tracker.close()
        if save is not None:
            save()
        else:
            save_hf_model(*self.saved.hf_model, self.log.output_dir)
        if self.info.is_main:
            write_run_marker(self.log.output_dir, {
                "step": step_id, "steps": self.step, "metrics": self.metrics,
                "initial_metrics": self.initial, "args": args})
        return True



# ---------------------------------------------------------------- the supervised programs' start
@dataclass
class SupervisedData:
    """The training data of step 1, step 2 or DPO as their loop draws it: ``loader`` (each rank's
    share, seeded: :func:`chatrl.distributed.dist.seeded_loader`, collated to lists), ``micro_batches``
    (:class:`chatrl.data.collate.MicroBatches`: an optimizer step's samples cut by count or token
    budget), ``batch`` (:class:`chatrl.sizes.BatchSizes`) and ``plan`` (:func:`chatrl.sizes.plan_steps`)."""

    loader: object
    micro_batches: MicroBatches
    batch: BatchSizes
    plan: StepPlan
    what: str = "samples"

    @classmethod
    def of(cls, s, info, dataset, collate, what: str) -> SupervisedData:
        """From the program's settings ``s`` (``batch``, ``optim``, ``packing``), this rank ``info``, the
        training ``dataset`` and the micro-batches' ``collate``; ``what`` names a sample in messages."""
        loader = dist.seeded_loader(dataset, s.batch.per_device_train_batch_size, list, info, s.optim.seed)
        micro_batches = MicroBatches(collate, s.batch.per_device_train_batch_size,
                                     s.packing.max_tokens_per_micro_batch, info.device, dist.all_reduce_max)
        batch = BatchSizes(s.batch.per_device_train_batch_size, s.optim.gradient_accumulation_steps,
                           info.world_size)
        plan = plan_steps(len(loader), len(dataset), batch, s.optim.num_train_epochs, s.optim.max_steps,
                          s.optim.num_warmup_steps, what=what)
        return cls(loader, micro_batches, batch, plan, what)

    def schedule(self, title: str) -> Schedule:
        """The run's :class:`Schedule` (``title``: the progress bar's label)."""
        plan = self.plan
        return Schedule(plan.total_steps, plan.steps_per_epoch, self.batch.gradient_accumulation_steps, title,
                        tuple(plan.notes), plan.cap_note)

    def describe(self, info, zero_stage: int, dtype_note: str) -> str:
        """The run's size in words: optimizer steps, global batch (ranks × per-rank batch ×
        accumulation), ZeRO stage and dtype."""
        b = self.batch
        return (f"{self.plan.total_steps} optimizer steps of global batch {b.global_batch} {self.what} "
                f"({info.world_size} ranks × {b.per_device_batch} × {b.gradient_accumulation_steps} "
                f"accumulation), ZeRO-{zero_stage}, {dtype_note}")

    def engine(self, name: str, s, model, report) -> tuple[object, SupervisedEvidence]:
        """The certificate's evidence (its loss-scale probe copies ``model`` first) and the DeepSpeed
        engine that trains ``model`` (:func:`chatrl.distributed.dist.trained_engine`); ``name`` names the program
        in the certificate, ``report`` is the data's :class:`chatrl.data.SkipReport`."""
        out, plan = s.log.output_dir, self.plan
        gas = self.batch.gradient_accumulation_steps
        probe = not s.certificate.disable_loss_scale_probe
        evidence = SupervisedEvidence.start(name, model, s.model.dtype, probe,
                                            resume_path(s.ckpt, out) is not None, out, self.loader,
                                            plan.steps_per_epoch, gas, report)
        engine = dist.trained_engine(model, s.optim, s.lora, s.zero, s.model.dtype, self.batch,
                                     plan.total_steps, plan.num_warmup_steps)
        return engine, evidence
