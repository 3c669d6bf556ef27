"""Benchmark step 1: training samples/s and tokens/s of the real program, printed as JSON.

Runs ``chatrl.step1_sft`` on helpful-base for ``--steps`` optimizer steps in each configuration and
reads its metrics log; the first configuration (ZeRO-0 on one rank) is the baseline that every
other is given as a ratio against, measured in the same run. Start-up and the first ``--warmup``
steps are excluded.

    .venv/bin/python bench/step1.py                          # tiny OPT (hidden 64, 2 layers), CPU
    .venv/bin/python bench/step1.py --model ../shared/models/stories260K --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))
CONFIGS = [("zero0_1rank", 1, 0), ("zero2_2ranks", 2, 2), ("zero3_2ranks", 2, 3)]


def measure(name, nprocs, stage, model, work, a) -> dict:
    from tests.launch import run_ranks

    out = Path(work) / name
    run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(model), "--data_path",
               str(SHARED / "data/hh-rlhf/helpful-base"), "--data_split", "10,0,0", "--max_seq_len", str(a.seq_len),
               "--per_device_train_batch_size", str(a.batch * 2 // nprocs), "--max_steps", str(a.steps),
               "--eval_iters", "1", "--zero_stage", str(stage), "--output_dir", str(out),
               "--data_output_path", str(Path(work) / "cache"), "--disable_progress_bar"], nprocs=nprocs,
              timeout=3600)
    rows = [json.loads(x) for x in (out / "logs/metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    t0, t1 = train[a.warmup - 1]["elapsed_s"], train[-1]["elapsed_s"]
    timed = train[a.warmup:]
    samples = len(timed) * a.batch * 2
    tokens = sum(r["train/tokens"] for r in timed)
    return {"samples_per_s": samples / (t1 - t0), "answer_tokens_per_s": tokens / (t1 - t0)}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: a tiny random OPT made on the fly)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="samples per rank with 2 ranks (global batch 2×this)")
    p.add_argument("--seq_len", type=int, default=256)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as work:
        model = a.model
        if model is None:
            from chatrl.models.tiny import make_tiny_model

            model = Path(work) / "opt"
            make_tiny_model("opt", model)
        results = {name: measure(name, n, stage, model, work, a) for name, n, stage in CONFIGS}
    base = results[CONFIGS[0][0]]["samples_per_s"]
    for r in results.values():
        r["ratio_vs_zero0_1rank"] = r["samples_per_s"] / base
    print(json.dumps({"bench": "step1", "model": str(a.model or "tiny-opt-h64-l2"), "global_batch": 2 * a.batch,
                      "seq_len": a.seq_len, "steps": a.steps, "results": results}, indent=2))


if __name__ == "__main__":
    main()
