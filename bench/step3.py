"""Benchmark step 3: PPO samples/s with the generation / training / refresh breakdown, hybrid engine on
and off, printed as JSON.

Runs the real ``chatrl.step3_ppo`` program over 2 CPU ranks (actor and critic under ZeRO-3) for
``--steps`` experience buffers in each mode and reads its metrics log; the hybrid-off run is the
baseline that the hybrid-on run is given as a ratio against, measured in the same run. The first
``--warmup`` buffers are excluded. The actor is a tiny random OPT made on the fly (``--hidden``,
``--layers``) unless ``--actor`` names a folder; the critic is the same architecture with a zero
value head.

    .venv/bin/python bench/step3.py
    .venv/bin/python bench/step3.py --hidden 512 --layers 8 --answer 128 --steps 6

With ``--algorithms ppo grpo rloo reinforce_pp`` it instead runs each algorithm on the same set-up
(hybrid engine on, the same rollouts per rank: ``--batch`` prompts × 1 answer for ppo,
``--batch / --samples`` prompts × ``--samples`` answers for the critic-free ones, the same reward
model) and reports samples/s and the peak resident memory per rank of each, with ratios against
ppo: the difference is the critic (its forward, its training step, its weights and optimizer).
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
KEYS = ["samples_per_s", "time/generate", "time/experience", "time/train", "time/gather", "time/shard",
        "time/release", "answer_len", "memory/rss_train_max_mb"]


def make_models(work: Path, a) -> tuple[str, str]:
    import torch

    from chatrl.models import load_tokenizer
    from chatrl.step2_reward.model import load_reward_model, save_reward_model
    from chatrl.tiny import TinySpec, make_tiny_model

    actor = a.actor
    if actor is None:
        actor = str(work / "actor")
        make_tiny_model("opt", actor, TinySpec(hidden=a.hidden, layers=a.layers, heads=max(4, a.hidden // 64),
                                               ffn=4 * a.hidden))
    tok = load_tokenizer(actor)
    critic = load_reward_model(actor, tok, require_head=False)
    torch.nn.init.zeros_(critic.hf.score.weight)
    save_reward_model(critic, tok, work / "critic")
    return actor, str(work / "critic")


def run_mode(hybrid: bool, actor: str, critic: str, work: Path, a, algorithm: str = "ppo") -> dict:
    from tests.launch import run_ranks

    out = work / (f"{algorithm}_" + ("hybrid_on" if hybrid else "hybrid_off"))
    n = 1 if algorithm == "ppo" else a.samples
    algo = [] if algorithm == "ppo" else ["--rl_algorithm", algorithm, "--num_samples_per_prompt", str(n),
                                          "--reward_model_name_or_path", critic]
    models = ["--critic_model_name_or_path", critic] if algorithm == "ppo" else []
    run_ranks(["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", actor, *models, *algo,
               "--data_path", str(SHARED / "data/hh-rlhf/helpful-base"), "--data_output_path", str(work / "cache"),
               "--max_prompt_seq_len", str(a.prompt), "--max_answer_seq_len", str(a.answer),
               "--per_device_generation_batch_size", str(a.batch // n),
               "--per_device_training_batch_size", str(a.batch),
               "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--max_steps", str(a.steps),
               "--num_warmup_steps", "0", "--output_dir", str(out), "--disable_progress_bar",
               *(["--enable_hybrid_engine"] if hybrid else [])], nprocs=2, timeout=3600)
    rows = [json.loads(x) for x in (out / "logs/metrics.jsonl").read_text().splitlines()][a.warmup:]
    return {k: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in KEYS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actor", default=None, help="actor folder (default: a tiny random OPT made on the fly)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="rollouts per rank per buffer")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--answer", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--algorithms", nargs="+", default=None, choices=["ppo", "grpo", "rloo", "reinforce_pp"],
                   help="compare these step-3 algorithms (hybrid engine on) instead of hybrid on/off")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt of the critic-free algorithms")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        actor, critic = make_models(work, a)
        if a.algorithms:
            res = {alg: run_mode(True, actor, critic, work, a, alg) for alg in a.algorithms}
            base = res.get("ppo")
            for r in res.values():
                if base is not None:
                    r["samples_per_s_vs_ppo"] = r["samples_per_s"] / base["samples_per_s"]
                    r["peak_rss_vs_ppo"] = r["memory/rss_train_max_mb"] / base["memory/rss_train_max_mb"]
            print(json.dumps({"bench": "step3_algorithms", "actor": a.actor or f"tiny-opt-h{a.hidden}-l{a.layers}",
                              "ranks": 2, "zero_stage": 3, "rollouts_per_rank": a.batch, "samples_per_prompt":
                              a.samples, "prompt": a.prompt, "answer": a.answer, "algorithms": res}, indent=2))
            return
        off = run_mode(False, actor, critic, work, a)
        on = run_mode(True, actor, critic, work, a)
    on["ratio_vs_hybrid_off"] = on["samples_per_s"] / off["samples_per_s"]
    on["generate_speedup"] = off["time/generate"] / max(on["time/generate"], 1e-9)
    print(json.dumps({"bench": "step3", "actor": a.actor or f"tiny-opt-h{a.hidden}-l{a.layers}", "ranks": 2,
                      "zero_stage": 3, "rollouts_per_rank": a.batch, "prompt": a.prompt, "answer": a.answer,
                      "hybrid_off": off, "hybrid_on": on}, indent=2))


if __name__ == "__main__":
    main()
