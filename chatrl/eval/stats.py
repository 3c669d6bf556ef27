"""The statistics of an evaluation: win rates with bootstrap intervals, the length-controlled win rate,
and the per-model figures (answer length, EOS rate, distinct-n, KL). Pure numpy functions, no I/O.

Outcomes are per prompt and draw: an ``(n, k)`` array for ``n`` prompts and ``k`` draws per prompt
(one greedy answer, or one sampled answer per seed), each the win of model B over model A: 1 when
the judge prefers B, 0 when it prefers A, 0.5 for a tie (or a soft preference in ``[0, 1]`` from a
pairwise judge, averaged over both presentation orders). ``docs/evaluation.md`` states each
formula with an example.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LengthControlled", "WinRate", "bootstrap_win_rate", "distinct_n", "length_controlled", "outcome",
           "win_rate"]


def outcome(score_a: float, score_b: float, tie_margin: float = 0.0) -> float:
    """The win of B over A from two pointwise judge scores: 1 if ``score_b - score_a > tie_margin``,
    0 if ``score_a - score_b > tie_margin``, else 0.5 (a tie counts as half a win)."""
    d = score_b - score_a
    return 1.0 if d > tie_margin else 0.0 if -d > tie_margin else 0.5


def _check_outcomes(outcomes) -> np.ndarray:
    y = np.asarray(outcomes, dtype=np.float64)
    if y.ndim == 1:
        y = y[:, None]
    if y.ndim != 2 or y.shape[0] == 0 or y.shape[1] == 0:
        raise ValueError(f"outcomes must be (prompts, draws) with at least one of each, got shape {y.shape}")
    if not np.all((y >= 0) & (y <= 1)):
        raise ValueError("outcomes must lie in [0, 1] (1: B wins, 0: A wins, 0.5: tie)")
    return y


def win_rate(outcomes) -> float:
    """Mean outcome over prompts and draws: the share of comparisons B wins, ties counted as half.

    Args:
        outcomes: ``(n, k)`` (or ``(n,)``) values in ``[0, 1]``.
    """
    return float(_check_outcomes(outcomes).mean())


def _resample_counts(n: int, n_boot: int, seed: int) -> np.ndarray:
    """``(n_boot, n)`` counts: how often each prompt appears in each bootstrap resample of the ``n``
    prompts (drawn with replacement from ``np.random.default_rng(seed)``)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    counts = np.zeros((n_boot, n), dtype=np.float64)
    np.add.at(counts, (np.arange(n_boot)[:, None], idx), 1.0)
    return counts


def _percentile_interval(values: np.ndarray, level: float) -> tuple[float, float]:
    """The central ``level`` percentile interval of ``values`` (numpy's linear interpolation, which is
    symmetric: the interval of ``1 - values`` is ``1 -`` the interval of ``values``, reversed)."""
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class WinRate:
    """A win rate and its bootstrap interval.

    Attributes:
        value: the win rate of B over A (:func:`win_rate`).
        low, high: the central ``level`` percentile bootstrap interval.
        level: the interval's coverage (0.95).
    """

    value: float
    low: float
    high: float
    level: float = 0.95

    @property
    def within_noise(self) -> bool:
        """Whether the interval holds 0.5: the data cannot tell B from A ("difference within noise")."""
        return self.low <= 0.5 <= self.high

    def to_dict(self) -> dict:
        """JSON form: ``{"value", "ci": [low, high], "within_noise"}``."""
        return {"value": self.value, "ci": [self.low, self.high], "within_noise": self.within_noise}


def bootstrap_win_rate(outcomes, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> WinRate:
    """The win rate with a percentile bootstrap interval over prompts (Efron & Tibshirani 1993, ch. 13).

    Each resample draws ``n`` prompts with replacement (seeded: ``np.random.default_rng(seed)``) and
    keeps all ``k`` draws of each drawn prompt, so that the answers of one prompt stay together (they
    are not independent: one hard prompt makes every seed's answer lose); the interval is the central
    ``level`` range of the ``n_boot`` resampled win rates. The resamples depend only on ``n`` and
    ``seed``: swapping A and B turns every resampled rate ``r`` into ``1 - r`` and so mirrors the
    interval exactly.

    Args:
        outcomes: ``(n, k)`` values in ``[0, 1]``. n_boot: resamples (≥ 1). seed: their RNG seed.
        level: coverage in ``(0, 1)``.

    Raises:
        ValueError: bad shapes or values, ``n_boot < 1`` or ``level`` outside ``(0, 1)``.
    """
    y = _check_outcomes(outcomes)
    if n_boot < 1 or not 0 < level < 1:
        raise ValueError(f"n_boot must be >= 1 and level in (0, 1), got {n_boot}, {level}")
    per_prompt = y.mean(axis=1)
    counts = _resample_counts(len(per_prompt), n_boot, seed)
    rates = counts @ per_prompt / len(per_prompt)
    return WinRate(float(y.mean()), *_percentile_interval(rates, level), level=level)


def _fit_logistic(x: np.ndarray, y: np.ndarray, w: np.ndarray, l2: float, iters: int = 50) -> np.ndarray:
    """Penalised logistic regressions fitted by Newton's method, several at once.

    Minimises, for each row ``r`` of ``w``, ``-Σ_i w[r, i] (y_i log p_i + (1 - y_i) log(1 - p_i)) +
    (l2 / 2) |θ_r|²`` with ``p_i = σ(θ_r · x_i)``. The penalty makes the problem strictly convex (a
    unique, finite fit even when the outcomes are separable by ``x``); a Newton step is capped at 4 in
    norm so that the first steps from 0 cannot overshoot.

    Args:
        x: ``(N, 2)`` design (a column of ones, the covariate). y: ``(N,)`` targets in ``[0, 1]``.
        w: ``(R, N)`` non-negative observation weights (bootstrap counts). l2: the penalty (> 0).

    Returns:
        ``(R, 2)`` coefficients.
    """
    theta = np.zeros((w.shape[0], x.shape[1]))
    eye = np.eye(x.shape[1])
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(theta @ x.T)))                        # (R, N)
        grad = (w * (p - y)) @ x + l2 * theta                            # (R, 2)
        hess = np.einsum("rn,ni,nj->rij", w * p * (1 - p), x, x) + l2 * eye  # (R, 2, 2)
        step = np.linalg.solve(hess, grad[..., None])[..., 0]
        norm = np.linalg.norm(step, axis=1, keepdims=True)
        step = step * np.minimum(1.0, 4.0 / np.maximum(norm, 1e-300))
        theta = theta - step
        if float(np.abs(step).max()) < 1e-10:
            break
    return theta


@dataclass(frozen=True)
class LengthControlled:
    """The length-controlled win rate and its bootstrap interval (:func:`length_controlled`).

    Attributes:
        value: the win rate predicted at equal length, or None when length explains the outcome
            (the outcomes are ordered by length and the data cannot say what B scores at equal length).
        low, high: the central ``level`` percentile bootstrap interval, resamples that cannot say it
            counted at both ends (0 for ``low``, 1 for ``high``).
        level: the interval's coverage (0.95).
    """

    value: float | None
    low: float
    high: float
    level: float = 0.95

    @property
    def within_noise(self) -> bool:
        """Whether the interval holds 0.5: at equal length the data cannot tell B from A."""
        return self.low <= 0.5 <= self.high

    @property
    def length_explains(self) -> bool:
        """Whether length alone explains the outcomes (no length-controlled figure)."""
        return self.value is None

    def to_dict(self) -> dict:
        """JSON form: ``{"value" (None when length explains the outcome), "ci": [low, high], "within_noise",
        "length_explains"}``."""
        return {"value": self.value, "ci": [self.low, self.high], "within_noise": self.within_noise,
                "length_explains": self.length_explains}


def _masked(x: np.ndarray, mask: np.ndarray, fill: float, reduce) -> np.ndarray:
    return reduce(np.where(mask, x, fill), axis=1)


def _separated_by_length(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which weightings of the data leave the logistic fit of :func:`length_controlled` without a
    maximum-likelihood estimate, and what such data says at equal length; several weightings at once.

    The maximum-likelihood fit of ``P(B wins) = σ(a + b x)`` does not exist exactly when the outcomes are
    separated (Albert & Anderson 1984): some direction ``(a, b) ≠ 0`` has ``a + b x ≥ 0`` at every win,
    ``≤ 0`` at every loss and ``= 0`` at every soft outcome (a tie), strictly at one point at least; the
    likelihood rises without bound along it, and a penalised fit is the penalty's choice, not the data's.
    With ``b ≠ 0`` the direction is a threshold on ``x``: the wins on one side, the losses on the other,
    the soft outcomes on it; a length rule reproduces every outcome, and the data cannot say what B
    scores at equal length (any threshold in the gap fits, each with its own prediction at ``x = 0``):
    NaN. With ``b = 0`` the outcome is unanimous: B wins every comparison (or loses every one); where
    the comparisons reach both sides of equal length (``min x ≤ 0 ≤ max x``) it does so at every
    length and the figure is 1 (or 0); where B is always the longer (or always the shorter) answer,
    length could explain it as well: NaN.

    Args:
        x: ``(N,)`` length differences (any scale). y: ``(N,)`` outcomes in ``[0, 1]``.
        w: ``(R, N)`` non-negative weights; a point with weight 0 is absent.

    Returns:
        ``(separated (R,) bool, value (R,))``: ``value`` is the figure where ``separated`` (NaN: length
        explains the outcome).
    """
    act = w > 0
    win, loss = act & (y == 1), act & (y == 0)
    soft = act & (y > 0) & (y < 1)
    inf = np.inf
    max_l, min_l = _masked(x, loss, -inf, np.max), _masked(x, loss, inf, np.min)
    max_w, min_w = _masked(x, win, -inf, np.max), _masked(x, win, inf, np.min)
    max_s, min_s = _masked(x, soft, -inf, np.max), _masked(x, soft, inf, np.min)
    lowest, highest = _masked(x, act, inf, np.min), _masked(x, act, -inf, np.max)
    longer_wins = np.maximum(max_l, max_s) <= np.minimum(min_w, min_s)
    shorter_wins = np.maximum(max_w, max_s) <= np.minimum(min_l, min_s)
    # where every point has one x, a threshold through it separates nothing (only the intercept is fitted)
    threshold = (highest > lowest) & (longer_wins | shorter_wins)
    all_win, all_loss = ~(loss | soft).any(axis=1), ~(win | soft).any(axis=1)
    unanimous = all_win | all_loss
    both_sides = (lowest <= 0) & (0 <= highest)
    value = np.where(unanimous & both_sides, np.where(all_win, 1.0, 0.0), np.nan)
    return unanimous | threshold, value


def length_controlled(outcomes, length_diff, n_boot: int = 1000, seed: int = 0, level: float = 0.95,
                      l2: float = 1e-2) -> LengthControlled:
    """The length-controlled win rate: the win rate a logistic regression of the outcome on the
    length difference predicts at equal length, with the same bootstrap as :func:`bootstrap_win_rate`.

    Model: ``P(B wins) = σ(a + b · Δ / s)``, ``Δ = len(B's answer) - len(A's answer)`` in characters
    (the judge reads text: characters mean the same for every tokenizer), ``s`` the root mean square
    of ``Δ`` (a scale only, so that one penalty fits every unit; 1 when all ``Δ`` are 0). Fitted to
    the soft outcomes (ties as 0.5) by penalised maximum likelihood (:func:`_fit_logistic`, ridge
    ``l2 (a² + b²) / 2``, a weak prior that keeps the Newton steps finite). The length-controlled win
    rate is ``σ(a)``, the prediction at ``Δ = 0``. The idea is AlpacaEval 2's length-controlled win
    rate (Dubois et al. 2024, a GLM with a length term, read off at zero length difference) without its
    per-instruction and per-model terms. A win that comes from length alone moves toward 0.5; a win
    at equal length stays.

    When length separates the outcomes (every win on one side of a length threshold, every loss on
    the other: a judge that prefers the longer answer) the likelihood has no maximum, and the
    penalised fit would report whatever the penalty makes of the imbalance of Δ (0.68 for a raw 0.73
    with ``l2`` 0.01, 0.53 with 1e-4): ``value`` is None, length explains the outcome
    (:func:`_separated_by_length`; a unanimous outcome is 1 or 0 where B also won, or lost, at the
    other side of equal length, None where it was always the longer or always the shorter answer).
    A bootstrap resample that cannot say counts as 0 for the interval's lower end and as 1 for its
    upper end, so the interval holds every value the data allows. Swapping A and B flips ``y → 1 - y`` and ``Δ → -Δ``, so ``a → -a``, the separated
    cases swap their ends, and the figure and its interval mirror. Resamples refit the model on the
    same prompt resamples as the win rate.

    Args:
        outcomes: ``(n, k)`` values in ``[0, 1]``. length_diff: ``(n, k)`` length differences.
        n_boot, seed, level: as :func:`bootstrap_win_rate`. l2: the ridge penalty.

    Raises:
        ValueError: shapes that differ, bad outcomes, a non-finite length difference.
    """
    y = _check_outcomes(outcomes)
    d = np.asarray(length_diff, dtype=np.float64).reshape(y.shape) if np.size(length_diff) == y.size else None
    if d is None or not np.all(np.isfinite(d)):
        raise ValueError(f"length_diff must be finite and of the outcomes' shape {y.shape}")
    n, k = y.shape
    scale = float(np.sqrt(np.mean(d ** 2))) or 1.0
    x = np.stack([np.ones(n * k), d.reshape(-1) / scale], axis=1)
    counts = np.concatenate([np.ones((1, n)), _resample_counts(n, n_boot, seed)])  # row 0: the data itself
    weights = np.repeat(counts, k, axis=1)
    theta = _fit_logistic(x, y.reshape(-1), weights, l2)
    fits = 1.0 / (1.0 + np.exp(-theta[:, 0]))
    separated, limit = _separated_by_length(x[:, 1], y.reshape(-1), weights)
    fits = np.where(separated, limit, fits)
    value = None if np.isnan(fits[0]) else float(fits[0])
    low, _ = _percentile_interval(np.nan_to_num(fits[1:], nan=0.0), level)
    _, high = _percentile_interval(np.nan_to_num(fits[1:], nan=1.0), level)
    return LengthControlled(value, low, high, level=level)


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n (Li et al. 2016): distinct word n-grams over all n-grams of ``texts`` (whitespace
    words, lower-cased, counted over the whole set of answers); NaN when the texts hold no n-gram.
    1 means no n-gram repeats; a model that answers everything alike scores near 0.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams, total = set(), 0
    for t in texts:
        words = t.lower().split()
        for i in range(len(words) - n + 1):
            grams.add(tuple(words[i:i + n]))
            total += 1
    return len(grams) / total if total else math.nan


def mean(values: Sequence[float]) -> float:
    """Mean of the finite values, NaN when there is none."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(xs) / len(xs) if xs else math.nan
