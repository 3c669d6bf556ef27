"""DeepSpeed workarounds, in one place: what chatrl changes in DeepSpeed's behaviour, and why.

Each one fixes a measured problem of DeepSpeed 0.19 on this project's machines (the docstrings give
the figures) and is applied once at start-up by :func:`chatrl.distributed.dist.init_distributed`
(:func:`before_process_group`, :func:`after_process_group`), or at engine creation by
:func:`chatrl.distributed.dist.initialize` (the sparse embedding gradients, the kept all-reduce buffer):

* :func:`stale_build_locks`: a killed JIT build leaves a lock every later DeepSpeed process waits on;
* :func:`skip_deepspeed_shm_op`: DeepSpeed's CPU shared-memory op leaks 66 MiB of ``/dev/shm`` per
  rank and run and JIT-builds for minutes;
* :func:`stub_deepspeed_muon`: importing DeepSpeed's Muon modules runs ``torch.compile`` (seconds
  per rank) for an optimizer chatrl never builds;
* :func:`gloo_reduce_scatter_by_all_reduce`: gloo's reduce-scatter is twice as slow as its all-reduce;
* :func:`undeprecated_all_gather`: DeepSpeed's all-gather calls a torch function deprecated in torch 2.13;
* :func:`sparse_embedding_grads`: fp32 ZeRO-0 all-reduces whole embedding tables for a few rows;
* :func:`lean_bf16_zero0_step`: bf16 ZeRO-0's optimizer step copies and scans every gradient three times;
* :func:`kept_allreduce_buffer`: ZeRO-0's all-reduce flattens the gradients into fresh memory at every step (on CPU);
  with :func:`gradients_in_buffer`, fp32 ZeRO-0's gradients are that buffer (no second copy of them).
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
    lean_bf16_zero0_step()


def after_process_group(single_node: bool) -> None:
    """The workarounds that need the process group: gloo's reduce-scatter as an all-reduce on one
    node (``single_node``: every rank of the job is on this node), DeepSpeed's all-gather without torch's
    deprecated alias. Idempotent."""
    gloo_reduce_scatter_by_all_reduce(single_node)
    undeprecated_all_gather()


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
    (loaded; ``docs/performance.md``), for an optimizer chatrl never builds (:func:`chatrl.distributed.dist.make_optimizer`
    builds AdamW, and chatrl's DeepSpeed configs name no optimizer). In the placeholders every name
    is :class:`NoDeepSpeedMuon`, so each check answers "no Muon", as with the real modules, and a
    Muon code path that did run would fail loudly. Modules already imported (a user's own code)
    are left as they are.
    """
    import sys
    import types

    for name in DEEPSPEED_MUON:
        if name not in sys.modules:
            stub = types.ModuleType(name, "chatrl's placeholder for a DeepSpeed Muon module (chatrl.distributed.deepspeed_patches)")
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


def undeprecated_all_gather() -> bool:
    """Make DeepSpeed's all-gather call ``torch.distributed.all_gather_single`` instead of
    ``all_gather_into_tensor``, which torch 2.13 deprecates as a thin alias of it.

    DeepSpeed 0.19 picks ``all_gather_into_tensor`` for every all-gather of ZeRO-3's parameter
    fetches, and each call site warned once per process (``FutureWarning: `torch.distributed.
    all_gather_into_tensor` is deprecated``): about ten lines in one replay, 47 in a 2-step probe with
    every warning shown. The function called is the one the alias calls, so nothing else changes.
    Installed on DeepSpeed's communication backend by :func:`after_process_group`; idempotent; left
    alone when torch has no ``all_gather_single`` or DeepSpeed picked another function. Returns True
    when installed.
    """
    from deepspeed import comm

    cdb = comm.comm.cdb
    single = getattr(torch.distributed, "all_gather_single", None)
    if cdb is None or single is None or getattr(cdb, "all_gather_function", None) is single:
        return single is not None and cdb is not None
    if cdb.all_gather_function is not getattr(torch.distributed, "all_gather_into_tensor", None):
        return False
    cdb.all_gather_function = single
    return True


def sparse_embedding_grads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Switch the model's word-embedding tables to sparse gradients where that is exact and cheaper;
    returns their weights. Called by :func:`chatrl.distributed.dist.initialize` for fp32 ZeRO-0 engines with an optimizer.

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


def lean_bf16_zero0_step() -> bool:
    """Give DeepSpeed's bf16 ZeRO-0 optimizer wrapper a step that touches each gradient once. Idempotent;
    returns True when installed.

    At ZeRO stage 0 in bf16 DeepSpeed wraps the optimizer in ``FP16_UnfusedOptimizer``, whose step
    walks the bf16 gradients three times, one parameter at a time: an inf/NaN scan
    (``CheckOverflow``), a norm of a fresh fp32 copy of each gradient (``get_weight_norm``), then a
    second fresh fp32 copy for the fp32 master weights; it multiplies every gradient by 1 (bf16 has
    no loss scale) and copies the masters back one by one. On the larger PPO set-up's step 3 (103M
    parameters, two CPU ranks) that was 18.6 % of the training phase (py-spy), AdamW itself a fifth of it.

    The replacement, for bf16 wrappers without model parallelism or DeepSpeed MoE (others keep
    DeepSpeed's step): the gradients are copied to fp32 in one ``torch._foreach_copy_`` (a gradient a
    rank never received counts as zeros, as in DeepSpeed); the global L2 norm is
    ``‖(‖g_i‖₂)_i‖₂`` of those fp32 copies, with DeepSpeed's arithmetic (an fp32 running sum of the
    squared norms per parameter group, the groups combined in float64): the same number on CPU, to the
    bit; on GPUs ``torch._foreach_norm`` may add within a tensor in another order than ``Tensor.norm``,
    so within fp32 rounding. A non-finite norm (an inf or NaN anywhere) skips the step as DeepSpeed
    does (``_skip_invalid_grad_norm``: counted, gradients dropped, learning-rate schedule held); the
    gradients were all-reduced before the step, so every rank decides alike, and DeepSpeed's extra
    all-reduce of its overflow flag (only for engines built with ``enable_backward_allreduce=False``)
    is not repeated. Otherwise DeepSpeed's own ``unscale_and_clip_grads`` gives the clip factor,
    applied in one ``torch._foreach_mul_`` when it is not 1, the wrapped optimizer steps, and the bf16 weights are
    refreshed from the masters in one ``torch._foreach_copy_``. On GPUs the fp32 gradient copies live
    for the step only, as in DeepSpeed (the caching allocator reuses their memory, and generation
    between steps has it); on CPU they are kept between steps (4 bytes a parameter), because fresh
    memory there costs a page fault per 4 KiB page: copying a 25.7M-element bf16 gradient into new
    fp32 memory took 54 ms on this machine, into a kept buffer 8 ms. Measured effect:
    ``docs/performance.md``.
    """
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if getattr(FP16_UnfusedOptimizer.step, "_chatrl_lean", False):
        return True
    deepspeed_step = FP16_UnfusedOptimizer.step

    def step(self, closure=None):
        if not _lean_step_applies(self):
            return deepspeed_step(self, closure)
        return _lean_bf16_step(self)

    step._chatrl_lean = True
    step.deepspeed_step = deepspeed_step  # DeepSpeed's own, for the parity test
    FP16_UnfusedOptimizer.step = step
    return True


def _lean_step_applies(opt) -> bool:
    if opt.low_precision_dtype != torch.bfloat16 or opt.fused_lamb_legacy or opt.mpu is not None:
        return False
    applies = getattr(opt, "_chatrl_lean_applies", None)
    if applies is None:
        from deepspeed.moe.utils import is_moe_param

        applies = not any(is_moe_param(p) for group in opt.fp16_groups for p in group)
        opt._chatrl_lean_applies = applies
    return applies


def _lean_bf16_step(opt) -> bool:
    """:func:`lean_bf16_zero0_step`'s step on a DeepSpeed ``FP16_UnfusedOptimizer`` ``opt``; returns
    whether the step was skipped (DeepSpeed's ``overflow``)."""
    import math

    from deepspeed.runtime.utils import get_global_norm

    kept = getattr(opt, "_chatrl_fp32_grads", None)
    if kept is None:  # on CPU, kept between steps: fresh memory costs page faults (docstring)
        kept = [[torch.empty_like(m) for m in group] if group and group[0].device.type == "cpu" else None
                for group in opt.fp32_groups]
        opt._chatrl_fp32_grads = kept
    norm_groups, masters, grads, weights = [], [], [], []
    for fp32_group, bf16_group, group_kept in zip(opt.fp32_groups, opt.fp16_groups, kept, strict=True):
        group_grads = group_kept or [torch.empty_like(m) for m in fp32_group]  # fp32, on the masters' device
        copied = [(g, w.grad) for g, w in zip(group_grads, bf16_group, strict=True) if w.grad is not None]
        if copied:
            torch._foreach_copy_([g for g, _ in copied], [lp for _, lp in copied])
        if len(copied) < len(group_grads):
            torch._foreach_zero_([g for g, w in zip(group_grads, bf16_group, strict=True) if w.grad is None])
        squares = torch._foreach_pow(torch._foreach_norm([g for g, _ in copied]), 2.0) if copied else []
        total = torch.zeros((), dtype=torch.float32, device=squares[0].device if squares else "cpu")
        for sq in squares:  # DeepSpeed's get_weight_norm: an fp32 running sum in parameter order
            total = total + sq
        norm_groups.append(float(total) ** 0.5)
        masters += fp32_group
        grads += group_grads
        weights += bf16_group
    norm = get_global_norm(norm_groups)  # √Σ over groups, in float64, as DeepSpeed
    if not math.isfinite(norm):
        return opt._skip_invalid_grad_norm()
    opt.overflow = False
    opt._global_grad_norm = norm
    opt._update_scale(False)
    combined_scale = opt.unscale_and_clip_grads(norm, apply_scale=False)
    if combined_scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / combined_scale)
    for m, g in zip(masters, grads, strict=True):
        m.grad = g
    opt.optimizer.step()
    for m in masters:
        m.grad = None
    torch._foreach_copy_([w.data for w in weights], masters)
    return opt.overflow


def gradients_in_buffer(engine, exclude: list[torch.nn.Parameter] = ()) -> torch.Tensor | None:
    """Make the dense gradients of an fp32 ZeRO-0 engine's trainable parameters views of one flat
    buffer, in the order DeepSpeed flattens them for its all-reduce; returns the buffer (None where
    it does not apply: parameters of several dtypes, or none).

    :func:`kept_allreduce_buffer` then all-reduces that buffer where it stands: no copy of the
    gradients into a buffer of their size, no copy back, and the buffer is the only gradient memory
    (on SmolLM2-135M in fp32, 0.5 GB less per rank: ``docs/real_model.md``). The views are
    attached (zeroed) now and again wherever the engine would drop the gradients (``zero_grad``,
    after each optimizer step), so backward accumulates into them in place. The numbers are
    those of fresh gradients: the first micro-batch adds its gradient to zeros (``0 + g = g``), the
    all-reduce sums the same values in the same layout, and a parameter without a gradient holds
    zeros, as DeepSpeed's reduction gives it at every optimizer step over several ranks anyway
    (``_get_gradients_for_reduction``); hence :func:`chatrl.distributed.dist.initialize` uses it only there.
    ``exclude``: parameters kept out (those with sparse gradients, :func:`sparse_embedding_grads`).
    """
    skip = {id(p) for p in exclude}
    params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() and id(p) not in skip]
    if not params or len({p.dtype for p in params}) > 1 or any(p.device.type != "cpu" for p in params):
        return None
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()

    def attach() -> None:
        flat.zero_()
        for p, v in zip(params, views, strict=True):
            p.grad = v

    drop = engine.zero_grad

    def zero_grad(*args, **kwargs):
        drop(*args, **kwargs)  # the others (sparse gradients) as DeepSpeed drops them
        attach()

    engine.zero_grad = zero_grad
    attach()
    engine.gradient_buffer = flat
    return flat


def kept_allreduce_buffer(engine) -> bool:
    """Flatten a CPU engine's gradients for its bucketed all-reduce into one buffer kept between steps;
    returns True when installed (models on CPU).

    On its bucketed path (``buffered_allreduce_fallback``: ZeRO stage 0, and ZeRO-1 when its optimizer
    has no reduction of its own) DeepSpeed's ``allreduce_bucket`` flattens the gradients into a new
    tensor (the engine's ``flatten``), all-reduces it and copies the sums back, at every step. ZeRO-2
    and ZeRO-3 reduce through their own buffers and never call ``flatten``. On CPU new memory
    costs a page fault per 4 KiB page at first touch, which made the flattening 30 % of the larger PPO
    set-up's gradient all-reduce (py-spy). Here ``engine.flatten`` concatenates into a buffer of the
    gradients' dtype that is kept (grown when a bucket is larger, a slice of it otherwise): the same
    values in the same layout, so the same sums. ``engine.flatten`` serves only that all-reduce; the
    buffer is scratch between the flattening and the copy back. Costs the gradients' size once more
    (2 bytes a parameter in bf16, 4 in fp32). GPU engines keep DeepSpeed's (the caching allocator
    reuses memory there).

    Where the gradients already are views of one buffer in order (:func:`gradients_in_buffer`),
    ``flatten`` returns the part of that buffer they fill: nothing is copied, and DeepSpeed's copy of
    the sums back onto the gradients copies each onto itself.
    """
    param = next(engine.module.parameters(), None)
    if param is None or param.device.type != "cpu":
        return False
    buffers: dict[torch.dtype, torch.Tensor] = {}
    grads = getattr(engine, "gradient_buffer", None)

    def in_place(tensors) -> torch.Tensor | None:
        """The part of the gradient buffer that ``tensors`` are, in order; None when they are not."""
        if grads is None or tensors[0].dtype != grads.dtype:
            return None
        size, base = grads.element_size(), grads.data_ptr()
        start = (tensors[0].data_ptr() - base) // size
        at = start
        for t in tensors:
            if t.untyped_storage().data_ptr() != grads.untyped_storage().data_ptr() or not t.is_contiguous() \
                    or t.data_ptr() != base + at * size:
                return None
            at += t.numel()
        return grads[start:at]

    def flatten(tensors):
        part = in_place(tensors)
        if part is not None:
            return part
        numel, dtype = sum(t.numel() for t in tensors), tensors[0].dtype
        buf = buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = buffers[dtype] = torch.empty(numel, dtype=dtype)
        out = buf[:numel]
        torch.cat([t.reshape(-1) for t in tensors], out=out)
        return out

    engine.flatten = flatten
    return True
