"""Benchmark: gloo's all-reduce, reduce-scatter and all-gather of the same bytes, and DeepSpeed's
reduce-scatter as chatrl installs it (:func:`chatrl.distributed.deepspeed_patches.gloo_reduce_scatter_by_all_reduce`).

Run it plainly and it launches itself over 2 CPU ranks (torchrun, gloo)::

    .venv/bin/python bench/collectives.py                  # 0.25 MB to 204 MB, fp32
    .venv/bin/python bench/collectives.py --sizes_mb 4 52  # chosen sizes

For each size (the full tensor, ``world × n`` elements) it times, as the median of ``--repeats``
calls between barriers: ``all_reduce`` of the tensor, ``reduce_scatter_tensor`` of it into ``n``,
``all_gather_into_tensor`` of ``n`` into it (torch's gloo collectives), and ``deepspeed.comm``'s
``reduce_scatter_fn`` (the entry point ZeRO-3 uses, an all-reduce once chatrl has initialised the
group). It prints one JSON object: milliseconds per call, and each collective's time as a ratio to
all-reduce of the same bytes, per size. Interpret only on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes_mb", type=float, nargs="+", default=[0.25, 1, 4, 16, 52, 104, 204],
                    help="full-tensor sizes, MB (fp32)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--nproc", type=int, default=2, help="ranks on this machine (torchrun)")
    return ap.parse_args(argv)


def _measure(args) -> None:
    import torch
    from deepspeed import comm

    from chatrl.distributed import dist

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's op loader prints there; stdout is the JSON
        info = dist.init_distributed()
    torch_dist = torch.distributed

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            torch_dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e3 * statistics.median(times)

    rows = []
    for mb in args.sizes_mb:
        n = int(mb * 1e6 / 4) // info.world_size
        full, part = torch.randn(n * info.world_size), torch.randn(n)
        ms = {
            "all_reduce": timed(lambda f=full: torch_dist.all_reduce(f)),
            "reduce_scatter_tensor": timed(lambda f=full, p=part: torch_dist.reduce_scatter_tensor(p, f)),
            "all_gather_into_tensor": timed(lambda f=full, p=part: torch_dist.all_gather_into_tensor(f, p)),
            "deepspeed_reduce_scatter_fn": timed(lambda f=full, p=part: comm.reduce_scatter_fn(p, f)),
        }
        rows.append({"mb": round(n * info.world_size * 4 / 1e6, 2), "ms": {k: round(v, 2) for k, v in ms.items()},
                     "vs_all_reduce": {k: round(v / ms["all_reduce"], 2) for k, v in ms.items()}})
    if info.is_main:
        print(json.dumps({"backend": torch_dist.get_backend(), "world_size": info.world_size,
                          "chatrl_reduce_scatter": bool(getattr(comm.comm.cdb, "_chatrl_reduce_scatter", False)),
                          "threads_per_rank": torch.get_num_threads(), "sizes": rows}, indent=1), flush=True)


def main(argv=None) -> None:
    args = _args(argv)
    if "RANK" in os.environ:
        from chatrl.distributed.dist import run_program

        run_program(lambda: _measure(args))
    from bench._launch import self_launch

    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    sys.exit(self_launch(__file__, args.nproc, argv if argv is not None else sys.argv[1:], env).returncode)


if __name__ == "__main__":
    main()
