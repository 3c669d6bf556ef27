"""The one seam between chatrl and DeepSpeed / torch.distributed.

Step code calls these functions and never branches on the backend: initialisation (NCCL on GPUs,
gloo with ``DS_ACCELERATOR=cpu`` elsewhere, a one-process group when started without a launcher),
the DeepSpeed config (from the batch sizes of :mod:`chatrl.sizes`), engine creation and
cross-rank reductions. Gathering ZeRO-3 weights and saving HF-format checkpoints is
:mod:`chatrl.distributed.weights`.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

from chatrl.config import LoraConfig, OptimConfig, ZeroConfig
from chatrl.distributed import deepspeed_patches
from chatrl.distributed.resilience import INTERRUPTED, report_failure, skip_nonfinite_steps
from chatrl.models.causal_lm import lora_enabled, optimizer_param_groups
from chatrl.sizes import BatchSizes

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
        """Whether this is global rank 0 (the rank that writes files and logs)."""
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
        deepspeed_patches.before_process_group()
        deepspeed.init_distributed(
            dist_backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes), verbose=False
        )
    deepspeed_patches.after_process_group(single_node=local_world_size() == get_world_size())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    acc = get_accelerator()
    if acc.device_name() == "cuda":
        acc.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        place_cpu_threads()
    return DistInfo(torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device)


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def get_world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main() -> bool:
    """Whether this process is global rank 0."""
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


def threads_for_load(cpus: int, load: float) -> int:
    """Intra-op threads for one process on ``cpus`` cores whose 1-minute load average is ``load``: one per
    idle core, ``round(cpus - load)``, at least 1 and at most ``cpus``.

    Each operator's parallel region ends when its slowest thread does; a thread that finds no idle core
    waits for a time slice, and a decoding loop of thousands of small operators pays that wait in each
    of them, so a busy machine slows a process with a thread per core far more than the load (an
    evaluation 13× slower at a load of about 5 on 2 cores). With no more threads than idle cores (one
    on a busy machine) it slows in proportion to its share of the cores, as any single-threaded process.
    """
    return max(1, min(cpus, round(cpus - load)))


def place_threads_for_load(program: str) -> str:
    """Set this single-process command's intra-op threads by :func:`threads_for_load` (the evaluation,
    the chat), unless ``OMP_NUM_THREADS`` is set; returns the one line that says how many and why.

    The load is ``os.getloadavg()``'s 1-minute figure before the command's own work starts; the cores,
    this process's CPUs (its affinity). Off CPU (``--device cuda``) the threads matter little and are set
    all the same.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if os.environ.get("OMP_NUM_THREADS"):
        return (f"{program}: {torch.get_num_threads()} CPU thread{'s' * (torch.get_num_threads() > 1)} "
                f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: every core
        torch.set_num_threads(cpus)
        return f"{program}: {cpus} CPU thread{'s' * (cpus > 1)} (no load average here; OMP_NUM_THREADS sets it)"
    n = threads_for_load(cpus, load)
    torch.set_num_threads(n)
    return (f"{program}: {n} CPU thread{'s' * (n > 1)} for {cpus} core{'s' * (cpus > 1)} at a load of {load:.1f} "
            "(one per idle core, so that a busy machine slows it in proportion; OMP_NUM_THREADS sets it)")


def barrier() -> None:
    """Wait for every rank (nothing without a process group)."""
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
    this). An exception is reported by :func:`chatrl.distributed.resilience.report_failure` and propagates
    (the interpreter exits non-zero as usual); Ctrl-C ends the process at once with code 130 after
    its one line.
    """
    try:
        with report_failure():
            result = main()  # noqa: F841  (referenced until the process ends)
            shutdown()
    except SystemExit as e:
        if e.code == INTERRUPTED:  # Ctrl-C: its one line is out; no teardown racing gloo
            exit_now(INTERRUPTED)
        raise
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


@dataclass(frozen=True)
class RankGroup:
    """The ranks a trainer's collectives run over: this ``rank`` of ``world_size``, and the sum and
    maximum over the ranks (:func:`all_reduce_sum`, :func:`all_reduce_max`), ``None`` on one rank
    (nothing to reduce)."""

    rank: int = 0
    world_size: int = 1
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, info: DistInfo) -> RankGroup:
        """The group of the job ``info`` places this process in (reductions only with several ranks)."""
        several = info.world_size > 1
        return cls(info.rank, info.world_size, all_reduce_sum if several else None,
                   all_reduce_max if several else None)


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
    Every batch (``collate``'s dict) also holds ``sample_index`` ``(B,)``, the examples' positions in
    ``dataset`` (the run's data accounting, :class:`chatrl.evidence.certificate.DataAccounting`); with
    ``collate=list`` each item holds its own (:class:`chatrl.data.collate.MicroBatches` collects them).
    """
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank,
                                                  shuffle=shuffle, seed=seed)
    return torch.utils.data.DataLoader(_Indexed(dataset), batch_size=batch_size, sampler=sampler,
                                       collate_fn=_IndexedCollate(collate), drop_last=drop_last,
                                       generator=torch.Generator().manual_seed(seed))


class _Indexed(torch.utils.data.Dataset):
    """``dataset`` whose items come with their index: ``(i, item)``; ``dataset`` is kept as ``.data``."""

    def __init__(self, dataset):
        self.data = dataset

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return int(i), self.data[i]


class _IndexedCollate:
    """``collate`` of the items, plus ``sample_index`` ``(B,)``, their indices; with a ``collate``
    that returns the items as a list (``list``), the items each with their ``sample_index``."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, pairs):
        batch = self.collate([item for _, item in pairs])
        if isinstance(batch, list):  # items for chatrl.data.collate.MicroBatches: each carries its index
            return [dict(item, sample_index=i) for i, item in pairs]
        batch["sample_index"] = torch.tensor([i for i, _ in pairs], dtype=torch.long)
        return batch


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
        gradient_clipping: global gradient-norm clip (0 disables; written as 0, since DeepSpeed's own
            default for a config without the key is 1.0).
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
    if not inference:  # always given: DeepSpeed's default when the key is absent is 1.0, not off
        cfg["gradient_clipping"] = float(max(gradient_clipping, 0.0))
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


def trained_engine(model: torch.nn.Module, optim: OptimConfig, lora: LoraConfig, zero: ZeroConfig, dtype: str,
                   batch: BatchSizes, total_steps: int, warmup_steps: int):
    """A model to train wrapped by DeepSpeed with its optimizer and learning-rate schedule; returns the engine.

    The one builder of every trained model (steps 1 and 2, DPO, step 3's actor and critic):
    parameter groups (no weight decay on biases and norms, the LoRA weights at their own rate,
    :func:`chatrl.models.causal_lm.optimizer_param_groups`) → AdamW (:func:`make_optimizer`) → the schedule
    (``transformers.get_scheduler``: ``--lr_scheduler_type`` with ``warmup_steps`` of linear
    warm-up over ``total_steps``) → the DeepSpeed config (:func:`deepspeed_config`) →
    :func:`initialize`. A collective under ZeRO-3: every rank calls it.

    Args:
        model: the model (loaded whole, LoRA applied: :func:`chatrl.models.trainable.load_trainable`).
        optim: its optimizer block (for step 3, read with the model's prefix: ``--actor_learning_rate``).
        lora: its LoRA block (the LoRA learning rate). zero: its ZeRO block (stage, offload).
        dtype: ``fp32`` | ``bf16`` | ``fp16``.
        batch: the run's batch sizes. total_steps: optimizer steps of this model over the run;
        warmup_steps: of them, the warm-up (the run's plan: :mod:`chatrl.sizes`).

    Raises:
        ValueError: an unknown ZeRO stage or dtype (:func:`deepspeed_config`).
    """
    from transformers import get_scheduler

    groups = optimizer_param_groups(model, optim.weight_decay, lora.lora_learning_rate if lora_enabled(lora) else None)
    optimizer = make_optimizer(groups, lr=optim.learning_rate, offload=zero.offload)
    scheduler = get_scheduler(optim.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps,
                              num_training_steps=max(total_steps, 1))
    config = deepspeed_config(batch, zero.zero_stage, zero.offload, dtype, optim.gradient_clipping)
    return initialize(model, config, optimizer, scheduler)


def initialize(model, config: dict, optimizer=None, lr_scheduler=None):
    """``deepspeed.initialize`` with chatrl's defaults; returns the engine.

    A model without an optimizer (frozen reference / reward) is wrapped for inference: ZeRO-3
    partitions it, stages 0–2 just move it to the device. With an optimizer, a step whose gradients
    are not finite is skipped at every ZeRO stage (counted in ``engine.skipped_steps``, schedule
    held; see :mod:`chatrl.distributed.resilience`).
    """
    import deepspeed

    deepspeed_patches.stub_deepspeed_muon()
    plain = optimizer is not None and _plain_fp32_zero0(config)
    sparse = deepspeed_patches.sparse_embedding_grads(model) if plain else []
    max_norm = config.get("gradient_clipping", 0.0) if plain else 0.0
    if plain:  # clipped by the non-finite guard below, with the norm it computes anyway (0: DeepSpeed's clip off)
        config = {**config, "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=config)
    if optimizer is not None and not hasattr(engine.optimizer, "overflow"):
        # ZeRO 1-3 and DeepSpeed's fp16/bf16 optimizers skip non-finite steps themselves; ZeRO-0 does not
        skip_nonfinite_steps(engine.optimizer, max_norm)
    elif max_norm:
        raise RuntimeError("DeepSpeed wrapped the fp32 ZeRO-0 optimizer; chatrl's gradient clipping would be lost")
    if sparse:
        deepspeed_patches.densify_after_allreduce(engine, sparse)
    if optimizer is not None:
        if plain and engine.dp_world_size > 1:  # the gradients are the all-reduce's buffer
            deepspeed_patches.gradients_in_buffer(engine, sparse)
        deepspeed_patches.kept_allreduce_buffer(engine)
    return engine


def _plain_fp32_zero0(config: dict) -> bool:
    """True for a DeepSpeed ``config`` of ZeRO stage 0 in fp32: the engine all-reduces gradients and
    calls chatrl's torch optimizer directly (no DeepSpeed optimizer wrapper of its own)."""
    return (config.get("zero_optimization", {}).get("stage", 0) == 0 and not config.get("bf16", {}).get("enabled")
            and not config.get("fp16", {}).get("enabled"))
