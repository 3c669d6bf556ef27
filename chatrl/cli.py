"""Command-line flags shared by every step, named as in DeepSpeed-Chat where the concept exists there.

The settings themselves (type, default, unit, help) are declared once in :mod:`chatrl.config`;
each ``add_*_args`` function here adds one concern's block as an argument group. Both spellings
are accepted: ``--per_device_train_batch_size`` and ``--per-device-train-batch-size``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from chatrl import config

RUN_MARKER = "chatrl_run.json"


def normalize_argv(argv: list[str]) -> list[str]:
    """Rewrite ``--dash-style`` flag names to ``--snake_style`` (values are left alone)."""
    out = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok.partition("=")
            tok = "--" + name[2:].replace("-", "_") + eq + value
        out.append(tok)
    return out


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".gz")
DATA_FLAGS = ("data_path", "eval_data_path", "unsupervised_dataset_name")


def _looks_local(entry: str) -> bool:
    return entry.startswith(("/", ".", "~")) or entry.endswith(DATA_SUFFIXES)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) after :func:`normalize_argv`.

    Local data entries (a path, or a name with a data-file suffix) that do not exist are refused
    here, with one line naming the flag, before any rank starts loading models.
    """
    import sys

    args = parser.parse_args(normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    for flag in DATA_FLAGS:
        for entry in getattr(args, flag, None) or []:
            path = entry.split("[", 1)[0] if entry.endswith("]") else entry
            if _looks_local(path) and not os.path.exists(os.path.expanduser(path)):
                parser.error(f"--{flag} {entry}: no such file or folder")
    if getattr(args, "save_total_limit", 1) < 1:
        parser.error(f"--save_total_limit must be >= 1 (the newest checkpoint is always kept), got {args.save_total_limit}")
    if getattr(args, "save_interval", 0) < 0:
        parser.error(f"--save_interval must be >= 0 (0: no checkpoints), got {args.save_interval}")
    resume_from = getattr(args, "resume_from_checkpoint", None)
    if resume_from and not os.path.isdir(resume_from):
        parser.error(f"--resume_from_checkpoint {resume_from}: no such folder")
    if resume_from:
        from chatrl.dist import COMPLETE

        if not os.path.isfile(os.path.join(resume_from, COMPLETE)):
            parser.error(f"--resume_from_checkpoint {resume_from}: not a complete chatrl checkpoint (no {COMPLETE}); "
                         "give one OUTPUT_DIR/checkpoints/step_N folder, or use --resume for the newest")
    return args


new_parser = config.new_parser


# The per-concern flag groups of steps 1-2, kept as one-line calls (declared in chatrl.config).
def add_model_args(p: argparse.ArgumentParser) -> None:
    config.add_block(p, config.ModelConfig)


def add_lora_args(p: argparse.ArgumentParser) -> None:
    config.add_block(p, config.LoraConfig)


def add_data_args(p: argparse.ArgumentParser, max_seq_len: int = 512) -> None:
    config.add_block(p, config.DataConfig, exclude=("unsupervised_dataset_name",),
                     defaults={"max_seq_len": max_seq_len})


def add_optim_args(p: argparse.ArgumentParser, lr: float = 1e-3) -> None:
    config.add_block(p, config.BatchConfig)
    config.add_block(p, config.OptimConfig, defaults={"learning_rate": lr})


def add_dist_args(p: argparse.ArgumentParser) -> None:
    config.add_block(p, config.ZeroConfig, only=("zero_stage", "offload", "local_rank"))


def add_log_args(p: argparse.ArgumentParser) -> None:
    config.add_block(p, config.LogConfig)


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    config.add_block(p, config.CheckpointConfig)


def resume_path(args) -> str | None:
    """The checkpoint to resume from: ``--resume_from_checkpoint``, else with ``--resume`` the newest
    complete one under ``OUTPUT_DIR/checkpoints``, else None."""
    if args.resume_from_checkpoint:
        return args.resume_from_checkpoint
    if args.resume:
        from chatrl.dist import list_checkpoints

        found = list_checkpoints(args.output_dir)
        return str(found[-1]) if found else None
    return None


def check_output_dir(output_dir: str, overwrite: bool) -> None:
    """Refuse to start when ``output_dir`` holds a finished run, unless ``--overwrite_output_dir``.

    Raises:
        FileExistsError: naming the folder and the flag.
    """
    marker = Path(output_dir) / RUN_MARKER
    if marker.exists() and not overwrite:
        raise FileExistsError(
            f"{output_dir} already holds a finished run ({RUN_MARKER}); pass --overwrite_output_dir to replace it "
            "or choose another --output_dir")


def write_run_marker(output_dir: str, info: dict) -> None:
    """Record a finished run (its step, flags and final metrics) as the last file written."""
    path = Path(output_dir) / RUN_MARKER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2, default=str) + "\n")
    os.replace(tmp, path)
