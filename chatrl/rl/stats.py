"""Logged statistics over the global batch: every rank adds its sums, one all-reduce, then the figures.

A mean of per-rank means is the global mean only when every rank holds the same weight, and a mean of
per-rank standard deviations is never the global one: rank 0 scoring 0 and rank 1 scoring 1 would log a
score std of 0. :class:`PooledStats` keeps each statistic as the sums it is made of (weighted sum and
weight for a mean; count, sum and sum of squares for a standard deviation; the moments of the returns
and residuals for the explained variance), all-reduces them in one float64 vector, and finishes them
into the figures of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class PooledStats:
    """Statistics of one training step over every rank's rollouts or tokens.

    Each ``add_*`` call adds this rank's part; :meth:`finish` (a collective when ``all_reduce_sum`` is
    given: every rank calls it, having added the same names) returns ``{name: float}``.
    """

    def __init__(self):
        self._kinds: dict[str, str] = {}
        self._sums: dict[str, list[float]] = {}

    def _add(self, name: str, kind: str, values: list[float]) -> None:
        if self._kinds.setdefault(name, kind) != kind:
            raise ValueError(f"statistic {name!r} added as {self._kinds[name]} and as {kind}")
        have = self._sums.setdefault(name, [0.0] * len(values))
        for i, v in enumerate(values):
            have[i] += float(v)

    def add_mean(self, name: str, values: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """A mean over items (``values`` of any shape, each weighing ``weights`` of the same shape, 1 by
        default; a 0 weight leaves the item out): sum of weighted values and of weights."""
        v = values.detach().double()
        w = torch.ones_like(v) if weights is None else weights.detach().double()
        keep = w != 0
        self._add(name, "mean", [torch.where(keep, v * w, 0.0).sum().item(), w.sum().item()])

    def add_weighted(self, name: str, mean: float, weight: float) -> None:
        """A mean already taken over ``weight`` items (e.g. one micro-batch's token mean and its token count)."""
        self._add(name, "mean", [float(mean) * float(weight), float(weight)])

    def add_std(self, name: str, values: torch.Tensor) -> None:
        """A population standard deviation over items: their count, sum and sum of squares."""
        v = values.detach().double().reshape(-1)
        self._add(name, "std", [v.numel(), v.sum().item(), (v * v).sum().item()])

    def add_explained_variance(self, name: str, values: torch.Tensor, returns: torch.Tensor,
                               mask: torch.Tensor) -> None:
        """``1 - Var(R - V) / Var(R)`` over the valid tokens of every rank (population variances, as
        :func:`chatrl.rl.core.explained_variance`): the count and the first two moments of ``R`` and
        ``R - V``."""
        valid = mask != 0
        r = returns.detach().double()[valid]
        d = r - values.detach().double()[valid]
        self._add(name, "ev", [r.numel(), r.sum().item(), (r * r).sum().item(), d.sum().item(), (d * d).sum().item()])

    def finish(self, all_reduce_sum: AllReduce | None = None) -> dict[str, float]:
        """The figures over every rank: a mean is NaN without weight, a std or explained variance NaN
        without items (the explained variance also when the returns do not vary)."""
        names = sorted(self._sums)  # the same order on every rank, whatever order they were added in
        flat = torch.tensor([x for n in names for x in self._sums[n]], dtype=torch.float64)
        if all_reduce_sum is not None and flat.numel():
            flat = all_reduce_sum(flat)
        out, i = {}, 0
        for n in names:
            k = len(self._sums[n])
            s = flat[i:i + k].tolist()
            i += k
            out[n] = _finish(self._kinds[n], s)
        return out


def _finish(kind: str, s: list[float]) -> float:
    if kind == "mean":
        return s[0] / s[1] if s[1] else math.nan
    if kind == "std":
        n, total, sq = s
        if not n:
            return math.nan
        mean = total / n
        var = sq / n - mean * mean
        return 0.0 if var <= 1e-12 * mean * mean else math.sqrt(var)  # a constant's moments round in float64
    n, r, r2, d, d2 = s
    if not n:
        return math.nan
    var_r = r2 / n - (r / n) ** 2
    var_d = d2 / n - (d / n) ** 2
    constant = var_r <= 1e-12 * max(r2 / n, 1e-300)  # float64 rounding of a constant's moments
    return math.nan if constant else 1.0 - var_d / var_r
