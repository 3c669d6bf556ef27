"""Learning curves that CI guards: one seeded, deterministic tiny set-up per algorithm (PPO, GRPO, RLOO,
REINFORCE++ and DPO) on 2 CPU ranks, its reward, KL, EOS rate and win rate at fixed steps, and the
tolerance band each must stay in (``tests/reference_curves/<name>.json``).

Every set-up starts from the same short step 1 of stories260K on helpful-base (:func:`sft_base`, about half
its greedy answers end within 24 tokens) and trains it to write the letter "e" (the reward of
:mod:`tests.reference_curves.rewards`; DPO learns it from pairs whose rejected answer is the chosen one
without its e's) on other helpful-base rows, 20 optimizer steps with HF snapshots every 5
(``--save_hf_interval 5``); then ``python -m chatrl.eval`` compares each snapshot and the final model
with the starting model on 48 of those prompts (sampled answers, seed 1), judged by the same rule.

Figures at steps 5, 10, 15, 20:

* ``reward``: step 3's ``reward/score_mean`` (DPO: ``train/rewards/margin``), mean of the 5 logged steps
  up to it (one step's batch of 32 rollouts is noisy);
* ``kl``: step 3's ``kl`` (nats per answer), the same 5-step mean; DPO: the evaluation's mean KL to the
  starting model of the sampled answers;
* ``eos_rate``: step 3's ``eos_rate``, the same 5-step mean; DPO: the evaluation's (sampled answers);
* ``win_rate``: the evaluation's win rate over the starting model.

The band of each figure is the range over the reference seeds (``SEEDS``), widened on each side by
half that range plus a floor (``FLOORS``): a change that moves a curve further than seed-to-seed noise
leaves it. CI runs the first seed only; runs are deterministic on one machine, so that run is
exactly the stored ``value``. ``scripts/reference_curves.py`` regenerates the files (15 runs, about 15
minutes on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import DATA, STORIES
from tests.launch import run_ranks

HERE = Path(__file__).resolve().parent
STEPS = (5, 10, 15, 20)
SEEDS = (1, 2, 3)  # the first is the one CI runs
FLOORS = {"reward": 0.05, "kl": 0.05, "eos_rate": 0.05, "win_rate": 0.05}
WINDOW = 5
REWARD_FN = f"{HERE / 'rewards.py'}:letter_e"

RL_PROMPTS = str(DATA / "hh-rlhf" / "helpful-base") + "[1200:1600]"
SFT = ["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES),
       "--data_path", str(DATA / "hh-rlhf" / "helpful-base") + "[0:1200]", "--data_split", "10,0,0",
       "--max_seq_len", "128", "--per_device_train_batch_size", "16", "--learning_rate", "2e-3",
       "--lr_scheduler_type", "constant", "--num_warmup_steps", "0", "--num_train_epochs", "2", "--max_steps", "40",
       "--zero_stage", "0", "--seed", "1234", "--disable_progress_bar"]
_STEP3 = ["--data_path", RL_PROMPTS, "--data_split", "0,0,10", "--actor_zero_stage", "0", "--critic_zero_stage", "0",
          "--enable_hybrid_engine", "--reward_fn", REWARD_FN, "--max_prompt_seq_len", "64",
          "--max_answer_seq_len", "24", "--actor_learning_rate", "3e-4", "--critic_learning_rate", "3e-3",
          "--num_warmup_steps", "0", "--lr_scheduler_type", "constant", "--init_kl_coef", "0.1",
          "--num_train_epochs", "100", "--max_steps", str(STEPS[-1]), "--save_hf_interval", str(STEPS[0]),
          "--disable_progress_bar"]
SETUPS = {  # 16 rollouts per rank and step in every step-3 set-up
    "ppo": [*_STEP3, "--rl_algorithm", "ppo", "--per_device_generation_batch_size", "16",
            "--per_device_training_batch_size", "16"],
    "grpo": [*_STEP3, "--rl_algorithm", "grpo", "--num_samples_per_prompt", "4",
             "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "16"],
    "rloo": [*_STEP3, "--rl_algorithm", "rloo", "--num_samples_per_prompt", "4",
             "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "16"],
    "reinforce_pp": [*_STEP3, "--rl_algorithm", "reinforce_pp", "--per_device_generation_batch_size", "16",
                     "--per_device_training_batch_size", "16"],
    "dpo": ["--data_split", "0,10,0", "--eval_fraction", "0.05", "--max_seq_len", "128",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--eval_iters", "1",
            "--learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--beta", "0.1", "--num_train_epochs", "100",
            "--max_steps", str(STEPS[-1]), "--save_hf_interval", str(STEPS[0]), "--disable_progress_bar"],
}
EVAL = ["--max_prompts", "48", "--no_greedy", "--seeds", "1", "--judge", REWARD_FN, "--max_prompt_seq_len", "64",
        "--max_answer_seq_len", "24", "--disable_progress_bar"]


def sft_base(work: Path, timeout: float = 900) -> Path:
    """The starting model of every set-up: stories260K after 40 steps of step 1 (2 ranks, seeded), in
    ``work/sft`` (built once: an existing finished folder is reused)."""
    out = work / "sft"
    if not (out / "chatrl_run.json").exists():
        run_ranks([*SFT, "--data_output_path", str(work / "cache"), "--output_dir", str(out)], timeout=timeout)
    return out


def dpo_pairs(path: Path) -> Path:
    """The DPO set-up's pairs: the RL prompts' rows of helpful-base, each chosen answer's first 24 words
    against the same words without the letter e (a preference the letter-e rule judges)."""
    from chatrl.data import load_samples
    from chatrl.eval.judges import transcript

    rows = []
    for s in load_samples(RL_PROMPTS):
        chosen = " ".join(s.chosen.split()[:24])
        rejected = chosen.replace("e", "").replace("E", "")
        if chosen.strip() and rejected.strip() and rejected != chosen:
            rows.append({"prompt": transcript(s.messages), "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _window_means(rows: list[dict], key: str) -> dict[int, float]:
    by_step = {r["step"]: r[key] for r in rows if key in r and isinstance(r.get(key), (int, float))}
    out = {}
    for step in STEPS:
        xs = [by_step[s] for s in range(step - WINDOW + 1, step + 1) if s in by_step]
        out[step] = sum(xs) / len(xs)
    return out


def run_setup(name: str, seed: int, work: Path, base: Path, timeout: float = 900) -> dict[str, dict[int, float]]:
    """Train set-up ``name`` from ``base`` (:func:`sft_base`) with ``seed`` on 2 CPU ranks under ``work``,
    evaluate its snapshots (one process, one thread), and return ``{figure: {step: value}}`` (module docstring)."""
    from chatrl.tracking import METRICS_FILE, read_metrics

    work.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    common = ["--output_dir", str(out), "--data_output_path", str(work / "cache"), "--seed", str(seed)]
    if name == "dpo":
        data = dpo_pairs(work / "pairs.jsonl")
        run_ranks(["-m", "chatrl.step2_dpo", "--model_name_or_path", str(base), "--data_path", str(data),
                   *SETUPS[name], *common], timeout=timeout)
        prompts = str(data)
    else:
        run_ranks(["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(base), *SETUPS[name], *common],
                  timeout=timeout)
        prompts = RL_PROMPTS
    rows = read_metrics(out / METRICS_FILE)
    run_ranks(["-m", "chatrl.eval", "--models", str(base), str(out), "--prompts", prompts, "--reference", str(base),
               "--output_dir", str(work / "eval"), *EVAL], nprocs=1, timeout=timeout)
    ev = json.loads((work / "eval" / "eval.json").read_text(encoding="utf-8"))
    points = {p["step"]: p for p in ev["series"]}
    figures = {"win_rate": {s: points[s]["win_rate"] for s in STEPS}}
    if name == "dpo":
        figures["reward"] = _window_means(rows, "train/rewards/margin")
        figures["kl"] = {s: points[s]["kl"] for s in STEPS}
        figures["eos_rate"] = {s: ev["figures"][points[s]["label"]]["sampled"]["eos_rate"] for s in STEPS}
    else:
        figures.update(reward=_window_means(rows, "reward/score_mean"), kl=_window_means(rows, "kl"),
                       eos_rate=_window_means(rows, "eos_rate"))
    return figures


def band(values: list[float], floor: float) -> tuple[float, float]:
    """``(low, high)``: the range of ``values`` widened on each side by half the range plus ``floor``."""
    lo, hi = min(values), max(values)
    margin = 0.5 * (hi - lo) + floor
    return lo - margin, hi + margin


def reference(name: str, runs: dict[int, dict[str, dict[int, float]]]) -> dict:
    """The stored file of set-up ``name`` from its runs per seed: per figure and step, the first seed's
    ``value``, every seed's value and the band."""
    first = SEEDS[0]
    figures = {}
    for fig in FLOORS:
        figures[fig] = {}
        for step in STEPS:
            values = [runs[s][fig][step] for s in SEEDS]
            lo, hi = band(values, FLOORS[fig])
            figures[fig][str(step)] = {"value": runs[first][fig][step], "seeds": values, "low": lo, "high": hi}
    return {"setup": name, "seeds": list(SEEDS), "steps": list(STEPS), "sft_flags": portable(SFT),
            "flags": portable(SETUPS[name]), "eval_flags": portable(EVAL),
            "figures": figures,
            "regenerate": "HF_HUB_OFFLINE=1 .venv/bin/python scripts/reference_curves.py --setups " + name}


def portable(flags: list[str]) -> list[str]:
    """``flags`` with this checkout's paths written as ``$DATA``, ``$STORIES``, ``$CURVES`` (the stored
    files must not depend on where the repository and ../shared are)."""
    names = (("$STORIES", str(STORIES)), ("$DATA", str(DATA)), ("$CURVES", str(HERE)))
    out = []
    for f in flags:
        for name, path in names:
            f = f.replace(path, name)
        out.append(f)
    return out


def load(name: str) -> dict:
    """The stored reference of set-up ``name``."""
    return json.loads((HERE / f"{name}.json").read_text(encoding="utf-8"))


def outside(ref: dict, figures: dict[str, dict[int, float]]) -> list[str]:
    """The figures of a run that leave their band, one line each (``[]`` when all are inside)."""
    bad = []
    for fig, per_step in ref["figures"].items():
        for step, b in per_step.items():
            v = figures[fig][int(step)]
            if not b["low"] <= v <= b["high"]:
                bad.append(f"{ref['setup']} {fig} at step {step}: {v:.4f} outside [{b['low']:.4f}, {b['high']:.4f}] "
                           f"(reference {b['value']:.4f}, seeds {[round(x, 4) for x in b['seeds']]})")
    return bad
