"""Held-out exact-match accuracy of a causal LM on prompt rows with a reference answer
(``scripts/make_arith_task.py``'s ``eval.jsonl``): greedy answers, scored by the built-in
``exact_match`` reward. Prints one JSON line ``{"accuracy", "n", "model"}``.

Usage::

    python scripts/eval_exact_match.py --model OUTPUT/step3_rlhf/actor --data data/arith/eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def evaluate(model_dir: str, rows: list[dict], max_new_tokens: int = 6, batch_size: int = 64,
             dtype: str | None = None) -> float:
    """Share of ``rows`` whose greedy answer's final number equals ``row["reference"]``; the model in
    ``dtype`` (``fp32``, ``bf16``; default: the dtype it was saved in)."""
    from transformers import AutoModelForCausalLM

    from chatrl.data.formatting import encode_prompt
    from chatrl.models import load_tokenizer, torch_dtype
    from chatrl.rewards.builtin import exact_match

    tok = load_tokenizer(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype) if dtype else "auto").eval()
    hits = 0.0
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        ids = [encode_prompt(tok, [{"role": "user", "content": r["prompt"]}]) for r in part]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        answers = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        hits += sum(exact_match([r["prompt"] for r in part], answers, [{"reference": r["reference"]} for r in part]))
    return hits / max(len(rows), 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder of the model (e.g. step 3's actor/)")
    p.add_argument("--data", required=True, help="JSONL prompt rows with 'prompt' and 'reference'")
    p.add_argument("--max_new_tokens", type=int, default=6, help="answer tokens")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="the model's dtype (default: as saved)")
    a = p.parse_args(argv)
    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines() if x.strip()]
    bad = [i for i, r in enumerate(rows) if "prompt" not in r or "reference" not in r]
    if bad:
        sys.exit(f"{a.data}: rows {bad[:5]} lack 'prompt' or 'reference'")
    print(json.dumps({"accuracy": evaluate(a.model, rows, a.max_new_tokens, dtype=a.dtype), "n": len(rows),
                      "model": a.model}))


if __name__ == "__main__":
    main()
