"""Metrics: one JSON object per line in ``OUTPUT_DIR/logs/metrics.jsonl``, TensorBoard, a progress bar.

Only rank 0 writes; other ranks get a tracker that does nothing, so step code calls it
unconditionally.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from chatrl.config import LogConfig
from chatrl.evidence.alerts import ALERT_PREFIX, AlertMonitor, format_alert

METRICS_FILE = Path("logs") / "metrics.jsonl"
SAMPLES_FILE = Path("logs") / "samples.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics log, in order; a line cut off by a crash is left out. ``[]`` if absent."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


#: A step-3 trend compares the mean of the first ``TREND_FIRST`` logged steps (the policy before it has
#: moved much) with the mean of the last ``TREND_LAST`` (the level it ends at, less noisy than one step).
TREND_FIRST, TREND_LAST = 5, 10


@dataclass(frozen=True)
class StepTrend:
    """How a per-step figure moved over a run (:func:`step_trend`).

    Attributes:
        start: mean of the first ``first`` finite values. end: mean of the last ``last`` (None with one value).
        first, last: the two windows' sizes in logged steps (disjoint).
        noise: two standard errors of ``end - start`` (``2 sqrt(s₁²/first + s₂²/last)``, the sample
            variances of the two windows, the steps' batches taken as independent); None when a window
            holds a single value.
    """

    start: float
    end: float | None
    first: int
    last: int
    noise: float | None

    @property
    def verdict(self) -> str | None:
        """"rose" or "fell" when ``end - start`` exceeds :attr:`noise`, else "no change beyond noise";
        None when the noise is unknown (too few steps)."""
        if self.end is None or self.noise is None:
            return None
        change = self.end - self.start
        return "no change beyond noise" if abs(change) <= self.noise else "rose" if change > 0 else "fell"

    def text(self, fmt: str) -> str:
        """``"0.128 → 0.120"`` (``fmt`` formats one value), the start alone with one value."""
        return fmt.format(self.start) + ("" if self.end is None else f" → {fmt.format(self.end)}")

    @property
    def definition(self) -> str:
        """The windows in words: ``"mean of the first 5 steps → of the last 10"``."""
        if self.end is None:
            return "one step logged"
        return f"mean of the first {self.first} step{'s' * (self.first > 1)} → of the last {self.last}"


def step_trend(values) -> StepTrend | None:
    """The trend of a per-step figure (step 3's score, its EOS rate): the one definition the console
    (:func:`results_line`, :class:`Trend`), ``train.py``'s results, the run report and the README use.

    The mean of the first ``min(TREND_FIRST, n // 2)`` finite values → the mean of the last
    ``min(TREND_LAST, n - first)``, two disjoint windows (``n`` the number of finite values); with one
    value, that value alone. Non-finite values are left out. None when there is none.
    """
    ys = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not ys:
        return None
    if len(ys) == 1:
        return StepTrend(ys[0], None, 1, 0, None)
    first = min(TREND_FIRST, len(ys) // 2)
    last = min(TREND_LAST, len(ys) - first)
    a, b = ys[:first], ys[-last:]

    def var(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)

    noise = 2 * math.sqrt(var(a) / first + var(b) / last) if first > 1 and last > 1 else None
    return StepTrend(sum(a) / first, sum(b) / last, first, last, noise)


# What a step's results line reports, in order: (metric, label, format, how). ``how``: "first→last"
# (the first and the last logged value: evaluations before and after training), "trend" (a
# per-step figure, :func:`step_trend`), "max", or "last".
RESULTS = (
    ("eval/ppl", "eval perplexity", "{:.2f}", "first→last"),
    ("eval/accuracy", "eval accuracy", "{:.3f}", "first→last"),
    ("eval/rewards/accuracy", "eval accuracy", "{:.3f}", "first→last"),
    ("eval/eos_rate", "greedy answers ending their turn", "{:.1%}", "first→last"),
    ("reward/score_mean", "score", "{:.3f}", "trend"),
    ("kl", "KL max", "{:.3f} nats", "max"),
    ("eos_rate", "EOS rate", "{:.2f}", "trend"),
)


def results_line(rows: list[dict]) -> str:
    """One line of a step's results from its metrics rows (:func:`read_metrics`): eval perplexity,
    accuracy and EOS checks before → after, step 3's score and EOS rate as :func:`step_trend`s
    with their verdicts and, once, the trend's windows, and its KL max (:data:`RESULTS`); non-finite
    values are left out. ``""`` when none is logged."""
    parts, windows = [], None
    for key, label, fmt, how in RESULTS:
        ys = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if not ys:
            continue
        if how == "max":
            parts.append(f"{label} {fmt.format(max(ys))}")
        elif how == "trend":
            t = step_trend(ys)
            parts.append(f"{label} {t.text(fmt)}" + (f" ({t.verdict})" if t.verdict else ""))
            windows = t.definition if t.end is not None else windows
        elif how == "first→last" and len(ys) > 1:
            parts.append(f"{label} {fmt.format(ys[0])} → {fmt.format(ys[-1])}")
        else:
            parts.append(f"{label} {fmt.format(ys[-1])}")
    return ", ".join(parts) + (f"; trends: {windows}" if windows else "")


class Trend:
    """The metrics rows of a running step, kept for a one-line trend on the console
    (:func:`results_line`: step 3's score and EOS rate as :func:`step_trend` so far, KL max)."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, metrics: dict) -> None:
        """Keep the figures :func:`results_line` reads from one logged row."""
        self.rows.append({k: metrics[k] for k, *_ in RESULTS if k in metrics})

    def line(self, label: str) -> str:
        """``label: score 0.126 → 0.142 (rose), KL max 0.880 nats, EOS rate 0.47 → 0.70 (rose); trends: mean
        of the first 5 steps → of the last 10``."""
        return f"{label}: {results_line(self.rows) or 'nothing logged yet'}"


class Tracker:
    """Writes metrics of one run, and checks them against the run-health alerts.

    Every logged row goes through :class:`chatrl.evidence.alerts.AlertMonitor`; an alert that fires is
    printed once (rank 0) and logged as ``alert/<rule>`` (its figure) in the same row.

    Args:
        output_dir: the step's output folder; the log goes to ``output_dir/logs/metrics.jsonl``
            (appended, so a resumed run continues the same file; see :meth:`resumed_at`).
        enabled: write anything at all (true on rank 0 only).
        tensorboard: also write TensorBoard scalars to ``tensorboard_path``
            (default ``output_dir/logs/tb``).
        progress: show a tqdm bar.
    """

    def __init__(self, output_dir: str, enabled: bool, tensorboard: bool = False,
                 tensorboard_path: str | None = None, progress: bool = True):
        self.enabled = enabled
        self.progress_enabled = enabled and progress
        self._tb = None
        self._bar = None
        self._start = time.time()
        self._desc = ""
        self.alerts = AlertMonitor()
        if not enabled:
            return
        log_dir = Path(output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = Path(output_dir) / METRICS_FILE
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_path or str(log_dir / "tb"))

    @classmethod
    def for_run(cls, log: LogConfig, is_main: bool) -> Tracker:
        """The tracker of a program's :class:`chatrl.config.LogConfig` (rank 0 writes: ``is_main``)."""
        return cls(log.output_dir, is_main, log.enable_tensorboard, log.tensorboard_path,
                   progress=not log.disable_progress_bar)

    def resumed_at(self, step: int) -> None:
        """A resumed run continues from optimizer step ``step``: drop the logged rows of later steps.

        Those steps are trained again, so their old rows would appear twice. The whole earlier log
        is first kept as ``metrics.before-resume-N.jsonl`` (N counts resumes), then
        ``metrics.jsonl`` is rewritten atomically with the rows up to ``step``. TensorBoard events of
        later steps are purged the same way (``SummaryWriter(purge_step=step + 1)``).
        """
        if not self.enabled:
            return
        import shutil

        self._file.close()
        n = 1 + sum(1 for _ in self.path.parent.glob("metrics.before-resume-*.jsonl"))
        shutil.copyfile(self.path, self.path.with_name(f"metrics.before-resume-{n}.jsonl"))
        kept = [row for row in read_metrics(self.path) if row.get("step", 0) <= step]
        _rewrite(self.path, kept)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        samples = self.path.parent.parent / SAMPLES_FILE
        if samples.exists():
            _rewrite(samples, [row for row in read_metrics(samples) if row.get("step", 0) <= step])
        self.alerts = AlertMonitor()  # alerts of the kept steps fired already: replay them silently
        for row in kept:
            self.alerts.update(row)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self._tb.log_dir
            self._tb.close()
            self._tb = SummaryWriter(log_dir, purge_step=step + 1)

    def log(self, metrics: dict, step: int) -> None:
        """Record ``metrics`` (name → number) at optimizer step ``step``."""
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "item") else v) for k, v in metrics.items()}
        fired = self.alerts.update({"step": step, **clean})
        clean.update({ALERT_PREFIX + a.rule: a.value for a in fired})
        row = {"step": step, "elapsed_s": round(time.time() - self._start, 3), **clean}
        self._file.write(json.dumps(row, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._bar is not None:
            keep = ("ppl", "eval/ppl", "eval/accuracy", "reward/mean")
            shown = {k: f"{v:.4g}" for k, v in clean.items() if isinstance(v, float) and ("loss" in k or k in keep)}
            self._bar.set_postfix(shown, refresh=False)
        for alert in fired:
            self.write(format_alert(alert, self._desc))

    def sample(self, step: int, prompt: str, answer: str, score: float, kl: float | None, show: bool = True,
               turns: list[dict] | None = None) -> None:
        """Record one rollout of optimizer step ``step`` in ``logs/samples.jsonl`` (for the run report):
        its prompt and answer text, reward-model ``score`` and summed ``kl`` (nats; ``None``, left out of
        the row, when the run has no reference); ``show`` prints it.
        A multi-turn episode also records its ``turns`` (``{"role", "content", "observation"}``), the
        environment's observations marked, and prints them as such (``[tool] …``)."""
        if not self.enabled:
            return
        row = {"step": step, "prompt": prompt, "answer": answer, "score": float(score),
               **({"kl": float(kl)} if kl is not None else {})}
        if turns is not None:
            row["turns"] = turns
            answer = "".join(f"\n  [{t['role']}] {t['content']}\n" if t["observation"] else t["content"] for t in turns)
        with open(self.path.parent.parent / SAMPLES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, allow_nan=True) + "\n")
        if show:
            shown = prompt if len(prompt) <= 400 else "…" + prompt[-400:]
            self.write(f"--- step {step} score {score:+.3f}\n{shown}[{answer}]")

    def bar(self, total: int, desc: str, initial: int = 0):
        """Start a progress bar of ``total`` optimizer steps (a no-op object off rank 0)."""
        if self.progress_enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True)
        self._desc = desc
        return self

    def advance(self, n: int = 1) -> None:
        """Move the progress bar one step."""
        if self._bar is not None:
            self._bar.update(n)

    def write(self, text: str) -> None:
        """Print a line on rank 0 without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Close the metrics file, TensorBoard writer and progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def _rewrite(path: Path, rows: list[dict]) -> None:
    """Replace a JSONL file with ``rows``, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row, allow_nan=True) + "\n" for row in rows), encoding="utf-8")
    os.replace(tmp, path)


def setup_logging(rank: int) -> None:
    """INFO logging on rank 0, warnings only elsewhere; quiets transformers' and DeepSpeed's chatter."""
    import logging

    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except Exception:  # pragma: no cover - transformers is a hard dependency; be robust anyway
        pass
