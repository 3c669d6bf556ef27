"""The run report: one self-contained ``report.html`` of a chatrl output folder.

    python -m chatrl.tools.report OUTPUT_DIR          # writes OUTPUT_DIR/report.html (atomically) and prints its path

``OUTPUT_DIR`` is ``train.py``'s ``--output-dir`` (with ``step1_actor/``, ``step2_reward/``,
``step3_rlhf/``) or one step's ``--output_dir``. The report reads only what the steps already
write: ``logs/metrics.jsonl`` (every curve, train and eval; the rows of a resumed run are joined,
with its resume points marked), ``logs/samples.jsonl`` (step 3's rollouts over time),
``chatrl_run.json`` (a finished step's flags and final metrics), ``certificate.json`` (the step's
correctness certificate, :mod:`chatrl.evidence.certificate`), ``OUTPUT_DIR/logs/stepN.log`` (the command
that ran a step) and ``OUTPUT_DIR/eval/eval.json`` (the evaluation's figures, :mod:`chatrl.eval`).
On top: the verdict (step 3's score and EOS rate trends, :func:`chatrl.tracking.step_trend`, and the
evaluation's final win rate), each step's certificate (every property with its figure, bound and pass/fail), then the
run-health alerts (:mod:`chatrl.evidence.alerts`) with their step and figure; then per step the headline
figures, wall time and its split, the charts, the samples and the flags; then the evaluation: win
rates with intervals, the KL / win-rate frontier over step 3's snapshots, and answers side by side.
Charts are drawn with plotly, whose JavaScript is embedded once, so the
file opens offline and makes no network requests. Running the command again on a live output
folder refreshes the report. ``docs/report.md`` describes the report and the alert rules.

Needs plotly (``pip install -e ".[web]"``).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from chatrl.checkpoint import RUN_MARKER
from chatrl.eval import EVAL_FILE, NO_JUDGE, length_controlled_text, verdict
from chatrl.evidence.alerts import ALERT_PREFIX, Alert, check_rows
from chatrl.evidence.certificate import read_certificate
from chatrl.tracking import METRICS_FILE, SAMPLES_FILE, read_metrics, step_trend

REPORT_FILE = "report.html"
STEP_FOLDERS = {"step1_actor": (1, "step 1: supervised fine-tuning"), "step2_reward": (2, "step 2: reward model"),
                "step3_rlhf": (3, "step 3: RLHF"),
                "step2_gold_reward": (4, "gold reward model (a second judge for the evaluation)")}
# Counters and sizes that are not curves worth a chart.
NOT_CHARTED = {"samples", "elapsed_min", "train/tokens", "eval/tokens", "eval/pairs"}
# Metrics drawn together on one chart (step 3); any other metric gets its own chart, with train/X and eval/X together.
CHART_ORDER = ("loss", "ppl", "accuracy", "margin", "score and KL-penalised reward", "kl", "entropy", "answer_len",
               "eos_rate", "reward/score_std", "actor_loss", "critic_loss", "ptx_loss", "explained_variance")
CHART_GROUPS = {"reward/score_mean": "score and KL-penalised reward", "reward/mean": "score and KL-penalised reward",
                "clip_frac": "clipping", "value_clip_frac": "clipping"}


@dataclass
class StepRun:
    """What one step's folder holds: metrics rows (logged order), samples, the finished-run marker."""

    folder: Path
    number: int | None
    title: str
    rows: list[dict]
    samples: list[dict]
    marker: dict | None
    command: str | None
    alerts: list[Alert] = field(default_factory=list)
    certificate: dict | None = None  # certificate.json, when the step wrote one

    starts: list[int] = field(default_factory=list)  # row indices where a resumed attempt continued

    @property
    def resumes(self) -> list[int]:
        """Steps from which a resumed attempt continued (the last kept step of each earlier log)."""
        return [self.rows[i - 1].get("step", 0) if i else 0 for i in self.starts]

    @property
    def wall_s(self) -> float:
        """Seconds of logged time over all attempts (each attempt's last ``elapsed_s``, summed)."""
        total = 0.0
        for a, b in zip([0, *self.starts], [*self.starts, len(self.rows)], strict=True):
            times = [r["elapsed_s"] for r in self.rows[a:b] if isinstance(r.get("elapsed_s"), (int, float))]
            total += max(times, default=0.0)
        return total


def _resume_starts(folder: Path, rows: list[dict]) -> list[int]:
    """Row indices of ``rows`` where a resumed attempt began: a resume keeps the earlier log as
    ``metrics.before-resume-N.jsonl`` (:meth:`chatrl.tracking.Tracker.resumed_at`), and the
    current log agrees with it up to the resume point."""
    starts = []
    logs = sorted((folder / METRICS_FILE).parent.glob("metrics.before-resume-*.jsonl"),
                  key=lambda p: int(p.stem.rsplit("-", 1)[1]) if p.stem.rsplit("-", 1)[1].isdigit() else 0)
    for log in logs:
        before = read_metrics(log)
        n = 0
        while n < min(len(before), len(rows)) and before[n] == rows[n]:
            n += 1
        starts.append(n)
    return sorted(set(starts))


def _load_step(folder: Path, output_dir: Path) -> StepRun:
    number, title = STEP_FOLDERS.get(folder.name, (None, folder.name))
    marker = None
    if (folder / RUN_MARKER).exists():
        try:
            marker = json.loads((folder / RUN_MARKER).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            marker = None
    if number is None and marker and isinstance(marker.get("step"), int):
        number = marker["step"]
        title = f"step {number}: {folder.name}"
    command = None
    for log in (output_dir / "logs" / f"step{number}.log", folder / "logs" / f"step{number}.log"):
        if number is not None and log.exists():
            lines = [x[2:] for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.startswith("$ ")]
            command = lines[-1] if lines else None
            break
    if folder.name == "step3_rlhf":  # step 3 names its algorithm (the run marker's flags, else the command's)
        algorithm = ((marker or {}).get("args") or {}).get("rl_algorithm")
        found = re.search(r"--rl[_-]algorithm[= ](\S+)", command or "")
        title = f"{title} ({algorithm or (found.group(1) if found else 'ppo')})"
    rows = read_metrics(folder / METRICS_FILE)
    run = StepRun(folder, number, title, rows, read_metrics(folder / SAMPLES_FILE), marker, command,
                  starts=_resume_starts(folder, rows))
    run.alerts = check_rows(run.rows)
    run.certificate = read_certificate(folder)
    return run


def find_steps(output_dir: str | os.PathLike) -> list[StepRun]:
    """The step runs under ``output_dir`` (a train.py output folder, or one step's folder), in step order.

    Raises:
        FileNotFoundError: no metrics log (``logs/metrics.jsonl``) in the folder or its sub-folders.
    """
    root = Path(output_dir)
    if (root / METRICS_FILE).exists():
        folders = [root]
    else:
        folders = sorted((p for p in root.iterdir() if (p / METRICS_FILE).exists()),
                         key=lambda p: (STEP_FOLDERS.get(p.name, (9, ""))[0], p.name)) if root.is_dir() else []
    if not folders:
        raise FileNotFoundError(f"{root}: no {METRICS_FILE} here or in its step folders (step1_actor/, step2_reward/, "
                                "step3_rlhf/); give train.py's --output-dir or a step's --output_dir")
    return [_load_step(f, root) for f in folders]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)):
            xs.append(row.get("step", 0))
            ys.append(float(v))
    return xs, ys


def _finite(ys: list[float]) -> list[float]:
    return [y for y in ys if math.isfinite(y)]


def _mean(ys: list[float]) -> float:
    ys = _finite(ys)
    return sum(ys) / len(ys) if ys else float("nan")


def headlines(run: StepRun) -> list[tuple[str, str]]:
    """(name, figure) pairs: state, steps, wall time and its split, and the step's key results."""
    out = [("state", "finished" if run.marker else "unfinished (running, stopped or failed)"),
           ("optimizer steps logged", str(max((r.get("step", 0) for r in run.rows), default=0))),
           ("wall time (logged)", f"{run.wall_s / 60:.1f} min")]
    if run.resumes:
        out.append(("resumed", f"{len(run.resumes)}× (after step{'s' if len(run.resumes) > 1 else ''} "
                               f"{', '.join(map(str, run.resumes))})"))
    rows = run.rows

    def first_last(key: str, label: str, fmt: str = "{:.4g}") -> None:
        ys = _finite(_series(rows, key)[1])
        if ys:
            out.append((label, fmt.format(ys[0]) + (" → " + fmt.format(ys[-1]) if len(ys) > 1 else "")))

    first_last("eval/ppl", "eval perplexity", "{:.2f}")
    first_last("eval/eos_rate", "greedy answers ending with EOS", "{:.1%}")
    first_last("eval/accuracy", "reward model eval accuracy (chosen > rejected)", "{:.3f}")
    first_last("eval/margin", "eval margin (chosen − rejected score)", "{:+.4f}")
    for key, label, fmt in (("reward/score_mean", "score: the weighted reward", "{:.3f}"),
                            ("eos_rate", "answers ending with EOS", "{:.1%}")):
        t = step_trend(_series(rows, key)[1])
        if t is not None:
            out.append((f"{label} ({t.definition})", t.text(fmt) + (f" ({t.verdict})" if t.verdict else "")))
    for key, label, fmt in (("kl", "KL to the reference, nats per answer", "{:.3f}"),
                            ("answer_len", "answer length, tokens", "{:.1f}"),
                            ("entropy", "entropy, nats per token", "{:.3f}")):
        t = step_trend(_series(rows, key)[1])
        if t is not None:
            n = t.last or 1
            out.append((f"{label} (last {n} step{'s' * (n > 1)})", fmt.format(t.start if t.end is None else t.end)))
    split = {k[5:]: sum(_finite(_series(rows, k)[1])) for k in _keys(rows) if k.startswith("time/")}
    total = sum(split.values())
    if total > 0:
        shares = sorted(((v / total, k) for k, v in split.items()), reverse=True)
        out.append(("time split (logged per-step timers)",
                    ", ".join(f"{k} {f:.0%}" for f, k in shares if f >= 0.005) or "-"))
    flat = [(k, ys[0]) for k in _keys(rows) for ys in [_series(rows, k)[1]]
            if k not in NOT_CHARTED and len(ys) > 1 and _constant(ys)]
    if flat:
        out.append(("constant over the run (not charted)", ", ".join(f"{k} = {v:.4g}" for k, v in flat)))
    return out


def _keys(rows: list[dict]) -> list[str]:
    """Numeric metric names in order of first appearance (no step, elapsed time or alerts)."""
    seen: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if k not in ("step", "elapsed_s") and not k.startswith(ALERT_PREFIX) and isinstance(v, (int, float)):
                seen.setdefault(k, None)
    return list(seen)


def _constant(ys: list[float]) -> bool:
    return len(set(ys)) == 1


def chart_groups(rows: list[dict]) -> dict[str, list[str]]:
    """Chart title → metric names drawn on it, the PPO health signals first (:data:`CHART_ORDER`).

    Metrics logged at fewer than 2 steps or with one constant value are left to the headline
    figures; ``train/X`` and ``eval/X`` share a chart, as do the ``time/*`` timers and the
    :data:`CHART_GROUPS`."""
    groups: dict[str, list[str]] = {}
    for k in _keys(rows):
        xs, ys = _series(rows, k)
        if k in NOT_CHARTED or len(xs) < 2 or _constant(ys):
            continue
        if k.startswith("time/"):
            title = "time per step (s)"
        elif k in CHART_GROUPS:
            title = CHART_GROUPS[k]
        else:
            title = k.split("/", 1)[1] if k.startswith(("train/", "eval/")) else k
        groups.setdefault(title, []).append(k)
    rank = {t: i for i, t in enumerate(CHART_ORDER)}
    return dict(sorted(groups.items(), key=lambda kv: rank.get(kv[0], len(rank))))


MAX_POINTS = 2000  # per curve: keeps the report of a 100k-step run small and quick to draw


def _thin(xs: list, ys: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    """Every k-th point (k = ⌈n / limit⌉) and the last one, so a curve has at most ``limit + 1`` points."""
    if len(xs) <= limit:
        return xs, ys
    k = -(-len(xs) // limit)
    idx = [*range(0, len(xs) - 1, k), len(xs) - 1]
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _figures(run: StepRun) -> list:
    import plotly.graph_objects as go

    figs = []
    for title, keys in chart_groups(run.rows).items():
        fig = go.Figure()
        for k in keys:
            xs, ys = _thin(*_series(run.rows, k))
            fig.add_trace(go.Scatter(x=xs, y=[y if math.isfinite(y) else None for y in ys], name=k,
                                     mode="lines+markers" if len(xs) <= 30 else "lines"))
        for step in run.resumes:
            fig.add_vline(x=step, line_dash="dash", line_color="#888", annotation_text="resumed",
                          annotation_position="top left")
        for alert in run.alerts:
            if alert.metric in keys:
                fig.add_vline(x=alert.step, line_dash="dot", line_color="#c0392b", annotation_text=alert.rule,
                              annotation_font_color="#c0392b")
        fig.update_layout(title={"text": title, "font": {"size": 14}}, height=300 + 20 * (len(keys) > 1),
                          margin={"l": 50, "r": 10, "t": 40, "b": 35 + 45 * (len(keys) > 1)},
                          legend={"orientation": "h", "y": -0.3}, showlegend=len(keys) > 1, template="plotly_white",
                          xaxis_title="optimizer step")
        figs.append(fig)
    return figs


def _esc(x) -> str:
    return html.escape(str(x))


def _alerts_html(runs: list[StepRun]) -> str:
    rows = [(run, a) for run in runs for a in run.alerts]
    if not rows:
        return '<p class="ok">No run-health alert fired (rules and thresholds: docs/report.md).</p>'
    body = "".join(f"<tr><td>{_esc(r.title)}</td><td>{a.step}</td><td><b>{_esc(a.rule)}</b></td>"
                   f"<td>{_esc(a.metric)} = {a.value:.4g}</td><td>{_esc(a.message)}</td></tr>" for r, a in rows)
    return ('<table class="alerts"><tr><th>step</th><th>at optimizer step</th><th>alert</th><th>figure</th>'
            f"<th>what it means</th></tr>{body}</table>")


def _figure(x) -> str:
    return "-" if x is None else f"{x:.3g}" if isinstance(x, float) else _esc(x)


def _certificates_html(runs: list[StepRun]) -> str:
    """Each step's certificate: property, figure, bound, pass / FAIL / not checked, and its message."""
    rows, missing = [], []
    for run in runs:
        cert = run.certificate
        if not cert:
            missing.append(run.title)
            continue
        for p in cert.get("properties", []):
            state = {True: ("pass", "pass"), False: ("FAIL", "fail"), None: ("not checked", "skip")}[p.get("passed")]
            rows.append(f'<tr class="{state[1]}"><td>{_esc(run.title)}</td><td><b>{_esc(p.get("name"))}</b></td>'
                        f'<td>{_figure(p.get("figure"))}</td><td>{_figure(p.get("bound"))}</td>'
                        f'<td class="verdict">{state[0]}</td><td>{_esc(p.get("message", ""))}</td></tr>')
    if not rows:
        return '<p class="sub">No step wrote a certificate yet (certificate.json: docs/certificate.md).</p>'
    failed = sum('class="fail"' in r for r in rows)
    head = (f'<p class="{"bad" if failed else "ok"}">{failed} propert{"y" if failed == 1 else "ies"} failed.</p>' if failed
            else '<p class="ok">Every checked property passed (docs/certificate.md).</p>')
    note = f'<p class="sub">No certificate: {_esc(", ".join(missing))}.</p>' if missing else ""
    return (f'{head}<table class="certificate"><tr><th>step</th><th>property</th><th>figure</th><th>bound</th>'
            f'<th>result</th><th>what was measured</th></tr>{"".join(rows)}</table>{note}')


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "…" + text[-n:]


def _answer_html(sample: dict) -> str:
    """A rollout's answer; a multi-turn episode's turns one after the other, each environment
    observation marked (``class="obs"``, labelled with its role)."""
    turns = sample.get("turns")
    if not turns:
        return f"<pre>{_esc(sample.get('answer', ''))}</pre>"
    return "".join(f"<pre class=\"obs\">[{_esc(t.get('role', 'tool'))}] {_esc(t.get('content', ''))}</pre>"
                   if t.get("observation") else f"<pre>{_esc(t.get('content', ''))}</pre>" for t in turns)


def _samples_html(samples: list[dict]) -> str:
    if not samples:
        return ""
    body = "".join(
        f"<tr><td>{s.get('step')}</td><td>{s.get('score', float('nan')):+.3f}</td><td>{s.get('kl', float('nan')):.3f}</td>"
        f"<td><pre>{_esc(_tail(s.get('prompt', ''), 600))}</pre></td><td>{_answer_html(s)}</td></tr>"
        for s in samples)
    return (f"<h3>Rollouts over time ({len(samples)})</h3><table class=\"samples\"><tr><th>step</th><th>score</th>"
            f"<th>KL (nats)</th><th>prompt (end)</th><th>answer</th></tr>{body}</table>")


def _flags_html(run: StepRun) -> str:
    parts = []
    if run.command:
        parts.append(f"<p>command:</p><pre class=\"cmd\">{_esc(run.command)}</pre>")
    args = (run.marker or {}).get("args") or (run.marker or {}).get("config")
    if isinstance(args, dict):
        body = "".join(f"<tr><td>{_esc(k)}</td><td>{_esc(json.dumps(v, default=str))}</td></tr>" for k, v in sorted(args.items()))
        parts.append(f"<details><summary>all flags of the finished run ({len(args)})</summary>"
                     f"<table class=\"flags\">{body}</table></details>")
    return "<h3>Flags</h3>" + "".join(parts) if parts else ""



# ------------------------------------------------------------------------------------------- evaluation
def find_eval(output_dir: str | os.PathLike) -> dict | None:
    """The evaluation of ``output_dir`` (``eval/eval.json`` in train.py's folder, or ``eval.json`` in an
    evaluation's own folder), or None."""
    for path in (Path(output_dir) / "eval" / EVAL_FILE, Path(output_dir) / EVAL_FILE):
        if path.is_file():
            try:
                return json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                return None
    return None


def _num(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _rate_cell(d: dict | None) -> str:
    if not d:
        return "-"
    w = d["win_rate"]
    cls = "noise" if w["within_noise"] else "gain" if w["value"] > 0.5 else "loss"
    return f'<span class="{cls}"><b>{w["value"]:.3f}</b> [{w["ci"][0]:.3f}, {w["ci"][1]:.3f}]</span>'


def _eval_table(ev: dict) -> str:
    fig = ev["figures"]
    gold = any(p.get("gold") for p in ev["pairs"])
    head = ("<tr><th>model B</th><th>against A</th><th>answers</th><th>win rate of B [95% interval]</th>"
            "<th>length-controlled</th>" + ("<th>gold judge's win rate</th>" if gold else "") +
            "<th>length, tokens (B / A)</th><th>EOS rate</th><th>distinct-1 / -2 of B</th><th>KL of B (nats)</th>"
            "<th></th></tr>")
    rows = []
    for p in ev["pairs"]:
        fa, fb, j = fig[p["a"]][p["decoding"]], fig[p["b"]][p["decoding"]], p.get("judge")
        note = NO_JUDGE if j is None else verdict(j["win_rate"])
        rows.append(f"<tr><td>{_esc(p['b'])}</td><td>{_esc(p['a'])}</td><td>{_esc(p['decoding'])}</td>"
                    f"<td>{_rate_cell(j)}</td><td>{length_controlled_text(j['length_controlled']) if j else '-'}</td>"
                    + (f"<td>{_rate_cell(p.get('gold'))}</td>" if gold else "") +
                    f"<td>{_num(fb['length_tokens'], '.1f')} / {_num(fa['length_tokens'], '.1f')}</td>"
                    f"<td>{_num(fb['eos_rate'], '.2f')} / {_num(fa['eos_rate'], '.2f')}</td>"
                    f"<td>{_num(fb['distinct_1'], '.2f')} / {_num(fb['distinct_2'], '.2f')}</td>"
                    f"<td>{_num(fb['kl'], '.3f')}</td><td>{note}</td></tr>")
    return f'<table class="eval">{head}{"".join(rows)}</table>'


def _frontier(ev: dict):
    """The KL / win-rate frontier over the checkpoint series (plotly figure), or None without a series."""
    import plotly.graph_objects as go

    points = [p for p in ev.get("series") or [] if p.get("win_rate") is not None]
    if not points:
        return None
    with_kl = all(p.get("kl") is not None for p in points)
    fig = go.Figure()
    for key, ci, name in (("win_rate", "ci", "judge"), ("gold_win_rate", "gold_ci", "gold judge")):
        pts = [p for p in points if p.get(key) is not None]
        if not pts:
            continue
        xs = [p["kl"] if with_kl else p["step"] for p in pts]
        fig.add_trace(go.Scatter(
            x=xs, y=[p[key] for p in pts], mode="lines+markers+text", name=name, text=[p["label"] for p in pts],
            textposition="top center", error_y={"type": "data", "symmetric": False,
                                                "array": [p[ci][1] - p[key] for p in pts],
                                                "arrayminus": [p[key] - p[ci][0] for p in pts]}))
    fig.add_hline(y=0.5, line_dash="dot", line_color="#888")
    for check in ev.get("over_optimisation") or []:  # the checkpoint where the gold judge's win rate peaks
        peak = next((p for p in points if p["label"] == check["peak"] and p.get("gold_win_rate") is not None), None)
        if peak is not None:
            fig.add_annotation(x=peak["kl"] if with_kl else peak["step"], y=peak["gold_win_rate"], text="gold peak",
                               showarrow=True, arrowhead=2, ay=-40, font={"color": "#c0392b"})
    fig.update_layout(title={"text": f"win rate over {ev['baseline']} against "
                             + ("KL to the reference" if with_kl else "step"), "font": {"size": 14}},
                      height=360, template="plotly_white", margin={"l": 50, "r": 10, "t": 40, "b": 40},
                      xaxis_title="KL to the reference (nats per answer)" if with_kl else "optimizer step",
                      yaxis_title="win rate")
    return fig


def _examples_html(ev: dict) -> str:
    rows = []
    for ex in ev.get("examples") or []:
        cells = "".join(
            f"<td><pre>{_esc(a['text'])}</pre><span class=\"sub\">{_esc(label)} ({_esc(a['decoding'])})"
            + "".join(f", {_esc(k[:-6])} {v:+.3f}" for k, v in a.items() if k.endswith("_score")) + "</span></td>"
            for label, a in ex["answers"].items())
        rows.append(f"<tr><td><pre>{_esc(_tail(ex['prompt'], 600))}</pre></td>{cells}</tr>")
    if not rows:
        return ""
    return f'<h3>Answers side by side</h3><table class="samples"><tr><th>prompt (end)</th>' \
           f'{"".join(f"<th>{_esc(m)}</th>" for m in ev["examples"][0]["answers"])}</tr>{"".join(rows)}</table>'


def evaluation_html(output_dir: str | os.PathLike) -> tuple[str, int]:
    """The report's Evaluation section (``OUTPUT/eval/eval.json``, :mod:`chatrl.eval`) and its number of
    charts; ``("", 0)`` when the folder holds no evaluation."""
    ev = find_eval(output_dir)
    if not ev:
        return "", 0
    judges = ev.get("judges") or {}
    desc = (f"{ev['prompts']['count']} held-out prompts; judge {judges.get('judge') or '(none)'}"
            + (f", gold judge {judges['gold']}" if judges.get("gold") else "")
            + (f", KL to {judges['reference']}" if judges.get("reference") else "")
            + "; answers: " + ", ".join(g if g == "greedy" else f"{g} ({len(ns)} seed{'s' if len(ns) > 1 else ''})"
                                        for g, ns in ev["decodings"].items()) + ". "
              "Intervals: 95% bootstrap over prompts; docs/evaluation.md explains every figure.")
    checks = "".join(f"<p><b>over-optimisation check ({_esc(c['run'])}):</b> {_esc(c['message'])}</p>"
                     for c in ev.get("over_optimisation") or [])
    fig = _frontier(ev)
    chart = "" if fig is None else ('<div class="chart">' + fig.to_html(
        full_html=False, include_plotlyjs=False, div_id="chart-eval-frontier",
        config={"displaylogo": False, "responsive": True}) + "</div>")
    return (f'<section id="evaluation"><h2>Evaluation</h2><p class="sub">{_esc(desc)}</p>{_eval_table(ev)}{checks}'
            f"{chart}{_examples_html(ev)}</section>", int(fig is not None))


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
h3{font-size:15px} .sub{color:#666;font-size:13px} .ok{color:#1e7e34} .bad{color:#c0392b;font-weight:bold}
table.certificate tr.pass td.verdict{color:#1e7e34;font-weight:bold} table.certificate tr.skip td.verdict{color:#888}
table.certificate tr.fail td{background:#fbeaea} table.certificate tr.fail td.verdict{color:#c0392b;font-weight:bold}
table{border-collapse:collapse;font-size:13px;margin:6px 0} td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
table.alerts{border:2px solid #c0392b} table.alerts th{background:#fbeaea}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:8px}
.chart{border:1px solid #eee;border-radius:4px}
pre{white-space:pre-wrap;margin:0;font-size:12px;max-width:640px} pre.obs{background:#eef4ff;color:#234} pre.cmd{max-width:none;background:#f6f6f6;padding:6px}
.gain{color:#1e7e34} .loss{color:#c0392b} .noise{color:#8a6d00}
"""


def verdict_lines(runs: list[StepRun], ev: dict | None) -> list[str]:
    """The report's first lines: what step 3 did to its score and EOS rate (:func:`chatrl.tracking.step_trend`,
    the console's and the README's definition, with its verdict) and, with an evaluation, the last
    model of the series (not the EMA) over the baseline, the headline decoding, with its verdict."""
    lines = []
    for run in runs:
        score, eos = (step_trend(_series(run.rows, k)[1]) for k in ("reward/score_mean", "eos_rate"))
        if score is None:
            continue
        text = f"{run.title}: score {score.text('{:.3f}')}" + (f", {score.verdict}" if score.verdict else "")
        if eos is not None:
            text += f"; EOS rate {eos.text('{:.2f}')}" + (f", {eos.verdict}" if eos.verdict else "")
        lines.append(text + (f" ({score.definition})" if score.end is not None else ""))
    ev = ev or {}
    final = [m["label"] for m in ev.get("models", [])[1:] if m.get("in_series", True)][-1:]
    pairs = [p for p in ev.get("pairs", []) if p.get("judge") and p["decoding"] == ev.get("headline")
             and p["a"] == ev.get("baseline") and p["b"] in final]
    if pairs:
        p = pairs[0]
        w = p["judge"]["win_rate"]
        lines.append(f"evaluation ({p['decoding']} answers): {p['b']} over {p['a']} {w['value']:.3f} "
                     f"[{w['ci'][0]:.3f}, {w['ci'][1]:.3f}], {verdict(w)}")
    return lines


def build_html(output_dir: str | os.PathLike) -> tuple[str, int]:
    """The report of ``output_dir`` as one HTML string, and the number of charts in it."""
    import plotly
    import plotly.offline

    runs = find_steps(output_dir)
    sections, n_charts = [], 0
    for i, run in enumerate(runs):
        figs = _figures(run)
        charts = "".join(
            '<div class="chart">' + fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"chart-{i}-{j}",
                                                config={"displaylogo": False, "responsive": True}) + "</div>"
            for j, fig in enumerate(figs))
        n_charts += len(figs)
        heads = "".join(f"<tr><td>{_esc(k)}</td><td><b>{_esc(v)}</b></td></tr>" for k, v in headlines(run))
        sections.append(f'<section id="{_esc(run.folder.name)}"><h2>{_esc(run.title)}</h2>'
                        f'<p class="sub">{_esc(run.folder)}</p><table class="head">{heads}</table>'
                        f'<h3>Curves ({len(figs)})</h3><div class="charts">{charts}</div>'
                        f"{_samples_html(run.samples)}{_flags_html(run)}</section>")
    evaluation, n_eval_charts = evaluation_html(output_dir)
    n_charts += n_eval_charts
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    doc = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="chatrl-charts" content="{n_charts}">'
           f"<title>chatrl run report: {_esc(Path(output_dir).resolve().name)}</title><style>{CSS}</style>"
           f"<script>{plotly.offline.get_plotlyjs()}</script></head><body>"
           f"<h1>chatrl run report</h1><p class=\"sub\">{_esc(Path(output_dir).resolve())} · written {when} · "
           f"plotly {plotly.__version__} · refresh: <code>python -m chatrl.tools.report {_esc(output_dir)}</code></p>"
           + "".join(f'<p class="verdict"><b>{_esc(line)}</b></p>' for line in verdict_lines(runs, find_eval(output_dir)))
           + f"<h2>Correctness certificate</h2>{_certificates_html(runs)}"
           f"<h2>Run-health alerts</h2>{_alerts_html(runs)}{''.join(sections)}{evaluation}</body></html>")
    return doc, n_charts


def write_report(output_dir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Write the report of ``output_dir`` to ``path`` (default ``OUTPUT_DIR/report.html``), atomically."""
    doc, _ = build_html(output_dir)
    path = Path(path) if path else Path(output_dir) / REPORT_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc, encoding="utf-8")
    os.replace(tmp, path)
    return path


def report_note(output_dir: str | os.PathLike) -> str:
    """Write the report and return one line for the console; never raises (a report must not stop a run)."""
    try:
        return f"run report: {write_report(output_dir)}"
    except ImportError as e:
        return f"run report not written ({e.name} is missing: pip install -e \".[web]\")"
    except Exception as e:  # noqa: BLE001 - any failure is reported, training goes on
        return f"run report not written: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> None:
    """``python -m chatrl.tools.report OUTPUT``: write OUTPUT/report.html from the run's logs."""
    p = argparse.ArgumentParser(prog="python -m chatrl.tools.report", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output_dir", help="train.py's --output-dir, or one step's --output_dir")
    p.add_argument("--out", default=None, help="where to write the HTML (default: OUTPUT_DIR/report.html)")
    a = p.parse_args(argv)
    t0 = time.time()
    try:
        path = write_report(a.output_dir, a.out)
    except FileNotFoundError as e:
        raise SystemExit(f"chatrl.tools.report: {e}") from None
    except ImportError as e:
        raise SystemExit(f"chatrl.tools.report needs {e.name}: pip install -e \".[web]\"") from None
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB, {time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
