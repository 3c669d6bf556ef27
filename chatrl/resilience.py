"""Faults during training: non-finite steps, resumable checkpoints of a training loop, and a failing rank.

* :func:`skip_nonfinite_steps` makes an optimizer skip a step whose gradients are not finite.
  DeepSpeed's ZeRO 1–3 optimizers already do (they report it as ``optimizer.overflow`` and the
  engine counts ``engine.skipped_steps`` and leaves the learning-rate schedule alone); the plain
  torch optimizer of ZeRO-0 does not, so :func:`chatrl.dist.initialize` installs this guard there.
* :class:`NonFiniteGuard` watches the engines of a step: a training step with a skipped optimizer
  step is counted, and ``max_in_a_row`` such steps in a row raise :class:`NonFiniteError` (the
  caller writes a checkpoint of the last good weights first: a skipped step changes nothing).
* :class:`LoopCheckpoints` is the ``--save_interval`` / ``--resume`` / non-finite logic the three
  steps share; :func:`batches_from` puts a data loader at a resumed step's first batch.
* :func:`report_failure` turns an exception on a rank into one line naming the rank, the step and
  the optimizer step reached, before the exception ends the process with a non-zero code (the
  launcher then stops the other ranks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

import torch

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many training steps in a row had non-finite loss or gradients."""


def skip_nonfinite_steps(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` a no-op (gradients dropped) when any gradient is NaN or ±inf.

    Sets ``optimizer.overflow`` after each call, the attribute DeepSpeed's engine reads to count a
    skipped step and hold the learning-rate schedule (a total gradient norm that overflows fp32, above
    ~1.8e19 per element, counts as non-finite too). For optimizers whose gradients are the same
    on every rank when ``step`` runs (ZeRO-0: DeepSpeed all-reduces them first), so every rank
    takes the same decision. Returns the optimizer, patched in place.
    """
    inner = optimizer.step

    def step(*args, **kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        # one fused norm over all gradients (a NaN or ±inf anywhere makes it non-finite); a per-tensor
        # isfinite() was 37% of a tiny model's optimizer step on CPU (bench/peers profile)
        finite = not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        optimizer.overflow = not finite
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            return None
        return inner(*args, **kwargs)

    optimizer.step = step
    optimizer.overflow = False
    return optimizer


class NonFiniteGuard:
    """Counts training steps whose optimizer steps were skipped for non-finite loss or gradients.

    Args:
        engines: name → DeepSpeed engine with an optimizer (``skipped_steps`` is read).
        max_in_a_row: this many training steps in a row with a skipped optimizer step raise
            :class:`NonFiniteError` (0: never).

    Call :meth:`after_step` once per training step (an optimizer step in steps 1–2, an experience
    buffer in step 3). ``skipped`` is the total number of skipped optimizer steps.
    """

    def __init__(self, engines: dict, max_in_a_row: int):
        self.engines, self.max_in_a_row = engines, max_in_a_row
        self._seen = {name: e.skipped_steps for name, e in engines.items()}
        self.skipped, self.in_a_row = 0, 0

    def after_step(self, step: int) -> bool:
        """Record training step ``step``; returns True when it had a skipped optimizer step.

        Raises:
            NonFiniteError: the ``max_in_a_row``-th bad step in a row.
        """
        new = {name: e.skipped_steps - self._seen[name] for name, e in self.engines.items()}
        self._seen = {name: e.skipped_steps for name, e in self.engines.items()}
        bad = sum(new.values())
        self.skipped += bad
        if not bad:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        which = ", ".join(f"{name} {n}" for name, n in new.items() if n)
        log.warning("step %d: non-finite loss or gradients; optimizer step skipped (%s); %d in a row",
                    step, which, self.in_a_row)
        if self.max_in_a_row and self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"{self.in_a_row} training steps in a row (up to step {step}) had non-finite loss or gradients "
                f"(--max_nonfinite_steps {self.max_in_a_row}); the weights are those of the last good step. "
                "Lower the learning rate, check the data, or use fp32/bf16 instead of fp16")
        return True


class LoopCheckpoints:
    """``--save_interval`` / ``--save_total_limit`` / ``--resume`` for one step's training loop.

    Args:
        args: parsed flags with ``output_dir``, ``save_interval``, ``save_total_limit``, ``resume``,
            ``resume_from_checkpoint``.
        engines: name → DeepSpeed engine saved in every checkpoint (models, optimizers, schedulers).
        extra_modules: name → ``torch.nn.Module`` without optimizer saved too (step 3's EMA actor),
            as per-rank safetensors of its (ZeRO-3: local) parameters.
    """

    def __init__(self, args, engines: dict, extra_modules: dict | None = None):
        self.args, self.engines, self.extra = args, engines, extra_modules or {}
        self.guard = NonFiniteGuard(engines, args.max_nonfinite_steps)

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
        """
        from chatrl import cli, dist

        path = cli.resume_path(self.args)
        if path is None:
            if self.args.resume:
                log.info("--resume: no complete checkpoint under %s/checkpoints; starting from scratch",
                         self.args.output_dir)
            return None
        state = dist.load_checkpoint(self.engines, path)
        for name, module in self.extra.items():
            _load_local_params(module, os.path.join(path, f"{name}_rank{dist.get_rank()}.safetensors"))
        state["path"] = str(path)
        return state

    def due(self, step: int, total_steps: int) -> bool:
        """A periodic checkpoint is due after training step ``step`` (never after the last one)."""
        return bool(self.args.save_interval) and step % self.args.save_interval == 0 and step < total_steps

    def save(self, step: int, state: dict) -> None:
        """Write a checkpoint of training step ``step`` with ``state`` (JSON-serialisable). All ranks call it."""
        from chatrl import dist

        def write_extra(folder):
            for name, module in self.extra.items():
                _save_local_params(module, os.path.join(folder, f"{name}_rank{dist.get_rank()}.safetensors"))

        dist.save_checkpoint(self.engines, self.args.output_dir, step, state, keep=self.args.save_total_limit,
                             write_extra=write_extra)


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


_PROGRESS = {"step": "", "optimizer_step": 0}


def _short(message: str, limit: int = 240) -> str:
    """First line of an error message, without a leading ``[file.cc:123]`` source location, cut to ``limit``."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return first if len(first) <= limit else first[:limit - 1] + "…"


def set_progress(step_name: str | None = None, optimizer_step: int | None = None) -> None:
    """Record where this rank is, for :func:`report_failure`'s message."""
    if step_name is not None:
        _PROGRESS["step"] = step_name
    if optimizer_step is not None:
        _PROGRESS["optimizer_step"] = optimizer_step


@contextlib.contextmanager
def report_failure():
    """Re-raise any exception after one line on stderr naming the rank, the step and its progress."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit):  # a deliberate exit (argparse's usage errors): its message is out already
            raise
        rank = os.environ.get("RANK", "0")
        where = _PROGRESS["step"] or "chatrl"
        # the DeepSpeed launcher's node rank and node count (CROSS_RANK / CROSS_SIZE) on multi-node jobs
        node = (f" on node {os.environ.get('CROSS_RANK')} of {os.environ['CROSS_SIZE']} ({socket.gethostname()})"
                if int(os.environ.get("CROSS_SIZE", "1")) > 1 else "")
        sys.stderr.write(f"\nchatrl: rank {rank} failed in {where} after optimizer step {_PROGRESS['optimizer_step']}"
                         f"{node}: {type(e).__name__}: {_short(str(e))}\n")
        if "Connection closed by peer" in str(e) or "Connection reset" in str(e) or "NCCL" in str(e):
            sys.stderr.write("chatrl: another rank has probably died; its own message (or the launcher's) names it. "
                             "The step continues from its last checkpoint with --resume (train.py adds it when the "
                             "same command is run again).\n")
        sys.stderr.flush()
        raise
