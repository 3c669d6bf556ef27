"""The evaluation's statistics (chatrl.eval.stats, chatrl.eval.summary): hand-derived win rates and
distinct-n, the bootstrap interval (its resamples, its mirror symmetry, its coverage), the
length-controlled win rate (intercept-only fit by hand, mirror, a length-only judge pulled toward 0.5,
a gain at equal length kept), and the over-optimisation check."""

import math

import numpy as np
import pytest

from chatrl.eval import verdict
from chatrl.eval.judges import compare
from chatrl.eval.stats import bootstrap_win_rate, distinct_n, length_controlled, outcome, win_rate
from chatrl.eval.summary import format_table, over_optimisation, pair_list


def test_outcome_and_win_rate_count_ties_as_half():
    assert [outcome(0.1, 0.3), outcome(0.3, 0.1), outcome(0.2, 0.2), outcome(0.2, 0.25, tie_margin=0.1)] == \
        [1.0, 0.0, 0.5, 0.5]
    assert win_rate([1, 0, 0.5, 1]) == 0.625
    assert win_rate([[1, 0], [0.5, 0.5]]) == 0.5  # (prompts, draws): the mean over both
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        win_rate([1.5])


def test_bootstrap_resamples_prompts_with_their_draws():
    y = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 1.0]])  # per prompt: 1, 0.5, 0, 0.75
    w = bootstrap_win_rate(y, n_boot=200, seed=7)
    assert w.value == pytest.approx(0.5625)
    rng = np.random.default_rng(7)  # the same resamples, by hand: prompt means averaged over drawn prompts
    idx = rng.integers(0, 4, size=(200, 4))
    rates = y.mean(1)[idx].mean(1)
    assert (w.low, w.high) == pytest.approx(tuple(np.quantile(rates, [0.025, 0.975])), abs=1e-12)
    const = bootstrap_win_rate(np.full((10, 3), 0.5))
    assert (const.value, const.low, const.high, const.within_noise) == (0.5, 0.5, 0.5, True)


def test_swapping_the_models_mirrors_the_interval_exactly():
    rng = np.random.default_rng(0)
    y = rng.choice([0.0, 0.5, 1.0], size=(50, 3), p=[0.3, 0.1, 0.6])
    d = rng.normal(0, 20, size=(50, 3))
    ab, ba = bootstrap_win_rate(y, seed=3), bootstrap_win_rate(1 - y, seed=3)
    assert (ba.value, ba.low, ba.high) == pytest.approx((1 - ab.value, 1 - ab.high, 1 - ab.low), abs=1e-12)
    lab, lba = length_controlled(y, d, seed=3), length_controlled(1 - y, -d, seed=3)
    assert (lba.value, lba.low, lba.high) == pytest.approx((1 - lab.value, 1 - lab.high, 1 - lab.low), abs=1e-9)


def test_noise_and_a_clear_gain():
    rng = np.random.default_rng(1)
    fair = (rng.random((200, 2)) < 0.5).astype(float)
    w = bootstrap_win_rate(fair)
    assert w.within_noise and w.low < 0.5 < w.high
    clear = (rng.random((200, 2)) < 0.95).astype(float)
    w = bootstrap_win_rate(clear)
    assert not w.within_noise and w.low > 0.9 and w.high - w.low < 0.08


def test_bootstrap_interval_covers_the_true_win_rate_about_95_percent_of_the_time():
    rng = np.random.default_rng(2)
    hits = 0
    for trial in range(200):
        y = (rng.random((80, 1)) < 0.6).astype(float)
        w = bootstrap_win_rate(y, n_boot=400, seed=trial)
        hits += w.low <= 0.6 <= w.high
    assert 0.90 <= hits / 200 <= 0.99, hits  # seen: 0.94


def test_length_controlled_without_length_differences_is_the_penalised_intercept():
    """With Δ = 0 everywhere only the intercept is fitted: n (σ(a) − ȳ) + λ a = 0 (the penalised score
    equation), solved here by bisection."""
    y = np.array([1.0] * 30 + [0.0] * 10)[:, None]
    lc = length_controlled(y, np.zeros_like(y), n_boot=10, l2=1e-2)
    lo, hi = -10.0, 10.0
    for _ in range(200):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if 40 * (1 / (1 + math.exp(-a)) - 0.75) + 1e-2 * a < 0 else (lo, a)
    assert lc.value == pytest.approx(1 / (1 + math.exp(-lo)), abs=1e-9)
    assert lc.value == pytest.approx(0.75, abs=1e-3)  # the penalty shrinks it by 2.7e-4


class LengthJudge:
    """A pointwise judge that rewards length alone: the score of an answer is its number of characters."""

    name = "length"

    def score(self, prompts, answers):
        return [float(len(a)) for a in answers]


def length_only(n: int, seed: int):
    """``n`` comparisons of A's answers (20-59 characters) and B's (30-69, 10 longer on average) by a judge
    that rewards length alone: ``(outcomes (n, 1), length differences (n, 1))``."""
    rng = np.random.default_rng(seed)
    a = ["x" * k for k in rng.integers(20, 60, n)]
    b = ["y" * k for k in rng.integers(30, 70, n)]
    d = np.array([len(z) - len(x) for x, z in zip(a, b, strict=True)], dtype=float)[:, None]
    prompts = [({"role": "user", "content": "q"},)] * n
    return compare(LengthJudge(), prompts, a, b)[:, None], d


@pytest.mark.parametrize("n,seed", [(120, 1), (120, 3), (300, 0), (300, 1), (300, 2), (300, 3)])
def test_a_win_that_length_alone_explains_is_reported_as_such(n, seed):
    """B's answers are 10 characters longer on average and the judge prefers the longer answer: B wins about
    0.7 of the comparisons, but at equal length it has no advantage. The outcomes are separated by length
    (no maximum-likelihood fit exists), so no length-controlled figure is given: length explains the
    outcome, and the interval [0, 1] holds 0.5. (A ridge-penalised fit gave 0.660 [0.532, 0.802] for
    n 120 seed 1 and 0.676 [0.566, 0.798] for seed 3: a length-only win called significant.)"""
    y, d = length_only(n, seed)
    raw, lc = bootstrap_win_rate(y), length_controlled(y, d)
    assert raw.value > 0.65 and not raw.within_noise
    assert lc.length_explains and lc.value is None and (lc.low, lc.high) == (0.0, 1.0) and lc.within_noise
    assert lc.to_dict() == {"value": None, "ci": [0.0, 1.0], "within_noise": True, "length_explains": True}
    mirrored = length_controlled(1 - y, -d)  # a judge that prefers the shorter answer, the models swapped
    assert mirrored.length_explains and (mirrored.low, mirrored.high) == (0.0, 1.0)


def test_a_unanimous_win_is_length_controlled_only_where_b_also_won_when_shorter():
    y = np.ones((40, 1))
    both = np.linspace(-20, 20, 40)[:, None]  # B also shorter in half the comparisons: it wins at every length
    lc = length_controlled(y, both, n_boot=200)
    assert (lc.value, lc.low, lc.high, lc.length_explains) == (1.0, 1.0, 1.0, False)
    assert length_controlled(1 - y, -both, n_boot=200).value == 0.0
    longer = np.linspace(1, 40, 40)[:, None]  # B always the longer answer: length could explain it as well
    lc = length_controlled(y, longer, n_boot=200)
    assert lc.length_explains and (lc.low, lc.high) == (0.0, 1.0)


def test_length_controlled_keeps_a_gain_at_equal_length():
    rng = np.random.default_rng(4)
    y = (rng.random((300, 1)) < 0.75).astype(float)
    d = rng.normal(0, 30, (300, 1))  # lengths differ, but the outcome does not depend on them
    raw, lc = bootstrap_win_rate(y), length_controlled(y, d)
    assert lc.value == pytest.approx(raw.value, abs=0.03) and not lc.within_noise


def test_distinct_n_by_hand():
    assert distinct_n(["a b a b"], 1) == 0.5  # a, b of 4 unigrams
    assert distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)  # (a b), (b a) of 3 bigrams
    assert distinct_n(["The cat", "the dog"], 1) == 0.75  # lower-cased: the, cat, dog of 4
    assert math.isnan(distinct_n(["one"], 2))


def test_over_optimisation_marks_the_gold_peak_and_a_proxy_that_keeps_rising():
    def pts(proxy, gold):
        return [{"label": f"s{i}", "win_rate": p, "gold_win_rate": g, "gold_ci": [g - 0.02, g + 0.02]}
                for i, (p, g) in enumerate(zip(proxy, gold, strict=True))]

    hacked = over_optimisation(pts([0.60, 0.70, 0.75, 0.80], [0.55, 0.62, 0.58, 0.54]))
    assert hacked["peak"] == "s1" and hacked["proxy_rises_after_peak"] and hacked["drop_beyond_noise"]
    assert hacked["gold_drop"] == pytest.approx(0.08)
    assert "peaks at s1 (0.620)" in hacked["message"] and "over-optimisation" in hacked["message"]
    healthy = over_optimisation(pts([0.6, 0.7], [0.55, 0.6]))
    assert healthy["peak"] == "s1" and not healthy["proxy_rises_after_peak"]
    assert "no sign of over-optimisation" in healthy["message"]


def test_pairs_and_the_table():
    assert pair_list(["a", "b", "c"], "baseline") == [("a", "b"), ("a", "c")]
    assert pair_list(["a", "b", "c"], "all") == [("a", "b"), ("a", "c"), ("b", "c")]
    fig = {"answers": 2, "length_tokens": 3.0, "length_chars": 9.0, "eos_rate": 1.0, "distinct_1": 1.0,
           "distinct_2": 1.0, "kl": None}
    judge = {"win_rate": {"value": 0.5, "ci": [0.4, 0.6], "within_noise": True},
             "length_controlled": {"value": 0.5, "ci": [0.4, 0.6], "within_noise": True}, "ties": 1.0}
    table = format_table({"figures": {"a": {"greedy": fig}, "b": {"greedy": fig}},
                          "pairs": [{"a": "a", "b": "b", "decoding": "greedy", "judge": judge}]})
    assert "b vs a" in table and "0.500 [0.400, 0.600]" in table and "difference within noise" in table
    # a loss within noise is not called a gain; a win that length explains has no length-controlled figure
    loss = {"win_rate": {"value": 0.417, "ci": [0.32, 0.51], "within_noise": True},
            "length_controlled": {"value": None, "ci": [0.0, 1.0], "within_noise": True, "length_explains": True},
            "ties": 0.0}
    table = format_table({"figures": {"a": {"greedy": fig}, "b": {"greedy": fig}},
                          "pairs": [{"a": "a", "b": "b", "decoding": "greedy", "judge": loss}]})
    assert "0.417 [0.320, 0.510]" in table and "gain" not in table and "difference within noise" in table
    assert "length explains the outcome" in table
    assert verdict({"value": 0.417, "within_noise": False}) == "A better"
    assert verdict({"value": 0.6, "within_noise": False}) == "B better"
