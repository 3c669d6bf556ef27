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

``--side_by_side`` measures the small PPO set-up instead: a tiny random OPT (hidden 64, 2 layers, 4
heads, FFN 256, GPT-2 BPE plus a separate ``<pad>``) as actor and reference, an
``OPTForSequenceClassification`` of the same backbone as critic and reward model, the first 1,000
helpful-base test prompts left-truncated to 128 tokens, 64-token answers at temperature 0.7, 4
prompts per rank, 2 ranks, ``--steps`` PPO steps, 1 epoch, fp32, hybrid engine on, started by the
DeepSpeed launcher, at each of ``--stages``; with ``--trl_python`` (the TRL 1.12 venv of
``../shared/baselines/trl/setup_venv.sh``) TRL's ``PPOTrainer`` runs the same set-up under torchrun
(``../shared/baselines/trl/scripts/ppo.py``). ``--dtype bf16``: chatrl at ``--dtype bf16`` and TRL with
``bf16=True`` (its mixed precision; ``bench/peers/trl_bf16.py``); ``--dtype fp32 bf16`` runs both dtypes
interleaved and adds chatrl's bf16/fp32 ratio per stage (``--trl_dtype bf16``: TRL in bf16 only). Runs are interleaved, ``--repeats`` times; the JSON
gives per mode the median (and range) of rollouts/s inside the loop, launch-to-exit seconds, the
phase split and the peak resident memory of each rank (``VmHWM``, polled), and ratios against TRL.

    .venv/bin/python bench/step3.py --side_by_side --repeats 3 --trl_python /tmp/trl_cpu/venv/bin/python
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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chatrl.rl import algorithms

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))
KEYS = ["samples_per_s", "time/generate", "time/experience", "time/train", "time/gather", "time/shard",
        "time/release", "answer_len", "memory/rss_train_max_mb"]


def make_models(work: Path, a) -> tuple[str, str]:
    import torch

    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model
    from chatrl.models.tiny import TinySpec, make_tiny_model

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


# ------------------------------------------------------------------ --side_by_side (the small PPO set-up)
ASSISTANT = "\n\nAssistant:"


def make_side_by_side_setup(work: Path, a) -> dict:
    """The tiny OPT actor, its reward model (seed 2) and the prompts, as TRL's harness builds them."""
    import gzip

    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers/gpt2")
    tok.add_special_tokens({"pad_token": "<pad>"})
    tok.model_max_length = 1024
    cfg = OPTConfig(vocab_size=len(tok), hidden_size=a.hidden, num_hidden_layers=a.layers,
                    num_attention_heads=max(4, a.hidden // 64), ffn_dim=4 * a.hidden, max_position_embeddings=1024,
                    word_embed_proj_dim=a.hidden, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id)
    torch.manual_seed(1)
    OPTForCausalLM(cfg).save_pretrained(work / "sft")
    tok.save_pretrained(work / "sft")
    torch.manual_seed(2)
    rm = OPTForSequenceClassification.from_pretrained(work / "sft", num_labels=1)
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(work / "rm")
    tok.save_pretrained(work / "rm")
    with gzip.open(SHARED / "data/hh-rlhf/helpful-base/test.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:1200]
    prompts = [r["chosen"][:r["chosen"].rfind(ASSISTANT) + len(ASSISTANT)] for r in rows]
    (work / "data").mkdir()
    for name, part in (("train", prompts[:1000]), ("eval", prompts[1000:])):  # the TRL harness's file names
        (work / f"data/pairs_{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in part))
    return {"sft": str(work / "sft"), "rm": str(work / "rm"), "prompts": str(work / "data/pairs_train.jsonl")}


def _peak_rss_mib(marker: str, peaks: dict) -> None:
    """Update ``peaks`` (local rank → MiB) with the VmHWM of the live rank processes whose command line has ``marker``."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if marker not in " ".join(cmd):
                continue
            rank = next((c.split("=", 1)[1] for c in cmd if c.startswith("--local_rank=")),
                        None) or _env_local_rank(pid)
            if rank is None:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        hwm = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), 0) / 1024
        peaks[int(rank)] = max(peaks.get(int(rank), 0.0), hwm)


def _env_local_rank(pid: str) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LOCAL_RANK=")]
    return found[0] if found else None


def _launch(cmd: list[str], env: dict, marker: str, log: Path, timeout: float) -> tuple[float, dict]:
    t0 = time.perf_counter()
    peaks: dict = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            _peak_rss_mib(marker, peaks)
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                raise TimeoutError(f"{cmd[:4]} ran over {timeout} s; log {log}")
            time.sleep(0.5)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} … exited {proc.returncode}; log {log}:\n" + log.read_text()[-3000:])
    return wall, {f"rank{k}": round(v, 1) for k, v in sorted(peaks.items())}


def _chatrl_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def run_chatrl(stage: int, setup: dict, out: Path, a, dtype: str = "fp32") -> dict:
    env = _chatrl_env()
    cmd = ["deepspeed", "--num_gpus", "2", "--module", "chatrl.step3_ppo",
           "--actor_model_name_or_path", setup["sft"], "--critic_model_name_or_path", setup["rm"],
           "--data_path", setup["prompts"], "--data_split", "0,0,10", "--data_output_path", str(out / "cache"),
           "--max_prompt_seq_len", "128", "--max_answer_seq_len", str(a.answer),
           "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
           "--max_steps", str(a.steps), "--num_warmup_steps", "0", "--temperature", "0.7",
           "--actor_zero_stage", str(stage), "--critic_zero_stage", str(stage), "--enable_hybrid_engine",
           "--seed", "1", "--disable_progress_bar", "--log_interval", "1", "--output_dir", str(out / "out"),
           "--dtype", dtype]
    wall, peaks = _launch(cmd, env, str(out / "out"), out.with_suffix(".log"), a.timeout)
    rows = [json.loads(x) for x in (out / "out/logs/metrics.jsonl").read_text().splitlines()]
    per_step = [r["samples"] - (rows[i - 1]["samples"] if i else 0) for i, r in enumerate(rows)]  # --log_interval 1
    loop_s = sum(n / r["samples_per_s"] for n, r in zip(per_step, rows, strict=True))
    return {"rollouts_per_s": rows[-1]["samples"] / loop_s, "launch_to_exit_s": wall,
            "phase_s": {k: sum(r[f"time/{k}"] for r in rows) for k in ("generate", "experience", "train")},
            "peak_rss_mib": peaks}


def run_trl(setup: dict, out: Path, a, dtype: str = "fp32") -> dict:
    script = SHARED / "baselines/trl/scripts/ppo.py"
    env = {**os.environ, "TRL_CPU_ROOT": str(Path(setup["prompts"]).parents[1]), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_DISABLED": "true", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env.pop("PYTHONPATH", None)
    bf16 = [str(Path(__file__).resolve().parent / "peers" / "trl_bf16.py")] if dtype == "bf16" else []
    cmd = [a.trl_python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *bf16, str(script),
           "--policy", setup["sft"], "--reward", setup["rm"], "--out", str(out / "model"),
           "--metrics-dir", str(out), "--updates", str(a.steps)]
    wall, peaks = _launch(cmd, env, str(out / "model"), out.with_suffix(".log"), a.timeout)
    m = json.loads((out / "ppo_metrics_rank0.json").read_text())
    split = m["time_split_s_this_rank"]
    return {"rollouts_per_s": m["episodes_this_rank_x_world"] / split["update_loop_total"], "launch_to_exit_s": wall,
            "phase_s": {"generate": split["generation"],
                        "experience": split["rollout_scoring_ref_value_reward_forwards"],
                        "train": split["train_forward_backward"]},
            "peak_rss_mib": peaks}


def _summary(runs: list[dict]) -> dict:
    def med(xs):
        return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}

    return {"runs": len(runs), "per_run": runs, "rollouts_per_s": med([r["rollouts_per_s"] for r in runs]),
            "launch_to_exit_s": med([r["launch_to_exit_s"] for r in runs]),
            "phase_s": {k: round(statistics.median(r["phase_s"][k] for r in runs), 2) for k in runs[0]["phase_s"]},
            "peak_rss_mib": {k: max(r["peak_rss_mib"].get(k, 0.0) for r in runs) for k in runs[0]["peak_rss_mib"]}}


def _mode(name: str) -> tuple[str, str, int | None]:
    """``chatrl_zero3`` / ``chatrl_bf16_zero3`` / ``trl`` / ``trl_bf16`` → (framework, dtype, stage)."""
    parts = name.split("_")
    dtype = "bf16" if "bf16" in parts else "fp32"
    return parts[0], dtype, int(parts[-1][4:]) if parts[-1].startswith("zero") else None


def side_by_side(a) -> dict:
    """Every (dtype, stage) of chatrl and TRL (with ``--trl_python``) in each dtype, interleaved; ratios
    against TRL in the same dtype, and chatrl's bf16 against its fp32 at the same stage."""
    modes = []
    for dtype in a.dtype:
        tag = "" if dtype == "fp32" else f"_{dtype}"
        modes += [f"chatrl{tag}_zero{s}" for s in a.stages] + ([f"trl{tag}"] if a.trl_python and dtype in a.trl_dtype
                                                                else [])
    runs: dict[str, list] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        setup = make_side_by_side_setup(work, a)
        for rep in range(a.repeats):
            for m in modes:  # interleaved: every mode sees the same load, repeat after repeat
                out = work / f"{m}_{rep}"
                framework, dtype, stage = _mode(m)
                runs[m].append(run_trl(setup, out, a, dtype) if framework == "trl"
                               else run_chatrl(stage, setup, out, a, dtype))
                print(json.dumps({"mode": m, "repeat": rep, **runs[m][-1]}), file=sys.stderr, flush=True)
    res = {m: _summary(r) for m, r in runs.items()}
    for m in res:
        framework, dtype, stage = _mode(m)
        if framework != "chatrl":
            continue
        trl = res.get("trl" if dtype == "fp32" else f"trl_{dtype}")
        if trl is not None:
            res[m]["vs_trl"] = {
                "rollouts_per_s": round(res[m]["rollouts_per_s"]["median"] / trl["rollouts_per_s"]["median"], 3),
                "launch_to_exit_speedup": round(trl["launch_to_exit_s"]["median"] / res[m]["launch_to_exit_s"]["median"],
                                                3)}
        fp32 = res.get(f"chatrl_zero{stage}")
        if dtype != "fp32" and fp32 is not None:
            res[m]["vs_chatrl_fp32"] = {
                "rollouts_per_s": round(res[m]["rollouts_per_s"]["median"] / fp32["rollouts_per_s"]["median"], 3),
                "train_phase": round(fp32["phase_s"]["train"] / res[m]["phase_s"]["train"], 3),
                "launch_to_exit_speedup": round(fp32["launch_to_exit_s"]["median"] / res[m]["launch_to_exit_s"]["median"],
                                                3)}
    return {"bench": "step3_side_by_side", "actor": f"tiny-opt-h{a.hidden}-l{a.layers}", "dtypes": a.dtype,
            "date": time.strftime("%Y-%m-%d"), "ranks": 2,
            "prompts_per_rank": 4, "prompt": 128, "answer": a.answer, "steps": a.steps, "repeats": a.repeats,
            "load_avg_1min_at_end": os.getloadavg()[0], "cpus": os.cpu_count(), "modes": res}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--actor", default=None, help="actor folder (default: a tiny random OPT made on the fly)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="rollouts per rank per buffer")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--answer", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--side_by_side", action="store_true",
                   help="the small PPO set-up (tiny OPT h64, 128 + 64 tokens, 4 prompts x 2 ranks, 20 steps) at "
                        "each ZeRO stage (and TRL)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 2, 3])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work_dir", default=None,
                   help="keep the side-by-side models, outputs and launch logs here (default: a temporary folder)")
    p.add_argument("--trl_python", default=None, help="python of the TRL 1.12 venv (adds TRL's PPOTrainer)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], nargs="+", default=["fp32"],
                   help="--side_by_side: chatrl's --dtype, each one a set of modes (bf16 and fp32 together give "
                        "chatrl's bf16/fp32 ratio); TRL runs in bf16 with bf16=True (bench/peers/trl_bf16.py)")
    p.add_argument("--trl_dtype", choices=["fp32", "bf16"], nargs="+", default=None,
                   help="--side_by_side with --trl_python: the dtypes TRL runs in (default: every --dtype)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--algorithms", nargs="+", default=None, choices=algorithms.names(),
                   help="compare these step-3 algorithms (hybrid engine on) instead of hybrid on/off")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt of the critic-free algorithms")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if a.side_by_side:
        a.trl_dtype = a.trl_dtype or a.dtype
        if "--hidden" not in sys.argv:
            a.hidden, a.layers = 64, 2
        a.steps = a.steps if "--steps" in sys.argv else 20
        print(json.dumps(side_by_side(a), indent=2))
        return
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
