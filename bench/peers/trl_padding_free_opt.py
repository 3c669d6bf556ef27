"""Whether TRL's padding-free SFT batch keeps an OPT model's sequences apart; runs in the TRL venv only.

TRL 1.12's ``DataCollatorForLanguageModeling(padding_free=True)`` (``SFTConfig(padding_free=True)``)
lays a batch's sequences end to end in one row with position ids restarting at 0 and no attention
mask. Attention implementations that read sequence boundaries from position ids (flash-attention's
variable-length path; transformers' SDPA mask for Llama and Qwen2) keep the sequences apart; OPT's
mask builder does not, so with SDPA or eager attention each token also attends to the sequences
before it in the row. This script collates two short conversations with TRL's own collator and
prints, as JSON, how far each sequence's logits in the row are from the same sequence run alone
(0 up to float rounding when the sequences are kept apart).

    /tmp/trl_cpu/venv/bin/python bench/peers/trl_padding_free_opt.py --model DIR   # e.g. run.py's tiny OPT
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

TEXTS = ("Human: what is a cat? Assistant: a small animal.", "Human: name a colour. Assistant: blue, like the sky.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="an OPT causal-LM folder (bench/peers/run.py --keep DIR: DIR/opt)")
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    examples = [{"input_ids": tok(t)["input_ids"]} for t in TEXTS]
    for e in examples:
        e["labels"] = list(e["input_ids"])
    batch = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=True)(examples)
    gaps, start = [], 0
    with torch.no_grad():
        row = model(**{k: batch[k] for k in ("input_ids", "position_ids")}).logits[0]
        for e in examples:
            n = len(e["input_ids"])
            alone = model(input_ids=torch.tensor([e["input_ids"]])).logits[0]
            gaps.append((row[start:start + n] - alone).abs().max().item())
            start += n
    print(json.dumps({"model_type": model.config.model_type, "attn_implementation": model.config._attn_implementation,
                      "collated_keys": sorted(batch), "max_logit_gap_per_sequence": gaps}))


if __name__ == "__main__":
    main()
