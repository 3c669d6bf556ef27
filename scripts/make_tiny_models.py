#!/usr/bin/env python
"""Write tiny, randomly initialised OPT / Llama / Qwen2 models (HF folders) for tests and demos.

    python scripts/make_tiny_models.py --out models/tiny            # opt and llama, hidden 64, 2 layers
    python scripts/make_tiny_models.py --family opt --hidden 512 --layers 8 --out models/bench

The tokenizer comes from ../shared/tokenizers (GPT-2 BPE for OPT and Llama, Qwen2 BPE for Qwen2)
unless --tokenizer names another folder; a <pad> token distinct from EOS is added.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from chatrl.models.tiny import FAMILIES, TinySpec, make_tiny_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="parent folder; each family goes to OUT/<family>")
    p.add_argument("--family", nargs="+", default=["opt", "llama"], choices=FAMILIES)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="Llama/Qwen2 key-value heads (default: --heads)")
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the family's shared one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="skip families whose folder already exists instead of failing")
    a = p.parse_args()
    spec = TinySpec(a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.max_positions, a.dropout)
    for family in a.family:
        out = Path(a.out) / family
        if a.force and (out / "config.json").exists():
            print(f"{out} exists, kept")
            continue
        model, tok = make_tiny_model(family, out, spec, a.tokenizer, a.seed)
        n = sum(p.numel() for p in model.parameters())
        print(f"wrote {out}: {type(model).__name__}, {n / 1e6:.2f}M parameters, vocab {len(tok)}")


if __name__ == "__main__":
    main()
