"""DeepSpeed workarounds, in one place: what chatrl changes in DeepSpeed's behaviour, and why.

Each one fixes a measured problem of DeepSpeed 0.19 on this project's machines (the docstrings give
the figures) and is applied once at start-up by :func:`chatrl.dist.init_distributed`
(:func:`before_process_group`, :func:`after_process_group`), or at engine creation by
:func:`chatrl.dist.initialize` (the sparse embedding gradients):

* :func:`stale_build_locks`: a killed JIT build leaves a lock every later DeepSpeed process waits on;
* :func:`skip_deepspeed_shm_op`: DeepSpeed's CPU shared-memory op leaks 66 MiB of ``/dev/shm`` per
  rank and run and JIT-builds for minutes;
* :func:`stub_deepspeed_muon`: importing DeepSpeed's Muon modules runs ``torch.compile`` (seconds
  per rank) for an optimizer chatrl never builds;
* :func:`gloo_reduce_scatter_by_all_reduce`: gloo's reduce-scatter is twice as slow as its all-reduce;
* :func:`sparse_embedding_grads`: fp32 ZeRO-0 all-reduces whole embedding tables for a few rows.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def before_process_group() -> None:
    """The workarounds that must precede ``deepspeed.init_distributed``: warn about stale build locks,
    skip the shared-memory op, stub DeepSpeed's Muon modules. Idempotent."""
    for lock in stale_build_locks():  # a DeepSpeed op built later (CPU Adam) would wait on it forever
        log.warning("%s is older than %.0f min: a torch extension build was killed and left it; every "
                    "DeepSpeed process waits on it. Delete it if no build is running.", lock, STALE_BUILD_LOCK_S / 60)
    skip_deepspeed_shm_op()
    stub_deepspeed_muon()


def after_process_group(single_node: bool) -> None:
    """The workarounds that need the process group: gloo's reduce-scatter as an all-reduce on one
    node (``single_node``: every rank of the job is on this node). Idempotent."""
    gloo_reduce_scatter_by_all_reduce(single_node)


STALE_BUILD_LOCK_S = 600.0  # a JIT build lock older than this is taken for a leftover of a killed build


def stale_build_locks(max_age_s: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """torch JIT-extension build locks older than ``max_age_s`` seconds (``lock`` files under
    ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, one folder per extension).

    DeepSpeed JIT-builds its C++ ops at their first use in every new environment (on CPU: its CPU
    Adam, used with ``--offload``), and torch serialises the build with a lock file that only the
    building process removes. A process killed while building (Ctrl-C at the first launch, a stopped
    test run) leaves the file, and every later DeepSpeed process waits for it forever, silently. A build takes seconds to a few minutes,
    so an old lock is a leftover; :func:`before_process_group` names it in a warning.
    """
    import time

    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # torch's own rule
    now = time.time()
    return sorted(p for p in Path(root).glob("*/*/lock")
                  if p.is_file() and now - p.stat().st_mtime > max_age_s)


def skip_deepspeed_shm_op() -> None:
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


DEEPSPEED_MUON = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


class NoDeepSpeedMuon:
    """Stands for every name of DeepSpeed's Muon modules in chatrl's processes (:func:`stub_deepspeed_muon`):
    nothing is an instance of it, and calling it (building the optimizer, running an update) raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("chatrl builds its own optimizer (AdamW); DeepSpeed's Muon optimizer is not supported")


def _muon_placeholder(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return NoDeepSpeedMuon


def stub_deepspeed_muon() -> None:
    """Put placeholders for DeepSpeed's Muon optimizer modules in ``sys.modules``, once per process.

    DeepSpeed imports ``deepspeed.runtime.zero.muon.muon_optimizer`` to ask whether the optimizer is
    a ``MuonWithAuxAdam`` (when an engine is built: the ZeRO 1-2 support check, ZeRO-3's and the bf16
    optimizer's set-up), and ZeRO-2 imports ``...original_muon`` at every gradient reduction,
    calling its ``muon_update`` only for Muon parameter groups. Importing either runs
    ``torch.compile`` on Muon's kernels: 2-5 s per rank on this machine after an optimizer exists
    (loaded; ``docs/performance.md``), for an optimizer chatrl never builds (:func:`chatrl.dist.make_optimizer`
    builds AdamW, and chatrl's DeepSpeed configs name no optimizer). In the placeholders every name
    is :class:`NoDeepSpeedMuon`, so each check answers "no Muon", as with the real modules, and a
    Muon code path that did run would fail loudly. Modules already imported (a user's own code)
    are left as they are.
    """
    import sys
    import types

    for name in DEEPSPEED_MUON:
        if name not in sys.modules:
            stub = types.ModuleType(name, "chatrl's placeholder for a DeepSpeed Muon module (chatrl.deepspeed_patches)")
            stub.__getattr__ = _muon_placeholder
            sys.modules[name] = stub


class _DoneWork:
    """The handle of a collective that has already completed (``wait`` returns at once)."""

    def wait(self, *args, **kwargs) -> bool:
        """Return at once: the collective has completed."""
        return True

    def is_completed(self) -> bool:
        """Always True."""
        return True


def gloo_reduce_scatter_by_all_reduce(single_node: bool) -> bool:
    """Make DeepSpeed's reduce-scatter an all-reduce when the backend is gloo on a single node.

    gloo's ring all-reduce is much faster on CPU than its reduce-scatter of the same bytes (2 ranks
    on one node, fp32, ``bench/collectives.py``: 204 MB all-reduced in 97 ms, reduce-scattered in
    205 ms; 4 MB: 1.6 against 6.7 ms; below about 1 MB the two are within a fraction of a
    millisecond). ZeRO-3 reduce-scatters every gradient bucket; on the larger benchmark actor the
    switch took step 3's ZeRO-3 training phase from 6.33 / 6.49 to 5.91 / 5.94 s per step in two
    interleaved pairs (``bench/results/step3_h512_ab_2026-12-01_2.json``). The input ``(world·n,)``
    is all-reduced in place and this rank's slot becomes the output ``(n,)``: the same sum (bit for bit
    on two ranks; with more, the two collectives may add in another order, within float rounding).

    Unlike torch's reduce-scatter, the input is overwritten, for every caller of
    ``deepspeed.comm``'s reduce-scatter in the process: DeepSpeed's ZeRO gradient path treats it as
    scratch already (it pre-divides it in place and reads only the output); chatrl has no other
    caller. Across nodes an all-reduce moves twice a reduce-scatter's bytes over the network, so
    multi-node jobs keep gloo's reduce-scatter. gloo's all-gather is kept too: up to 16 MB, ZeRO-3's
    per-layer sizes, it takes 0.76–1.27× an all-reduce's time.

    ``single_node``: all ranks of the job are on this node. Installed on DeepSpeed's communication
    backend (``deepspeed.comm``) by :func:`after_process_group`; idempotent; NCCL and other backends
    are left alone. Returns True when installed.
    """
    from deepspeed import comm

    cdb = comm.comm.cdb
    if getattr(cdb, "_chatrl_reduce_scatter", False):
        return True
    if (cdb is None or not torch.distributed.is_initialized() or torch.distributed.get_backend() != "gloo"
            or not single_node):
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


def sparse_embedding_grads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Switch the model's word-embedding tables to sparse gradients where that is exact and cheaper;
    returns their weights. Called by :func:`chatrl.dist.initialize` for fp32 ZeRO-0 engines with an optimizer.

    A batch touches a few hundred rows of a word-embedding table (50k rows for GPT-2's
    vocabulary), yet a dense gradient is the whole table: zeroed, filled, flattened into DeepSpeed's
    all-reduce bucket, all-reduced and copied back at every step. A sparse gradient (the rows
    touched) is instead all-gathered by DeepSpeed's engine (its ``sparse_allreduce`` path) and made
    dense once, after the reduction and before clipping and the optimizer
    (:func:`densify_after_allreduce`), so clipping, the non-finite guard and AdamW (whose moments
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


def densify_after_allreduce(engine, weights: list[torch.nn.Parameter]) -> None:
    """Make ``weights``' sparse gradients dense right after DeepSpeed's gradient reduction (which sums
    them across data-parallel ranks as sparse tensors), before the optimizer step and its clipping."""
    reduce = engine.allreduce_gradients

    def allreduce_then_densify(*args, **kwargs):
        reduce(*args, **kwargs)
        for w in weights:
            if w.grad is not None and w.grad.is_sparse:
                w.grad = w.grad.to_dense()

    engine.allreduce_gradients = allreduce_then_densify
