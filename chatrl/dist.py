"""The one seam between chatrl and DeepSpeed / torch.distributed.

Step code calls these functions and never branches on the backend: initialisation (NCCL on GPUs,
gloo with ``DS_ACCELERATOR=cpu`` elsewhere, a one-process group when started without a launcher),
the DeepSpeed config (from the batch sizes of :mod:`chatrl.sizes`), engine creation and
cross-rank reductions. Gathering ZeRO-3 weights and saving HF-format checkpoints is
:mod:`chatrl.weights`.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

if TYPE_CHECKING:
    from chatrl.sizes import BatchSizes

log = logging.getLogger(__name__)


def _prepare_accelerator_env() -> None:
    """Select DeepSpeed's CPU accelerator when no CUDA device exists (must precede ``import deepspeed``)."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


STALE_BUILD_LOCK_S = 600.0  # a JIT build lock older than this is taken for a leftover of a killed build


def stale_build_locks(max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """torch JIT-extension build locks older than ``max_age_s`` seconds (``lock`` files under
    ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, one folder per extension).

    DeepSpeed JIT-builds its C++ ops at their first use in every new environment (on CPU: its CPU
    Adam, used with ``--offload``), and torch serialises the build with a lock file that only the
    building process removes. A process killed while building (Ctrl-C at the first launch, a stopped
    test run) leaves the file, and every later DeepSpeed process waits for it forever, silently. A build takes seconds to a few minutes,
    so an old lock is a leftover; :func:`init_distributed` names it in a warning.
    """
    import time

    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # torch's own rule
    now = time.time()
    return sorted(p for p in Path(root).glob("*/*/lock")
                  if p.is_file() and now - p.stat().st_mtime > max_age_s)


def _skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed's communication backend from loading its CPU shared-memory op (once per process).

    On the CPU accelerator, DeepSpeed's torch backend loads ``deepspeed_shm_comm`` when it is created:
    a C++ op JIT-built in every new environment (minutes of compiling at a first launch, under a
    lock that a killed build leaves behind, see :func:`stale_build_locks`), whose initialisation
    maps a 66 MiB ``/dev/shm/deepspeed_allreduce_buffer_<addr>_<port>_<rank>`` file per rank that
    DeepSpeed 0.19 never unlinks: each run on a new port left 132 MiB of RAM taken until reboot
    (22 GiB of this machine's 24 GiB after a day of test runs). The op serves only
    ``deepspeed.comm.inference_all_reduce`` (DeepSpeed's inference kernels, which chatrl does not
    use: the hybrid engine's tensor parallelism runs torch's collectives); without it DeepSpeed
    takes its own path for an op it cannot build, gloo. Replaces ``deepspeed.comm.torch.build_shm_op``
    by a function returning None; has no effect on CUDA, where the op does not exist.
    """
    import importlib

    backend = importlib.import_module("deepspeed.comm.torch")
    backend.build_shm_op = lambda: None


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
        for lock in stale_build_locks():  # a DeepSpeed op built later (CPU Adam) would wait on it forever
            log.warning("%s is older than %.0f min: a torch extension build was killed and left it; every "
                        "DeepSpeed process waits on it. Delete it if no build is running.", lock,
                        STALE_BUILD_LOCK_S / 60)
        _skip_deepspeed_shm_op()
        deepspeed.init_distributed(
            dist_backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes), verbose=False
        )
    gloo_reduce_scatter_by_all_reduce()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        place_cpu_threads()
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


class _DoneWork:
    """The handle of a collective that has already completed (``wait`` returns at once)."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def gloo_reduce_scatter_by_all_reduce() -> bool:
    """Make DeepSpeed's reduce-scatter an all-reduce when the backend is gloo on a single node.

    gloo's ring all-reduce is much faster on CPU than its reduce-scatter of the same bytes (2 ranks
    on one node, fp32, ``bench/collectives.py``: 204 MB all-reduced in 97 ms, reduce-scattered in
    205 ms; 4 MB: 1.6 against 6.7 ms; below about 1 MB the two are within a fraction of a
    millisecond). ZeRO-3 reduce-scatters every gradient bucket; on the larger benchmark actor the
    switch took step 3's ZeRO-3 training phase from 6.33 / 6.49 to 5.91 / 5.94 s per step in two
    interleaved pairs (``bench/results/step3_h512_ab_2026-12-01_s6.json``). The input ``(world·n,)``
    is all-reduced in place and this rank's slot becomes the output ``(n,)``: the same sum (bit for bit
    on two ranks; with more, the two collectives may add in another order, within float rounding).

    Unlike torch's reduce-scatter, the input is overwritten, for every caller of
    ``deepspeed.comm``'s reduce-scatter in the process: DeepSpeed's ZeRO gradient path treats it as
    scratch already (it pre-divides it in place and reads only the output); chatrl has no other
    caller. Across nodes an all-reduce moves twice a reduce-scatter's bytes over the network, so
    multi-node jobs keep gloo's reduce-scatter. gloo's all-gather is kept too: up to 16 MB, ZeRO-3's
    per-layer sizes, it takes 0.76–1.27× an all-reduce's time.

    Installed on DeepSpeed's communication backend (``deepspeed.comm``) by :func:`init_distributed`;
    idempotent; NCCL and other backends are left alone. Returns True when installed.
    """
    from deepspeed import comm

    cdb = comm.comm.cdb
    if getattr(cdb, "_chatrl_reduce_scatter", False):
        return True
    if (cdb is None or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "gloo"
            or local_world_size() != get_world_size()):
        return False
    fallback = cdb.reduce_scatter_function

    def reduce_scatter_tensor(output_tensor, input_tensor, op=torch.distributed.ReduceOp.SUM, group=None,
                              async_op=False):
        if not (output_tensor.is_contiguous() and input_tensor.is_contiguous()) and fallback is not None:
            return fallback(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        n, rank = output_tensor.numel(), torch.distributed.get_rank(group)
        torch.distributed.all_reduce(input_tensor, op=op, group=group)
        slot = input_tensor.view(-1)[rank * n: (rank + 1) * n]
        if slot.data_ptr() != output_tensor.data_ptr():  # DeepSpeed usually passes the slot itself
            output_tensor.view(-1).copy_(slot)
        return _DoneWork() if async_op else None

    cdb.reduce_scatter_function = reduce_scatter_tensor
    cdb._chatrl_reduce_scatter = True
    return True


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


def cpu_threads_per_rank() -> int:
    """Intra-op CPU threads for one rank: this process's CPUs divided by the ranks on the node (>= 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_world_size())


def place_cpu_threads() -> int:
    """Give this rank :func:`cpu_threads_per_rank` intra-op threads, unless ``OMP_NUM_THREADS`` is set.

    Without it every rank of a node starts one thread per CPU of the node: ``ranks × CPUs`` threads
    on ``CPUs`` cores, and each small operator's parallel region waits for descheduled threads
    (measured in ``docs/performance.md``: the step-3 critic forward 10× slower). torchrun sets
    ``OMP_NUM_THREADS=1`` for the same reason; the DeepSpeed launcher sets nothing. Returns the
    thread count in use.
    """
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(cpu_threads_per_rank())
    return torch.get_num_threads()


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def shutdown() -> None:
    """Leave the process group at the end of a successful run (all ranks call it): a barrier, then
    ``destroy_process_group``.

    On gloo this is not enough for a clean exit: process groups that DeepSpeed still references
    keep their worker threads, and the interpreter's exit can then abort the process; a program
    ends with :func:`run_program` (or :func:`exit_now` after this), which skips that exit.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def exit_now(code: int = 0) -> None:
    """End the process at once after a finished run: flush logging and stdio, then ``os._exit``.

    Skips the interpreter's teardown (freeing every module and tensor of torch, DeepSpeed,
    transformers one by one), measured at 10+ s per rank on a loaded machine
    (``docs/performance.md``). Call only when all output is written and the process group shut
    down (:func:`shutdown`); ``atexit`` handlers do not run.
    """
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_program(main: Callable[[], object]) -> NoReturn:
    """Run a step program (``python -m chatrl.step…``) on this rank, then end the process.

    ``main()`` does the whole step and returns whatever holds its DeepSpeed engines; they stay
    referenced while the process group is shut down (:func:`shutdown`, all ranks), and the
    process then ends with :func:`exit_now` (exit code 0), skipping the interpreter's finalisation.
    That finalisation races with gloo: a gloo worker thread that drops a finished asynchronous
    all-gather (ZeRO-3's parameter fetches) must take the GIL to free the work's tensors; during
    finalisation, taking the GIL ends the thread (``pthread_exit``) inside that C++ destructor,
    and ``std::terminate`` aborts the process: "terminate called without an active exception",
    signal 6, after all output was written, so the launcher reports a finished step as failed
    (core dump of a 2-rank ZeRO-3 probe: ``~AsyncAllgatherWork`` → ``decref`` →
    ``PyThread_exit_thread``; 3 of 6 probe runs aborted with ``shutdown()`` alone, 0 of 8 with
    this). An exception is reported by :func:`chatrl.resilience.report_failure` and propagates
    (the interpreter exits non-zero as usual).
    """
    from chatrl.resilience import report_failure

    with report_failure():
        result = main()  # noqa: F841  (referenced until the process ends)
        shutdown()
    exit_now(0)


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


def seeded_loader(dataset, batch_size: int, collate, info: DistInfo, seed: int, drop_last: bool = False,
                  shuffle: bool = True) -> torch.utils.data.DataLoader:
    """This rank's shuffled share of ``dataset`` (a ``DistributedSampler`` seeded with ``seed``).

    The loader has its own seeded generator: creating an iterator must not draw from the global
    RNG, so a resumed run sees exactly the batches and random numbers of an uninterrupted one.
    """
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                                  shuffle=shuffle, seed=seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate,
                                       drop_last=drop_last, generator=torch.Generator().manual_seed(seed))


def resident_mb() -> float:
    """This process's resident memory now (not its peak), in MiB (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


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
    """AdamW over ``param_groups``: DeepSpeed's CPU Adam when offloading on GPUs, torch's fused AdamW elsewhere.

    Fused (one vectorised kernel per parameter, CUDA or CPU) rather than the for-loop default on
    CPU: the same update to float32 rounding (``tests/unit/test_resilience.py``), about 10× faster
    on CPU, which matters under ZeRO-0 where every rank steps the whole model. DeepSpeed's CPU
    Adam would need a C++ build at first use (minutes of start-up) for no gain over it.
    """
    if offload and torch.cuda.is_available():
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(param_groups, lr=lr, betas=betas)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, fused=True)


_DEEPSPEED_MUON = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


class _NoDeepSpeedMuon:
    """Stands for every name of DeepSpeed's Muon modules in chatrl's processes (:func:`_stub_deepspeed_muon`):
    nothing is an instance of it, and calling it (building the optimizer, running an update) raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("chatrl builds its own optimizer (AdamW); DeepSpeed's Muon optimizer is not supported")


def _muon_placeholder(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _NoDeepSpeedMuon


def _stub_deepspeed_muon() -> None:
    """Put placeholders for DeepSpeed's Muon optimizer modules in ``sys.modules``, once per process.

    DeepSpeed imports ``deepspeed.runtime.zero.muon.muon_optimizer`` to ask whether the optimizer is
    a ``MuonWithAuxAdam`` (when an engine is built: the ZeRO 1-2 support check, ZeRO-3's and the bf16
    optimizer's set-up), and ZeRO-2 imports ``...original_muon`` at every gradient reduction,
    calling its ``muon_update`` only for Muon parameter groups. Importing either runs
    ``torch.compile`` on Muon's kernels: 2-5 s per rank on this machine after an optimizer exists
    (loaded; ``docs/performance.md``), for an optimizer chatrl never builds (:func:`make_optimizer`
    builds AdamW, and chatrl's DeepSpeed configs name no optimizer). In the placeholders every name
    is :class:`_NoDeepSpeedMuon`, so each check answers "no Muon", as with the real modules, and a
    Muon code path that did run would fail loudly. Modules already imported (a user's own code)
    are left as they are.
    """
    import sys
    import types

    for name in _DEEPSPEED_MUON:
        if name not in sys.modules:
            stub = types.ModuleType(name, "chatrl's placeholder for a DeepSpeed Muon module (chatrl.dist)")
            stub.__getattr__ = _muon_placeholder
            sys.modules[name] = stub


FROZEN_WHOLE_FRACTION = 1 / 8  # 'auto': a frozen model stays whole up to this share of a rank's device memory


def frozen_zero_stage(trained_stage: int, model: torch.nn.Module, partition: str = "auto",
                      offload: bool = False) -> int:
    """The ZeRO stage of a frozen model (reference, reward, EMA) that runs beside a trained one.

    A frozen model has no gradients or optimizer states, so ZeRO stages 1–2 hold nothing of it: the
    choice is a whole copy per rank (stage 0) or partitioned parameters (stage 3) that every forward
    all-gathers, layer by layer. Partitioning saves ``(1 - 1/world) × weights`` per rank and costs a
    collective per layer and forward (on two CPU ranks over gloo, step 3's experience phase on the
    larger benchmark actor took 13.2 s per 8 steps partitioned against 8.1 s whole:
    ``docs/performance.md``). The numbers computed are the same either way (ZeRO-3 gathers the same
    weights before each layer). A collective when a process group is up (the ranks' answers are
    combined, so that all choose alike): call it on every rank.

    Args:
        trained_stage: ZeRO stage (0–3) of the trained model this one sits beside (the actor for the
            reference and EMA, the critic for the reward model).
        model: the frozen model, loaded whole and not yet wrapped by DeepSpeed (a model built under
            ``deepspeed.zero.Init`` is already partitioned and would weigh nothing); its parameter
            bytes are what is weighed.
        partition: ``--partition_frozen_models``: ``always`` (DeepSpeed-Chat's rule: stage 3 whenever
            the trained model is at stage 3), ``never``, or ``auto``: stage 3 only when the weights
            exceed :data:`FROZEN_WHOLE_FRACTION` of one rank's device memory (a GPU's memory; on CPU
            the node's memory divided by its ranks).
        offload: the model's ``--offload_*_model`` flag; parameter offload needs stage 3, so it
            wins over ``never``.

    Returns:
        0 or 3; always 0 when ``trained_stage < 3`` (partitioned parameters are ZeRO-3's).

    Raises:
        ValueError: an unknown ``partition``.
    """
    if partition not in ("auto", "always", "never"):
        raise ValueError(f"--partition_frozen_models must be auto, always or never, got {partition!r}")
    if trained_stage != 3:
        return 0
    if offload or partition == "always":
        return 3
    if partition == "never":
        return 0
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    memory = acc.total_memory() / (local_world_size() if acc.device_name() == "cpu" else 1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    large = torch.tensor(float(weights > FROZEN_WHOLE_FRACTION * memory), device=acc.current_device_name())
    return 3 if all_reduce_max(large).item() else 0  # every rank must choose alike (devices may differ)


def frozen_engine(model: torch.nn.Module, trained_stage: int, batch: BatchSizes, dtype: str, partition: str,
                  offload: bool):
    """A frozen model (reference, reward, EMA) wrapped by DeepSpeed for inference; returns the engine.

    The engine has no optimizer (:func:`initialize` with :func:`deepspeed_config`'s ``inference``
    config) and its ZeRO stage is :func:`frozen_zero_stage`'s choice: the model whole on every
    rank (stage 0) or its parameters partitioned (stage 3). A collective (the stage choice is):
    call it on every rank. Freezing the parameters (``requires_grad``) and eval mode are the
    caller's.

    Args:
        model: the frozen model, loaded whole and not yet wrapped by DeepSpeed.
        trained_stage: ZeRO stage (0–3) of the trained model this one sits beside.
        batch: the run's :class:`~chatrl.sizes.BatchSizes` (the engine's config needs them).
        dtype: ``fp32`` | ``bf16`` | ``fp16``.
        partition: ``--partition_frozen_models`` (``auto``, ``always``, ``never``; see
            :func:`frozen_zero_stage`).
        offload: the model's ``--offload_*_model`` flag: its partitions are kept in CPU memory, which
            applies only under ZeRO-3; when the stage chosen is 0 (the trained model is not at
            stage 3) the flag is logged and ignored, and the model stays on the device.

    Raises:
        ValueError: an unknown ``partition`` (:func:`frozen_zero_stage`) or ``dtype``
            (:func:`deepspeed_config`).
    """
    stage = frozen_zero_stage(trained_stage, model, partition, offload)
    if offload and stage != 3:
        log.info("the frozen model's --offload_* flag applies under ZeRO-3; it stays on the device")
    return initialize(model, deepspeed_config(batch, stage, offload and stage == 3, dtype, inference=True))


def initialize(model, config: dict, optimizer=None, lr_scheduler=None):
    """``deepspeed.initialize`` with chatrl's defaults; returns the engine.

    A model without an optimizer (frozen reference / reward) is wrapped for inference: ZeRO-3
    partitions it, stages 0–2 just move it to the device. With an optimizer, a step whose gradients
    are not finite is skipped at every ZeRO stage (counted in ``engine.skipped_steps``, schedule
    held; see :mod:`chatrl.resilience`).
    """
    import deepspeed

    _stub_deepspeed_muon()
    plain = optimizer is not None and _plain_fp32_zero0(config)
    sparse = sparse_embedding_grads(model) if plain else []
    max_norm = config.get("gradient_clipping", 0.0) if plain else 0.0
    if max_norm:  # clipped by the non-finite guard below, with the norm it computes anyway
        config = {k: v for k, v in config.items() if k != "gradient_clipping"}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
    if optimizer is not None and not hasattr(engine.optimizer, "overflow"):
        from chatrl.resilience import skip_nonfinite_steps

        # ZeRO 1-3 and DeepSpeed's fp16/bf16 optimizers skip non-finite steps themselves; ZeRO-0 does not
        skip_nonfinite_steps(engine.optimizer, max_norm)
    elif max_norm:
        raise RuntimeError("DeepSpeed wrapped the fp32 ZeRO-0 optimizer; chatrl's gradient clipping would be lost")
    if sparse:
        _densify_after_allreduce(engine, sparse)
    return engine


def _plain_fp32_zero0(config: dict) -> bool:
    """True for a DeepSpeed ``config`` of ZeRO stage 0 in fp32: the engine all-reduces gradients and
    calls chatrl's torch optimizer directly (no DeepSpeed optimizer wrapper of its own)."""
    return (config.get("zero_optimization", {}).get("stage", 0) == 0 and not config.get("bf16", {}).get("enabled")
            and not config.get("fp16", {}).get("enabled"))


def sparse_embedding_grads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Switch the model's word-embedding tables to sparse gradients where that is exact and cheaper;
    returns their weights. Called by :func:`initialize` for fp32 ZeRO-0 engines with an optimizer.

    A batch touches a few hundred rows of a word-embedding table (50k rows for GPT-2's
    vocabulary), yet a dense gradient is the whole table: zeroed, filled, flattened into DeepSpeed's
    all-reduce bucket, all-reduced and copied back at every step. A sparse gradient (the rows
    touched) is instead all-gathered by DeepSpeed's engine (its ``sparse_allreduce`` path) and made
    dense once, after the reduction and before clipping and the optimizer
    (:func:`_densify_after_allreduce`), so clipping, the non-finite guard and AdamW (whose moments
    decay on every row) see the same dense sum. Only the tables of Hugging Face models'
    ``get_input_embeddings()`` are switched, when trainable and used by no other module: a table
    tied to the LM head gets a dense gradient from the head anyway, and small tables (positions)
    gain nothing. ZeRO 1-3 and fp16/bf16 optimizers flatten gradients into their own buffers and
    take no sparse gradient, hence the fp32 ZeRO-0 condition. Measured effect: ``docs/performance.md``.
    """
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    weights = []
    for m in model.modules():
        get = getattr(m, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        if (isinstance(emb, torch.nn.Embedding) and emb.weight.requires_grad and uses.get(id(emb.weight)) == 1
                and emb.max_norm is None and all(w is not emb.weight for w in weights)):
            emb.sparse = True
            weights.append(emb.weight)
    return weights


def _densify_after_allreduce(engine, weights: list[torch.nn.Parameter]) -> None:
    """Make ``weights``' sparse gradients dense right after DeepSpeed's gradient reduction (which sums
    them across data-parallel ranks as sparse tensors), before the optimizer step and its clipping."""
    reduce = engine.allreduce_gradients

    def allreduce_then_densify(*args, **kwargs):
        reduce(*args, **kwargs)
        for w in weights:
            if w.grad is not None and w.grad.is_sparse:
                w.grad = w.grad.to_dense()

    engine.allreduce_gradients = allreduce_then_densify
