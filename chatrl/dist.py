"""The one seam between chatrl and DeepSpeed / torch.distributed.

Step code calls these functions and never branches on the backend: initialisation (NCCL on GPUs,
gloo with ``DS_ACCELERATOR=cpu`` elsewhere, a one-process group when started without a launcher),
the DeepSpeed config with every derived batch size computed and checked here, engine creation,
cross-rank reductions, and saving HF-format checkpoints (ZeRO-3 partitions gathered, LoRA merged,
safetensors, written atomically).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _prepare_accelerator_env() -> None:
    """Select DeepSpeed's CPU accelerator when no CUDA device exists (must precede ``import deepspeed``)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global ``rank`` of ``world_size``, ``local_rank`` on its node, ``device``."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_minutes: float = 30.0) -> DistInfo:
    """Initialise torch.distributed for DeepSpeed and return this process's place.

    Works under the DeepSpeed launcher, torchrun, or a bare ``python`` (a one-rank group on a free
    local port). Uses NCCL when CUDA is available, else gloo with ``DS_ACCELERATOR=cpu``.
    Collectives time out after ``timeout_minutes`` so that a dead rank ends the job instead of
    hanging it. Idempotent.
    """
    _prepare_accelerator_env()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        deepspeed.init_distributed(
            dist_backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes), verbose=False
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


def get_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def get_world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main() -> bool:
    return get_rank() == 0


def local_world_size() -> int:
    """Ranks on this node: torchrun's ``LOCAL_WORLD_SIZE``, the DeepSpeed launcher's ``LOCAL_SIZE``,
    Open MPI's, else the whole world (a safe over-estimate when sharing cores)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(key):
            return int(os.environ[key])
    return get_world_size()


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def shutdown() -> None:
    """Leave the process group cleanly at the end of a successful run (all ranks call it).

    A barrier, then ``destroy_process_group``: exiting with the group alive leaves the backend's
    threads to be torn down by the interpreter's exit, which can abort the process (seen with
    gloo: "terminate called without an active exception", exit code -6, after all work was done).
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over ranks (a new tensor; ``t`` is left as it was)."""
    out = t.detach().clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(out)
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of ``t`` over ranks."""
    return all_reduce_sum(t) / get_world_size()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``t`` over ranks."""
    out = t.detach().clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out


def shard_for_eval(n: int, rank: int, world: int) -> list[int]:
    """Indices of rank ``rank``'s share of ``n`` eval rows, padded with ``-1`` to equal length on all ranks.

    Every rank then runs the same number of forward passes (a ZeRO-3 requirement); ``-1`` rows are
    evaluated as copies of row 0 and excluded from the metrics.
    """
    per_rank = math.ceil(n / world)
    idx = list(range(rank, n, world))
    return idx + [-1] * (per_rank - len(idx))


def eval_batches(dataset, collate, batch_size: int, rank: int, world: int):
    """Yield this rank's ``(batch, real)`` eval micro-batches (:func:`shard_for_eval`); ``real (B,)`` is
    False on padding rows, which every metric must leave out."""
    idx = shard_for_eval(len(dataset), rank, world)
    for i in range(0, len(idx), batch_size):
        chunk = idx[i:i + batch_size]
        batch = collate([dataset[max(j, 0)] for j in chunk])
        yield batch, torch.tensor([j >= 0 for j in chunk])


@dataclass(frozen=True)
class BatchSizes:
    """Every batch size of a run, derived and checked in one place.

    ``global_batch = per_device_batch × gradient_accumulation_steps × world_size`` samples per
    optimizer step.
    """

    per_device_batch: int
    gradient_accumulation_steps: int
    world_size: int

    def __post_init__(self):
        for name in ("per_device_batch", "gradient_accumulation_steps", "world_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.gradient_accumulation_steps * self.world_size


def deepspeed_config(
    batch: BatchSizes,
    zero_stage: int = 0,
    offload: bool = False,
    dtype: str = "fp32",
    gradient_clipping: float = 1.0,
    inference: bool = False,
) -> dict:
    """The DeepSpeed config dict for one engine.

    Args:
        batch: derived batch sizes (``train_batch_size`` is checked by DeepSpeed against them).
        zero_stage: 0–3. ``offload``: parameters (stage 3) and optimizer states to CPU.
        dtype: ``fp32`` | ``bf16`` | ``fp16`` (fp16 uses dynamic loss scaling).
        gradient_clipping: global gradient-norm clip (0 disables).
        inference: a frozen model (reference, reward): no optimizer sections.

    Raises:
        ValueError: a stage outside 0–3 or an unknown dtype.
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"--dtype must be fp32, bf16 or fp16, got {dtype!r}")
    zero: dict = {"stage": zero_stage}
    if zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=1e4, stage3_max_live_parameters=3e7,
                    stage3_prefetch_bucket_size=3e7, stage3_gather_16bit_weights_on_model_save=False)
    if offload:
        zero["offload_param" if inference else "offload_optimizer"] = {"device": "cpu"}
        if zero_stage == 3 and not inference:
            zero["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": batch.per_device_batch,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "train_batch_size": batch.global_batch,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if not inference and gradient_clipping > 0:
        cfg["gradient_clipping"] = gradient_clipping
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg


def make_optimizer(param_groups: list[dict], lr: float, offload: bool, betas=(0.9, 0.95)):
    """AdamW over ``param_groups``: DeepSpeed's CPU Adam when offloading on GPUs, torch's fused one elsewhere."""
    if offload and torch.cuda.is_available():
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(param_groups, lr=lr, betas=betas)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, fused=True)  # fused: ~7x the default on CPU too


def initialize(model, config: dict, optimizer=None, lr_scheduler=None):
    """``deepspeed.initialize`` with chatrl's defaults; returns the engine.

    A model without an optimizer (frozen reference / reward) is wrapped for inference: ZeRO-3
    partitions it, stages 0–2 just move it to the device. With an optimizer, a step whose gradients
    are not finite is skipped at every ZeRO stage (counted in ``engine.skipped_steps``, schedule
    held; see :mod:`chatrl.resilience`).
    """
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
    if optimizer is not None and not hasattr(engine.optimizer, "overflow"):
        from chatrl.resilience import skip_nonfinite_steps

        skip_nonfinite_steps(engine.optimizer)  # ZeRO 1-3 skip non-finite steps themselves; ZeRO-0 does not
    return engine


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
    """Rebuild ``module``'s HF model from ``state`` on CPU, with LoRA adapters merged by peft."""
    hf = module
    peft_config = None
    if hasattr(module, "peft_config"):
        peft_config = module.peft_config["default"]
        hf = module.get_base_model()
    with torch.device("meta"):
        empty = type(hf)._from_config(hf.config, dtype=next(iter(state.values())).dtype)
    if peft_config is not None:
        from peft import get_peft_model

        empty = get_peft_model(empty, peft_config)
    empty.load_state_dict(state, strict=False, assign=True)
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


def save_hf_model(module: torch.nn.Module, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save ``module`` (an HF model, maybe peft-wrapped, maybe ZeRO-3 partitioned) as an HF folder.

    All ranks must call it. Rank 0 gathers the full weights, merges LoRA, and writes
    ``config.json``, ``model.safetensors`` (sharded if large) and the tokenizer into ``out_dir``,
    which then loads with plain ``from_pretrained``. Files are written to a temporary folder first
    and each is moved into place with an atomic rename; weight files of an earlier export that the
    new one does not have are removed, other content of ``out_dir`` (logs, checkpoints) is kept.
    """
    state = full_state_dict(module)
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


CHECKPOINT_DIR = "checkpoints"
COMPLETE = "complete.json"


def _rng_state() -> dict:
    import random

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(engines: dict, output_dir: str | os.PathLike, step: int, state: dict,
                    keep: int = 2, write_extra=None) -> Path:
    """Write a resumable checkpoint of ``engines`` (name → DeepSpeed engine) at optimizer step ``step``.

    Every rank writes its ZeRO partitions and RNG state into ``OUTPUT/checkpoints/.tmp-step_N``;
    after a barrier rank 0 writes ``complete.json`` (``state``: counters, loader position…) and
    renames the folder to ``step_N`` in one atomic rename, then keeps only the newest ``keep``
    checkpoints. A crash at any point leaves earlier checkpoints intact and no ``step_N`` folder
    without ``complete.json``. ``write_extra(folder)``, if given, runs on every rank before the
    final barrier (per-rank files of the caller's own). All ranks must call it.
    """
    root = Path(output_dir) / CHECKPOINT_DIR
    tmp, final = root / f".tmp-step_{step}", root / f"step_{step}"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(tmp / name), tag="state", save_latest=False)
    torch.save(_rng_state(), tmp / f"rng_rank{get_rank()}.pt")
    if write_extra is not None:
        write_extra(tmp)
    barrier()
    if is_main():
        (tmp / COMPLETE).write_text(json.dumps({"step": step, **state}, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(list_checkpoints(output_dir), key=lambda p: int(p.name[5:]))[:-keep or None]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``OUTPUT/checkpoints``, oldest first (half-written ones are skipped)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for p in root.glob("step_*"):
        if p.name[5:].isdigit() and (p / COMPLETE).is_file():
            found.append(p)
        elif p.is_dir():
            log.warning("skipping incomplete checkpoint %s (no %s)", p, COMPLETE)
    return sorted(found, key=lambda p: int(p.name[5:]))


#: DeepSpeed's own classes inside its engine checkpoints, allowed by the weights-only unpickler.
_DS_CHECKPOINT_CLASSES = (("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                          ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                          ("deepspeed.utils.tensor_fragment", "fragment_address"))


@contextlib.contextmanager
def _weights_only_loads(engine):
    """Make ``engine``'s checkpoint reads use ``torch.load(weights_only=True)``.

    DeepSpeed's torch checkpoint engine unpickles with ``weights_only=False`` (any code in a
    file runs). Its engine checkpoints hold tensors, plain containers and three DeepSpeed data
    classes, which are allowed here and nothing else.
    """
    import importlib

    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is None:
        yield
        return
    allowed = [getattr(importlib.import_module(m), n) for m, n in _DS_CHECKPOINT_CLASSES]

    def load(path, map_location=None):
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)

    ckpt_engine.load = load
    try:
        yield
    finally:
        del ckpt_engine.load  # back to the class's method


def load_checkpoint(engines: dict, path: str | os.PathLike) -> dict:
    """Restore ``engines`` (models, optimizers, schedulers) and this rank's RNG from ``path``.

    Every file is read with ``torch.load(weights_only=True)`` (DeepSpeed's engine files too):
    nothing in a checkpoint can run code.

    Returns the ``state`` dict saved with it (``step`` included).

    Raises:
        FileNotFoundError: ``path`` is not a complete checkpoint.
    """
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise FileNotFoundError(f"{path} is not a complete chatrl checkpoint (no {COMPLETE})")
    for name, engine in engines.items():
        with _weights_only_loads(engine):
            engine.load_checkpoint(str(path / name), tag="state")
    rng = path / f"rng_rank{get_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((path / COMPLETE).read_text())
