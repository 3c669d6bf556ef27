"""Parity of the fast paths in :mod:`chatrl.distributed.dist` against the plain ones : the fused AdamW
against torch's for-loop AdamW, and the CPU thread placement (of ranks, and of single-process commands by the
machine's load)."""

import os

import pytest
import torch

from chatrl.distributed import deepspeed_patches, dist


def test_fused_adamw_takes_the_plain_adamw_steps():
    torch.manual_seed(0)
    shapes = [(50, 16), (16,), (7, 3)]
    plain = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    fused = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    groups = [{"params": fused[:2], "weight_decay": 0.1}, {"params": fused[2:], "weight_decay": 0.0}]
    opt = dist.make_optimizer(groups, lr=1e-2, offload=False)
    assert opt.defaults["fused"] is True
    ref = torch.optim.AdamW([{"params": plain[:2], "weight_decay": 0.1}, {"params": plain[2:], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(plain, fused, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
    for p, q in zip(plain, fused, strict=True):
        assert not torch.equal(p, torch.zeros_like(p))
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-6)


def test_cpu_threads_are_split_between_local_ranks(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        for key in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            monkeypatch.delenv(key, raising=False)
        monkeypatch.setenv("LOCAL_SIZE", str(2 * cpus))  # DeepSpeed launcher's name; more ranks than CPUs
        assert dist.cpu_threads_per_rank() == 1
        monkeypatch.setenv("LOCAL_SIZE", "1")
        assert dist.place_cpu_threads() == cpus
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting wins
        torch.set_num_threads(before)
        assert dist.place_cpu_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_single_process_command_takes_one_thread_per_idle_core(monkeypatch):
    """The evaluation and the chat: threads = round(cores - 1-minute load), at least 1, at most the cores.
    Measured on 2 cores at a load of 6.1-6.8: 48 greedy tokens for 8 prompts on stories260K took 16.2-18.6 s
    with 2 threads and 0.33-0.36 s with 1 (the 2 threads waited on each other in every operator); before,
    both commands kept torch's default, a thread per core, at any load."""
    assert [dist.threads_for_load(2, load) for load in (0.0, 0.4, 0.6, 1.0, 5.5)] == [2, 2, 1, 1, 1]
    assert [dist.threads_for_load(16, load) for load in (0.0, 3.2, 15.5, 40.0)] == [16, 13, 1, 1]
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.setattr(os, "getloadavg", lambda: (5.5, 4.0, 3.0))
        line = dist.place_threads_for_load("chatrl.eval")
        assert torch.get_num_threads() == 1
        assert line.startswith("chatrl.eval: 1 CPU thread for 2 cores at a load of 5.5 (one per idle core")
        monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.1, 0.1))
        assert dist.place_threads_for_load("chatrl chat").startswith("chatrl chat: 2 CPU threads for 2 cores")
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's setting wins
        torch.set_num_threads(1)
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        assert dist.place_threads_for_load("chatrl.eval") == "chatrl.eval: 1 CPU thread (OMP_NUM_THREADS=1)"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


_MUON_PROBE = r"""
import os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
import pytest
import torch
from chatrl.distributed import deepspeed_patches
from chatrl.distributed import dist
from chatrl.sizes import BatchSizes
dist.init_distributed()
stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
opt = dist.make_optimizer([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-2, offload=False)
engine = dist.initialize(model, dist.deepspeed_config(BatchSizes(2, 1, 1), stage), opt)
before = [p.detach().clone() for p in engine.module.parameters()] if stage < 3 else None
loss = engine(torch.randn(2, 8)).pow(2).sum()
engine.backward(loss)
engine.step()
stubs = [sys.modules.get(m) for m in deepspeed_patches.DEEPSPEED_MUON]
print("MODULES", int("torch._inductor.compile_fx" in sys.modules),
      int(all(m is not None and m.MuonWithAuxAdam is deepspeed_patches.NoDeepSpeedMuon for m in stubs)), float(loss))
"""


def test_deepspeed_engines_train_without_importing_muon():
    """ZeRO 0, 2 and 3 engines build and take a step with DeepSpeed's Muon module a placeholder: its
    ``torch.compile`` of Muon's kernels (seconds per rank) never runs."""
    import subprocess
    import sys

    from tests.conftest import REPO

    for stage in (0, 2, 3):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", _MUON_PROBE, str(stage), str(dist.free_port())], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        line = [x for x in out.stdout.splitlines() if x.startswith("MODULES")]
        assert out.returncode == 0 and line, out.stderr[-3000:]
        _, compiled, stub, loss = line[0].split()
        assert (compiled, stub) == ("0", "1"), (stage, line[0])
        assert float(loss) > 0


def test_a_muon_optimizer_is_refused_clearly():
    deepspeed_patches.stub_deepspeed_muon()
    import sys

    optimizer, kernels = (sys.modules[m] for m in deepspeed_patches.DEEPSPEED_MUON)
    if optimizer.MuonWithAuxAdam is deepspeed_patches.NoDeepSpeedMuon:  # not when this process imported DeepSpeed's Muon
        with pytest.raises(RuntimeError, match="Muon optimizer is not supported"):
            optimizer.MuonWithAuxAdam([])
        with pytest.raises(RuntimeError, match="Muon optimizer is not supported"):
            kernels.muon_update(None, None)


_SPARSE_PROBE = r"""
import copy, json, sys
import torch
from transformers import OPTConfig, OPTForCausalLM, OPTForSequenceClassification
from chatrl.distributed import dist
from chatrl.sizes import BatchSizes
info = dist.init_distributed()
stage, clip = int(sys.argv[1]), float(sys.argv[2])
cfg = OPTConfig(vocab_size=500, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                max_position_embeddings=64, word_embed_proj_dim=16, pad_token_id=1, dropout=0.0)
torch.manual_seed(0)
model = OPTForSequenceClassification(cfg)
ref, start = copy.deepcopy(model), copy.deepcopy(model)
opt = torch.optim.SGD(model.parameters(), lr=1.0)  # a linear read-out of the gradients (Adam would amplify rounding)
sparse_seen = []
opt.register_step_pre_hook(lambda o, *_: sparse_seen.append(any(p.grad is not None and p.grad.is_sparse
                                                                    for g in o.param_groups for p in g["params"])))
config = dist.deepspeed_config(BatchSizes(2, 1, info.world_size), stage, gradient_clipping=clip)
engine = dist.initialize(model, config, opt)
ref_opt = torch.optim.SGD(ref.parameters(), lr=1.0)
g = torch.Generator().manual_seed(1)
norms = []
for _ in range(3):
    ids = torch.randint(2, 500, (info.world_size, 2, 12), generator=g)  # every rank draws all; each takes its own
    loss = engine(input_ids=ids[info.rank]).logits.pow(2).sum() * 10
    engine.backward(loss)
    engine.step()
    ref_opt.zero_grad()  # the plain reference: the mean over ranks of each rank's loss, dense, torch's clip
    (sum(ref(input_ids=ids[r]).logits.pow(2).sum() * 10 for r in range(info.world_size)) / info.world_size).backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)) if clip else 0.0)
    ref_opt.step()
diff = dist.all_reduce_max(torch.tensor(max((p.detach() - q.detach()).abs().max().item()
                                             for p, q in zip(engine.module.parameters(), ref.parameters())))).item()
moved = {n: (p.detach() - q.detach()).abs().max().item()
         for (n, p), q in zip(ref.named_parameters(), start.parameters()) if "k_proj.bias" not in n}  # gradient 0
tied = OPTForCausalLM(cfg)
dist.initialize(tied, config, dist.make_optimizer([{"params": list(tied.parameters())}], lr=1e-2, offload=False))
if info.rank == 0:  # one RESULT line (diff over both ranks): two ranks printing at once can interleave
    print("RESULT", json.dumps({"sparse": model.get_input_embeddings().sparse, "sparse_at_step": any(sparse_seen),
                                "diff": diff, "norms": norms, "moved": moved,
                                "tied_sparse": tied.get_input_embeddings().sparse,
                                "position_sparse": model.model.decoder.embed_positions.sparse}), flush=True)
dist.shutdown()  # gloo's threads stopped, then no interpreter teardown (it can abort: chatrl.distributed.dist.run_program)
dist.exit_now()
"""


@pytest.mark.parametrize("stage", [0, 2])
def test_zero0_sparse_embedding_grads_and_clipping_take_the_dense_steps(stage, tmp_path):
    """Two ranks, fp32: at ZeRO-0 the word-embedding table gets sparse gradients (all-gathered by
    DeepSpeed, made dense before the optimizer) and the non-finite guard clips with its own norm;
    the parameters after three clipped SGD steps (a linear read-out of the gradients) equal a dense
    single-process reference (the mean of the ranks' losses, torch's clip_grad_norm_) to float32
    rounding, and no sparse gradient reaches the optimizer. ZeRO-2 keeps dense gradients
    and DeepSpeed's clipping, and reaches the same parameters. A table tied to the LM head and the
    position table stay dense."""
    import json

    from tests.launch import run_ranks

    probe = tmp_path / "probe.py"
    probe.write_text(_SPARSE_PROBE)
    out = run_ranks([str(probe), str(stage), "0.5"], nprocs=2, timeout=300)
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split(" ", 1)[1])
    assert res["sparse"] is (stage == 0)
    assert res["tied_sparse"] is False and res["position_sparse"] is False
    assert min(res["norms"]) > 0.5  # every step was clipped
    assert min(res["moved"].values()) > 1e-5, res["moved"]  # the steps changed every parameter tensor
    assert res["sparse_at_step"] is False
    assert res["diff"] < 1e-6, res


def test_frozen_models_are_partitioned_only_beside_zero3_and_when_large(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    model = torch.nn.Linear(100, 10)  # 1,010 fp32 parameters: 4,040 bytes
    acc = get_accelerator()
    monkeypatch.setenv("LOCAL_SIZE", "2")
    for memory, expect in ((8 * 4040 * 2, 0), (8 * 4040 * 2 - 16, 3)):  # whole up to 1/8 of memory / 2 ranks
        monkeypatch.setattr(type(acc), "total_memory", lambda self, device_index=None, m=memory: m)
        assert dist.frozen_zero_stage(3, model, "auto") == expect, memory
        assert [dist.frozen_zero_stage(s, model, "auto") for s in (0, 1, 2)] == [0, 0, 0]  # no partitions asked for
    assert dist.frozen_zero_stage(3, model, "always") == 3 and dist.frozen_zero_stage(2, model, "always") == 0
    assert dist.frozen_zero_stage(3, model, "never") == 0
    assert dist.frozen_zero_stage(3, model, "never", offload=True) == 3  # parameter offload needs ZeRO-3
    with pytest.raises(ValueError, match="--partition_frozen_models"):
        dist.frozen_zero_stage(3, model, "sometimes")


_FROZEN_PROBE = r"""
import copy, json, sys
import torch
from transformers import OPTConfig, OPTForCausalLM
from chatrl.distributed import dist
from chatrl.sizes import BatchSizes
info = dist.init_distributed()
cfg = OPTConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, dropout=0.0)
torch.manual_seed(0)
model = OPTForCausalLM(cfg).eval().requires_grad_(False)
batch = BatchSizes(2, 1, info.world_size)
engines = {}
for partition in ("never", "always"):
    stage = dist.frozen_zero_stage(3, model, partition)
    engines[partition] = dist.initialize(copy.deepcopy(model), dist.deepspeed_config(batch, stage, inference=True))
ids = torch.randint(2, 500, (2, 12), generator=torch.Generator().manual_seed(info.rank))
mask = torch.ones_like(ids)
mask[0, :3] = 0  # a left-padded row
with torch.no_grad():
    logits = {k: e(input_ids=ids, attention_mask=mask).logits for k, e in engines.items()}
diff = dist.all_reduce_max((logits["never"] - logits["always"]).abs().max()).item()  # over both ranks' batches
scale = logits["never"].abs().max().item()
if info.rank == 0:  # one RESULT line: two ranks printing at once can interleave on the shared pipe
    print("RESULT", json.dumps({"diff": diff, "scale": scale,
                                "partitioned": {k: any(hasattr(p, "ds_tensor") for p in e.module.parameters())
                                                for k, e in engines.items()}}), flush=True)
dist.shutdown()
dist.exit_now()
"""


def test_a_whole_frozen_model_computes_what_the_partitioned_one_does(tmp_path):
    """Two ranks: the same frozen causal LM kept whole (``--partition_frozen_models never``) and ZeRO-3
    partitioned (``always``, DeepSpeed-Chat's rule) gives the same logits on a left-padded batch."""
    import json

    from tests.launch import run_ranks

    probe = tmp_path / "probe.py"
    probe.write_text(_FROZEN_PROBE)
    out = run_ranks([str(probe)], nprocs=2, timeout=300)
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split(" ", 1)[1])
    assert res["partitioned"] == {"never": False, "always": True}
    assert res["scale"] > 0.01 and res["diff"] < 1e-6, res


_REDUCE_SCATTER_PROBE = r"""
import copy, json
import torch
from deepspeed import comm
from chatrl.distributed import dist
from chatrl.sizes import BatchSizes
from chatrl.distributed.weights import full_state_dict
info = dist.init_distributed()
cdb = comm.comm.cdb
installed = bool(getattr(cdb, "_chatrl_reduce_scatter", False))
import os
shm_files = [f for f in os.listdir("/dev/shm") if f"_{os.environ['MASTER_PORT']}_" in f]  # DeepSpeed's shm op's
summed = torch.full((5,), 1.0 + info.rank)
comm.inference_all_reduce(summed)  # the op's one user (in place): falls back to gloo
g = torch.Generator().manual_seed(7 + info.rank)
x = torch.randn(2 * 1003, generator=g)
plain = torch.empty(1003)
torch.distributed.reduce_scatter_tensor(plain, x.clone())
out = torch.empty(1003)
comm.reduce_scatter_fn(out, x.clone())  # DeepSpeed's entry point, as ZeRO-3 calls it
aliased = x.clone()
slot = aliased[info.rank * 1003:(info.rank + 1) * 1003]
handle = comm.reduce_scatter_fn(slot, aliased, async_op=True)
handle.wait()

def zero3_steps(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = dist.initialize(model, dist.deepspeed_config(BatchSizes(2, 1, info.world_size), 3), opt)
    for step in range(2):
        ids = torch.randint(2, 300, (info.world_size, 2, 10), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids[info.rank], labels=ids[info.rank]).loss)
        engine.step()
    return {n: t.clone() for n, t in full_state_dict(engine.module).items()}

from transformers import OPTConfig, OPTForCausalLM
cfg = OPTConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                max_position_embeddings=32, word_embed_proj_dim=16, pad_token_id=1, dropout=0.0)
torch.manual_seed(0)
model = OPTForCausalLM(cfg)
start, initial = copy.deepcopy(model), copy.deepcopy(model).state_dict()
patched, calls = cdb.reduce_scatter_function, []
cdb.reduce_scatter_function = lambda *a, **k: calls.append(1) or patched(*a, **k)
fast = zero3_steps(model)
cdb.reduce_scatter_function = cdb.get_reduce_scatter_function()  # gloo's own reduce-scatter
slow = zero3_steps(start)
cdb.reduce_scatter_function = patched
if info.rank == 0:  # full_state_dict gathers to rank 0
    print("RESULT", json.dumps({
        "installed": installed, "zero3_calls": len(calls), "shm_op": cdb.shm_comm_op is not None,
        "shm_files": shm_files, "inference_all_reduce": summed.tolist(), "diff": (out - plain).abs().max().item(),
        "aliased_diff": (slot - plain).abs().max().item(),
        "params_diff": max((fast[k] - slow[k]).abs().max().item() for k in fast),
        "moved": max((fast[k] - v).abs().max().item() for k, v in initial.items() if k in fast)}), flush=True)
dist.shutdown()
dist.exit_now()
"""


def test_gloo_reduce_scatter_by_all_reduce_is_exact(tmp_path):
    """Two gloo ranks: DeepSpeed's reduce-scatter, made an all-reduce by chatrl, equals torch's gloo
    reduce-scatter (also when the output is the input's own slot, asynchronously), and two ZeRO-3
    SGD steps reach the same parameters with either. DeepSpeed's shared-memory op is not loaded
    (no /dev/shm buffer for the job's port) and its one user, inference_all_reduce, still sums."""
    import json

    from tests.launch import run_ranks

    probe = tmp_path / "probe.py"
    probe.write_text(_REDUCE_SCATTER_PROBE)
    out = run_ranks([str(probe)], nprocs=2, timeout=300)
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split(" ", 1)[1])
    assert res["installed"] is True and res["zero3_calls"] >= 2  # ZeRO-3's gradients went through it
    assert res["diff"] == 0.0 and res["aliased_diff"] == 0.0, res
    assert res["moved"] > 1e-3 and res["params_diff"] < 1e-7, res
    assert res["shm_op"] is False and res["shm_files"] == [] and res["inference_all_reduce"] == [3.0] * 5, res


def test_an_old_extension_build_lock_is_reported(tmp_path, monkeypatch):
    """A torch JIT build lock left by a killed build makes every later DeepSpeed process wait forever;
    locks older than the threshold are found (a fresh one, a build in progress, is not)."""
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old, fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "other" / "lock"
    for f in (old, fresh):
        f.parent.mkdir(parents=True)
        f.touch()
    stamp = time.time() - deepspeed_patches.STALE_BUILD_LOCK_S - 5
    os.utime(old, (stamp, stamp))
    assert deepspeed_patches.stale_build_locks() == [old]
    assert deepspeed_patches.stale_build_locks(max_age_s=0.0) == sorted([old, fresh])


_LEAN_BF16_PROBE = r"""
import copy, json, sys, types
import torch
from transformers import OPTConfig, OPTForSequenceClassification
from chatrl.distributed import dist
from chatrl.sizes import BatchSizes
info = dist.init_distributed()
cfg = OPTConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, dropout=0.0)
torch.manual_seed(0)
model = OPTForSequenceClassification(cfg).to(torch.bfloat16)
model.unused = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))  # never receives a gradient
plain, start = copy.deepcopy(model), copy.deepcopy(model)
config = dist.deepspeed_config(BatchSizes(2, 1, info.world_size), 0, dtype="bf16", gradient_clipping=float(sys.argv[1]))
engines = []
for m in (model, plain):  # two parameter groups, as chatrl builds them (no decay on biases and norms)
    named = list(m.named_parameters())
    groups = [{"params": [p for n, p in named if p.ndim > 1], "weight_decay": 0.1},
              {"params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0}]
    engines.append(dist.initialize(m, config, dist.make_optimizer(groups, lr=1e-2, offload=False)))
lean, deepspeed_own = engines
opt = deepspeed_own.optimizer
opt.step = types.MethodType(type(opt).step.deepspeed_step, opt)  # this engine keeps DeepSpeed's step
from torch._utils import _flatten_dense_tensors
kept = lean.flatten is not _flatten_dense_tensors
deepspeed_own.flatten = _flatten_dense_tensors  # and DeepSpeed's all-reduce bucket
g = torch.Generator().manual_seed(1)
norms, skipped_at = [], []
for step in range(4):
    ids = torch.randint(2, 500, (info.world_size, 2, 12), generator=g)[info.rank]
    for e in engines:
        loss = e(input_ids=ids).logits.float().pow(2).sum() * 10
        e.backward(loss * float("nan") if step == 2 else loss)  # step 2: a non-finite gradient
        e.step()
    norms.append([e.optimizer._global_grad_norm for e in engines])
    skipped_at.append([e.skipped_steps for e in engines])
for e in engines:  # a step straight on the optimizers, one parameter without a gradient (DeepSpeed's
    g = torch.Generator().manual_seed(5)       # all-reduce zero-fills them, so an engine step never has one)
    for n, p in e.module.named_parameters():
        p.grad = None if n == "score.weight" else (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
    e.optimizer.step()
    norms.append(e.optimizer._global_grad_norm)
diff = max((p.detach().float() - q.detach().float()).abs().max().item()
           for p, q in zip(lean.module.parameters(), deepspeed_own.module.parameters()))
moved = min((p.detach().float() - q.detach().float()).abs().max().item()
            for (n, p), q in zip(lean.module.named_parameters(), start.parameters()) if n != "unused")
if info.rank == 0:
    print("RESULT", json.dumps({"kind": type(lean.optimizer).__name__, "diff": diff, "kept": kept, "moved": moved, "norms": norms,
                                "skipped": skipped_at, "dtype": str(next(lean.module.parameters()).dtype)}), flush=True)
dist.shutdown()
dist.exit_now()
"""


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_lean_bf16_zero0_step_takes_deepspeeds_steps(clip, tmp_path):
    """Two ranks, bf16 at ZeRO-0: DeepSpeed wraps AdamW in its unfused bf16 optimizer, whose step chatrl
    replaces (:func:`chatrl.distributed.deepspeed_patches.lean_bf16_zero0_step`), and chatrl's engines flatten the
    gradients for the all-reduce into a kept buffer (:func:`~chatrl.distributed.deepspeed_patches.kept_allreduce_buffer`).
    Against a copy of the same engine that keeps DeepSpeed's own step and flattening, over four steps (two
    parameter groups, weight decay, a parameter that never gets a gradient, clipping on and off, a NaN
    loss at the third) and a fifth optimizer step taken directly with one gradient missing: the global
    gradient norms are the same number, both skip the NaN step and only it, and the bf16 weights end equal."""
    import json

    from tests.launch import run_ranks

    probe = tmp_path / "probe.py"
    probe.write_text(_LEAN_BF16_PROBE)
    out = run_ranks([str(probe), str(clip)], nprocs=2, timeout=300)
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split(" ", 1)[1])
    assert res["kind"] == "FP16_UnfusedOptimizer" and res["dtype"] == "torch.bfloat16" and res["kept"]
    assert [s for s, _ in res["skipped"]] == [0, 0, 1, 1] and [s for _, s in res["skipped"]] == [0, 0, 1, 1]
    direct = res["norms"][4:]
    assert len(direct) == 2 and direct[0] == direct[1] > 0, direct
    for step, (lean, own) in enumerate(res["norms"][:4]):
        if step == 2:
            assert lean == own == float("inf")
        else:
            assert lean > 0 and lean == own, res["norms"]
    if clip:
        assert min(n for n, _ in res["norms"][:4]) > clip  # every finite step was clipped
    assert res["moved"] > 0  # every trained tensor changed
    assert res["diff"] == 0.0, res


_ALL_GATHER_PROBE = r"""
import os, sys, warnings
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
import torch
from deepspeed import comm
from chatrl.distributed import dist
dist.init_distributed()
out = torch.zeros(3)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    comm.all_gather_into_tensor(out, torch.tensor([1.0, 2.0, 3.0]))
print("GATHERED", out.tolist(), "WARNINGS", [str(w.message)[:60] for w in caught])
"""


def test_deepspeed_all_gather_calls_no_deprecated_torch_function():
    """ZeRO-3's parameter fetches go through DeepSpeed's all-gather, which called torch's deprecated
    ``all_gather_into_tensor`` (a FutureWarning per call site and process)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", _ALL_GATHER_PROBE, str(dist.free_port())], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"})
    line = [x for x in proc.stdout.splitlines() if x.startswith("GATHERED")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert line[0] == "GATHERED [1.0, 2.0, 3.0] WARNINGS []"


_GRADIENT_BUFFER_PROBE = r"""
import copy, json, sys
import torch
from transformers import OPTConfig, OPTForCausalLM
from chatrl.distributed import deepspeed_patches
from chatrl.distributed import dist
from chatrl.sizes import BatchSizes
info = dist.init_distributed()
cfg = OPTConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, dropout=0.0)
torch.manual_seed(0)
model = OPTForCausalLM(cfg)
model.unused = torch.nn.Parameter(torch.ones(3))  # never receives a gradient
fresh = copy.deepcopy(model)
config = dist.deepspeed_config(BatchSizes(2, 2, info.world_size), 0, dtype="fp32", gradient_clipping=0.5)

def build(m):  # two parameter groups, as chatrl builds them (no decay on biases and norms)
    named = list(m.named_parameters())
    groups = [{"params": [p for n, p in named if p.ndim > 1], "weight_decay": 0.1},
              {"params": [p for n, p in named if p.ndim <= 1], "weight_decay": 0.0}]
    return dist.initialize(m, config, dist.make_optimizer(groups, lr=1e-2, offload=False))

lean = build(model)
install = deepspeed_patches.gradients_in_buffer
deepspeed_patches.gradients_in_buffer = lambda engine, exclude=(): None  # as before: fresh gradients each step
own = build(fresh)
deepspeed_patches.gradients_in_buffer = install
buf = lean.gradient_buffer
def in_buffer(e):
    return all(p.grad is not None and p.grad.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
               for p in e.module.parameters())
views, norms = [in_buffer(lean)], []
g = torch.Generator().manual_seed(1)
for step in range(4):
    for micro in range(2):
        ids = torch.randint(2, 500, (info.world_size, 2, 12), generator=g)[info.rank]
        for e in (lean, own):
            loss = e(input_ids=ids, labels=ids).loss * 10
            e.backward(loss * float("nan") if step == 2 else loss)  # step 2: a non-finite gradient
            if e is lean:
                views.append(in_buffer(lean))
            e.step()
    norms.append([e.get_global_grad_norm() for e in (lean, own)])
    views.append(in_buffer(lean))
diff = max((p - q).abs().max().item() for p, q in zip(lean.module.parameters(), own.module.parameters(), strict=True))
own_grads = len({p.grad.untyped_storage().data_ptr() for p in own.module.parameters() if p.grad is not None})
if info.rank == 0:
    print("RESULT", json.dumps({"diff": diff, "views": views, "norms": norms, "own_grads": own_grads,
                                "skipped": [lean.skipped_steps, own.skipped_steps],
                                "buffer": buf.numel(), "params": sum(p.numel() for p in lean.module.parameters())}), flush=True)
dist.shutdown()
dist.exit_now()
"""


def test_zero0_gradients_are_the_allreduce_buffer_and_take_the_same_steps(tmp_path):
    """Two ranks, fp32 ZeRO-0, two micro-batches per optimizer step, clipping, a NaN step: the
    gradients are views of one buffer (:func:`~chatrl.distributed.deepspeed_patches.gradients_in_buffer`, all-reduced
    where it stands: no second copy of the gradients) before every backward, after it and after every
    step, and the engine reaches the same weights to the bit, with the same gradient norms, as one
    whose gradients are fresh tensors flattened into the kept all-reduce buffer at every step."""
    import json
    import math

    from tests.launch import run_ranks

    probe = tmp_path / "probe.py"
    probe.write_text(_GRADIENT_BUFFER_PROBE)
    out = run_ranks([str(probe)], nprocs=2, timeout=300)
    res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split(" ", 1)[1])
    assert all(res["views"]) and len(res["views"]) == 13, res["views"]
    assert res["buffer"] == res["params"]  # one buffer of every trainable parameter (the tied head counted once)
    assert res["own_grads"] == 0  # the other engine drops its gradients at each step (new ones at each backward)
    assert res["skipped"] == [1, 1]
    for step, (lean, own) in enumerate(res["norms"]):
        assert (math.isnan(lean) and math.isnan(own)) if step == 2 else (lean == own > 0.5), res["norms"]  # clipped
    assert res["diff"] == 0.0, res
