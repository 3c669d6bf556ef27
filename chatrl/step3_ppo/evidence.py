"""What step 3 shows of itself: its certificate (``certificate.json``) and its rollout records.

:class:`Step3Evidence` observes the run (:class:`chatrl.run.Run`: before and after each
step, at the start and the end) and keeps, across the run and its resumes:

* the largest sampler/trainer log-prob gap (property 1, :func:`chatrl.evidence.certificate.agreement_property`);
* the trainer's weight-version check (property 2, :class:`chatrl.evidence.weight_version.WeightVersionCheck`);
* the prompts fed to each step (property 3, :class:`chatrl.evidence.certificate.DataAccounting`);
* the loss-scale probes of the actor and the critic at the first step (property 4): the rows of the
  first actor optimizer step, on every rank, against the same rows as one micro-batch on one rank
  (:meth:`chatrl.step3_ppo.trainer.Trainer.one_batch_actor_loss`, ``one_batch_critic_loss``);
* every ``--save_rollouts``-th step's record (:mod:`chatrl.evidence.rollout_records`), with a checkpoint
  of the step before it, from which ``python -m chatrl.tools.replay`` trains on the record again.
"""

from __future__ import annotations

import contextlib
import math

from chatrl.distributed import dist
from chatrl.evidence.certificate import (
    Certificate,
    DataAccounting,
    RunObserver,
    agreement_property,
    merge_loss_scale,
    pipeline_skips,
    weight_version_property,
)
from chatrl.evidence.rollout_records import write_step
from chatrl.evidence.weight_version import WeightVersionError


class Step3Evidence(RunObserver):
    """Step 3's certificate and rollout records (module docstring), an observer of the run
    (:class:`chatrl.run.Run`); it reads the trainer only through its public methods.

    Args:
        settings: the run's :class:`chatrl.step3_ppo.settings.Step3Settings`.
        args: the parsed flags (recorded in every rollout index, for the replay).
        info: this rank. plan: the run's sizes. trainer: its :class:`~chatrl.step3_ppo.trainer.Trainer`.
        probes: the engines' loss-scale probes. loader: the prompts' loader. report: the data's
            :class:`chatrl.data.SkipReport`.
    """

    def __init__(self, settings, args, info, plan, trainer, probes: dict, loader, report):
        self.s, self.args, self.info, self.plan = settings, args, info, plan
        self.trainer, self.probes = trainer, probes
        self.cert = Certificate(settings.log.output_dir, f"step 3 ({settings.algorithm.name})")
        self.accounting = DataAccounting(loader, plan.buffers_per_epoch, settings.rollout.generation_batches,
                                         pipeline_skips(report))
        self.logp_diff_max: float | None = None
        self.steps = 0
        self.every = settings.certificate.save_rollouts

    # ------------------------------------------------------------------ resume
    def state(self) -> dict:
        """What a checkpoint keeps (JSON): the properties so far, the largest gap, the weight checks."""
        return {"properties": self.cert.state(), "logp_diff_max": self.logp_diff_max, "steps": self.steps,
                "weights": self.trainer.weight_versions().state_dict()}

    def started(self, resumed: dict | None) -> None:
        """Continue from a checkpoint's :meth:`state` (the data counts come back through the run's
        checkpoints)."""
        state = (resumed or {}).get("certificate")
        if not state:
            return
        self.cert.restore(state.get("properties"))
        self.logp_diff_max, self.steps = state.get("logp_diff_max"), int(state.get("steps", 0))
        self.trainer.weight_versions().load_state_dict(state.get("weights") or {})

    # ------------------------------------------------------------------ the loop
    def probing(self) -> bool:
        """Whether a loss-scale probe is still to run (at the run's first step)."""
        return any(p.active for p in self.probes.values())

    def recording(self, step: int) -> bool:
        """Whether training step ``step`` (1-based) is recorded (``--save_rollouts``)."""
        return bool(self.every) and step % self.every == 0

    def before_step(self, step) -> None:
        """Ask the trainer for its per-token trace when ``step`` is probed or recorded."""
        self.trainer.trace_learning(self.probing() or self.recording(step.number))

    def probe(self, exp) -> None:
        """The loss-scale probes, at the first step (a collective when they run)."""
        if not self.probing():
            return
        t, props = self.trainer, []
        rows = t.first_optimizer_step_rows(exp)  # this rank's rows of the first actor optimizer step
        trace = t.learning_trace() or {}
        for name, probe in self.probes.items():
            if t.loss_aggregation(name) == "micro-batch-token-mean":
                props.append(probe.skip("--loss_agg_mode micro-batch-token-mean depends on the split by "
                                        "design"))
                continue
            norms = trace.get(f"{name}_grad_norm") or [None]
            loss = t.one_batch_actor_loss if name == "actor" else t.one_batch_critic_loss
            props.append(probe.check(norms[0], rows, loss, train_mode=False))
        self.cert.add(merge_loss_scale(props))

    def after_step(self, step) -> None:
        """The loss-scale probes at the first step; the step's agreement figure and, when due, its
        rollouts (``step.result``: the experience; every rank writes its own)."""
        exp, metrics, n = step.result, step.figures, step.number
        self.probe(exp)
        gap = metrics.get("rollout/logp_diff_max")
        if gap is not None and math.isfinite(gap):
            self.logp_diff_max = gap if self.logp_diff_max is None else max(self.logp_diff_max, gap)
        self.steps = n
        trace = self.trainer.learning_trace()
        self.trainer.trace_learning(False)
        if not self.recording(n):
            return
        figures = {"actor_loss": metrics.get("actor_loss"), "critic_loss": metrics.get("critic_loss"),
                   "actor_grad_norm": (trace or {}).get("actor_grad_norm", []),
                   "critic_grad_norm": (trace or {}).get("critic_grad_norm", []),
                   "kl_coef": metrics.get("kl_coef"), "metrics": metrics}
        index = {"args": vars(self.args), "tokenizer": self.s.actor.model_name_or_path,
                 "algorithm": self.s.algorithm.name, "dtype": self.s.actor.dtype,
                 "ppo_epochs": self.s.ppo.ppo_epochs,
                 "checkpoint": f"step_{n - 1}" if n > 1 else None, "figures": figures}
        write_step(self.s.log.output_dir, n, self.info.rank, self.info.world_size, exp, trace,
                   index if self.info.is_main else None, barrier=dist.barrier)

    def needs_checkpoint(self, step: int, total: int) -> bool:
        """Whether a checkpoint of step ``step`` is needed because step ``step + 1`` will be recorded
        (the replay starts from it)."""
        return step < total and self.recording(step + 1)

    def finish(self, steps: int) -> Certificate:
        """Every property after ``steps`` training steps; writes ``certificate.json`` (a collective)."""
        self.cert.add(agreement_property(self.logp_diff_max, self.s.actor.dtype,
                                         self.s.certificate.logp_diff_bound, self.steps))
        self.cert.add(weight_version_property(self.trainer.weight_versions()))
        self.cert.add(self.accounting.finish(self.steps))
        if "loss_scale" not in self.cert.properties:
            self.cert.add(merge_loss_scale([p.property_unchecked() for p in self.probes.values()]))
        self.cert.write()
        return self.cert

    def failed(self) -> None:
        """After a weight-version failure (raised on every rank): write the certificate as it stands
        (rank 0, no collective) before the error ends the run."""
        self.cert.add(weight_version_property(self.trainer.weight_versions()))
        if self.logp_diff_max is not None:
            self.cert.add(agreement_property(self.logp_diff_max, self.s.actor.dtype,
                                             self.s.certificate.logp_diff_bound, self.steps))
        self.cert.write()

    @contextlib.contextmanager
    def failing_on_stale_weights(self):
        """``with evidence.failing_on_stale_weights(): <the loop>``: a
        :class:`chatrl.evidence.weight_version.WeightVersionError` (rollouts of other weights than the
        trainer's, raised on every rank) writes the certificate as it stands (:meth:`failed`) and
        goes on."""
        try:
            yield
        except WeightVersionError:
            self.failed()
            raise
