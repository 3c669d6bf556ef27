"""Resident memory of a GRPO step, phase by phase, per rank.

    .venv/bin/python bench/grpo_memory.py [--model smollm2-135m-instruct] [--steps 3] [--beta 0]

Runs ``chatrl.step3_ppo`` with bench/peers/run.py's GRPO set-up (2 CPU ranks, ZeRO-0, hybrid engine,
the dtype of ``--dtype``, 2-digit additions with the ``exact_match`` reward, ``--prompts`` prompts ×
``--samples`` answers of at most ``--answer_len`` tokens per rank and step, the KL off at ``--beta 0``,
else a k3 loss term) under the DeepSpeed launcher, and reads each rank's memory at the end of every
phase of the run:

* ``tokenizer_data``: tokenizer and prompt rows loaded (what a process holds before any model);
* ``actor_engine``: the actor loaded and wrapped by DeepSpeed (optimizer built, states not yet touched);
* ``reference``: the frozen reference built (equal to the previous phase when it is not built);
* ``hybrid_engine``: the rollout engine built;
* per step ``N``: ``generate_N`` (rollouts and rewards), ``experience_N``, ``backward_N`` (the actor's
  backward of the step's last micro-batch), ``optimizer_N`` (the step after it).

Each phase gives ``rss_gb`` (resident now, ``VmRSS``) and ``hwm_gb`` (the peak so far, ``VmHWM``:
what bench/peers/run.py polls), both GiB. The script prints one JSON object ``{"rank0": {phase:
{...}}, "rank1": ..., "peak_gb": {...}, "set_up": ...}`` and, with ``--out``, writes it there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKS = 2


def _memory() -> dict:
    """``{"rss_gb", "hwm_gb"}`` of this process from ``/proc/self/status``."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) / 2**20  # kB -> GiB
    return {"rss_gb": round(fields["VmRSS"], 3), "hwm_gb": round(fields["VmHWM"], 3)}


def rank_program(argv: list[str], out: str) -> None:
    """One rank: step 3 with its phases wrapped to record memory at their ends into ``out`` (JSON)."""
    from chatrl.step3_ppo import main as step3
    from chatrl.step3_ppo import trainer as trainer_mod

    phases: dict[str, dict] = {}
    step = {"n": 0}

    def mark(name: str) -> None:
        phases[name] = _memory()
        Path(out).write_text(json.dumps(phases))  # at every phase: a run stopped early keeps its figures

    def after(obj, attr: str, name):
        original = getattr(obj, attr)

        def wrapped(*a, **k):
            result = original(*a, **k)
            mark(name() if callable(name) else name)
            return result

        setattr(obj, attr, wrapped)

    after(step3, "prompt_batches", "tokenizer_data")
    import chatrl.step3_ppo.engine as engine_mod

    after(engine_mod.dist, "trained_engine", "actor_engine")
    after(engine_mod, "load_causal_lm", "reference_loaded")
    after(engine_mod.dist, "frozen_engine", "reference")
    original_build = engine_mod.build_engines

    def build_engines(*a, **k):
        engines = original_build(*a, **k)
        phases.setdefault("reference", phases["actor_engine"])  # not built: the same memory as before
        engines.actor.backward = _wrap(engines.actor.backward, lambda: f"backward_{step['n']}")
        engines.actor.step = _wrap(engines.actor.step, lambda: f"optimizer_{step['n']}")
        return engines

    def _wrap(fn, name):
        def wrapped(*a, **k):
            result = fn(*a, **k)
            mark(name())
            return result
        return wrapped

    step3.build_engines = build_engines
    after(step3.HybridEngine, "sampler", "hybrid_engine")
    original_rollout = trainer_mod.Trainer.rollout

    def rollout(self, prompt_ids, prompt_mask, metadata, number, *a, **k):
        step["n"] = number
        result = original_rollout(self, prompt_ids, prompt_mask, metadata, number, *a, **k)
        mark(f"generate_{number}")
        return result

    trainer_mod.Trainer.rollout = rollout
    after(trainer_mod.Trainer, "make_experience", lambda: f"experience_{step['n']}")
    step3.main(argv)
    Path(out).write_text(json.dumps(phases))


def arith_rows(path: Path) -> None:
    """bench/peers/run.py's GRPO prompt rows: 1000 2-digit additions (seed 0)."""
    from scripts.make_arith_task import make_task

    train, _ = make_task(1000, 0, seed=0, max_operand=99, ops=("+",))
    path.write_text("".join(json.dumps(r) + "\n" for r in train))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="the actor (a zoo name or a folder)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="prompts per rank and step")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt")
    p.add_argument("--answer_len", type=int, default=32)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: off, as TRL's default)")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more step-3 flags, last")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--log", help="the ranks' output (default: a temporary file, shown on failure)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is stopped")
    if "--rank_out" in sys.argv:  # a rank under the launcher: the other arguments are step 3's flags
        i = sys.argv.index("--rank_out")
        rank_program(sys.argv[1:i] + sys.argv[i + 2:], sys.argv[i + 1].replace("RANK", os.environ.get("LOCAL_RANK", "0")))
        return
    a = p.parse_args()
    from chatrl.distributed.dist import free_port
    from chatrl.models.model_zoo import resolve

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        arith_rows(work / "arith.jsonl")
        per_rank = a.prompts * a.samples
        kl = (["--init_kl_coef", str(a.beta), "--kl_in", "loss", "--kl_loss_estimator", "k3"] if a.beta
              else ["--init_kl_coef", "0"])
        flags = ["--actor_model_name_or_path", str(resolve(a.model)), "--rl_algorithm", "grpo",
                 "--num_samples_per_prompt", str(a.samples), "--reward_fn", "exact_match",
                 "--data_path", str(work / "arith.jsonl"), "--data_split", "0,0,10", "--max_prompt_seq_len", "128",
                 "--max_answer_seq_len", str(a.answer_len), "--per_device_generation_batch_size", str(a.prompts),
                 "--per_device_training_batch_size", str(per_rank), "--max_steps", str(a.steps),
                 "--temperature", "1.0", "--actor_learning_rate", "5e-6", "--lr_scheduler_type", "constant",
                 "--actor_weight_decay", "0", "--gradient_clipping", "1.0", "--num_warmup_steps", "0",
                 "--enable_hybrid_engine", *kl, "--data_output_path", str(work / "cache"),
                 "--disable_progress_bar", "--seed", "1", "--output_dir", str(work / "out"), "--dtype", a.dtype,
                 "--actor_zero_stage", "0", *a.extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
        launcher = Path(sys.executable).with_name("deepspeed")
        cmd = [str(launcher), "--num_gpus", str(RANKS), "--master_port", str(free_port()), str(Path(__file__)),
               "--rank_out", str(work / "rank_RANK.json"), *flags]
        log = Path(a.log or work / "log")
        with open(log, "w") as f:
            run = subprocess.run(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout)
        ranks = {f"rank{r}": json.loads((work / f"rank_{r}.json").read_text()) for r in range(RANKS)
                 if (work / f"rank_{r}.json").exists()}
        if run.returncode:
            print(json.dumps({"exit": run.returncode, **ranks}))
            sys.exit(f"step 3 exited {run.returncode}:\n{log.read_text()[-4000:]}")
        rows = [json.loads(x) for x in (work / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor_loss" in r]
    result = {**ranks, "peak_gb": {k: max(v["hwm_gb"] for v in ph.values()) for k, ph in ranks.items()},
              "actor_loss": [r["actor_loss"] for r in train], "kl": [r.get("kl") for r in train],
              "set_up": {"model": a.model, "steps": a.steps, "prompts": a.prompts, "samples": a.samples,
                         "answer_len": a.answer_len, "beta": a.beta, "dtype": a.dtype, "ranks": RANKS,
                         "extra": a.extra}}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
