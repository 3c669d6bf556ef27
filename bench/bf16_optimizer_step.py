"""Benchmark: one bf16 ZeRO-0 optimizer step, DeepSpeed's own against chatrl's
(:func:`chatrl.distributed.deepspeed_patches.lean_bf16_zero0_step`), and the gradient flattening of the
ZeRO-0 all-reduce, DeepSpeed's (new memory) against chatrl's kept buffer
(:func:`chatrl.distributed.deepspeed_patches.kept_allreduce_buffer`).

One process, one thread (what a rank has on this 2-core machine), a one-rank gloo group. For each
model shape, random OPT weights in bf16 under a DeepSpeed engine built as chatrl builds trained
models (fused AdamW, ZeRO-0, bf16, gradient clipping 1.0), random bf16 gradients, then the two
steps alternated ``--repeats`` times (the first pair dropped as warm-up); the same for the two
flattenings. Prints one JSON object: median milliseconds and DeepSpeed's time over chatrl's.

    .venv/bin/python bench/bf16_optimizer_step.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: name → (hidden, layers, FFN, vocabulary): the larger PPO set-up's actor, the peer benchmark's reward model
SHAPES = {"opt_h512_8_layers": (512, 8, 2048, 50272), "opt_h64_2_layers": (64, 2, 256, 50269)}


def measure(shape: tuple[int, int, int, int], repeats: int) -> dict:
    import torch
    from torch._utils import _flatten_dense_tensors
    from transformers import OPTConfig, OPTForCausalLM

    from chatrl.distributed import dist
    from chatrl.sizes import BatchSizes

    hidden, layers, ffn, vocab = shape
    cfg = OPTConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64),
                    ffn_dim=ffn, max_position_embeddings=1024, word_embed_proj_dim=hidden)
    model = OPTForCausalLM(cfg).to(torch.bfloat16)
    config = dist.deepspeed_config(BatchSizes(4, 1, 1), 0, dtype="bf16", gradient_clipping=1.0)
    engine = dist.initialize(model, config, dist.make_optimizer([{"params": list(model.parameters())}], lr=1e-6,
                                                                offload=False))
    opt = engine.optimizer
    chatrl_step = opt.step
    deepspeed_step = types.MethodType(type(opt).step.deepspeed_step, opt)
    grads = []
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
        grads.append(p.grad)
    chatrl_flatten = engine.flatten
    times: dict[str, list[float]] = {"step_deepspeed": [], "step_chatrl": [], "flatten_deepspeed": [],
                                     "flatten_chatrl": []}
    for i in range(repeats + 1):
        for name, f in (("step_deepspeed", deepspeed_step), ("step_chatrl", chatrl_step),
                        ("flatten_deepspeed", lambda: _flatten_dense_tensors(grads)),
                        ("flatten_chatrl", lambda: chatrl_flatten(grads))):
            t0 = time.perf_counter()
            f()
            if i:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            **{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
            "step_deepspeed_over_chatrl": round(med["step_deepspeed"] / med["step_chatrl"], 2),
            "flatten_deepspeed_over_chatrl": round(med["flatten_deepspeed"] / med["flatten_chatrl"], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=8, help="alternations per shape (after one warm-up)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    a = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from chatrl.distributed import dist

    dist.init_distributed()
    torch.set_num_threads(1)
    result = {"bench": "bf16_optimizer_step", "date": time.strftime("%Y-%m-%d"), "threads": 1,
              "repeats": a.repeats, "shapes": {name: measure(SHAPES[name], a.repeats) for name in a.shapes}}
    print(json.dumps(result, indent=1), flush=True)
    dist.shutdown()
    dist.exit_now()


if __name__ == "__main__":
    main()
