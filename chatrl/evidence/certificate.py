"""A run's correctness certificate: ``OUTPUT_DIR/certificate.json``, written by every step.

Each property is measured on the run itself and compared with a declared bound
(``docs/certificate.md``):

1. **sampler/trainer agreement** (step 3): the largest per-token gap between the sampler's and the
   training forward's log-prob of a sampled token over the run (``rollout/logp_diff_max``,
   :func:`chatrl.rl.loss.logp_diff`) against a bound declared per dtype (:data:`AGREEMENT_BOUNDS`,
   or ``--logp_diff_bound``);
2. **weight version** (step 3): every rollout carries the version and checksum of the weights that
   generated it, and the trainer checked them against its own before learning
   (:mod:`chatrl.evidence.weight_version`; a failure stops the run at that step);
3. **data accounting**: per epoch, which examples the loss saw, how often, against the data set and
   the sampler's order: examples seen, repeated, not seen by reason, skipped by the data pipeline
   by reason (:class:`DataAccounting`); a resumed run carries the counts in its checkpoints;
4. **loss scale**: the first optimizer step's gradient norm (DeepSpeed's, after the accumulation
   and the ranks' averaging) against the norm of the same global batch computed as one micro-batch
   on one rank, by the loss's definition, on a copy of the initial weights (:class:`LossScaleProbe`).

:class:`Certificate` holds the properties and writes the file (rank 0, atomically); the run
report (:mod:`chatrl.tools.report`) shows it on top. A failed property is logged as an error naming the
property and its figure.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from chatrl.distributed.dist import all_reduce_max, all_reduce_sum, barrier, get_rank, get_world_size, is_main

log = logging.getLogger(__name__)

CERTIFICATE_FILE = "certificate.json"

#: Bound on the largest per-token |sampler − trainer| log-prob gap of a run, per dtype (nats). fp32:
#: the measured gaps are 4e-6 to 1.3e-5 (``docs/critic_free.md``); half precision rounds the logits.
AGREEMENT_BOUNDS = {"fp32": 1e-4, "bf16": 0.5, "fp16": 0.1}

#: Relative tolerance of the loss-scale probe, per dtype: two summation orders of one gradient, and the
#: norm itself (torch's float32 norm of a 3.2M-element embedding gradient is off by 3e-4 on CPU).
LOSS_SCALE_RTOL = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}

PROPERTIES = {"agreement": "sampler/trainer agreement", "weight_version": "weight version",
              "data_accounting": "data accounting", "loss_scale": "loss scale"}


@dataclass
class Property:
    """One measured property: its figure, its bound, passed (True / False; None: not checked, the
    message says why), a one-line message naming the property and the figure, and details."""

    key: str
    figure: float | None
    bound: float | None
    passed: bool | None
    message: str
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        # plain numbers in certificate.json, whatever the caller computed them with (a 0-dim tensor included)
        self.figure = None if self.figure is None else float(self.figure)
        self.bound = None if self.bound is None else float(self.bound)
        self.passed = None if self.passed is None else bool(self.passed)
        self.details = {k: float(v) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                        for k, v in self.details.items()}

    @property
    def name(self) -> str:
        """The property's name (``PROPERTIES``)."""
        return PROPERTIES.get(self.key, self.key)


class Certificate:
    """The properties of one run of one step (``program``: "step 1", ...), written to
    ``OUTPUT_DIR/certificate.json`` by rank 0 (:meth:`write`, atomic)."""

    def __init__(self, output_dir: str | os.PathLike, program: str):
        self.path = Path(output_dir) / CERTIFICATE_FILE
        self.program = program
        self.properties: dict[str, Property] = {}

    def add(self, prop: Property) -> Property:
        """Record ``prop`` (replacing one of the same key); a failure is logged as an error on rank 0."""
        self.properties[prop.key] = prop
        if prop.passed is False and is_main():
            log.error("%s", prop.message)
        return prop

    @property
    def passed(self) -> bool:
        """No property failed (unchecked ones do not fail the certificate)."""
        return all(p.passed is not False for p in self.properties.values())

    def to_dict(self) -> dict:
        """The JSON form: program, overall pass, and each property with name, figure, bound, pass, message."""
        return {"program": self.program, "passed": self.passed,
                "properties": [{"name": p.name, **asdict(p)} for p in self.properties.values()]}

    def state(self) -> dict:
        """The properties measured so far, for a checkpoint (a resumed run keeps them)."""
        return {k: asdict(p) for k, p in self.properties.items()}

    def restore(self, state: dict | None) -> None:
        """Take back the properties of :meth:`state` (from a checkpoint)."""
        for k, p in (state or {}).items():
            self.properties[k] = Property(**p)

    def write(self) -> Path:
        """Write the file on rank 0 (others do nothing); returns its path."""
        if is_main():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n")
            os.replace(tmp, self.path)
        return self.path


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def read_certificate(folder: str | os.PathLike) -> dict | None:
    """The certificate of a step's output folder, or None when it has none (or it cannot be read)."""
    path = Path(folder) / CERTIFICATE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


# ------------------------------------------------------------------------------------ 1. agreement
def agreement_property(max_gap: float | None, dtype: str, bound: float | None = None, steps: int = 0) -> Property:
    """Property 1 from the largest ``rollout/logp_diff_max`` of the run (nats) and the dtype's bound
    (:data:`AGREEMENT_BOUNDS`; ``bound`` overrides it)."""
    bound = AGREEMENT_BOUNDS.get(dtype, AGREEMENT_BOUNDS["fp32"]) if bound is None else bound
    if max_gap is None:
        return Property("agreement", None, bound, None, "sampler/trainer agreement: not measured (no step ran)")
    ok = max_gap <= bound
    return Property("agreement", max_gap, bound, ok,
                    f"sampler/trainer agreement {'passed' if ok else 'failed'}: the largest per-token log-prob gap "
                    f"between sampler and trainer over {steps} steps is {max_gap:.3g} nats "
                    f"({'≤' if ok else '>'} the {dtype} bound {bound:g})"
                    + ("" if ok else ": the sampler and the trainer do not score the same distribution (a flag such "
                       "as --temperature read by one side only, stale weights, or a numerics difference)"),
                    {"dtype": dtype, "steps": steps})


# ------------------------------------------------------------------------------- 2. weight version
def weight_version_property(check) -> Property:
    """Property 2 from a :class:`chatrl.evidence.weight_version.WeightVersionCheck` after the run (or its failure)."""
    if check.failure:
        return Property("weight_version", check.max_gap, check.max_bound, False, check.failure,
                        {"rollouts_checked": check.rollouts, "versions": check.versions})
    if not check.rollouts:
        return Property("weight_version", None, None, None, "weight version: not checked (no rollout was stamped)")
    first, last = (check.versions[0], check.versions[-1]) if check.versions else (0, 0)
    return Property("weight_version", check.max_gap, check.max_bound, True,
                    f"weight version passed: {check.rollouts} rollouts, each generated by the weights the trainer "
                    f"held (versions {first}..{last}); largest checksum gap {check.max_gap:.3g} ≤ bound "
                    f"{check.max_bound:.3g}", {"rollouts_checked": check.rollouts, "versions": check.versions})


# ------------------------------------------------------------------------------- 3. data accounting
class DataAccounting:
    """Which examples of the training set each epoch fed to the loss, against the data order.

    Args:
        loader: the step's loader (:func:`chatrl.distributed.dist.seeded_loader`: batches carry ``sample_index``,
            its sampler gives this rank's order of an epoch).
        steps_per_epoch: training steps per epoch. batches_per_step: loader batches per step.
        skipped: ``{reason: rows}`` the data pipeline skipped (:class:`chatrl.data.SkipReport`).

    :meth:`record` counts, per epoch, how often each example reached the loss on this rank;
    :meth:`state_dict` / :meth:`load_state_dict` carry the counts (summed over ranks) through a
    checkpoint; :meth:`finish` compares them with what the sampler's order says ``steps`` training
    steps must have drawn (each rank's order, up to the batches of the steps taken in each epoch):
    equal means every example the run was meant to see was seen exactly as often, in every epoch,
    resumed or not. A collective: every rank calls :meth:`state_dict` and :meth:`finish`.
    """

    def __init__(self, loader, steps_per_epoch: int, batches_per_step: int, skipped: dict | None = None):
        self.loader, self.steps_per_epoch, self.batches_per_step = loader, steps_per_epoch, batches_per_step
        self.size = len(loader.dataset)
        self.skipped = dict(skipped or {})
        self.counts: dict[int, torch.Tensor] = {}

    def record(self, epoch: int, batch: dict) -> None:
        """Count the examples of one loader batch (its ``sample_index``) as fed to the loss in ``epoch``."""
        idx = batch.get("sample_index") if isinstance(batch, dict) else None
        if idx is None:
            raise KeyError("DataAccounting.record: the batch has no 'sample_index' (a loader of dist.seeded_loader)")
        counts = self.counts.setdefault(epoch, torch.zeros(self.size, dtype=torch.int32))
        counts.index_add_(0, idx.cpu().long(), torch.ones(len(idx), dtype=torch.int32))

    def _global(self) -> dict[int, torch.Tensor]:
        epochs = torch.tensor([max(self.counts, default=-1)], dtype=torch.float64)
        n_epochs = int(all_reduce_max(epochs)[0]) + 1
        out = {}
        for e in range(n_epochs):
            local = self.counts.get(e, torch.zeros(self.size, dtype=torch.int32))
            out[e] = all_reduce_sum(local.to(torch.float64)).round().to(torch.int32)
        return out

    def state_dict(self) -> dict:
        """The counts summed over ranks (``{"counts": {epoch: (N,) int32}}``); a collective."""
        return {"size": self.size, "counts": self._global()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's counts: rank 0 holds them, the others start at zero (so that
        the sum over ranks is right).

        Raises:
            ValueError: the checkpoint counted a data set of another size.
        """
        if int(state["size"]) != self.size:
            raise ValueError(f"data accounting: the checkpoint counted {state['size']} examples, this run has "
                             f"{self.size} (another data set or split)")
        self.counts = ({int(e): c.clone() for e, c in state["counts"].items()} if get_rank() == 0 else {})

    def _expected(self, epoch: int, steps_in_epoch: int) -> torch.Tensor:
        sampler = self.loader.sampler
        saved = getattr(sampler, "epoch", 0)
        sampler.set_epoch(epoch)
        order = list(iter(sampler))
        sampler.set_epoch(saved)
        prefix = order[:min(steps_in_epoch * self.batches_per_step * self.loader.batch_size, len(order))]
        counts = torch.zeros(self.size, dtype=torch.float64)
        counts.index_add_(0, torch.tensor(prefix, dtype=torch.long), torch.ones(len(prefix), dtype=torch.float64))
        return all_reduce_sum(counts).round().to(torch.int32)

    def finish(self, steps: int) -> Property:
        """Property 3 after ``steps`` training steps; a collective."""
        recorded = self._global()
        epochs, ok, rows = [], True, []
        for e in range(-(-steps // self.steps_per_epoch) if steps else 0):
            k = min(self.steps_per_epoch, steps - e * self.steps_per_epoch)
            got = recorded.get(e, torch.zeros(self.size, dtype=torch.int32))
            want = self._expected(e, k)
            missing = int((want - got).clamp(min=0).sum())
            extra = int((got - want).clamp(min=0).sum())
            seen = int((got > 0).sum())
            drawn = int(got.sum())
            complete = k == self.steps_per_epoch
            row = {"epoch": e, "steps": k, "complete": complete, "size": self.size, "seen": seen,
                   "repeated": drawn - seen, "drawn": drawn, "expected_drawn": int(want.sum()),
                   "not_seen": {("remainder (fewer than one optimizer step)" if complete
                                 else "not reached (the run ended in this epoch)"): self.size - seen},
                   "sampler_padding_repeats": int(want.sum()) - int((want > 0).sum()),
                   "missing": missing, "extra": extra}
            ok = ok and not missing and not extra
            rows.append(row)
            epochs.append(f"epoch {e}: {seen} of {self.size} seen" + (f", {drawn - seen} repeated" if drawn > seen else "")
                          + ("" if complete else f" ({k} of {self.steps_per_epoch} steps)"))
        total_missing = sum(r["missing"] for r in rows)
        total_extra = sum(r["extra"] for r in rows)
        details = {"size": self.size, "skipped_by_pipeline": self.skipped, "epochs": rows}
        if not rows:
            return Property("data_accounting", None, 0, None, "data accounting: no training step ran", details)
        figure = float(total_missing + total_extra)
        skipped = (f"; skipped by the data pipeline: {', '.join(f'{n} {r}' for r, n in sorted(self.skipped.items()))}"
                   if self.skipped else "")
        if ok:
            return Property("data_accounting", figure, 0, True,
                            f"data accounting passed: every example was fed to the loss as often as the data order "
                            f"says ({'; '.join(epochs)}){skipped}", details)
        bad = [r for r in rows if r["missing"] or r["extra"]]
        return Property("data_accounting", figure, 0, False,
                        f"data accounting failed: {total_missing} example draws missing and {total_extra} extra "
                        f"against the data order (first in epoch {bad[0]['epoch']}: {bad[0]['missing']} missing, "
                        f"{bad[0]['extra']} extra; {'; '.join(epochs)}): the run skipped or repeated data", details)


def pipeline_skips(report) -> dict:
    """``{reason: rows}`` over every source of a :class:`chatrl.data.SkipReport` (train and eval rows)."""
    out: dict[str, int] = {}
    for name in getattr(report, "sources", {}):
        for reason, n in report.skipped(name).items():
            out[reason] = out.get(reason, 0) + int(n)
    return out


# ------------------------------------------------------------------------------------ 4. loss scale
_DROPOUT_FIELDS = ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout", "resid_pdrop",
                   "embd_pdrop", "attn_pdrop", "classifier_dropout")


def active_dropout(model: torch.nn.Module) -> float:
    """The largest dropout probability of ``model`` in training mode (config fields and ``nn.Dropout``
    modules, LoRA's included); 0 when two forward passes of the same batch give the same numbers."""
    p = max((float(m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)), default=0.0)
    cfg = getattr(model, "config", None)
    for key in _DROPOUT_FIELDS:
        v = getattr(cfg, key, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            p = max(p, float(v))
    return p


class LossScaleProbe:
    """Property 4: the first optimizer step's gradient norm against one micro-batch on one rank.

    Made before the engine wraps the model (:meth:`start`): rank 0 keeps a deep copy of the initial
    weights. After the run's first optimizer step, :meth:`check` (a collective) gathers what each
    rank's micro-batches of that step were to rank 0, which computes the loss of the whole global
    batch as ONE micro-batch with ``reference_loss(copy, items)`` (the loss's definition: no
    accumulation, no rank, no DeepSpeed scaling), its gradient norm over the trainable parameters,
    and compares it with the engine's (``engine.get_global_grad_norm()``: DeepSpeed's norm of the
    step's averaged gradient, before clipping) within :data:`LOSS_SCALE_RTOL`.

    Not checked (with the reason in the message) when off, on a resumed run (its certificate keeps
    the first run's figure), with active dropout (two forward passes differ), or when the step
    was not finite.
    """

    def __init__(self, copy_: torch.nn.Module | None, dtype: str, reason: str | None, what: str = "model"):
        self.copy, self.dtype, self.reason, self.what = copy_, dtype, reason, what
        self.gradient_buffer: torch.Tensor | None = None

    def use_gradient_buffer(self, buffer: torch.Tensor | None) -> None:
        """Let :meth:`check` put the copy's gradients in ``buffer``: the trained engine's flat gradient
        buffer (:func:`chatrl.distributed.deepspeed_patches.gradients_in_buffer`), all zeros between its optimizer
        step and its next backward, when the check runs. The copy's trainable parameters fill it in
        order (it is used only when their sizes add up to it and it holds zeros) and it is zeroed again afterwards: the
        check then needs no gradient memory of its own (one model's weights less at its peak). ``None``:
        the copy gets gradients of its own."""
        self.gradient_buffer = buffer

    def _gradients_in_buffer(self, model: torch.nn.Module) -> bool:
        """Attach views of :attr:`gradient_buffer` as ``model``'s gradients; False when it does not fit."""
        buf = self.gradient_buffer
        params = [p for p in model.parameters() if p.requires_grad and p.numel()]
        if buf is None or sum(p.numel() for p in params) != buf.numel() or any(p.dtype != buf.dtype for p in params):
            return False
        if bool(buf.any()):  # gradients accumulating for the engine's next step: not borrowed
            return False
        offset = 0
        for p in params:
            p.grad = buf[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        return True

    @classmethod
    def start(cls, model: torch.nn.Module, dtype: str, enabled: bool, resuming: bool, train_mode: bool = True,
              what: str = "model") -> LossScaleProbe:
        """Before ``dist.trained_engine(model, ...)``: the probe, with rank 0's copy of ``model``.

        ``train_mode``: the loop runs the model in training mode (steps 1, 2, DPO; step 3 runs in
        eval mode, where dropout is off)."""
        reason = None
        if not enabled:
            reason = "off (--disable_loss_scale_probe)"
        elif resuming:
            reason = "measured by the run this one resumes"
        elif train_mode and active_dropout(model) > 0:
            reason = (f"dropout {active_dropout(model):g} is on: two forward passes of the same batch differ "
                      "(--dropout 0 or --disable_dropout to check it)")
        copy_ = copy.deepcopy(model) if reason is None and is_main() else None
        return cls(copy_, dtype, reason, what)

    @property
    def active(self) -> bool:
        """Whether :meth:`check` is still to run."""
        return self.reason is None

    def skip(self, reason: str) -> Property:
        """Give up the check (``reason`` says why); returns the not-checked property."""
        self.reason, self.copy = reason, None
        return self.property_unchecked()

    def property_unchecked(self) -> Property:
        """The property when not checked."""
        return Property("loss_scale", None, None, None, f"loss scale ({self.what}): not checked: {self.reason}")

    def check(self, engine_norm: float | None, items, reference_loss: Callable[[torch.nn.Module, list], torch.Tensor],
              train_mode: bool = True) -> Property:
        """Compare ``engine_norm`` (the first optimizer step's gradient norm) with the one-micro-batch norm.

        Args:
            engine_norm: ``engine.get_global_grad_norm()`` after the first optimizer step.
            items: this rank's part of the step's global batch (any picklable object: sample indices,
                CPU rollouts); gathered to rank 0 as a list in rank order.
            reference_loss: ``reference_loss(model, items_of_every_rank)`` of the whole global batch as
                one micro-batch (rank 0 only): a 0-dim loss, or an iterable of 0-dim parts whose sum is
                that loss (each part's own share of it, e.g. a few sequences' summed NLL over the global
                batch's token count): each part's gradient is taken before the next is computed, so a
                real model's global batch never holds its activations at once (:func:`loss_parts`).
            train_mode: run the copy in training mode (as the loop ran the engine).

        Returns:
            The property (the same on every rank). A collective: every rank calls it.
        """
        if not self.active:
            return self.property_unchecked()
        if isinstance(engine_norm, torch.Tensor):  # DeepSpeed's bf16 and ZeRO optimizers return a 0-dim tensor
            engine_norm = float(engine_norm)
        gathered = [None] * get_world_size() if is_main() else None
        if torch.distributed.is_initialized() and get_world_size() > 1:
            torch.distributed.gather_object(items, gathered, dst=0)
        else:
            gathered = [items]
        result = torch.zeros(2, dtype=torch.float64)
        if is_main():
            model = self.copy
            model.train(train_mode)
            model.zero_grad(set_to_none=True)
            shared = self._gradients_in_buffer(model)
            loss = 0.0
            for part in loss_parts(reference_loss(model, gathered)):
                part.backward()
                loss += float(part.detach())
            squares = sum(float(p.grad.detach().double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
            result[0] = math.sqrt(squares)
            result[1] = loss
            if shared:  # the engine's buffer back as its next backward expects it
                model.zero_grad(set_to_none=True)
                self.gradient_buffer.zero_()
        self.copy = self.gradient_buffer = None  # the copy is needed once
        result = all_reduce_sum(result)
        barrier()
        ref, ref_loss = float(result[0]), float(result[1])
        rtol = LOSS_SCALE_RTOL.get(self.dtype, LOSS_SCALE_RTOL["fp32"])
        if engine_norm is None or not math.isfinite(engine_norm):
            self.reason = f"the first optimizer step's gradient norm is {engine_norm} (a skipped step)"
            return self.property_unchecked()
        gap = abs(engine_norm - ref) / max(ref, 1e-30)
        ok = gap <= rtol
        self.reason = "done"
        details = {"engine_grad_norm": engine_norm, "one_micro_batch_grad_norm": ref, "one_micro_batch_loss": ref_loss,
                   "ratio": engine_norm / ref if ref else None, "dtype": self.dtype, "what": self.what}
        return Property("loss_scale", gap, rtol, ok,
                        f"loss scale ({self.what}) {'passed' if ok else 'failed'}: the first optimizer step's gradient "
                        f"norm is {engine_norm:.6g}, the same global batch as one micro-batch on one rank gives "
                        f"{ref:.6g} (ratio {engine_norm / ref if ref else float('nan'):.6g}; relative gap {gap:.3g} "
                        f"{'≤' if ok else '>'} {rtol:g})"
                        + ("" if ok else ": the loss is scaled wrongly for the accumulation or the ranks"), details)


def loss_parts(loss) -> list | object:
    """A reference loss as parts: a 0-dim tensor becomes ``[loss]``; an iterable of 0-dim tensors is
    returned as it is (consumed lazily by :meth:`LossScaleProbe.check`)."""
    return [loss] if isinstance(loss, torch.Tensor) else loss


def merge_loss_scale(props: list[Property]) -> Property:
    """One loss-scale property from several models' (step 3's actor and critic): the worst figure;
    failed if any failed, passed if all checked ones passed."""
    checked = [p for p in props if p.passed is not None]
    if not checked:
        return Property("loss_scale", None, None, None, "; ".join(p.message for p in props))
    worst = max(checked, key=lambda p: (p.passed is False, p.figure or 0.0))
    return Property("loss_scale", worst.figure, worst.bound, all(p.passed for p in checked),
                    "; ".join(p.message for p in props), {p.details.get("what", str(i)): p.details
                                                           for i, p in enumerate(props)})


# ------------------------------------------------------------------- the certificate as a run's observer
class RunObserver:
    """What a run (:class:`chatrl.run.Run`) tells its certificate, in order: :meth:`started` (from
    scratch or resumed), :meth:`before_step` and :meth:`after_step` around each training step's body,
    :meth:`finish` at the end. Between them the run asks :meth:`state` (for a checkpoint),
    :meth:`probing` (whether the loss-scale probe runs after this step) and :meth:`needs_checkpoint`.
    ``accounting`` (:class:`DataAccounting`) is fed every batch that reaches the loss and kept in
    checkpoints. An observer reads a trainer only through its public methods."""

    accounting: DataAccounting

    def started(self, resumed: dict | None) -> None:
        """The run starts from scratch (None) or resumes from a checkpoint's state (its ``certificate``)."""

    def probing(self) -> bool:
        """Whether a loss-scale probe is still to run."""
        return False

    def before_step(self, step) -> None:
        """Before the body of training step ``step`` (:class:`chatrl.run.Step`)."""

    def after_step(self, step) -> None:
        """After step ``step``'s body, its non-finite guard and its figures (``step.figures``)."""

    def needs_checkpoint(self, step: int, total: int) -> bool:
        """Whether the certificate needs a checkpoint of step ``step`` of ``total`` (besides the schedule's)."""
        return False

    def state(self) -> dict:
        """What a checkpoint keeps of the certificate (JSON)."""
        return {}

    def finish(self, steps: int):
        """After ``steps`` training steps: every property; writes ``certificate.json`` (a collective)."""
        raise NotImplementedError


@dataclass
class SupervisedEvidence(RunObserver):
    """The certificate of step 1, step 2 or DPO and the two properties their loops measure.

    ``cert`` (:class:`Certificate`), ``probe`` (:class:`LossScaleProbe`, checked after the first
    optimizer step with the inputs the loop gives ``step.probe``) and ``accounting``
    (:class:`DataAccounting`, fed every micro-batch); made by :meth:`start` before the engine wraps
    the model, closed by :meth:`finish` after the loop.
    """

    cert: Certificate
    probe: LossScaleProbe
    accounting: DataAccounting

    @classmethod
    def start(cls, program: str, model: torch.nn.Module, dtype: str, probe_enabled: bool, resuming: bool,
              output_dir: str | os.PathLike, loader, steps_per_epoch: int, batches_per_step: int,
              report=None) -> SupervisedEvidence:
        """Before ``dist.trained_engine(model, ...)`` (the probe copies the initial weights on rank 0).

        Args:
            program: how the certificate names the step (``"step 1 (SFT)"``).
            dtype: the run's dtype (the probe's tolerance). probe_enabled: not
                ``--disable_loss_scale_probe``. resuming: the run resumes from a checkpoint.
            loader, steps_per_epoch, batches_per_step: as :class:`DataAccounting`'s.
            report: the data pipeline's :class:`chatrl.data.SkipReport` (None: nothing skipped).
        """
        probe = LossScaleProbe.start(model, dtype, probe_enabled, resuming)
        return cls(Certificate(output_dir, program), probe,
                   DataAccounting(loader, steps_per_epoch, batches_per_step, pipeline_skips(report)))

    def started(self, resumed: dict | None) -> None:
        """A resumed run keeps the properties its checkpoint holds."""
        if resumed:
            self.cert.restore(resumed.get("certificate"))

    def probing(self) -> bool:
        """Whether the loss-scale probe is still to run (after the run's first optimizer step)."""
        return self.probe.active

    def after_step(self, step) -> None:
        """After the first optimizer step: the loss-scale probe (a collective) with ``step.probe_input``
        and the engine's gradient norm (``step.grad_norm()``)."""
        if self.probe.active:
            items, reference_loss = step.probe_input
            self.check_loss_scale(step.grad_norm(), items, reference_loss)

    def state(self) -> dict:
        """The properties measured so far."""
        return self.cert.state()

    def check_loss_scale(self, engine_norm: float | None, items, reference_loss) -> Property:
        """After the first optimizer step: :meth:`LossScaleProbe.check` (a collective), added to the certificate."""
        return self.cert.add(self.probe.check(engine_norm, items, reference_loss))

    def finish(self, steps: int) -> Path:
        """After ``steps`` optimizer steps (a collective): the data accounting, the loss scale if it was
        never checked (with its reason), the file written. Returns its path."""
        self.cert.add(self.accounting.finish(steps))
        if "loss_scale" not in self.cert.properties:
            self.cert.add(self.probe.property_unchecked())
        return self.cert.write()
