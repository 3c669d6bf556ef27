"""Attention on this CPU in bf16 models: torch's SDPA in bf16 against chatrl's float32 island, printed as JSON.

A bf16 model on CPU attends with :data:`chatrl.models.precision.FP32_SDPA`: transformers' SDPA on float32
copies of the bf16 queries, keys and values, its output cast back to bf16. This benchmark times one
attention forward + backward (the training step's) three ways for each shape the benchmarks' models
use, on one thread (what one rank uses on this 2-core machine):

* ``bf16_sdpa``: torch's SDPA on the bf16 tensors (what transformers' ``sdpa`` runs in a bf16 model);
* ``fp32_island``: chatrl's island on the same bf16 tensors (the casts included);
* ``fp32_sdpa``: SDPA on float32 tensors (an fp32 model's attention).

Shapes ``(batch, heads, length, head width)``, with the boolean padding mask transformers passes
for a padded batch (rows left-padded by up to a quarter of the length), or causal without a mask:
the small set-up's reward model (4 pairs of up to 256 tokens, 4 heads of 16), the larger PPO set-up's
actor (4 rollouts of 192 tokens, 8 heads of 64), and longer rows. Each figure is the median of
``--repeats`` timings (milliseconds) taken in turn, the three ways interleaved; the ratios are the
bf16 SDPA's time over each other way's (above 1: faster than bf16 SDPA).

    .venv/bin/python bench/attention_cpu.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {"small set-up reward model": (8, 4, 256, 16), "larger PPO actor": (4, 8, 192, 64),
          "long rows, width 64": (4, 8, 512, 64), "long rows, width 128": (2, 16, 1024, 128)}


def _inputs(b: int, h: int, n: int, d: int, masked: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = None
    if masked:
        pads = torch.randint(0, n // 4, (b,), generator=g)
        keep = torch.arange(n)[None, :] >= pads[:, None]
        mask = (torch.ones(n, n, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]) | torch.eye(
            n, dtype=torch.bool)
    return q, k, v, mask


def _time(fn, q, k, v, mask) -> float:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    out = fn(q, k, v, mask)
    out.float().sum().backward()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from chatrl.models.precision import _sdpa_in_fp32

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7, help="timings per way and shape (default 7; each row is also "
                                                          "printed to stderr as it finishes)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: one rank's share here)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    module = torch.nn.Module()
    module.is_causal = True
    ways = {"bf16_sdpa": lambda q, k, v, m: sdpa_attention_forward(module, q, k, v, m)[0],
            "fp32_island": lambda q, k, v, m: _sdpa_in_fp32(module, q, k, v, m)[0],
            "fp32_sdpa": lambda q, k, v, m: sdpa_attention_forward(module, q.float(), k.float(), v.float(), m)[0]}
    rows = []
    for name, shape in SHAPES.items():
        for masked in (True, False):
            q, k, v, mask = _inputs(*shape, masked)
            for fn in ways.values():  # warm-up
                _time(fn, q, k, v, mask)
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(a.repeats):
                for w, fn in ways.items():
                    times[w].append(_time(fn, q, k, v, mask))
            ms = {w: round(statistics.median(t), 2) for w, t in times.items()}
            rows.append({"shape": name, "b_h_n_d": list(shape), "mask": "padding" if masked else "causal",
                         "ms": ms, "bf16_sdpa_over": {w: round(ms["bf16_sdpa"] / ms[w], 2) for w in ways
                                                     if w != "bf16_sdpa"}})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    cpu = torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None
    print(json.dumps({"bench": "attention_cpu", "date": time.strftime("%Y-%m-%d"), "threads": a.threads, "cpu": cpu,
                      "torch": torch.__version__, "repeats": a.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
