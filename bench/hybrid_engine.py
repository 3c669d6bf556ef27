"""Benchmark: generation throughput of plain ZeRO-3 ``generate`` against the hybrid engine.

Run it plainly and it launches itself over 2 CPU ranks (torchrun, gloo)::

    .venv/bin/python bench/hybrid_engine.py                      # the reference set-up (a few minutes)
    .venv/bin/python bench/hybrid_engine.py --hidden 128 --layers 2 --new-tokens 16   # quick

The reference set-up: a randomly initialised OPT (hidden 512, 8 layers, 8 heads, FFN 2048,
vocab 50272, fp32) trained under ZeRO-3 over 2 ranks, batch 8 per rank, prompts of 128 tokens,
128 new tokens with EOS disabled (``min_new_tokens = max_new_tokens``), greedy. Measured:

(a) ``plain``: the hybrid engine with ``enable_hybrid_engine=False``, i.e. HF ``generate(synced_gpus=True)``
    on the ZeRO-3 module (every layer all-gathered for every token);
(b) ``engine_tp1`` and (c) ``engine_tp2``: the hybrid engine, with the entry (gather + shard) and
    exit (release) counted in the wall time.

It prints one JSON object: new tokens/s over both ranks for each mode, the ratio of each to (a),
the engine's phase timings, and whether the greedy tokens of every mode agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50272)
    ap.add_argument("--batch", type=int, default=8, help="prompts per rank")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--modes", default="plain,engine_tp1,engine_tp2")
    ap.add_argument("--gather-group", type=int, default=8, help="--tp_gather_partition_size")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="training dtype of the actor (the inference copy and plain generation use it too)")
    ap.add_argument("--keep-copy", action="store_true",
                    help="--release_inference_cache off: exit keeps the copy (the flag's default)")
    return ap.parse_args(argv)


def _launch(argv) -> int:
    args = _args(argv)
    import torch

    from bench._launch import self_launch

    accelerator = "cuda" if torch.cuda.is_available() else "cpu"  # one rank per GPU there (--nprocs)
    env = {"DS_ACCELERATOR": accelerator, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = self_launch(__file__, args.nprocs, argv, env, capture=True)
    result = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not result:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-6000:])
        return proc.returncode or 1
    print(result[-1])
    return 0


def _worker(argv) -> None:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    from chatrl.config import HybridEngineConfig
    from chatrl.distributed import dist as cdist
    from chatrl.hybrid_engine import HybridEngine
    from chatrl.sizes import BatchSizes

    args = _args(argv)
    info = cdist.init_distributed()
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                    num_attention_heads=args.heads, ffn_dim=4 * args.hidden, word_embed_proj_dim=args.hidden,
                    max_position_embeddings=max(2048, args.prompt_tokens + args.new_tokens),
                    do_layer_norm_before=True, dropout=0.0, pad_token_id=1, eos_token_id=2, bos_token_id=2)
    model = OPTForCausalLM(cfg).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    config = cdist.deepspeed_config(BatchSizes(args.batch, 1, info.world_size), zero_stage=3, dtype=args.dtype)
    engine = cdist.initialize(model, config, torch.optim.AdamW(model.parameters(), lr=1e-5))
    gen = torch.Generator().manual_seed(1 + info.rank)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_tokens), generator=gen)
    mask = torch.ones_like(ids)
    n = args.new_tokens
    kw = dict(max_new_tokens=n, min_new_tokens=n, eos_token_id=2, pad_token_id=1)
    out: dict = {"setup": {"model": "opt", "params": n_params, "hidden": args.hidden, "layers": args.layers,
                           "vocab": args.vocab, "ranks": info.world_size, "zero_stage": 3,
                           "batch_per_rank": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": n,
                           "dtype": args.dtype, "release_inference_cache": not args.keep_copy,
                           "threads_per_rank": None}}
    seqs = {}
    for mode in args.modes.split(","):
        he = (HybridEngine(engine, HybridEngineConfig(enable_hybrid_engine=False)) if mode == "plain"
              else HybridEngine(engine, HybridEngineConfig(
                  enable_hybrid_engine=True, inference_tp_size=int(mode[-1]),
                  tp_gather_partition_size=args.gather_group, release_inference_cache=not args.keep_copy)))
        out["setup"]["threads_per_rank"] = he.threads_per_rank
        cdist.barrier()
        t0 = time.perf_counter()
        he.enter_inference()
        seqs[mode] = he.generate(ids, mask, **kw)
        he.exit_inference()
        cdist.barrier()
        wall = time.perf_counter() - t0
        tokens = info.world_size * args.batch * n
        out[mode] = {"seconds": round(wall, 3), "new_tokens_per_s": round(tokens / wall, 2),
                     "timings": {k: round(v, 3) for k, v in he.timings.items()}}
    plain = out.get("plain", {}).get("new_tokens_per_s")
    if plain:
        for mode in seqs:
            out[mode]["ratio_to_plain"] = round(out[mode]["new_tokens_per_s"] / plain, 2)
    modes = list(seqs)
    same = all(torch.equal(seqs[modes[0]], seqs[m]) for m in modes[1:])
    out["tokens_equal_across_modes"] = bool(cdist.all_reduce_sum(torch.tensor(int(not same))).item() == 0)
    if info.is_main:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        from chatrl.distributed.dist import run_program

        run_program(lambda: _worker(sys.argv[1:]))
    else:
        sys.exit(_launch(sys.argv[1:]))
