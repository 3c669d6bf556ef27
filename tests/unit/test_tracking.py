"""The metrics log: rows per step, and a resume that drops the rows of steps it will redo."""

import json
import math

import pytest

from chatrl.pipeline import plan as planning
from chatrl.tracking import Tracker


def _steps(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_resume_drops_rows_after_the_checkpoint_and_keeps_the_old_log(tmp_path):
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    for step in range(1, 6):
        t.log({"train/loss": 1.0 / step, "eval/ppl": float("nan")}, step)
    t.close()
    with open(tmp_path / "logs" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # the crash cut the last line
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    t.resumed_at(3)
    t.log({"train/loss": 0.3}, 4)
    t.close()
    log = tmp_path / "logs"
    assert _steps(log / "metrics.jsonl") == [1, 2, 3, 4]
    assert json.loads((log / "metrics.jsonl").read_text().splitlines()[-1])["train/loss"] == 0.3
    before = (log / "metrics.before-resume-1.jsonl").read_text()
    assert before.count("\n") == 5 and before.endswith('"train/lo')  # nothing lost, cut line included
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    t.resumed_at(2)
    t.close()
    assert _steps(log / "metrics.jsonl") == [1, 2]
    assert (log / "metrics.before-resume-2.jsonl").exists()


def test_other_ranks_write_nothing(tmp_path):
    t = Tracker(str(tmp_path), enabled=False)
    t.log({"x": 1.0}, 1)
    t.resumed_at(0)
    t.close()
    assert not (tmp_path / "logs").exists()


def test_results_line_of_each_step_and_the_pipeline_summary(tmp_path):
    """train.py ended without results; its last lines now give each step's results, read from the
    step's metrics log (the demo's step-3 log: 40 rows), and step 3 writes the same trend line."""
    from pathlib import Path

    from chatrl.tracking import METRICS_FILE, Trend, read_metrics, results_line
    from tests.unit.test_entry_points import train

    demo = read_metrics(Path(__file__).parents[1] / "data" / "demo_step3_metrics.jsonl")
    assert results_line(demo) == ("score 0.279 → 0.340 (rose), KL max 1.473 nats, EOS rate 0.47 → 0.76 (rose); "
                                  "trends: mean of the first 5 steps → of the last 10")
    step1 = [{"step": 0, "eval/loss": 3.79, "eval/ppl": 44.24}, {"step": 5, "train/loss": 2.5},
             {"step": 114, "eval/ppl": 10.81}, {"step": 114, "eval/eos_rate": 0.9375}]
    assert results_line(step1) == "eval perplexity 44.24 → 10.81, greedy answers ending their turn 93.8%"
    step2 = [{"step": 0, "eval/accuracy": 0.486}, {"step": 91, "eval/accuracy": 0.569, "eval/margin": 0.007}]
    assert results_line(step2) == "eval accuracy 0.486 → 0.569"
    assert results_line([{"step": 1, "eval/ppl": float("nan")}]) == ""
    trend = Trend()
    for row in demo[:10]:
        trend.add(row)
    assert trend.line("step 3 (ppo) at step 10/40") == "step 3 (ppo) at step 10/40: " + results_line(demo[:10])
    runs = []
    for n, rows in ((1, step1), (2, step2), (3, demo)):
        folder = tmp_path / f"step{n}"
        (folder / METRICS_FILE).parent.mkdir(parents=True)
        (folder / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(planning.StepRun(n, planning.STEP_NAMES[n], "", folder, [], False))
    runs.append(planning.StepRun(3, "RLHF, grpo", "", tmp_path / "nothing", [], False))
    assert train.results_summary(runs) == [
        "results:", "  step 1 (supervised fine-tuning): eval perplexity 44.24 → 10.81, greedy answers ending their "
        "turn 93.8%", "  step 2 (reward model): eval accuracy 0.486 → 0.569",
        "  step 3 (RLHF): " + results_line(demo)]


def test_one_trend_definition_and_its_verdict():
    """Step 3's score and EOS rate are told one way: the mean of the first 5 logged steps → of the last 10
    (disjoint windows, shorter when fewer steps were logged), with "rose", "fell" or "no change beyond
    noise" (two standard errors of the difference). The run report uses the same function
    (tests/unit/test_report.py)."""
    from chatrl.tracking import Trend, results_line, step_trend

    rising = [0.2 + 0.01 * k for k in range(1, 13)]  # 12 steps: windows 1-5 and 6-12
    t = step_trend(rising)
    assert (t.first, t.last) == (5, 7) and t.start == pytest.approx(0.23) and t.end == pytest.approx(0.29)
    # sample variances 1e-4 × 2.5 (steps 1-5) and 1e-4 × 14/3 (steps 6-12)
    assert t.noise == pytest.approx(2 * math.sqrt(2.5e-4 / 5 + 1e-4 * 14 / 3 / 7))  # 0.0216
    assert t.verdict == "rose" and t.definition == "mean of the first 5 steps → of the last 7"
    flat = [0.1, 0.2] * 10  # 20 steps: 0.14 → 0.15, a change of 0.01 against noise 0.059
    t = step_trend(flat)
    assert (t.first, t.last, round(t.start, 6), round(t.end, 6)) == (5, 10, 0.14, 0.15)
    assert t.verdict == "no change beyond noise"
    assert step_trend([0.3]).text("{:.2f}") == "0.30" and step_trend([0.3]).verdict is None
    assert step_trend([0.3, 0.5]).verdict is None and step_trend([float("nan")]) is None
    eos = [0.9] * 6 + [0.1] * 6
    rows = [{"step": k + 1, "reward/score_mean": r, "eos_rate": e} for k, (r, e) in enumerate(zip(rising, eos, strict=True))]
    line = results_line(rows)
    assert line == ("score 0.230 → 0.290 (rose), EOS rate 0.90 → 0.21 (fell); "
                    "trends: mean of the first 5 steps → of the last 7")
    trend = Trend()  # the console's line while step 3 runs is the same line
    for row in rows:
        trend.add(row)
    assert trend.line("step 3 (ppo) at step 12/12") == f"step 3 (ppo) at step 12/12: {line}"
