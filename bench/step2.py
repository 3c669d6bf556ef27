"""Benchmark step 2's reward model: training and scoring throughput in pairs per second, printed as JSON.

Runs in one process without DeepSpeed, so it measures the model code (forward at every position,
end-score gather, pairwise loss, backward, AdamW) rather than the launcher. Pairs are random
token ids whose lengths vary between ``seq_len / 2`` and ``seq_len`` (right-padded, as in
training); timings exclude ``--warmup`` steps.

    .venv/bin/python bench/step2.py                                # a tiny random OPT made on the fly
    .venv/bin/python bench/step2.py --model output/models/opt --batch 8 --seq_len 512 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def random_pairs(batch: int, seq_len: int, vocab: int, pad_id: int, gen: torch.Generator):
    """A PairCollator-shaped batch: ``input_ids`` and ``attention_mask`` of shape ``(2·batch, seq_len)``."""
    lengths = torch.randint(seq_len // 2, seq_len + 1, (2 * batch,), generator=gen)
    ids = torch.randint(0, vocab, (2 * batch, seq_len), generator=gen)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="causal-LM or reward-model folder (default: a tiny random OPT)")
    p.add_argument("--batch", type=int, default=4, help="pairs per step")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # quiets DeepSpeed's accelerator probe on stdout
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, pairwise_loss
    from chatrl.models.tiny import TinySpec, make_tiny_model

    transformers.logging.set_verbosity_error()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = os.path.join(tmp, "opt")
            make_tiny_model("opt", path, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
        tok = load_tokenizer(path)
        model = load_reward_model(path, tok, dtype=args.dtype, require_head=False).to(device)
    vocab = model.hf.get_input_embeddings().weight.shape[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    batches = [[t.to(device) for t in random_pairs(args.batch, args.seq_len, vocab, tok.pad_token_id, gen)]
               for _ in range(args.warmup + args.steps)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    model.train()
    for i, (ids, mask) in enumerate(batches):
        if i == args.warmup:
            sync()
            t0 = time.perf_counter()
        scores = model(ids, mask).end_scores
        loss = pairwise_loss(scores[:args.batch], scores[args.batch:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    train_s = time.perf_counter() - t0

    model.eval()
    with torch.no_grad():
        for i, (ids, mask) in enumerate(batches):
            if i == args.warmup:
                sync()
                t0 = time.perf_counter()
            model(ids, mask)
    sync()
    score_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "bench": "step2_reward", "model": args.model or "tiny-opt(h64,l2)", "params": n_params,
        "device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
        "batch_pairs": args.batch, "seq_len": args.seq_len, "steps": args.steps,
        "train_pairs_per_s": round(args.steps * args.batch / train_s, 2),
        "score_pairs_per_s": round(args.steps * args.batch / score_s, 2),
        "train_tokens_per_s": round(sum(int(m.sum()) for _, m in batches[args.warmup:]) / train_s, 1),
    }))


if __name__ == "__main__":
    main()
