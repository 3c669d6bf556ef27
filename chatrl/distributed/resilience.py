"""Faults during training: non-finite steps and a failing rank (checkpoints: :mod:`chatrl.checkpoint`).

* :func:`skip_nonfinite_steps` makes an optimizer skip a step whose gradients are not finite.
  DeepSpeed's ZeRO 1–3 optimizers already do (they report it as ``optimizer.overflow`` and the
  engine counts ``engine.skipped_steps`` and leaves the learning-rate schedule alone); the plain
  torch optimizer of ZeRO-0 does not, so :func:`chatrl.distributed.dist.initialize` installs this guard there.
* :class:`NonFiniteGuard` watches the engines of a step: a training step with a skipped optimizer
  step is counted, and ``max_in_a_row`` such steps in a row raise :class:`NonFiniteError` (the
  caller writes a checkpoint of the last good weights first: a skipped step changes nothing).
* :func:`nonfinite_scores` puts step 3's rewards through the ``--debug_nonfinite_steps`` testing hook.
* :func:`report_failure` turns an exception on a rank into one line naming the rank, the step and
  the optimizer step reached, before the exception ends the process with a non-zero code (the
  launcher then stops the other ranks); a :class:`chatrl.errors.UsageError` (bad input the message
  fully names) is printed alone, without a traceback, and exits with code 2; Ctrl-C prints one line
  (what was saved, how to go on) and exits with 130.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

import torch

from chatrl.errors import UsageError

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many training steps in a row had non-finite loss or gradients."""


def skip_nonfinite_steps(optimizer: torch.optim.Optimizer, max_norm: float = 0.0) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` a no-op (gradients dropped) when any gradient is NaN or ±inf, and
    clip the gradients to a total L2 norm of ``max_norm`` (0: no clipping) before a finite step.

    Sets ``optimizer.overflow`` after each call, the attribute DeepSpeed's engine reads to count a
    skipped step and hold the learning-rate schedule (a total gradient norm that overflows fp32, above
    ~1.8e19 per element, counts as non-finite too). For optimizers whose gradients are the same
    on every rank when ``step`` runs (ZeRO-0: DeepSpeed all-reduces them first), so every rank
    takes the same decision and the same clip. The norm (before clipping) is left in
    ``optimizer._global_grad_norm``, where DeepSpeed's engine reads it for ``get_global_grad_norm()``
    as from its own optimizers. The clip is DeepSpeed's fp32 rule (and torch's):
    gradients × min(1, max_norm / (norm + 1e-6)), with the one norm the guard computes anyway;
    :func:`chatrl.distributed.dist.initialize` hands ZeRO-0's clipping to it so the norm is computed once, with
    no collective. Returns the optimizer, patched in place.
    """
    inner = optimizer.step

    def step(*args, **kwargs):
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        # one fused norm over all gradients (a NaN or ±inf anywhere makes it non-finite); a per-tensor
        # isfinite() was 37% of a tiny model's optimizer step on CPU (bench/peers profile)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else None
        finite = norm is None or bool(torch.isfinite(norm))
        optimizer.overflow = not finite
        optimizer._global_grad_norm = float(norm) if norm is not None else 0.0  # DeepSpeed's get_global_grad_norm
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            return None
        if max_norm > 0 and params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return inner(*args, **kwargs)

    if hasattr(inner, "_wrapped_by_lr_sched"):
        # a learning-rate schedule built on this optimizer tracks its steps through ``inner``, which this
        # step still calls; say so, or torch warns at the schedule's first step that step() was overridden
        step._wrapped_by_lr_sched = True
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


def nonfinite_scores(reward, hook):
    """Step 3's ``reward`` (``reward(batch) -> (scores (B,), parts)``, :class:`chatrl.rewards.WeightedReward`)
    with its scores passed through ``hook`` (``--debug_nonfinite_steps``: :meth:`chatrl.run.Run.nonfinite`,
    NaN at the listed steps)."""

    def scores(batch):
        total, parts = reward(batch)
        return hook(total), parts

    return scores


_PROGRESS: dict = {"step": "", "optimizer_step": 0, "saved": None, "saved_step": None, "resumes": False}

#: Exit code of a step stopped by Ctrl-C (SIGINT), as shells report it: 128 + 2.
INTERRUPTED = 130

#: Seconds a rank whose collective failed because another rank left waits before its own line, so
#: that the failing rank's line, the cause, is printed above it.
SECONDARY_DELAY_S = 1.0


def _short(message: str, limit: int = 240) -> str:
    """First line of an error message, without a leading ``[file.cc:123]`` source location, cut to ``limit``."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return first if len(first) <= limit else first[:limit - 1] + "…"


def set_progress(step_name: str | None = None, optimizer_step: int | None = None, *, saved: str | None = None,
                 saved_step: int | None = None, resumes: bool | None = None) -> None:
    """Record where this rank is, for :func:`report_failure`'s messages: the step's name, its
    optimizer step, the newest checkpoint written or resumed from (``saved``, at ``saved_step``),
    and whether the same command resumes from it (``--resume``)."""
    if step_name is not None:
        _PROGRESS["step"] = step_name
    if optimizer_step is not None:
        _PROGRESS["optimizer_step"] = optimizer_step
    if saved is not None:
        _PROGRESS["saved"], _PROGRESS["saved_step"] = saved, saved_step
    if resumes is not None:
        _PROGRESS["resumes"] = resumes


def interrupted_message() -> str:
    """The one line printed when Ctrl-C stops a step: where it was, what was saved, how to go on."""
    where, n = _PROGRESS["step"] or "chatrl", _PROGRESS["optimizer_step"]
    if _PROGRESS["saved"]:
        saved = f"saved: the checkpoint {_PROGRESS['saved']} (optimizer step {_PROGRESS['saved_step']})"
        how = ("the same command resumes from it" if _PROGRESS["resumes"]
               else "the same command with --resume continues from it")
    else:
        saved, how = "nothing saved yet (no checkpoint written: --save_interval)", "the same command starts again"
    return f"chatrl: interrupted (Ctrl-C) in {where} after optimizer step {n}; {saved}; {how}"


def stop_on_ctrl_c() -> None:
    """Make Ctrl-C under a launcher end this rank with :func:`report_failure`'s one line.

    A terminal sends SIGINT to the whole job; the DeepSpeed launcher answers it by sending SIGTERM
    to every rank at once, which ended each rank before its ``KeyboardInterrupt`` was handled: no
    chatrl line at all. After a SIGINT (handled first when both are pending) this rank's next
    SIGINT and SIGTERM are absorbed, so the interruption is reported and the rank exits with
    :data:`INTERRUPTED`. A SIGTERM without a SIGINT (the launcher stopping the job because another
    rank failed, a scheduler ending it) keeps its default: the process ends at once, as before.
    Call on every rank once at start-up; outside the main thread (a step run inside another program's
    worker thread) it does nothing, as signals reach the main thread only.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def absorb(signum, frame):
        return None

    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, absorb)
        signal.signal(signal.SIGTERM, absorb)
        raise KeyboardInterrupt

    def terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, terminated)


@contextlib.contextmanager
def report_failure():
    """Re-raise any exception after one line on stderr naming the rank, the step and its progress.

    Ctrl-C (``KeyboardInterrupt``) prints :func:`interrupted_message` instead of a traceback, on
    rank 0 only, and exits with :data:`INTERRUPTED`; a :class:`chatrl.errors.UsageError` prints its
    message alone and exits with 2.
    """
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit):  # a deliberate exit (argparse's usage errors): its message is out already
            raise
        if isinstance(e, KeyboardInterrupt):
            if os.environ.get("RANK", "0") == "0":
                sys.stderr.write(interrupted_message() + "\n")
                sys.stderr.flush()
            raise SystemExit(INTERRUPTED) from None
        if isinstance(e, UsageError):  # a message that says everything: alone, as argparse prints a bad flag
            sys.stderr.write(f"chatrl: error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
        rank = os.environ.get("RANK", "0")
        where = _PROGRESS["step"] or "chatrl"
        secondary = "Connection closed by peer" in str(e) or "Connection reset" in str(e) or "NCCL" in str(e)
        if secondary:  # another rank's failure: let that rank's own line (the cause) come out first
            import time

            time.sleep(SECONDARY_DELAY_S)
        # the DeepSpeed launcher's node rank and node count (CROSS_RANK / CROSS_SIZE) on multi-node jobs
        node = (f" on node {os.environ.get('CROSS_RANK')} of {os.environ['CROSS_SIZE']} ({socket.gethostname()})"
                if int(os.environ.get("CROSS_SIZE", "1")) > 1 else "")
        sys.stderr.write(f"\nchatrl: rank {rank} failed in {where} after optimizer step {_PROGRESS['optimizer_step']}"
                         f"{node}: {type(e).__name__}: {_short(str(e))}\n")
        if secondary:
            sys.stderr.write("chatrl: another rank has probably died; its own message (or the launcher's) names it. "
                             "The step continues from its last checkpoint with --resume (train.py adds it when the "
                             "same command is run again).\n")
        sys.stderr.flush()
        raise
