"""Parsing a program's command line: both spellings of a flag (``--per_device_train_batch_size`` and
``--per-device-train-batch-size``), and the checks every step makes before any rank loads a model
(local data paths exist, checkpoint flags are sane). The flags themselves are declared once, in
:mod:`chatrl.config`, and composed per program (:func:`chatrl.config.program_parser`).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from chatrl.checkpoint import COMPLETE, RUN_MARKER, list_checkpoints
from chatrl.errors import UsageError
from chatrl.models import model_zoo
from chatrl.rewards import kinds


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


def looks_local(entry: str) -> bool:
    """Whether a data entry names a local path (starts with ``/``, ``.`` or ``~``, or ends with a data
    file's suffix) rather than a hub data set."""
    return entry.startswith(("/", ".", "~")) or entry.endswith(DATA_SUFFIXES)


_WEIGHTED = re.compile(r"^(\s*[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*\*\s*)?(.*)$", re.DOTALL)


def resolve_path(value: str, kind: str, cwd: str | os.PathLike) -> str:
    """``value`` of a flag of path ``kind`` (:data:`chatrl.config.PATH_KINDS`) made absolute against ``cwd``.

    ``file``: always (``~`` expanded). ``model``: when it exists under ``cwd`` or looks local (starts
    with ``/``, ``.`` or ``~``); a hub name (``facebook/opt-1.3b``) or a short name is left alone.
    ``data``: the same per entry, keeping a row slice (``rows.jsonl.gz[0:128]``); a data-file suffix
    also looks local. ``reward_fn``: the file of ``[W*]path/to/file.py:function``; module specs
    (``mypkg.mod:fn``) and built-ins are left alone.
    """
    base = Path(cwd)

    def absolute(path: str) -> str:
        return str((base / Path(path).expanduser()).resolve())

    if kind == "file":
        return absolute(value)
    if kind == "reward_fn":
        weight, target = _WEIGHTED.match(value).groups()
        module, sep, fn = target.rpartition(":")
        if sep and module.endswith(".py"):
            return (weight or "") + absolute(module) + ":" + fn
        return value
    path, sl = (value.split("[", 1)[0], "[" + value.split("[", 1)[1]) if kind == "data" and value.endswith("]") \
        and "[" in value else (value, "")
    local = (base / Path(path).expanduser()).exists() or path.startswith(("/", ".", "~")) or (
        kind == "data" and path.endswith(DATA_SUFFIXES))
    return absolute(path) + sl if local else value


def resolve_argv(argv: list[str], parser: argparse.ArgumentParser, cwd: str | os.PathLike) -> list[str]:
    """A command line with the value of every path flag of ``parser`` (its ``path_kinds``) made
    absolute against ``cwd`` (:func:`resolve_path`): ``--flag v``, ``--flag=v`` and the several
    values of a list flag (up to the next flag). Other tokens, and dash spellings, are kept."""
    kinds = getattr(parser, "path_kinds", {})
    many = {a.dest for a in parser._actions if a.nargs in ("+", "*")}
    out, kind, several = [], None, False
    for tok in argv:
        if tok.startswith("--") and len(tok) > 2:
            name, eq, value = tok.partition("=")
            dest = name[2:].replace("-", "_")
            kind, several = kinds.get(dest), dest in many
            if eq and kind:
                tok, kind = name + eq + resolve_path(value, kind, cwd), None
            out.append(tok)
            continue
        out.append(resolve_path(tok, kind, cwd) if kind else tok)
        if not several:
            kind = None
    return out


def resolve_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every model flag of ``parser`` (path kind ``model``) in ``args`` through
    :func:`chatrl.models.model_zoo.resolve`, in place: a short name becomes its hub name, a packaged model's
    name its converted folder, a ``.gguf`` file the folder converted from it. A value that names an
    existing local folder stays as it is.

    Raises:
        SystemExit: (through ``parser.error``) a packaged model not fetched yet, or a GGUF file that
            does not convert: one line naming the flag and what to do.
    """
    for dest, kind in getattr(parser, "path_kinds", {}).items():
        value = getattr(args, dest, None)
        if kind != "model" or value is None:
            continue
        try:
            names = [v if os.path.isdir(v) else model_zoo.resolve(v) for v in (value if isinstance(value, list)
                                                                              else [value])]
        except UsageError as err:
            parser.error(f"--{dest}: {err}")
        setattr(args, dest, names if isinstance(value, list) else names[0])


def parse(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) after :func:`normalize_argv`.

    Local data entries (a path, or a name with a data-file suffix) that do not exist are refused
    here, with one line naming the flag, before any rank starts loading models; so is an
    ``--output_dir`` that holds a finished run, or the checkpoints of an unfinished one, when the
    command says neither ``--resume`` nor ``--overwrite_output_dir`` (a rerun would overwrite them).
    ``--reward_fn`` and ``--reward_url`` values are checked by their kinds here (a function is imported),
    so a misspelt one is refused in one line too.
    """
    import sys

    args = parser.parse_args(normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    resolve_models(parser, args)
    for flag in DATA_FLAGS:
        for entry in getattr(args, flag, None) or []:
            path = entry.split("[", 1)[0] if entry.endswith("]") else entry
            if looks_local(path) and not os.path.exists(os.path.expanduser(path)):
                parser.error(f"--{flag} {entry}: no such file or folder")
    if getattr(args, "save_total_limit", 1) < 1:
        parser.error(f"--save_total_limit must be >= 1 (the newest checkpoint is always kept), got {args.save_total_limit}")
    if getattr(args, "save_interval", 0) < 0:
        parser.error(f"--save_interval must be >= 0 (0: no checkpoints), got {args.save_interval}")
    if getattr(args, "save_hf_interval", 0) < 0:
        parser.error(f"--save_hf_interval must be >= 0 (0: no snapshots), got {args.save_hf_interval}")
    for flag in ("reward_fn", "reward_url"):  # checked now (cheap): a misspelt one is one line
        for spec in getattr(args, flag, None) or []:
            try:
                kinds.check(spec, f"--{flag}")
            except ValueError as e:  # a UsageError naming the flag and the spec, or a bad weight
                parser.error(str(e))
    output_dir = getattr(args, "output_dir", None)
    if output_dir and hasattr(args, "resume") and not getattr(args, "overwrite_output_dir", False):
        if os.path.isfile(os.path.join(output_dir, RUN_MARKER)):
            parser.error(f"--output_dir {output_dir} already holds a finished run ({RUN_MARKER}); pass "
                         "--overwrite_output_dir to replace it or choose another --output_dir")
        found = list_checkpoints(output_dir)
        if found and not args.resume and not args.resume_from_checkpoint:
            parser.error(f"--output_dir {output_dir} holds the checkpoints of an unfinished run (newest: "
                         f"{found[-1].name}); add --resume to continue from it, or --overwrite_output_dir to "
                         "start afresh")
    resume_from = getattr(args, "resume_from_checkpoint", None)
    if resume_from and not os.path.isdir(resume_from):
        parser.error(f"--resume_from_checkpoint {resume_from}: no such folder")
    if resume_from:
        if not os.path.isfile(os.path.join(resume_from, COMPLETE)):
            parser.error(f"--resume_from_checkpoint {resume_from}: not a complete chatrl checkpoint (no {COMPLETE}); "
                         "give one OUTPUT_DIR/checkpoints/step_N folder, or use --resume for the newest")
    return args
