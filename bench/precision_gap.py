"""The sampler/trainer log-prob gap by dtype, inference TP size, ZeRO stage and fp32 LM head, printed as JSON.

Each cell runs the real ``chatrl.step3_ppo`` program over 2 CPU ranks for ``--steps`` experience buffers:
GRPO (4 answers per prompt) on stories260K (a pretrained tiny Llama) with the hybrid engine, a rule
reward that moves the policy (:func:`share_of_e`: the share of the answer's characters that are the
letter ``e``; learning rate 5e-4), and reads ``rollout/logp_diff_max`` and ``rollout/logp_diff_mean``
of the first step (the policy the run started from) and of the last one (a policy trained for
``--steps`` steps). The gap is the same formula on both sides (the training forward's log-softmax of
the sampled token against the sampler's), so it measures the two forward passes only: KV-cache
decoding against a full forward, and at TP 2 a row-parallel all-reduce.

    .venv/bin/python bench/precision_gap.py                       # the table of docs/precision.md
    .venv/bin/python bench/precision_gap.py --dtypes bf16 --tp 1 --zero 3 --steps 5

``fp32`` cells run without ``--fp32_lm_head`` only (the head is float32 already).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))


def share_of_e(prompts, answers, metadata):
    """Reward: the share of an answer's characters that are the letter ``e`` (0 for an empty answer)."""
    return [a.count("e") / max(len(a), 1) for a in answers]


def run_cell(work: Path, dtype: str, tp: int, zero: int, head: bool, a) -> dict:
    out = work / f"{dtype}_tp{tp}_z{zero}_{'head' if head else 'plain'}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(a.port),
           "-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(SHARED / "models" / "stories260K"),
           "--data_path", str(SHARED / "data" / "prompts"), "--data_split", "0,0,10",
           "--data_output_path", str(work / "cache"), "--output_dir", str(out), "--disable_progress_bar",
           "--rl_algorithm", "grpo", "--num_samples_per_prompt", "4", "--reward_fn",
           f"{Path(__file__).resolve()}:share_of_e", "--max_prompt_seq_len", "32", "--max_answer_seq_len",
           str(a.answer), "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "16",
           "--actor_learning_rate", "5e-4", "--num_warmup_steps", "0", "--lr_scheduler_type", "constant",
           "--init_kl_coef", "0.05", "--max_steps", str(a.steps), "--num_train_epochs", "10", "--actor_zero_stage", str(zero),
           "--enable_hybrid_engine", "--inference_tp_size", str(tp), "--dtype", dtype, "--seed", str(a.seed),
           *(["--fp32_lm_head"] if head else [])]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rollout/logp_diff_max" in r]
    first, last = rows[0], rows[-1]
    pick = ("rollout/logp_diff_max", "rollout/logp_diff_mean", "reward/score_mean", "kl", "ratio_mean")
    return {"start": {k: first.get(k) for k in pick}, "end": {k: last.get(k) for k in pick},
            "max_over_steps": max(r["rollout/logp_diff_max"] for r in rows),
            "steps": len(rows), "seconds": round(time.time() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--zero", nargs="+", type=int, default=[0, 2, 3])
    p.add_argument("--heads", nargs="+", default=["off", "on"], choices=["off", "on"], help="--fp32_lm_head")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--answer", type=int, default=16, help="answer tokens")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    cells = []
    with tempfile.TemporaryDirectory(prefix="chatrl_gap_") as tmp:
        for dtype, tp, zero, head in itertools.product(a.dtypes, a.tp, a.zero, a.heads):
            if dtype == "fp32" and head == "on":
                continue
            cell = {"dtype": dtype, "tp": tp, "zero": zero, "fp32_lm_head": head == "on",
                    **run_cell(Path(tmp), dtype, tp, zero, head == "on", a)}
            print(json.dumps(cell), file=sys.stderr, flush=True)
            cells.append(cell)
    result = {"bench": "precision_gap", "date": time.strftime("%Y-%m-%d"), "steps": a.steps, "answer_tokens": a.answer,
              "set_up": "GRPO x4, stories260K, hybrid engine, share-of-e reward, lr 5e-4, 2 CPU ranks", "cells": cells}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
