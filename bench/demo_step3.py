"""The demo's step 3 under several settings and seeds: does it raise the held-out reward-model score?

Steps 1 and 2 of the demo run once (``--base``: made with ``train.py --preset demo --step 1 2
--skip-eval`` when the folder holds no step-2 model yet). Then, seed by seed and variant by variant
(interleaved, so that a change in the machine's load falls on every variant alike), step 3 and the
demo's evaluation run as the demo runs them::

    train.py --preset demo --output-dir WORK/<variant>_s<seed> --step 3 --step3-args "--seed S FLAGS"

with the base's step-1 actor, step-2 reward model and data cache linked into that folder, and with
step 3's checkpoints, snapshots and rollout records off (``LEAN``: they do not change its training). ``--seed``
seeds step 3's prompt order, initial critic head, sampling and its share of the data split (so the
held-out prompts of the evaluation are the run's own); steps 1 and 2 are the same bits in every run.

Per run, from ``step3_rlhf/logs/metrics.jsonl`` and the evaluation's ``eval/answers.jsonl`` and
``eval/eval.json``:

* ``score``: the training-time reward-model score, the mean of the first 5 steps → of the last 10
  (``reward/score_mean``; the console's and the report's definition);
* ``heldout``: step 2's reward model's mean score of step 1's and of step 3's final answers on the
  evaluation's held-out prompts, greedy and sampled, and their difference (``gain``);
* ``win_rate``: the evaluation's win rate of step 3's final actor over step 1's by the same judge,
  with its 95 % interval, greedy and sampled; ``kl`` and ``eos_rate`` of the sampled answers.

Per variant, over the seeds: mean, sample standard deviation, minimum and maximum of each headline
figure. One JSON object goes to stdout (and ``--out``)::

    .venv/bin/python bench/demo_step3.py --base /tmp/demo --work /tmp/demo_runs --seeds 1234 1 2 \\
        --variant default= --variant old_agg="--loss_agg_mode micro-batch-token-mean" --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST, LAST = 5, 10  # the trend's windows (chatrl.tracking)
# what step 3 writes beside its training (checkpoints, HF snapshots, rollout records): off, which leaves the
# evaluation step 1's actor against the final one; the training itself is the demo's, bit for bit
LEAN = "--save_interval 0 --save_hf_interval 0 --save_rollouts 0"


def _args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the demo's output folder with steps 1 and 2")
    ap.add_argument("--work", required=True, type=Path, help="where each variant × seed writes")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1234, 1, 2])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=FLAGS: step-3 flags of one variant (empty: the demo's own); repeatable")
    ap.add_argument("--out", type=Path, help="also write the JSON here (rewritten after every run)")
    ap.add_argument("--reuse", action="store_true", help="read a run already finished instead of redoing it")
    ap.add_argument("--read_only", action="store_true",
                    help="run nothing: read the finished runs under --work (an unfinished one is recorded as null)")
    args = ap.parse_args(argv)
    variants = {}
    for v in args.variant or ["default="]:
        name, sep, flags = v.partition("=")
        if not sep or not name:
            ap.error(f"--variant {v!r}: write NAME=FLAGS (FLAGS may be empty)")
        variants[name] = flags
    args.variants = variants
    return args


def _train(argv: list[str], log: Path) -> float:
    """Run ``train.py --preset demo argv`` (its environment as this process's), its output to ``log``;
    returns the wall seconds. Raises SystemExit naming the log when it fails."""
    t0 = time.time()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.call([sys.executable, str(REPO / "train.py"), "--preset", "demo", *argv], cwd=REPO,
                             stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"demo_step3: train.py {shlex.join(argv)} failed (exit {rc}); see {log}")
    return time.time() - t0


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def read_run(out: Path) -> dict:
    """The figures of one finished run in ``out`` (module docstring)."""
    rows = [json.loads(line) for line in (out / "step3_rlhf" / "logs" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    steps = {}
    for r in rows:  # the last row of each step that carries the figure
        if "reward/score_mean" in r:
            steps[r["step"]] = r
    ordered = [steps[k] for k in sorted(steps)]
    score = [r["reward/score_mean"] for r in ordered]
    eos = [r.get("eos_rate") for r in ordered]
    answers = [json.loads(line) for line in (out / "eval" / "answers.jsonl").read_text().splitlines()
               if line.strip()]
    ev = json.loads((out / "eval" / "eval.json").read_text())
    models = list(dict.fromkeys(a["model"] for a in answers))
    base, final = models[0], models[-1]
    key = next(k for k in answers[0] if k.endswith("_score"))
    heldout = {}
    for name in sorted({a["decoding"] for a in answers}):  # "greedy", "seed1" (the sampled answers)
        decoding = "greedy" if name == "greedy" else "sampled"
        before = _mean([a[key] for a in answers if a["model"] == base and a["decoding"] == name])
        after = _mean([a[key] for a in answers if a["model"] == final and a["decoding"] == name])
        heldout[decoding] = {"before": before, "after": after, "gain": after - before,
                             "prompts": sum(a["model"] == final and a["decoding"] == name for a in answers)}
    return {"score": {"first": _mean(score[:FIRST]), "last": _mean(score[-LAST:]),
                      "change": _mean(score[-LAST:]) - _mean(score[:FIRST])},
            "eos_rate": {"first": _mean(eos[:FIRST]), "last": _mean(eos[-LAST:])},
            "kl_max": max((r.get("kl", 0.0) for r in ordered), default=None),
            "heldout": heldout, "models": [base, final], "judge_key": key, "eval": _eval_figures(ev, final)}


def _eval_figures(ev: dict, final: str) -> dict:
    """The evaluation's headline pair (step 3's final actor over step 1's): the judge's win rate
    ``{"value", "ci", "within_noise"}`` per decoding (``greedy``, ``sampled``), as ``eval.json`` holds it."""
    return {p["decoding"]: p["judge"]["win_rate"] for p in ev.get("pairs", [])
            if p.get("b") == final and p.get("judge")}


def summarise(runs: dict) -> dict:
    """Per variant: mean, sample standard deviation, minimum and maximum over seeds of the headline figures."""
    figures = {"score_change": lambda r: r["score"]["change"],
               "heldout_gain_greedy": lambda r: r["heldout"].get("greedy", {}).get("gain"),
               "heldout_gain_sampled": lambda r: r["heldout"].get("sampled", {}).get("gain"),
               "heldout_after_greedy": lambda r: r["heldout"].get("greedy", {}).get("after"),
               "heldout_after_sampled": lambda r: r["heldout"].get("sampled", {}).get("after"),
               "win_rate_greedy": lambda r: r["eval"].get("greedy", {}).get("value"),
               "win_rate_sampled": lambda r: r["eval"].get("sampled", {}).get("value"),
               "kl_max": lambda r: r["kl_max"]}
    out = {}
    for variant, by_seed in runs.items():
        done = [r for r in by_seed.values() if r is not None]
        out[variant] = {}
        for name, get in figures.items():
            xs = [get(r) for r in done if get(r) is not None]
            if xs:
                out[variant][name] = {"mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else None,
                                      "min": min(xs), "max": max(xs), "n": len(xs)}
    return out


def main(argv=None) -> int:
    args = _args(argv)
    base, work = args.base.resolve(), args.work.resolve()
    if not args.read_only and not (base / "step2_reward" / "config.json").exists():
        print(f"demo_step3: steps 1 and 2 into {base}", file=sys.stderr, flush=True)
        base.mkdir(parents=True, exist_ok=True)
        _train(["--output-dir", str(base), "--step", "1", "2", "--skip-eval"], base / "steps12.log")
    runs = {v: {} for v in args.variants}
    result = {"base": str(base), "seeds": args.seeds, "variants": args.variants, "runs": runs}
    for seed in args.seeds:
        for variant, flags in args.variants.items():
            out = work / f"{variant}_s{seed}"
            if args.read_only and not (out / "eval" / "eval.json").exists():
                runs[variant][str(seed)] = None
                continue
            if not (args.reuse or args.read_only and (out / "eval" / "eval.json").exists()):
                out.mkdir(parents=True, exist_ok=True)
                for name in ("step1_actor", "step2_reward", "data_cache"):
                    if not (out / name).exists():
                        os.symlink(base / name, out / name)
                load = os.getloadavg()[0]
                took = _train(["--output-dir", str(out), "--step", "3", "--overwrite",
                               "--step3-args", f"--seed {seed} {LEAN} {flags}".strip()], out / "train.log")
                (out / "took.json").write_text(json.dumps({"seconds": took, "load_before": load,
                                                           "load_after": os.getloadavg()[0]}))
            runs[variant][str(seed)] = {**read_run(out), **json.loads((out / "took.json").read_text())}
            print(f"{variant} seed {seed}: {json.dumps(runs[variant][str(seed)]['heldout'])}", file=sys.stderr,
                  flush=True)
            result["summary"] = summarise(runs)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
