"""Batch-shape invariance through the real training loops: one launch runs every configuration.

Usage (1 rank, or 2 under torchrun): invariance_worker.py RESULT_DIR WORK_DIR [--zero 0 2 3] [--only NAME ...]

On one rank it runs each program with micro-batch 4 × accumulation 1 and micro-batch 1 ×
accumulation 4; on two ranks with micro-batch 1 × accumulation 2 per rank: the same global batch of 4
(steps 1, 2 and DPO: the first 4 examples of the shuffled order; step 3: 4 rollouts of the same
prompts, answered by a sampler that depends on the prompt alone). Each run is one optimizer step of
the step's own loop (:mod:`tests.stages.loop_runs`); rank 0 saves the full first-step gradients of
every trained engine to ``RESULT_DIR/NAME-zeroZ-LAYOUT.pt``.
"""

import argparse
import time
from pathlib import Path

import torch

from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from tests.stages.loop_runs import base_argv, run

#: name → (program, extra flags, ZeRO stages or None for all): each critic-free aggregation on GRPO, PPO with
#: its default; and a control that must differ, DeepSpeed-Chat's split-dependent micro-batch mean (ZeRO-0 only)
CONFIGS = {
    "sft": ("sft", [], None),
    "reward": ("reward", [], None),
    "dpo": ("dpo", [], None),
    "ppo": ("ppo", [], None),
    "grpo-token-mean": ("grpo", ["--loss_agg_mode", "token-mean"], None),
    "grpo-seq-mean-token-mean": ("grpo", ["--loss_agg_mode", "seq-mean-token-mean"], None),
    "grpo-seq-mean-token-sum-norm": ("grpo", ["--loss_agg_mode", "seq-mean-token-sum-norm"], None),
    "control-ppo-micro-batch-token-mean": ("ppo", ["--loss_agg_mode", "micro-batch-token-mean"], (0,)),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("work")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 2, 3])
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument("--model", default=None)
    a = p.parse_args()
    info = dist.init_distributed()
    result, work = Path(a.result), Path(a.work)
    layouts = {1: [("mb4xacc1", 4, 1), ("mb1xacc4", 1, 4)], 2: [("2xmb1xacc2", 1, 2)]}[info.world_size]
    times = {}
    for name, (program, extra, zeros) in CONFIGS.items():
        if a.only and name not in a.only:
            continue
        for zero in (z for z in a.zero if zeros is None or z in zeros):
            for layout, micro, gas in layouts:
                t0 = time.time()
                out = work / f"{name}-zero{zero}-{layout}"
                kw = {"model": a.model} if a.model else {}
                argv = base_argv(program, work, out, micro=micro, gas=gas, zero=zero, steps=1, extra=extra, **kw)
                got = run(program, argv, fixed_sampler=True)
                if info.is_main:
                    torch.save({"grads": got["grads"], "rows": got["rows"]}, result / f"{name}-zero{zero}-{layout}.pt")
                times[f"{name}-zero{zero}-{layout}"] = time.time() - t0
    if info.is_main:
        print("RUN TIMES " + " ".join(f"{k}={v:.1f}s" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    run_program(main)
