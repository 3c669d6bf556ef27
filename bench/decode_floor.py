"""Benchmark: how close one decoding step of the hybrid engine comes to this CPU's floor.

A decode step must read every weight matrix once (the decoder layers and the LM head) and the KV
cache of every layer. This script times, on one thread, (1) a decode step of the engine's loop
(``chatrl.hybrid_engine.decode``) on the reference model of ``bench/hybrid_engine.py`` (OPT hidden
512, 8 layers, vocab 50272, fp32, 8 rows, 128-token prompts), and (2) the same step's pieces run
bare: the 48 layer matmuls over distinct weights, the LM-head matmul and the attention over a
half-full cache. The sum of (2) is the floor of (1) for this arithmetic; the prefill is timed too.
The LM head is timed in both forms, ``h @ Wᵀ`` and ``W @ hᵀ``, and bf16 products also with their
weights reordered once for oneDNN (``chatrl.hybrid_engine.decode.PackedWeight``, the loop's form on
CPU); the floor takes the fastest;
``--dtype bf16`` runs the model and the pieces in bf16, the model attending as chatrl's loaders make it
attend on CPU (in fp32, :func:`chatrl.models.precision.attention_implementation`) and the floor's attention
timed the same way (float32 copies of the query and the cache, the output cast back).

    .venv/bin/python bench/decode_floor.py
    .venv/bin/python bench/decode_floor.py --dtype bf16 --rows 4 --new-tokens 64   # step 3's larger set-up

``--model`` takes a real model instead (a folder or a ``chatrl.models.model_zoo`` name, loaded as chatrl's
steps load it, ``chatrl.models.causal_lm.load_causal_lm``): the floor's pieces then follow its shape (every
linear layer of its decoder layers, its LM head, attention over its key/value heads with grouped-query
heads shared). A second floor is printed beside the arithmetic one: reading the decoder layers'
weights, the LM head and the KV cache once at this thread's measured memory bandwidth (a 256 MiB
buffer summed, the best of 5), which no decode step can beat.

    .venv/bin/python bench/decode_floor.py --model smollm2-135m-instruct --dtype bf16 --rows 8 \
        --prompt-tokens 48 --new-tokens 32     # GRPO's rollout batch on SmolLM2: 2 prompts x 4 answers

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


def read_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second this thread reads from memory: a ``mib`` MiB float32 buffer summed, best of ``repeats``."""
    buf = torch.ones(mib * 2**18, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def _layers(model) -> torch.nn.ModuleList:
    """The decoder layers of an HF causal LM (Llama-like ``model.layers`` or OPT's ``model.decoder.layers``)."""
    body = model.model
    return body.layers if hasattr(body, "layers") else body.decoder.layers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="rows decoded together (default 8)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's weights (default fp32)")
    ap.add_argument("--bf16-sdpa", action="store_true",
                    help="--dtype bf16: attend with transformers' SDPA in bf16 instead of chatrl's fp32 attention")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of every row (default 128)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per row (default 128)")
    ap.add_argument("--model", default=None,
                    help="a real model (folder or chatrl.models.model_zoo name) instead of the random OPT")
    ap.add_argument("--plain-seconds", type=float, default=None,
                    help="plain ZeRO-3 generation time of bench/hybrid_engine.py in the same conditions")
    args = ap.parse_args(argv)
    from transformers import OPTConfig, OPTForCausalLM

    from chatrl.hybrid_engine.decode import (
        GenerationSettings,
        GroupBatch,
        PackedWeight,
        TPGroup,
        can_prepack,
        decode,
    )
    from chatrl.models.precision import FP32_SDPA, attention_implementation, attention_kwargs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.model:
        from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
        from chatrl.models.model_zoo import resolve

        path = str(resolve(args.model)) if not str(args.model).startswith(("/", ".")) else args.model
        model = load_causal_lm(path, load_tokenizer(path, padding_side="left"), args.dtype).eval()
        cfg = model.config
        island = getattr(cfg, "_attn_implementation", None) == FP32_SDPA
        name = f"{cfg.model_type} {path}"
    else:
        cfg = OPTConfig(vocab_size=50272, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, ffn_dim=2048,
                        word_embed_proj_dim=512, max_position_embeddings=2048, dropout=0.0,
                        **({} if args.bf16_sdpa else attention_kwargs(args.dtype, "cpu")))
        island = not args.bf16_sdpa and attention_implementation(args.dtype, "cpu") == FP32_SDPA
        model = OPTForCausalLM(cfg).to(dtype).eval()
        name = "opt"
    rows, p, n = args.rows, args.prompt_tokens, args.new_tokens
    vocab = model.lm_head.weight.shape[0]
    ids = torch.randint(3, min(vocab, cfg.vocab_size), (rows, p))
    batch = GroupBatch(ids, torch.ones_like(ids), 0, rows, 0, (rows,))

    def run(new):
        s = GenerationSettings(max_new_tokens=new, min_new_tokens=new, eos_token_ids=(2,), pad_token_id=1)
        return decode(model, batch, s, TPGroup())

    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    with torch.inference_mode():
        prefill = _ms(lambda: run(1), n=3)
        total = _ms(lambda: run(n), n=1)
        step = (total - prefill) / (n - 1)
        lin = [m for m in _layers(model).modules() if isinstance(m, torch.nn.Linear)]
        inputs = {m: torch.randn(rows, m.in_features, dtype=dtype) for m in lin}
        layer_forms = {"F.linear": _ms(lambda: [m(inputs[m]) for m in lin])}
        hidden = torch.randn(rows, cfg.hidden_size, dtype=dtype)
        w = model.lm_head.weight
        head_forms = {"h_Wt": _ms(lambda: torch.nn.functional.linear(hidden, w), n=20),
                      "W_ht": _ms(lambda: torch.mm(w, hidden.t()), n=20)}
        if can_prepack(w):  # the decode loop's form for bf16 on CPU: weights reordered once for oneDNN
            packed = {m: PackedWeight(m.weight, m.bias, rows) for m in lin}
            layer_forms["prepacked"] = _ms(lambda: [packed[m].linear(inputs[m]) for m in lin])
            head_packed = PackedWeight(w, None, rows)
            head_forms["prepacked"] = _ms(lambda: head_packed.linear(hidden), n=20)
        layers = min(layer_forms.values())
        head = min(head_forms.values())
        kv = p + n // 2
        q = torch.randn(rows, heads, 1, d, dtype=dtype)
        caches = [(torch.randn(rows, kv_heads, kv, d, dtype=dtype), torch.randn(rows, kv_heads, kv, d, dtype=dtype))
                  for _ in range(cfg.num_hidden_layers)]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = {"enable_gqa": True} if kv_heads != heads else {}
        if island:  # chatrl's attention on CPU for bf16: float32 copies in, the model's dtype out
            attention = _ms(lambda: [sdpa(q.float(), k.float(), v.float(), **gqa).to(dtype) for k, v in caches])
        else:
            attention = _ms(lambda: [sdpa(q, k, v, **gqa) for k, v in caches])
        bandwidth = read_bandwidth()
    size = torch.finfo(dtype).bits // 8
    weight_bytes = sum(t.numel() for t in _layers(model).parameters()) * size + w.numel() * w.element_size()
    kv_bytes = 2 * cfg.num_hidden_layers * rows * kv_heads * kv * d * size
    bandwidth_floor = (weight_bytes + kv_bytes) / bandwidth * 1e3
    floor = layers + head + attention
    out = {"setup": {"model": name, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": heads,
                     "kv_heads": kv_heads, "vocab": vocab, "dtype": args.dtype,
                     "attention": "fp32 copies" if island else "sdpa", "rows": rows,
                     "prompt_tokens": p, "new_tokens": n, "threads": 1},
           "ms": {"prefill": round(prefill, 1), "decode_step": round(step, 2), "floor_step": round(floor, 2),
                  "floor_layers": round(layers, 2), "floor_lm_head": round(head, 2),
                  "floor_attention": round(attention, 2),
                  "lm_head_forms": {k: round(v, 2) for k, v in head_forms.items()},
                  "layer_forms": {k: round(v, 2) for k, v in layer_forms.items()}},
           "step_over_floor": round(step / floor, 3),
           "bandwidth": {"read_gb_per_s": round(bandwidth / 1e9, 2), "weight_mb": round(weight_bytes / 1e6, 1),
                         "kv_cache_mb": round(kv_bytes / 1e6, 1), "floor_step_ms": round(bandwidth_floor, 2)},
           "step_over_bandwidth_floor": round(step / bandwidth_floor, 3),
           "best_engine_seconds": round((prefill + (n - 1) * floor) / 1e3, 2)}
    if args.plain_seconds:
        out["best_possible_ratio_to_plain"] = round(args.plain_seconds / out["best_engine_seconds"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
