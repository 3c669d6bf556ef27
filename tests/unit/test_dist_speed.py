"""Parity of the fast paths in :mod:`chatrl.dist` against the plain ones (issue 15): the fused AdamW
against torch's for-loop AdamW, and the CPU thread placement."""

import os

import pytest
import torch

from chatrl import dist


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


_MUON_PROBE = r"""
import os, sys
os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
import pytest
import torch
from chatrl import dist
dist.init_distributed()
stage = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
opt = dist.make_optimizer([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-2, offload=False)
engine = dist.initialize(model, dist.deepspeed_config(dist.BatchSizes(2, 1, 1), stage), opt)
before = [p.detach().clone() for p in engine.module.parameters()] if stage < 3 else None
loss = engine(torch.randn(2, 8)).pow(2).sum()
engine.backward(loss)
engine.step()
stubs = [sys.modules.get(m) for m in dist._DEEPSPEED_MUON]
print("MODULES", int("torch._inductor.compile_fx" in sys.modules),
      int(all(m is not None and m.MuonWithAuxAdam is dist._NoDeepSpeedMuon for m in stubs)), float(loss))
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
    dist._stub_deepspeed_muon()
    import sys

    optimizer, kernels = (sys.modules[m] for m in dist._DEEPSPEED_MUON)
    if optimizer.MuonWithAuxAdam is dist._NoDeepSpeedMuon:  # not when this process imported DeepSpeed's Muon
        with pytest.raises(RuntimeError, match="Muon optimizer is not supported"):
            optimizer.MuonWithAuxAdam([])
        with pytest.raises(RuntimeError, match="Muon optimizer is not supported"):
            kernels.muon_update(None, None)
