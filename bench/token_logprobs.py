"""The answer tokens' log-probs, forward and backward: chatrl's chunked ``token_logprobs`` against
autograd through the plain formula (the logits up-cast whole to float32, divided by the temperature,
gather minus logsumexp one row at a time: chatrl's path before), printed as JSON.

Per shape and dtype, interleaved, the median of ``--repeats`` timings of each path: the training
pass (forward with the entropy, as step 3's first pass, then backward) and the no-grad pass (the
reference's log-probs). ``--processes 2`` times the same in two processes at once, one thread each,
as the two ranks of step 3 on this 2-core machine share its memory bandwidth (the figures are
process 0's). The default shapes: the larger PPO set-up (4 rollouts of 64 + 1 answer positions,
OPT's vocabulary 50272) and DeepSpeed-Chat's default micro-batch (16 rollouts of 256 answer tokens).

    .venv/bin/python bench/token_logprobs.py
    .venv/bin/python bench/token_logprobs.py --processes 2 --out bench/results/token_logprobs_$(date +%F).json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatrl.logprobs import float_dtype, token_logprobs  # noqa: E402

SHAPES = {"larger PPO set-up": (4, 65, 50272), "DeepSpeed-Chat micro-batch": (16, 256, 50272)}


def plain(logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: bool):
    """chatrl's path before: the whole tensor up-cast and divided, then a row at a time."""
    z = logits.to(float_dtype(logits)) / temperature
    logp, ent = [], []
    for row, y in zip(z, labels, strict=True):
        lse = torch.logsumexp(row, -1)
        logp.append(row.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse)
        if entropy:
            ent.append(lse - torch.linalg.vecdot((row - lse.unsqueeze(-1)).exp_(), row))
    return (torch.stack(logp), torch.stack(ent)) if entropy else torch.stack(logp)


def chunked(logits, labels, temperature, entropy):
    return token_logprobs(logits, labels, temperature, entropy)


def one(fn, base: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor, grad: bool) -> float:
    x = base.detach().requires_grad_(grad)
    t0 = time.perf_counter()
    if grad:
        logp, _ = fn(x, labels, 0.7, True)
        logp.backward(upstream)
    else:
        with torch.no_grad():
            fn(x, labels, 0.7, False)
    return time.perf_counter() - t0


def measure(shape, dtype: torch.dtype, repeats: int, barrier=None) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(*shape, generator=g) * 3).to(dtype)
    labels = torch.randint(0, shape[-1], shape[:2], generator=g)
    upstream = torch.randn(shape[:2], generator=g)
    out = {}
    for grad in (True, False):
        times = {"plain": [], "chatrl": []}
        for i in range(repeats + 1):
            for name, fn in (("plain", plain), ("chatrl", chunked)):
                if barrier is not None:
                    barrier.wait()
                t = one(fn, base, labels, upstream, grad)
                if i:  # the first is the warm-up
                    times[name].append(t)
        key = "train_pass" if grad else "no_grad_pass"
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[key] = {"plain_ms": round(med["plain"], 1), "chatrl_ms": round(med["chatrl"], 1),
                    "speedup": round(med["plain"] / med["chatrl"], 2)}
    return out


def _worker(rank, shape, dtype, repeats, barrier, queue):
    result = measure(shape, dtype, repeats, barrier)
    if rank == 0:
        queue.put(result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--processes", type=int, default=1, choices=[1, 2], help="2: both cores at once, as two ranks")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    result = {"bench": "token_logprobs", "date": time.strftime("%Y-%m-%d"), "threads_per_process": 1,
              "processes": a.processes, "temperature": 0.7, "repeats": a.repeats, "cases": []}
    ctx = mp.get_context("spawn")
    for name, shape in SHAPES.items():
        for dt in a.dtypes:
            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
            if a.processes == 1:
                figures = measure(shape, dtype, a.repeats)
            else:
                barrier, queue = ctx.Barrier(a.processes), ctx.Queue()
                procs = [ctx.Process(target=_worker, args=(r, shape, dtype, a.repeats, barrier, queue))
                         for r in range(a.processes)]
                for proc in procs:
                    proc.start()
                figures = queue.get()
                for proc in procs:
                    proc.join()
            result["cases"].append({"shape": name, "logits": list(shape), "dtype": dt, **figures})
            print(json.dumps(result["cases"][-1]), file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
