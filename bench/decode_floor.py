"""Benchmark: how close one decoding step of the hybrid engine comes to this CPU's floor.

A decode step must read every weight matrix once (the decoder layers and the LM head) and the KV
cache of every layer. This script times, on one thread, (1) a decode step of the engine's loop
(``chatrl.hybrid_engine.decode``) on the reference model of ``bench/hybrid_engine.py`` (OPT hidden
512, 8 layers, vocab 50272, fp32, 8 rows, 128-token prompts), and (2) the same step's pieces run
bare: the 48 layer matmuls over distinct weights, the LM-head matmul and the attention over a
half-full cache. The sum of (2) is the floor of (1) for this arithmetic; the prefill is timed too.
The LM head is timed in both forms, ``h @ Wᵀ`` and ``W @ hᵀ`` (the floor takes the faster);
``--dtype bf16`` runs the model and the pieces in bf16, the model attending as chatrl's loaders make it
attend on CPU (in fp32, :func:`chatrl.precision.attention_implementation`) and the floor's attention
timed the same way (float32 copies of the query and the cache, the output cast back).

    .venv/bin/python bench/decode_floor.py
    .venv/bin/python bench/decode_floor.py --dtype bf16 --rows 4 --new-tokens 64   # step 3's larger set-up

It prints one JSON object (milliseconds per step, the ratio of step to floor, and the best
possible engine ratio to plain ZeRO-3 generation for a given plain time, ``--plain-seconds``).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _ms(fn, n: int = 10) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="rows decoded together (default 8)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's weights (default fp32)")
    ap.add_argument("--bf16-sdpa", action="store_true",
                    help="--dtype bf16: attend with transformers' SDPA in bf16 instead of chatrl's fp32 attention")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of every row (default 128)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per row (default 128)")
    ap.add_argument("--plain-seconds", type=float, default=None,
                    help="plain ZeRO-3 generation time of bench/hybrid_engine.py in the same conditions")
    args = ap.parse_args(argv)
    from transformers import OPTConfig, OPTForCausalLM

    from chatrl.hybrid_engine.decode import GenerationSettings, GroupBatch, TPGroup, decode
    from chatrl.precision import FP32_SDPA, attention_implementation, attention_kwargs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=50272, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, ffn_dim=2048,
                    word_embed_proj_dim=512, max_position_embeddings=2048, dropout=0.0,
                    **({} if args.bf16_sdpa else attention_kwargs(args.dtype, "cpu")))
    island = not args.bf16_sdpa and attention_implementation(args.dtype, "cpu") == FP32_SDPA
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = OPTForCausalLM(cfg).to(dtype).eval()
    rows, p, n = args.rows, args.prompt_tokens, args.new_tokens
    ids = torch.randint(3, cfg.vocab_size, (rows, p))
    batch = GroupBatch(ids, torch.ones_like(ids), 0, rows, 0, (rows,))

    def run(new):
        s = GenerationSettings(max_new_tokens=new, min_new_tokens=new, eos_token_ids=(2,), pad_token_id=1)
        return decode(model, batch, s, TPGroup())

    with torch.inference_mode():
        prefill = _ms(lambda: run(1), n=3)
        total = _ms(lambda: run(n), n=1)
        step = (total - prefill) / (n - 1)
        lin = [m for m in model.model.decoder.layers.modules() if isinstance(m, torch.nn.Linear)]
        inputs = {m: torch.randn(rows, m.in_features, dtype=dtype) for m in lin}
        layers = _ms(lambda: [m(inputs[m]) for m in lin])
        hidden = torch.randn(rows, cfg.hidden_size, dtype=dtype)
        w = model.lm_head.weight
        head_forms = {"h_Wt": _ms(lambda: torch.nn.functional.linear(hidden, w), n=20),
                      "W_ht": _ms(lambda: torch.mm(w, hidden.t()), n=20)}
        head = min(head_forms.values())
        heads, d, kv = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads, p + n // 2
        q = torch.randn(rows, heads, 1, d, dtype=dtype)
        caches = [(torch.randn(rows, heads, kv, d, dtype=dtype), torch.randn(rows, heads, kv, d, dtype=dtype))
                  for _ in range(cfg.num_hidden_layers)]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if island:  # chatrl's attention on CPU for bf16: float32 copies in, the model's dtype out
            attention = _ms(lambda: [sdpa(q.float(), k.float(), v.float()).to(dtype) for k, v in caches])
        else:
            attention = _ms(lambda: [sdpa(q, k, v) for k, v in caches])
    floor = layers + head + attention
    out = {"setup": {"model": "opt", "hidden": 512, "layers": 8, "vocab": 50272, "dtype": args.dtype, "attention": "fp32 copies" if island else "sdpa", "rows": rows,
                     "prompt_tokens": p, "new_tokens": n, "threads": 1},
           "ms": {"prefill": round(prefill, 1), "decode_step": round(step, 2), "floor_step": round(floor, 2),
                  "floor_layers": round(layers, 2), "floor_lm_head": round(head, 2),
                  "floor_attention": round(attention, 2),
                  "lm_head_forms": {k: round(v, 2) for k, v in head_forms.items()}},
           "step_over_floor": round(step / floor, 3),
           "best_engine_seconds": round((prefill + (n - 1) * floor) / 1e3, 2)}
    if args.plain_seconds:
        out["best_possible_ratio_to_plain"] = round(args.plain_seconds / out["best_engine_seconds"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
