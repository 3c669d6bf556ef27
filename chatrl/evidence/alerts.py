"""Run-health alerts computed from the logged metrics: the ways RLHF runs go wrong, seen early.

Every rule reads only the rows that :class:`chatrl.tracking.Tracker` already writes (no cost in
the training loop). :class:`AlertMonitor` is fed one row at a time; a rule fires at most once per
run, at the first step where its condition holds. The Tracker prints each alert once on rank 0
and logs its figure as the metric ``alert/<rule>`` in the same row; the run report
(:mod:`chatrl.tools.report`) replays the same rules over the whole log and lists them at the top.

The rules and their thresholds are documented in ``docs/report.md`` (keep the two in step):

===================  ========================================================================
rule                 fires when (``base`` = mean of the first ``baseline_steps`` logged values,
                     ``recent`` = mean of the last ``window`` values)
===================  ========================================================================
answer_len_growth    ``answer_len`` recent > ``len_growth`` × base and ≥ base + ``len_min_gain``
answer_len_at_max    ``eos_rate`` ≤ ``eos_floor`` and ``answer_len`` unchanged (±0.1 %) for
                     ``window`` steps in a row: every answer runs to the length limit
eos_collapse         ``eos_rate`` recent < ``eos_drop`` × base (base ≥ 0.2)
entropy_collapse     ``entropy`` recent < ``entropy_drop`` × base
kl_surge             ``kl`` ≥ ``kl_floor`` and its least-squares slope over the last
                     ``slope_steps`` steps ≥ ``kl_slope`` nats/step and ≥ ``kl_accel`` × the
                     slope over the ``slope_steps`` steps before
score_up_reward_down over the last ``hack_steps`` steps ``reward/score_mean`` rose and
                     ``reward/mean`` (score − β·KL: the reward relative to the reference model)
                     fell, both by more than ``hack_margin`` × the mean ``reward/score_std``
nonfinite            a logged value is NaN/±inf, or a ``skipped_steps`` counter grows
===================  ========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Thresholds:
    """The alert rules' thresholds (see the module docstring and ``docs/report.md``)."""

    baseline_steps: int = 3       # logged values averaged for a rule's starting level
    window: int = 3               # logged values averaged for a rule's current level
    len_growth: float = 2.0       # answer_len: factor over the starting length
    len_min_gain: float = 8.0     # answer_len: and at least this many tokens more
    eos_floor: float = 0.02       # answer_len_at_max: EOS rate at or below this
    eos_drop: float = 0.5         # eos_collapse: below this share of the starting EOS rate
    eos_min_base: float = 0.2     # eos_collapse: only when the run started with at least this EOS rate
    entropy_drop: float = 0.3     # entropy_collapse: below this share of the starting entropy
    kl_floor: float = 2.0         # kl_surge: KL (nats per answer) at least this
    kl_slope: float = 0.5         # kl_surge: rising at least this many nats per step
    kl_accel: float = 2.0         # kl_surge: and this many times faster than the steps before
    slope_steps: int = 5          # kl_surge: steps per slope estimate
    hack_steps: int = 10          # score_up_reward_down: window (steps)
    hack_margin: float = 0.5      # score_up_reward_down: change in units of the score's spread over rollouts


@dataclass(frozen=True)
class Alert:
    """One fired rule: ``step`` (optimizer step of the row), ``metric`` and its ``value`` (the
    figure), and ``message`` (one line: what was seen and what it usually means)."""

    rule: str
    step: int
    metric: str
    value: float
    message: str


RULES = ("answer_len_growth", "answer_len_at_max", "eos_collapse", "entropy_collapse", "kl_surge",
         "score_up_reward_down", "nonfinite")
ALERT_PREFIX = "alert/"


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, …, n−1 (units of ys per step)."""
    n = len(ys)
    xm, ym = (n - 1) / 2, _mean(ys)
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum((i - xm) ** 2 for i in range(n))


@dataclass
class AlertMonitor:
    """Checks each logged row against the rules; :meth:`update` returns the alerts that fire now.

    Args:
        thresholds: the rules' thresholds.

    A rule needs its metrics in the rows (the PPO rules read step 3's ``answer_len``,
    ``eos_rate``, ``entropy``, ``kl``, ``reward/score_mean``, ``reward/mean``,
    ``reward/score_std``); rows without them leave it silent. Keys starting with ``alert/`` are
    ignored. Each rule fires at most once.
    """

    thresholds: Thresholds = field(default_factory=Thresholds)
    fired: dict = field(default_factory=dict)      # rule → Alert
    _series: dict = field(default_factory=dict)    # metric → [finite values in order]
    _counters: dict = field(default_factory=dict)  # skipped-steps metric → last value

    def update(self, row: dict) -> list[Alert]:
        """Feed one metrics row (``{"step": int, name: number, …}``); returns the newly fired alerts."""
        step = int(row.get("step", 0))
        new = []
        for name, value in row.items():
            if name in ("step", "elapsed_s") or name.startswith(ALERT_PREFIX) or not isinstance(value, (int, float)):
                continue
            value = float(value)
            if not math.isfinite(value):
                new.append(Alert("nonfinite", step, name, value,
                                 f"{name} = {value} at step {step}: a non-finite loss or statistic"))
                continue
            if name.endswith("skipped_steps"):
                before = self._counters.get(name, 0.0)
                self._counters[name] = value
                if value > before:
                    new.append(Alert("nonfinite", step, name, value,
                                     f"{name} {before:g} → {value:g} at step {step}: optimizer steps skipped "
                                     "for non-finite loss or gradients"))
            self._series.setdefault(name, []).append(value)
        touched = {k for k in row if k in self._series}
        for check in (self._length, self._eos, self._entropy, self._kl, self._hack):
            alert = check(step, touched)
            if alert is not None:
                new.append(alert)
        out = []
        for alert in new:
            if alert.rule not in self.fired:
                self.fired[alert.rule] = alert
                out.append(alert)
        return out

    def _levels(self, name: str, touched: set) -> tuple[float, float] | None:
        """(base, recent) of ``name`` once enough values are logged and this row has one."""
        t, ys = self.thresholds, self._series.get(name, [])
        if name not in touched or len(ys) < t.baseline_steps + t.window:
            return None
        return _mean(ys[:t.baseline_steps]), _mean(ys[-t.window:])

    def _length(self, step: int, touched: set) -> Alert | None:
        t = self.thresholds
        lv = self._levels("answer_len", touched)
        if lv is None:
            return None
        base, recent = lv
        if recent > t.len_growth * base and recent >= base + t.len_min_gain:
            return Alert("answer_len_growth", step, "answer_len", recent,
                         f"answer length {recent:.1f} tokens (mean of the last {t.window} steps) is "
                         f"{recent / base:.1f}× the first steps' {base:.1f}: answers growing without bound "
                         "(a length hack of the reward model?)")
        lens, eos = self._series["answer_len"][-t.window:], self._series.get("eos_rate", [])[-t.window:]
        if (len(eos) == t.window and max(eos) <= t.eos_floor
                and max(lens) - min(lens) <= 1e-3 * max(abs(max(lens)), 1.0)):
            return Alert("answer_len_at_max", step, "answer_len", lens[-1],
                         f"answer length pinned at {lens[-1]:.1f} tokens with EOS rate ≤ {t.eos_floor:g} for "
                         f"{t.window} steps: every answer runs to the length limit")
        return None

    def _eos(self, step: int, touched: set) -> Alert | None:
        t = self.thresholds
        lv = self._levels("eos_rate", touched)
        if lv is None or lv[0] < t.eos_min_base or lv[1] >= t.eos_drop * lv[0]:
            return None
        base, recent = lv
        return Alert("eos_collapse", step, "eos_rate", recent,
                     f"EOS rate {recent:.2f} (mean of the last {t.window} steps) fell below {t.eos_drop:g}× the "
                     f"first steps' {base:.2f}: answers stop ending (consider --penalty_no_eos)")

    def _entropy(self, step: int, touched: set) -> Alert | None:
        t = self.thresholds
        lv = self._levels("entropy", touched)
        if lv is None or lv[0] <= 0 or lv[1] >= t.entropy_drop * lv[0]:
            return None
        base, recent = lv
        return Alert("entropy_collapse", step, "entropy", recent,
                     f"entropy {recent:.3f} nats (mean of the last {t.window} steps) fell below "
                     f"{t.entropy_drop:g}× the first steps' {base:.3f}: the policy is collapsing to few answers")

    def _kl(self, step: int, touched: set) -> Alert | None:
        t, ys = self.thresholds, self._series.get("kl", [])
        if "kl" not in touched or len(ys) < 2 * t.slope_steps or ys[-1] < t.kl_floor:
            return None
        now, before = _slope(ys[-t.slope_steps:]), _slope(ys[-2 * t.slope_steps:-t.slope_steps])
        if now < t.kl_slope or now < t.kl_accel * max(before, 0.0):
            return None
        coef = self._series.get("kl_coef", [])
        held = f" with KL coefficient {coef[-1]:.3g}" if coef else ""
        return Alert("kl_surge", step, "kl", ys[-1],
                     f"KL {ys[-1]:.2f} nats rising {now:.2f} nats/step (was {before:.2f}){held}: faster than the "
                     "KL penalty holds it (raise --init_kl_coef, use --kl_ctl adaptive, or lower the learning rate)")

    def _hack(self, step: int, touched: set) -> Alert | None:
        t = self.thresholds
        score, reward = self._series.get("reward/score_mean", []), self._series.get("reward/mean", [])
        spread = self._series.get("reward/score_std", [])
        if "reward/mean" not in touched or min(len(score), len(reward)) < t.hack_steps:
            return None
        k = t.window
        s, r = score[-t.hack_steps:], reward[-t.hack_steps:]
        rise, fall = _mean(s[-k:]) - _mean(s[:k]), _mean(r[:k]) - _mean(r[-k:])
        scale = _mean(spread[-t.hack_steps:]) if spread else 1.0
        margin = t.hack_margin * max(scale, 1e-6)
        if rise <= margin or fall <= margin:
            return None
        return Alert("score_up_reward_down", step, "reward/mean", r[-1],
                     f"over the last {t.hack_steps} steps the score rose by {rise:+.3f} while the KL-penalised reward "
                     f"fell by {-fall:+.3f}: the actor buys score with distance from the reference (reward hacking?)")


def check_rows(rows: list[dict], thresholds: Thresholds | None = None) -> list[Alert]:
    """All alerts of a whole metrics log (rows in logged order), in the order they fired."""
    monitor = AlertMonitor(thresholds or Thresholds())
    fired = []
    for row in rows:
        fired += monitor.update(row)
    return fired


def format_alert(alert: Alert, stage: str = "") -> str:
    """The console line of an alert: ``chatrl alert [step 3 grpo, step 17] eos_collapse: …``."""
    where = f"{stage}, step {alert.step}" if stage else f"step {alert.step}"
    return f"chatrl alert [{where}] {alert.rule}: {alert.message} (docs/report.md)"
