"""Model weights out of DeepSpeed: gathering ZeRO-3 partitions and saving Hugging Face folders.

:func:`gathered` gathers partitioned parameters for a block, :func:`full_state_dict` builds the
whole state dict on rank 0 one module at a time, and :func:`save_hf_model` writes an HF folder
(ZeRO-3 partitions gathered, LoRA merged by peft, safetensors, each file moved into place
atomically) that loads with plain ``from_pretrained``; :func:`atomic_dir` is the
write-then-rename folder used for other outputs too. Plain (unpartitioned) tensors pass through
unchanged, so the same calls serve every ZeRO stage. :func:`save_snapshot_if_due` writes the HF
snapshots of ``--save_hf_interval`` (``OUTPUT_DIR/snapshots/step_N``) and :func:`list_snapshots` finds them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from chatrl.distributed.dist import barrier, is_main

log = logging.getLogger(__name__)


def _is_zero3_param(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


@contextlib.contextmanager
def gathered(params, modifier_rank: int | None = None):
    """Gather ZeRO-3 partitioned ``params`` for the duration of the block (no-op for plain tensors).

    With ``modifier_rank`` set, edits that rank makes are scattered back on exit.
    """
    params = [p for p in params if _is_zero3_param(p)]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
        yield


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (un-partitioned) state dict of ``module`` on CPU, on rank 0; ``{}`` on other ranks.

    Every rank must call it (ZeRO-3 gathers are collectives). Parameters are gathered one module
    at a time so that peak memory stays at one layer's worth above the partitions.
    """
    out: dict[str, torch.Tensor] = {}
    main = is_main()
    for prefix, sub in module.named_modules():
        tensors = {**dict(sub.named_parameters(recurse=False)),
                   **{k: b for k, b in sub.named_buffers(recurse=False)
                      if k not in sub._non_persistent_buffers_set}}
        if not tensors:
            continue
        with gathered(list(tensors.values())):
            if main:
                for k, t in tensors.items():
                    out[f"{prefix}.{k}" if prefix else k] = t.detach().to("cpu", copy=True)
    return out


def _merged_hf_model(module: torch.nn.Module, state: dict[str, torch.Tensor]):
    """Rebuild ``module``'s HF model from ``state`` on CPU, with LoRA adapters merged by peft.

    The result has the input model's architecture: tied input/output embeddings stay tied (one
    shared matrix); ``module``'s own config and generation config are copied, never changed.
    """
    hf = module
    peft_config = None
    if hasattr(module, "peft_config"):
        peft_config = module.peft_config["default"]
        hf = module.get_base_model()
    config = copy.deepcopy(hf.config)  # the export must not change the live model's config
    with torch.device("meta"):
        empty = type(hf)._from_config(config, dtype=next(iter(state.values())).dtype)
    if getattr(hf, "generation_config", None) is not None:  # the stop ids set by models.fit_embeddings
        empty.generation_config = copy.deepcopy(hf.generation_config)
    if peft_config is not None:
        from peft import get_peft_model

        empty = get_peft_model(empty, peft_config)
    empty.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        # assign=True put separate tensors in the tied slots; tie them again before peft's merge,
        # which otherwise sees two matrices and unties the export (tie_word_embeddings: false)
        (empty.get_base_model() if peft_config is not None else empty).tie_weights()
    if peft_config is not None:
        empty = empty.merge_and_unload()
    missing = [n for n, p in empty.named_parameters() if p.is_meta]
    if missing:
        empty.tie_weights()
        missing = [n for n, p in empty.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"checkpoint is missing parameters: {missing[:5]}")
    return empty


def atomic_dir(final: str | os.PathLike):
    """Context manager yielding a temporary folder beside ``final``, renamed onto it on success.

    A crash mid-write leaves ``final`` as it was (or absent) and a ``.tmp-*`` folder that readers
    ignore. An existing ``final`` is replaced only after the new one is complete.
    """

    @contextlib.contextmanager
    def _cm():
        final_path = Path(final)
        final_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final_path.name}-", dir=final_path.parent))
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = None
        if final_path.exists():
            old = final_path.with_name(f".old-{final_path.name}-{os.getpid()}")
            os.replace(final_path, old)
        os.replace(tmp, final_path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    return _cm()


def save_hf_model(module: torch.nn.Module, tokenizer, out_dir: str | os.PathLike,
                  dtype: torch.dtype | None = None) -> None:
    """Save ``module`` (an HF model, maybe peft-wrapped, maybe ZeRO-3 partitioned) as an HF folder.

    All ranks must call it. Rank 0 gathers the full weights, merges LoRA, and writes
    ``config.json``, ``model.safetensors`` (sharded if large) and the tokenizer into ``out_dir``,
    which then loads with plain ``from_pretrained``. Files are written to a temporary folder first
    and each is moved into place with an atomic rename; weight files of an earlier export that the
    new one does not have are removed, other content of ``out_dir`` (logs, checkpoints) is kept.
    ``dtype``: cast the floating-point weights to it first (step 3's float32 EMA exported in
    ``--dtype``); default: as they are. ``config.json`` records the dtype saved.
    """
    state = full_state_dict(module)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if is_main():
        model = _merged_hf_model(module, state)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=out))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            new_files = {f.name for f in tmp.iterdir()}
            for stale in out.glob("model*.safetensors*"):
                if stale.name not in new_files:
                    stale.unlink()
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
                os.replace(f, out / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("saved HF model to %s", out)
    barrier()


SNAPSHOT_DIR = "snapshots"


def save_snapshot_if_due(interval: int, step: int, total_steps: int, module: torch.nn.Module, tokenizer,
                         output_dir: str | os.PathLike) -> Path | None:
    """Write ``module`` as an HF folder ``OUTPUT_DIR/snapshots/step_{step}`` (:func:`save_hf_model`)
    when ``interval`` (``--save_hf_interval``) divides ``step`` and ``step`` is not the last one (the
    final model is saved anyway). All ranks call it. Returns the folder written, or None."""
    if not interval or step % interval or step >= total_steps:
        return None
    path = Path(output_dir) / SNAPSHOT_DIR / f"step_{step}"
    save_hf_model(module, tokenizer, path)
    return path


def list_snapshots(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete snapshot under ``OUTPUT_DIR/snapshots``, in step order
    (a folder counts once its ``config.json``, written last by :func:`save_hf_model`, is there)."""
    root = Path(output_dir) / SNAPSHOT_DIR
    found = []
    for d in root.glob("step_*") if root.is_dir() else []:
        tail = d.name[len("step_"):]
        if tail.isdigit() and (d / "config.json").is_file():
            found.append((int(tail), d))
    return sorted(found)
