"""What every step program does first: its place in the job, logging, the output folder, the seed."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import set_seed

from chatrl.certificate import CERTIFICATE_FILE
from chatrl.checkpoint import CHECKPOINT_DIR, RUN_MARKER, check_output_dir, resume_path
from chatrl.config import CheckpointConfig, LogConfig
from chatrl.dist import DistInfo, barrier, init_distributed
from chatrl.resilience import set_progress, stop_on_ctrl_c
from chatrl.rollout_records import ROLLOUTS_DIR
from chatrl.tracking import METRICS_FILE, SAMPLES_FILE, setup_logging
from chatrl.weights import SNAPSHOT_DIR


def start(step_name: str, log: LogConfig, seed: int, ckpt: CheckpointConfig | None = None) -> DistInfo:
    """Start a step program on this rank and return its place in the job.

    Names the step for failure reports (:func:`chatrl.resilience.set_progress`), reports Ctrl-C under
    a launcher in one line (:func:`chatrl.resilience.stop_on_ctrl_c`), joins the process
    group (:func:`chatrl.dist.init_distributed`), sets up logging, refuses an output folder that
    holds a finished run unless ``--overwrite_output_dir`` (:func:`chatrl.checkpoint.check_output_dir`),
    and, given the run's ``ckpt`` block, clears what an earlier run left in the folder when this run
    starts from scratch rather than from a checkpoint (:func:`start_afresh`); then seeds Python,
    NumPy and torch (``--seed``). Every rank calls it.

    Raises:
        UsageError: ``--output_dir`` holds a finished run (names the folder and the flag).
    """
    set_progress(step_name)
    stop_on_ctrl_c()
    info = init_distributed()
    setup_logging(info.rank)
    check_output_dir(log.output_dir, log.overwrite_output_dir)
    if ckpt is not None and resume_path(ckpt, log.output_dir) is None:
        if info.is_main:
            start_afresh(log.output_dir)
        barrier()
    set_seed(seed)
    return info


#: What a run leaves in its output folder that a new run from scratch must not inherit: its marker,
#: checkpoints, snapshots, rollout records, certificate, and logs (TensorBoard's default folder too).
EARLIER_RUN = (RUN_MARKER, CHECKPOINT_DIR, SNAPSHOT_DIR, ROLLOUTS_DIR, CERTIFICATE_FILE, str(METRICS_FILE),
               str(SAMPLES_FILE), "logs/metrics.before-resume-*.jsonl", "logs/tb")


def start_afresh(output_dir: str | Path) -> list[Path]:
    """Remove an earlier run's state from ``output_dir`` (:data:`EARLIER_RUN`); returns what was removed.

    A run that starts from scratch in a folder used before (``--overwrite_output_dir``, or a first
    attempt that stopped before its first checkpoint) must not mix with it: the old metrics rows
    would precede the new ones in ``logs/metrics.jsonl`` (the results line and the report then
    compared two runs), the old run's later checkpoints would rank above the new ones (the newest
    ``--save_total_limit`` are kept, so a new ``step_10`` beside an old ``step_40`` was deleted at
    once, and ``--resume`` would continue the old run), and an old ``chatrl_run.json`` would mark an
    unfinished new run as finished. The HF model files are left: the new run overwrites them.
    """
    root = Path(output_dir)
    removed = []
    for pattern in EARLIER_RUN:
        for path in sorted(root.glob(pattern)):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed
