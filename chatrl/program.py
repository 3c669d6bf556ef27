"""What every step program does first: its place in the job, logging, the output folder, the seed."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers import set_seed

from chatrl.checkpoint import CHECKPOINT_DIR, RUN_MARKER, check_output_dir, resume_path
from chatrl.config import CheckpointConfig, LogConfig
from chatrl.distributed.dist import DistInfo, barrier, init_distributed
from chatrl.distributed.resilience import set_progress, stop_on_ctrl_c
from chatrl.distributed.weights import SNAPSHOT_DIR
from chatrl.evidence.certificate import CERTIFICATE_FILE
from chatrl.evidence.rollout_records import ROLLOUTS_DIR
from chatrl.models.causal_lm import check_context_window, check_packing, load_tokenizer
from chatrl.tracking import METRICS_FILE, SAMPLES_FILE, setup_logging


def start(step_name: str, log: LogConfig, seed: int, ckpt: CheckpointConfig | None = None) -> DistInfo:
    """Start a step program on this rank and return its place in the job.

    Names the step for failure reports (:func:`chatrl.distributed.resilience.set_progress`), reports Ctrl-C under
    a launcher in one line (:func:`chatrl.distributed.resilience.stop_on_ctrl_c`), joins the process
    group (:func:`chatrl.distributed.dist.init_distributed`), sets up logging, refuses an output folder that
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


def start_training(step_name: str, s, context_window: bool = True) -> tuple[DistInfo, object]:
    """What a supervised program (steps 1, 2, DPO) does first, from its settings ``s`` (``model``,
    ``data``, ``packing``, ``log``, ``optim``, ``ckpt``): the sequence budget checked against the
    model's context window (``context_window``), ``--packing`` checked for the model's family (both
    before anything is loaded), :func:`start`, then the model's tokenizer. Returns ``(this rank, tokenizer)``.

    Raises:
        UsageError: ``--max_seq_len`` beyond the context window, ``--packing`` for an unsupported
            family, or an ``--output_dir`` that holds a finished run.
    """
    model = s.model
    if context_window:
        check_context_window(model.model_name_or_path, {"--max_seq_len": s.data.max_seq_len},
                             model.trust_remote_code)
    check_packing(s.packing, model.model_name_or_path, model.trust_remote_code)
    info = start(step_name, s.log, s.optim.seed, s.ckpt)
    return info, load_tokenizer(model.model_name_or_path, trust_remote_code=model.trust_remote_code)


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
