"""One owner for a run's state on disk and in the loop.

* the run marker (``chatrl_run.json``, the last file a finished step writes) and the refusal to
  overwrite a finished run: :func:`check_output_dir`, :func:`write_run_marker`;
* resumable checkpoints (``OUTPUT/checkpoints/step_N``, written atomically, RNG state included):
  :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`list_checkpoints`, and which one to
  resume from: :func:`resume_path`;
* a training loop's checkpoint schedule with the non-finite guard: :class:`LoopCheckpoints`;
* the data position of a resumed loop: :func:`batches_from` (a loader at a step's first batch)
  and :class:`Cycle` (step 3's endless PTX batches, with the count to skip).

Imports :mod:`chatrl.distributed.dist` and :mod:`chatrl.distributed.resilience`; neither imports this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from chatrl.config import CheckpointConfig
from chatrl.distributed.dist import barrier, get_rank, is_main
from chatrl.distributed.resilience import NonFiniteError, NonFiniteGuard, set_progress
from chatrl.errors import UsageError

log = logging.getLogger(__name__)

RUN_MARKER = "chatrl_run.json"


def resume_path(ckpt: CheckpointConfig, output_dir: str) -> str | None:
    """The checkpoint to resume from: ``--resume_from_checkpoint``, else with ``--resume`` the newest
    complete one under ``OUTPUT_DIR/checkpoints``, else None."""
    if ckpt.resume_from_checkpoint:
        return ckpt.resume_from_checkpoint
    if ckpt.resume:
        found = list_checkpoints(output_dir)
        return str(found[-1]) if found else None
    return None


def check_output_dir(output_dir: str, overwrite: bool) -> None:
    """Refuse to start when ``output_dir`` holds a finished run, unless ``--overwrite_output_dir``.

    Raises:
        UsageError: naming the folder and the flag (printed alone, as a parser's error).
    """
    marker = Path(output_dir) / RUN_MARKER
    if marker.exists() and not overwrite:
        raise UsageError(
            f"{output_dir} already holds a finished run ({RUN_MARKER}); pass --overwrite_output_dir to replace it "
            "or choose another --output_dir")


def write_run_marker(output_dir: str, info: dict) -> None:
    """Record a finished run (its step, flags and final metrics) as the last file written."""
    path = Path(output_dir) / RUN_MARKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(tmp, path)


CHECKPOINT_DIR = "checkpoints"
COMPLETE = "complete.json"


def _rng_state() -> dict:
    import random

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(engines: dict, output_dir: str | os.PathLike, step: int, state: dict,
                    keep: int = 2, write_extra=None, spare=None) -> Path:
    """Write a resumable checkpoint of ``engines`` (name → DeepSpeed engine) at optimizer step ``step``.

    Every rank writes its ZeRO partitions and RNG state into ``OUTPUT/checkpoints/.tmp-step_N``;
    after a barrier rank 0 writes ``complete.json`` (``state``: counters, loader position…) and
    renames the folder to ``step_N`` in one atomic rename, then keeps only the newest ``keep``
    checkpoints (and any whose step ``spare(step)`` holds). A crash at any point leaves earlier checkpoints intact and no ``step_N`` folder
    without ``complete.json``. ``write_extra(folder)``, if given, runs on every rank before the
    final barrier (per-rank files of the caller's own). All ranks must call it.
    """
    root = Path(output_dir) / CHECKPOINT_DIR
    tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(tmp / name), tag="state", save_latest=False)
    torch.save(_rng_state(), tmp / f"rng_rank{get_rank()}.pt")
    if write_extra is not None:
        write_extra(tmp)
    barrier()
    if is_main():
        (tmp / COMPLETE).write_text(json.dumps({"step": step, **state}, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(list_checkpoints(output_dir), key=lambda p: int(p.name[5:]))[:-keep or None]:
            if spare is None or not spare(int(old.name[5:])):
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``OUTPUT/checkpoints``, oldest first (half-written ones are skipped)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.glob("step_*"):
        if p.name[5:].isdigit() and (p / COMPLETE).is_file():
            found.append(p)
        elif p.is_dir():
            log.warning("skipping incomplete checkpoint %s (no %s)", p, COMPLETE)
    return sorted(found, key=lambda p: int(p.name[5:]))


#: DeepSpeed's own classes inside its engine checkpoints, allowed by the weights-only unpickler.
_DS_CHECKPOINT_CLASSES = (("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                          ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                          ("deepspeed.utils.tensor_fragment", "fragment_address"))


@contextlib.contextmanager
def _weights_only_loads(engine):
    """Make ``engine``'s checkpoint reads use ``torch.load(weights_only=True)``.

    DeepSpeed's torch checkpoint engine unpickles with ``weights_only=False`` (any code in a
    file runs). Its engine checkpoints hold tensors, plain containers and three DeepSpeed data
    classes, which are allowed here and nothing else.
    """
    import importlib

    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is None:
        yield
        return
    allowed = [getattr(importlib.import_module(m), n) for m, n in _DS_CHECKPOINT_CLASSES]

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    ckpt_engine.load = load
    try:
        yield
    finally:
        del ckpt_engine.load  # back to the class's method


def load_checkpoint(engines: dict, path: str | os.PathLike) -> dict:
    """Restore ``engines`` (models, optimizers, schedulers) and this rank's RNG from ``path``.

    Every file is read with ``torch.load(weights_only=True)`` (DeepSpeed's engine files too):
    nothing in a checkpoint can run code.

    Returns the ``state`` dict saved with it (``step`` included).

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete chatrl checkpoint (no {COMPLETE})")
    for name, engine in engines.items():
        with _weights_only_loads(engine):
            engine.load_checkpoint(str(path / name), tag="state")
    rng = path / f"rng_rank{get_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((path / COMPLETE).read_text())


class LoopCheckpoints:
    """``--save_interval`` / ``--save_total_limit`` / ``--resume`` for one step's training loop.

    Args:
        ckpt: the program's :class:`chatrl.config.CheckpointConfig`.
        output_dir: the step's ``--output_dir`` (checkpoints go to ``OUTPUT_DIR/checkpoints``).
        engines: name → DeepSpeed engine saved in every checkpoint (models, optimizers, schedulers).
        layout: the run's batch layout (:meth:`chatrl.sizes.BatchSizes.layout`,
            :attr:`chatrl.sizes.PPOPlan.layout`), recorded in every checkpoint and checked on resume.
        extra_modules: name → ``torch.nn.Module`` without optimizer saved too (step 3's EMA actor),
            as per-rank safetensors of its (ZeRO-3: local) parameters.
        extra_state: name → an object with ``state_dict()`` (a collective: every rank calls it; rank 0's
            result is saved as ``NAME.pt``, tensors and plain containers) and ``load_state_dict(state)``
            (every rank, on resume): the data accounting (:class:`chatrl.evidence.certificate.DataAccounting`).
        spare: ``spare(step) -> bool``: checkpoints of such steps outlive ``--save_total_limit`` (step 3:
            the one a recorded step starts from, which ``python -m chatrl.tools.replay`` needs).
    """

    def __init__(self, ckpt: CheckpointConfig, output_dir: str, engines: dict, layout: dict,
                 extra_modules: dict | None = None, extra_state: dict | None = None, spare=None):
        self.cfg, self.output_dir, self.engines, self.layout = ckpt, output_dir, engines, layout
        self.extra = extra_modules or {}
        self.extra_state = extra_state or {}
        self.spare = spare
        self.guard = NonFiniteGuard(engines, ckpt.max_nonfinite_steps)
        # for the Ctrl-C line: does the same command continue from the newest checkpoint?
        set_progress(resumes=bool(ckpt.resume and not ckpt.resume_from_checkpoint))

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped so far for non-finite loss or gradients (this run)."""
        return self.guard.skipped

    def after_step(self, step: int, state: dict) -> bool:
        """Record training step ``step`` with the non-finite guard; True when it was skipped.

        Raises:
            NonFiniteError: ``--max_nonfinite_steps`` bad steps in a row; a checkpoint of the
                current (last good) weights with ``state`` is written first.
        """
        try:
            return self.guard.after_step(step)
        except NonFiniteError:
            self.save(step, {**state, "stopped": "non-finite"})
            raise

    def save_if_due(self, step: int, total_steps: int, state: dict) -> None:
        """Write the periodic checkpoint of training step ``step`` when :meth:`due`."""
        if self.due(step, total_steps):
            self.save(step, state)

    def resume(self) -> dict | None:
        """Load the checkpoint ``--resume``/``--resume_from_checkpoint`` point to; returns its state or None.

        The state holds ``step`` and what the caller saved with it.

        Raises:
            FileNotFoundError: ``--resume_from_checkpoint`` is not a complete checkpoint.
            UsageError: the checkpoint was written with another world size or batch layout
                (:func:`check_resume_layout`).
        """
        path = resume_path(self.cfg, self.output_dir)
        if path is None:
            if self.cfg.resume:
                log.info("--resume: no complete checkpoint under %s/checkpoints; starting from scratch",
                         self.output_dir)
            return None
        check_resume_layout(path, self.layout)
        state = load_checkpoint(self.engines, path)
        for name, module in self.extra.items():
            _load_local_params(module, os.path.join(path, f"{name}_rank{get_rank()}.safetensors"))
        for name, obj in self.extra_state.items():
            saved = Path(path) / f"{name}.pt"
            if saved.is_file():
                obj.load_state_dict(torch.load(saved, weights_only=True))
            else:
                log.warning("checkpoint %s holds no %s; it starts afresh", path, saved.name)
        state["path"] = str(path)
        set_progress(saved=str(path), saved_step=state.get("step"))
        return state

    def stop_here(self, step: int) -> bool:
        """``--stop_after_steps`` (testing): the loop ends after training step ``step`` without the
        final save, as a crash would."""
        return step == self.cfg.stop_after_steps

    @staticmethod
    def note_stop(step: int, tracker) -> None:
        """Log the ``--stop_after_steps`` stop and close ``tracker``."""
        tracker.write(f"stopping after step {step} (--stop_after_steps), without the final save")
        tracker.close()

    def due(self, step: int, total_steps: int) -> bool:
        """A periodic checkpoint is due after training step ``step`` (never after the last one)."""
        return bool(self.cfg.save_interval) and step % self.cfg.save_interval == 0 and step < total_steps

    def save(self, step: int, state: dict) -> None:
        """Write a checkpoint of training step ``step`` with ``state`` (JSON-serialisable). All ranks call it."""
        def write_extra(folder):
            for name, module in self.extra.items():
                _save_local_params(module, os.path.join(folder, f"{name}_rank{get_rank()}.safetensors"))
            for name, obj in self.extra_state.items():
                extra = obj.state_dict()  # a collective: every rank
                if is_main():
                    torch.save(extra, os.path.join(folder, f"{name}.pt"))

        path = save_checkpoint(self.engines, self.output_dir, step, {**state, "layout": self.layout},
                               keep=self.cfg.save_total_limit, write_extra=write_extra, spare=self.spare)
        set_progress(saved=str(path), saved_step=step)


def _describe_layout(layout: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in layout.items())


def check_resume_layout(path, layout: dict) -> None:
    """Refuse to resume from checkpoint ``path`` with another batch layout than the one it recorded.

    The data order is a function of the layout (each rank's ``DistributedSampler`` share, the
    batches per optimizer step), so a resume with another layout would neither continue at the
    next unseen sample nor skip the right ones (it silently retrained seen samples). A checkpoint
    without a recorded layout (written before layouts were recorded) is accepted with a warning.

    Raises:
        UsageError: naming both layouts and the checkpoint.
    """
    saved = json.loads((Path(path) / COMPLETE).read_text()).get("layout")
    if saved is None:
        log.warning("checkpoint %s records no batch layout; resuming as if it were %s", path, _describe_layout(layout))
        return
    if saved != layout:
        raise UsageError(f"cannot resume from {path}: it was written with {_describe_layout(saved)}; this run has "
                         f"{_describe_layout(layout)}. The data order depends on this layout: resume with the "
                         "checkpoint's ranks and batch flags, or start a new --output_dir")


def batches_from(loader, step: int, steps_per_epoch: int, batches_per_step: int):
    """An iterator over ``loader`` positioned at the first batch of training step ``step``.

    The loader's ``DistributedSampler`` is set to the epoch holding ``step``; the batches of that
    epoch's earlier steps are drawn and dropped. With a loader that has its own seeded generator
    this gives a resumed run exactly the batches the uninterrupted run would have seen.
    """
    loader.sampler.set_epoch(step // steps_per_epoch)
    it = iter(loader)
    for _ in range(step % steps_per_epoch * batches_per_step):
        next(it)
    return it


def _local_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.ds_tensor if hasattr(p, "ds_tensor") else p.data) for name, p in module.named_parameters()}


def _save_local_params(module: torch.nn.Module, path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in _local_params(module).items()}, path)


@torch.no_grad()
def _load_local_params(module: torch.nn.Module, path: str) -> None:
    from safetensors.torch import load_file

    saved = load_file(path)
    for name, dst in _local_params(module).items():
        if name not in saved or saved[name].shape != dst.shape:
            raise ValueError(f"{path}: parameter {name} missing or of another shape (was the world size changed?)")
        dst.copy_(saved[name])


class Cycle:
    """Endless batches of ``loader`` (a DistributedSampler's), epoch after epoch, on ``device``.

    ``consumed`` counts the batches handed out; a resumed run calls :meth:`skip` with it to
    continue where the checkpoint was taken.
    """

    def __init__(self, loader, device):
        self.loader, self.device, self.consumed = loader, device, 0
        self._it, self._epoch = None, 0

    def __iter__(self):
        return self

    def _next_raw(self) -> dict:
        while True:
            if self._it is None:
                self.loader.sampler.set_epoch(self._epoch)
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
                self.consumed += 1
                return batch
            except StopIteration:
                self._it, self._epoch = None, self._epoch + 1

    def __next__(self) -> dict:
        return {k: v.to(self.device) for k, v in self._next_raw().items()}

    def skip(self, n: int) -> None:
        """Hand out (and drop) ``n`` batches."""
        for _ in range(n):
            self._next_raw()
