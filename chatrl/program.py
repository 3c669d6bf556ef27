"""What every step program does first: its place in the job, logging, the output folder, the seed."""

from __future__ import annotations

from transformers import set_seed

from chatrl.checkpoint import check_output_dir
from chatrl.config import LogConfig
from chatrl.dist import DistInfo, init_distributed
from chatrl.resilience import set_progress
from chatrl.tracking import setup_logging


def start(step_name: str, log: LogConfig, seed: int) -> DistInfo:
    """Start a step program on this rank and return its place in the job.

    Names the step for failure reports (:func:`chatrl.resilience.set_progress`), joins the process
    group (:func:`chatrl.dist.init_distributed`), sets up logging, refuses an output folder that
    holds a finished run unless ``--overwrite_output_dir`` (:func:`chatrl.checkpoint.check_output_dir`)
    and seeds Python, NumPy and torch (``--seed``). Every rank calls it.

    Raises:
        FileExistsError: ``--output_dir`` holds a finished run (names the folder and the flag).
    """
    set_progress(step_name)
    info = init_distributed()
    setup_logging(info.rank)
    check_output_dir(log.output_dir, log.overwrite_output_dir)
    set_seed(seed)
    return info
