"""Run-health alerts: each rule on a synthetic series fires at the hand-derived step with the
hand-derived figure, and a healthy PPO series fires nothing; the Tracker prints each alert once
and logs it as a metric."""

import json
import math

import pytest

from chatrl.evidence.alerts import Thresholds, check_rows
from chatrl.tracking import Tracker


def healthy(n=40):
    """A PPO run that learns quietly: score up, KL slowly up, entropy and length steady, EOS high."""
    rows = []
    for i in range(n):
        step = i + 1
        rows.append({"step": step, "reward/score_mean": 0.3 + 0.005 * i, "reward/score_std": 0.2,
                     "reward/mean": 0.3 + 0.004 * i, "kl": 0.05 * i, "kl_coef": 0.1,
                     "entropy": 2.0 - 0.01 * i + 0.02 * (-1) ** i, "answer_len": 30 + (i % 3),
                     "eos_rate": 0.9 - 0.05 * (i % 2), "skipped_steps": 0.0, "actor_loss": 0.01 * (-1) ** i})
    return rows


def with_series(name, values, base=None):
    rows = base or healthy(len(values))
    for row, v in zip(rows, values, strict=True):
        row[name] = v
    return rows


def fired(rows, **kw):
    return {a.rule: a for a in check_rows(rows, Thresholds(**kw) if kw else None)}


def test_healthy_series_is_silent():
    assert fired(healthy()) == {}


def test_answer_length_growth():
    # lengths 30 for 10 steps, then +10 per step: step 11 → 40, 12 → 50, 13 → 60, 14 → 70
    lens = [30.0] * 10 + [30.0 + 10 * k for k in range(1, 21)]
    a = fired(with_series("answer_len", lens))
    assert set(a) == {"answer_len_growth"}
    # recent = mean of the last 3 > 2 × 30 = 60 first at step 15: (60 + 70 + 80) / 3 = 70 (step 14: 60 exactly)
    assert a["answer_len_growth"].step == 15 and a["answer_len_growth"].value == pytest.approx(70.0)


def test_answer_length_pinned_at_max_with_no_eos():
    rows = with_series("eos_rate", [0.9] * 8 + [0.0] * 12, healthy(20))
    rows = with_series("answer_len", [30.0] * 8 + [48.0] * 12, rows)
    a = fired(rows)
    # eos 0 and length 48 for 3 steps in a row: steps 9, 10, 11 → fires at 11
    assert a["answer_len_at_max"].step == 11 and a["answer_len_at_max"].value == 48.0
    # EOS mean of the last 3 < 0.5 × 0.9: step 9 gives (0.9 + 0.9 + 0) / 3 = 0.6, step 10 gives 0.3
    assert a["eos_collapse"].step == 10 and a["eos_collapse"].value == pytest.approx(0.3)
    assert "answer_len_growth" not in a  # 48 < 2 × 30


def test_eos_collapse_figure_and_silence_when_eos_was_never_learned():
    eos = [0.8] * 5 + [0.8 - 0.1 * k for k in range(1, 8)] + [0.1] * 8
    a = fired(with_series("eos_rate", eos))
    # base 0.8, threshold 0.4: steps 9, 10, 11 have 0.4, 0.3, 0.2 → mean 0.3 at step 11; step 10: 0.4 (not < 0.4)
    assert list(a) == ["eos_collapse"]
    assert a["eos_collapse"].step == 11 and a["eos_collapse"].value == pytest.approx(0.3)
    assert fired(with_series("eos_rate", [0.1] * 5 + [0.0] * 15)) == {}  # base 0.1 < 0.2: nothing to lose


def test_entropy_collapse():
    ent = [2.0] * 6 + [2.0 * 0.7 ** k for k in range(1, 15)]
    a = fired(with_series("entropy", ent))
    # base 2.0, threshold 0.6; steps 7, 8, … have 1.4, 0.98, 0.686, 0.480, 0.336: the mean of the last 3 is
    # below 0.6 first at step 11, (0.686 + 0.480 + 0.336) / 3 = 0.5008 (step 10: (0.98 + 0.686 + 0.480) / 3 = 0.715)
    assert list(a) == ["entropy_collapse"]
    assert a["entropy_collapse"].step == 11
    assert a["entropy_collapse"].value == pytest.approx((2 * 0.7 ** 3 + 2 * 0.7 ** 4 + 2 * 0.7 ** 5) / 3)


def test_kl_surge_needs_level_speed_and_acceleration():
    kl = [0.2 * i for i in range(15)] + [2.8 + 1.0 * k for k in range(1, 11)]
    a = fired(with_series("kl", kl, healthy(25)))
    # slope 0.2/step up to step 15 (kl 2.8), then 1.0/step. Step t's last-5 slope: t=16: (2.2,2.4,2.6,2.8,3.8)
    # slope 0.36; t=17: (2.4,2.6,2.8,3.8,4.8) → 0.64 ≥ 0.5 but the 5 before (1.4..2.2) have 0.2 → 0.64 ≥ 0.4 ✓
    assert a["kl_surge"].step == 17 and a["kl_surge"].value == pytest.approx(4.8)
    steady = [0.6 * i for i in range(25)]  # fast but not accelerating: silent
    assert "kl_surge" not in fired(with_series("kl", steady, healthy(25)))
    small = [0.01 * 2 ** (i / 2) for i in range(12)] + [0.0] * 13  # accelerating but below 2 nats: silent
    assert "kl_surge" not in fired(with_series("kl", small, healthy(25)))


def test_score_up_while_kl_penalised_reward_down():
    score = [0.3 + 0.05 * i for i in range(20)]
    reward = [0.3] * 8 + [0.3 - 0.05 * k for k in range(1, 13)]
    rows = with_series("reward/mean", reward, with_series("reward/score_mean", score, healthy(20)))
    rows = with_series("reward/score_std", [0.16] * 20, rows)
    a = fired(rows)
    # window of 10 steps, first 3 against last 3: the score's rise is 0.05 × 7 = 0.35 throughout; both must
    # exceed 0.5 × 0.16 = 0.08. Step 10 (steps 1..10): reward last 3 = 0.3, 0.25, 0.2 → fall 0.05;
    # step 11 (steps 2..11): last 3 = 0.25, 0.2, 0.15 → fall 0.1 ✓
    assert list(a) == ["score_up_reward_down"]
    assert a["score_up_reward_down"].step == 11 and a["score_up_reward_down"].value == pytest.approx(0.15)
    # a wider score spread needs a larger change: margin 0.125 is passed at step 12 (fall 0.15), not 11 (0.1)
    assert fired(with_series("reward/score_std", [0.25] * 20, rows))["score_up_reward_down"].step == 12


def test_nonfinite_value_and_skipped_steps():
    rows = healthy(10)
    rows[3]["actor_loss"] = float("nan")
    a = fired(rows)
    assert a["nonfinite"].step == 4 and a["nonfinite"].metric == "actor_loss" and math.isnan(a["nonfinite"].value)
    rows = [{"step": s, "train/loss": 1.0, "train/skipped_steps": float(s >= 6)} for s in range(1, 10)]
    a = fired(rows)
    assert a["nonfinite"].step == 6 and a["nonfinite"].metric == "train/skipped_steps" and a["nonfinite"].value == 1.0


def test_tracker_prints_once_logs_the_figure_and_a_resume_does_not_refire(tmp_path, capsys):
    eos = [0.8] * 5 + [0.8 - 0.1 * k for k in range(1, 8)] + [0.1] * 8
    rows = with_series("eos_rate", eos)
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    for row in rows[:15]:
        t.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    t.close()
    out = capsys.readouterr().out
    assert out.count("chatrl alert") == 1 and "[step 11] eos_collapse: EOS rate 0.30" in out
    logged = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "alert/eos_collapse" in r] == [11]
    assert logged[10]["alert/eos_collapse"] == pytest.approx(0.3)
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    t.resumed_at(12)  # the alert of step 11 is replayed silently
    for row in rows[12:]:
        t.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    t.close()
    assert "chatrl alert" not in capsys.readouterr().out
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    t.resumed_at(9)  # before the alert: the redone steps fire it again, once
    for row in rows[9:]:
        t.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    t.close()
    assert capsys.readouterr().out.count("chatrl alert") == 1


def test_demo_runs_real_step3_metrics():
    """The 40 PPO steps of `train.py --preset demo` (stories260K, 2 CPU ranks): a healthy run, no alert.
    Its KL warm-up (0 → ~1 nat in 7 steps, β 0.1) lowers the KL-penalised reward while the score rises a
    little: with a margin of 0.1 score std (batch noise) that fired score_up_reward_down at step 13."""
    from pathlib import Path

    from chatrl.tracking import read_metrics

    rows = read_metrics(Path(__file__).resolve().parents[1] / "data" / "demo_step3_metrics.jsonl")
    assert len(rows) == 40 and rows[-1]["step"] == 40
    assert check_rows(rows) == []
    a = fired(rows, hack_margin=0.1)
    assert list(a) == ["score_up_reward_down"] and a["score_up_reward_down"].step == 13
