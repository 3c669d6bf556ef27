"""What step 3 shows of itself: its certificate (``certificate.json``) and its rollout records.

:class:`Step3Evidence` is called by the loop (:func:`chatrl.step3_ppo.main.train`) at a few
points and keeps, across the run and its resumes:

* the largest sampler/trainer log-prob gap (property 1, :func:`chatrl.certificate.agreement_property`);
* the trainer's weight-version check (property 2, :class:`chatrl.weight_version.WeightVersionCheck`);
* the prompts fed to each step (property 3, :class:`chatrl.certificate.DataAccounting`);
* the loss-scale probes of the actor and the critic at the first step (property 4): the rows of the
  first actor optimizer step, on every rank, against the same rows as one micro-batch on one rank
  (:meth:`chatrl.step3_ppo.trainer.Trainer.one_batch_actor_loss`, ``one_batch_critic_loss``);
* every ``--save_rollouts``-th step's record (:mod:`chatrl.rollout_records`), with a checkpoint
  of the step before it, from which ``python -m chatrl.replay`` trains on the record again.
"""

from __future__ import annotations

import math

from chatrl import dist
from chatrl.certificate import (
    Certificate,
    DataAccounting,
    agreement_property,
    merge_loss_scale,
    pipeline_skips,
    weight_version_property,
)
from chatrl.rollout_records import write_step


class Step3Evidence:
    """Step 3's certificate and rollout records (module docstring).

    Args:
        settings: the run's :class:`chatrl.step3_ppo.settings.Step3Settings`.
        args: the parsed flags (recorded in every rollout index, for the replay).
        info: this rank. plan: the run's sizes. trainer: its :class:`~chatrl.step3_ppo.trainer.Trainer`.
        probes: the engines' loss-scale probes. loader: the prompts' loader. report: the data's
            :class:`chatrl.data.SkipReport`.
    """

    def __init__(self, settings, args, info, plan, trainer, probes: dict, loader, report):
        self.s, self.args, self.info, self.plan, self.trainer, self.probes = settings, args, info, plan, trainer, probes
        self.cert = Certificate(settings.log.output_dir, f"step 3 ({settings.algorithm.name})")
        self.accounting = DataAccounting(loader, plan.buffers_per_epoch, settings.rollout.generation_batches,
                                         pipeline_skips(report))
        self.logp_diff_max: float | None = None
        self.steps = 0
        self.every = settings.certificate.save_rollouts

    # ------------------------------------------------------------------ resume
    def state(self) -> dict:
        """What a checkpoint keeps (JSON): the properties so far, the largest gap, the weight checks."""
        w = self.trainer.weight_check
        return {"properties": self.cert.state(), "logp_diff_max": self.logp_diff_max, "steps": self.steps,
                "weights": {"rollouts": w.rollouts, "max_gap": w.max_gap, "max_bound": w.max_bound,
                            "versions": w.versions}}

    def restore(self, state: dict | None) -> None:
        """Continue from a checkpoint's :meth:`state` (the data counts come back through
        ``LoopCheckpoints(extra_state=...)``)."""
        if not state:
            return
        self.cert.restore(state.get("properties"))
        self.logp_diff_max, self.steps = state.get("logp_diff_max"), int(state.get("steps", 0))
        w, saved = self.trainer.weight_check, state.get("weights") or {}
        w.rollouts, w.max_gap = int(saved.get("rollouts", 0)), float(saved.get("max_gap", 0.0))
        w.max_bound, w.versions = float(saved.get("max_bound", 0.0)), list(saved.get("versions", []))

    # ------------------------------------------------------------------ the loop
    def record_prompts(self, step: int, batch: dict) -> None:
        """Count a prompt batch of training step ``step + 1`` (``step`` steps done) as fed to the loss."""
        self.accounting.record(step // self.plan.buffers_per_epoch, batch)

    def probing(self) -> bool:
        """Whether a loss-scale probe is still to run (at the run's first step)."""
        return any(p.active for p in self.probes.values())

    def recording(self, step: int) -> bool:
        """Whether training step ``step`` (1-based) is recorded (``--save_rollouts``)."""
        return bool(self.every) and step % self.every == 0

    def before_learn(self, step: int) -> None:
        """Ask the trainer for its per-token trace when step ``step`` (1-based) is probed or recorded."""
        self.trainer.trace = {} if (self.probing() or self.recording(step)) else None

    def after_learn(self, exp) -> None:
        """The loss-scale probes, at the first step (a collective when they run)."""
        if not self.probing():
            return
        t, props = self.trainer, []
        rows = exp.rows(slice(0, t.gas * t.mb)).to("cpu")  # this rank's rows of the first actor optimizer step
        for name, probe in self.probes.items():
            split = t.mode if name == "actor" else t.critic_mode
            if split == "micro-batch-token-mean":
                props.append(probe.skip("--loss_agg_mode micro-batch-token-mean depends on the split by design"))
                continue
            norms = t.trace.get(f"{name}_grad_norm") or [None]
            loss = t.one_batch_actor_loss if name == "actor" else t.one_batch_critic_loss
            props.append(probe.check(norms[0], rows, loss, train_mode=False))
        self.cert.add(merge_loss_scale(props))

    def after_step(self, step: int, exp, metrics: dict) -> None:
        """Record step ``step``'s agreement figure and, when due, its rollouts (every rank writes its own)."""
        gap = metrics.get("rollout/logp_diff_max")
        if gap is not None and math.isfinite(gap):
            self.logp_diff_max = gap if self.logp_diff_max is None else max(self.logp_diff_max, gap)
        self.steps = step
        trace, self.trainer.trace = self.trainer.trace, None
        if not self.recording(step):
            return
        figures = {"actor_loss": metrics.get("actor_loss"), "critic_loss": metrics.get("critic_loss"),
                   "actor_grad_norm": (trace or {}).get("actor_grad_norm", []),
                   "critic_grad_norm": (trace or {}).get("critic_grad_norm", []),
                   "kl_coef": metrics.get("kl_coef"), "metrics": metrics}
        index = {"args": vars(self.args), "tokenizer": self.s.actor.model_name_or_path,
                 "algorithm": self.s.algorithm.name, "dtype": self.s.actor.dtype, "ppo_epochs": self.s.ppo.ppo_epochs,
                 "checkpoint": f"step_{step - 1}" if step > 1 else None, "figures": figures}
        write_step(self.s.log.output_dir, step, self.info.rank, self.info.world_size, exp, trace,
                   index if self.info.is_main else None, barrier=dist.barrier)

    def needs_checkpoint(self, step: int, total: int) -> bool:
        """Whether a checkpoint of step ``step`` is needed because step ``step + 1`` will be recorded
        (the replay starts from it)."""
        return step < total and self.recording(step + 1)

    def finish(self) -> Certificate:
        """Every property at the end of the run; writes ``certificate.json`` (a collective)."""
        self.cert.add(agreement_property(self.logp_diff_max, self.s.actor.dtype, self.s.certificate.logp_diff_bound,
                                         self.steps))
        self.cert.add(weight_version_property(self.trainer.weight_check))
        self.cert.add(self.accounting.finish(self.steps))
        if "loss_scale" not in self.cert.properties:
            self.cert.add(merge_loss_scale([p.property_unchecked() for p in self.probes.values()]))
        self.cert.write()
        return self.cert

    def failed(self) -> None:
        """After a weight-version failure (raised on every rank): write the certificate as it stands
        (rank 0, no collective) before the error ends the run."""
        self.cert.add(weight_version_property(self.trainer.weight_check))
        if self.logp_diff_max is not None:
            self.cert.add(agreement_property(self.logp_diff_max, self.s.actor.dtype,
                                             self.s.certificate.logp_diff_bound, self.steps))
        self.cert.write()
