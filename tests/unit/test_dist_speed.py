"""Parity of the fast paths in :mod:`chatrl.dist` against the plain ones (issue 15): the fused AdamW
against torch's for-loop AdamW, and the CPU thread placement."""

import os

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
