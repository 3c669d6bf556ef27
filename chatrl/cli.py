"""Parsing a program's command line: both spellings of a flag (``--per_device_train_batch_size`` and
``--per-device-train-batch-size``), and the checks every step makes before any rank loads a model
(local data paths exist, checkpoint flags are sane). The flags themselves are declared once, in
:mod:`chatrl.config`, and composed per program (:func:`chatrl.config.program_parser`).
"""

from __future__ import annotations

import argparse
import os

from chatrl.checkpoint import COMPLETE


def normalize_argv(argv: list[str], known: set[str] | None = None) -> list[str]:
    """Rewrite ``--dash-style`` flag names to ``--snake_style`` (values are left alone).

    With ``known`` (flag names without ``--``), only tokens naming one of them are rewritten, so
    a value that looks like flags (train.py's ``--step1-args "--a-b 1"``) is passed on untouched.
    """
    out = []
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok.partition("=")
            snake = name[2:].replace("-", "_")
            if known is None or (snake in known and " " not in name):
                tok = "--" + snake + eq + value
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
        if not os.path.isfile(os.path.join(resume_from, COMPLETE)):
            parser.error(f"--resume_from_checkpoint {resume_from}: not a complete chatrl checkpoint (no {COMPLETE}); "
                         "give one OUTPUT_DIR/checkpoints/step_N folder, or use --resume for the newest")
    return args
