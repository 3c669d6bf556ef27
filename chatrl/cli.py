"""Command-line flags shared by every step, named as in DeepSpeed-Chat where the concept exists there.

Each ``add_*_args`` function adds one concern's flags as an argument group; a step composes the
groups it needs, so ``--help`` documents every flag where it is declared. Both spellings are
accepted: ``--per_device_train_batch_size`` and ``--per-device-train-batch-size``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

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


def new_parser(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model_name_or_path", required=True, help="HF hub name or local folder of a causal LM")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="training dtype")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    g.add_argument("--dropout", type=float, default=None,
                   help="override every dropout probability in the model config (unset: keep the config's)")
    g.add_argument("--trust_remote_code", action="store_true", help="allow model code from the hub (off: safer)")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (peft)")
    g.add_argument("--lora_dim", type=int, default=0, help="LoRA rank; 0 disables LoRA")
    g.add_argument("--lora_module_name", default="layers.",
                   help="LoRA wraps every nn.Linear whose qualified name contains this text")
    g.add_argument("--only_optimize_lora", action="store_true", help="freeze all but the LoRA weights")
    g.add_argument("--lora_learning_rate", type=float, default=5e-4, help="learning rate of the LoRA weights")


def add_data_args(p: argparse.ArgumentParser, max_seq_len: int = 512) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data_path", nargs="+", required=True,
                   help="hub data set names and/or local .jsonl/.json/.parquet files or folders (optionally "
                        ".gz, optionally with a row slice 'path[a:b]'); several are blended")
    g.add_argument("--data_split", default="2,4,4",
                   help="relative shares of each preference data set for steps 1,2,3 (DeepSpeed-Chat style)")
    g.add_argument("--data_output_path", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "chatrl_data"),
                   help="tokenized-data cache folder (keyed by a hash of every input)")
    g.add_argument("--eval_data_path", nargs="*", default=None,
                   help="explicit eval sources; by default a held-out share of each phase is used")
    g.add_argument("--eval_fraction", type=float, default=0.05, help="share of each phase held out for eval")
    g.add_argument("--max_seq_len", type=int, default=max_seq_len, help="max tokens of prompt + answer")


def add_optim_args(p: argparse.ArgumentParser, lr: float = 1e-3) -> None:
    g = p.add_argument_group("optimisation")
    g.add_argument("--per_device_train_batch_size", type=int, default=4, help="micro-batch per rank")
    g.add_argument("--per_device_eval_batch_size", type=int, default=8, help="eval batch per rank")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--learning_rate", type=float, default=lr, help="peak learning rate")
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay (not on biases / norms)")
    g.add_argument("--num_train_epochs", type=int, default=1, help="passes over the training split")
    g.add_argument("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--lr_scheduler_type", default="cosine",
                   choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                            "constant_with_warmup"], help="learning-rate schedule (transformers.get_scheduler)")
    g.add_argument("--num_warmup_steps", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--gradient_clipping", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    g.add_argument("--seed", type=int, default=1234, help="seed of data order, splits and initialisation")


def add_dist_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    g.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer states (and stage-3 params) to CPU")
    g.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher; ignore")


def add_log_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output and logging")
    g.add_argument("--output_dir", required=True, help="folder of the HF-format result, its logs and checkpoints")
    g.add_argument("--overwrite_output_dir", action="store_true", help="allow replacing a finished run's output")
    g.add_argument("--eval_interval", type=int, default=0, help="evaluate every N optimizer steps (0: per epoch only)")
    g.add_argument("--log_interval", type=int, default=1, help="log training metrics every N optimizer steps")
    g.add_argument("--enable_tensorboard", action="store_true", help="also write TensorBoard events")
    g.add_argument("--tensorboard_path", default=None, help="TensorBoard folder (unset: OUTPUT_DIR/logs/tb)")
    g.add_argument("--disable_progress_bar", action="store_true", help="no tqdm bar on rank 0")


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and resume")
    g.add_argument("--save_interval", type=int, default=0,
                   help="write a resumable checkpoint every N optimizer steps to OUTPUT_DIR/checkpoints (0: off)")
    g.add_argument("--save_total_limit", type=int, default=2, help="keep only the newest N checkpoints (N >= 1)")
    g.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint, if any")
    g.add_argument("--resume_from_checkpoint", default=None,
                   help="continue from this checkpoint folder (OUTPUT_DIR/checkpoints/step_N); wins over --resume")
    g.add_argument("--stop_after_steps", type=int, default=0,
                   help="testing: stop after N optimizer steps without the final save, as a crash would")
    g.add_argument("--max_nonfinite_steps", type=int, default=10,
                   help="steps with non-finite loss or gradients are skipped; stop (with a checkpoint) after "
                        "this many in a row (0: never stop)")
    g.add_argument("--debug_nonfinite_steps", type=int, nargs="*", default=[],
                   help="make the loss NaN at these steps (tests the non-finite guard)")


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
