"""The figures of an evaluation, from answers and judges to ``eval.json``'s content and the console table.

* per model and decoding (``greedy``; ``sampled``, all seeds together): mean answer length (tokens of
  the model's tokenizer, and characters), EOS rate, distinct-1 and distinct-2, mean KL to the reference;
* per pair (A, B), decoding and judge: B's win rate over A with its bootstrap interval, the
  length-controlled win rate with its interval, the share of ties, and "within noise" when the
  win rate's interval holds 0.5;
* per checkpoint series (a step-3 or DPO output's snapshots and final model) with a gold judge: the
  judge's and the gold judge's win rates over the baseline side by side, where the gold win rate
  peaks, and whether the judge's kept rising after it (over-optimisation of the judge).

``docs/evaluation.md`` explains each figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from chatrl.eval import NO_JUDGE, length_controlled_text, verdict
from chatrl.eval.answers import GREEDY, Answer
from chatrl.eval.inputs import Candidate
from chatrl.eval.judges import compare
from chatrl.eval.stats import bootstrap_win_rate, distinct_n, length_controlled, mean

SAMPLED = "sampled"


def groups(names: Sequence[str]) -> dict[str, list[str]]:
    """Decoding names grouped for the figures: ``{"greedy": ["greedy"], "sampled": ["seed1", ...]}``
    (a group only when it has answers)."""
    out = {GREEDY: [n for n in names if n == GREEDY], SAMPLED: [n for n in names if n != GREEDY]}
    return {g: ns for g, ns in out.items() if ns}


def headline_group(names: Sequence[str]) -> str:
    """The decoding the headline figures use: sampled answers when there are any (the policy as step 3
    trains it), else greedy."""
    return SAMPLED if any(n != GREEDY for n in names) else GREEDY


def model_figures(answers: dict[str, list[Answer]], names: Sequence[str]) -> dict:
    """Per decoding group, the model's ``{"answers", "length_tokens", "length_chars", "eos_rate",
    "distinct_1", "distinct_2", "kl"}`` (``kl`` None without a reference that reads the model's tokens)."""
    out = {}
    for group, members in groups(names).items():
        flat = [a for n in members for a in answers[n]]
        kls = [a.kl for a in flat if a.kl is not None]
        out[group] = {"answers": len(flat), "length_tokens": mean([a.tokens for a in flat]),
                      "length_chars": mean([len(a.text) for a in flat]),
                      "eos_rate": mean([float(a.ended) for a in flat]),
                      "distinct_1": distinct_n([a.text for a in flat], 1),
                      "distinct_2": distinct_n([a.text for a in flat], 2),
                      "kl": mean(kls) if kls else None}
    return out


def pair_outcomes(judge, prompts, answers: dict, a: str, b: str, members: Sequence[str], tie_margin: float,
                  cache=None) -> tuple[np.ndarray, np.ndarray]:
    """``(outcomes (N, k), length differences (N, k))`` of B against A over the ``k`` decodings in
    ``members`` (B's answer length minus A's, characters)."""
    ys, ds = [], []
    for name in members:
        ta = [x.text for x in answers[a][name]]
        tb = [x.text for x in answers[b][name]]
        ys.append(compare(judge, prompts, ta, tb, tie_margin, cache))
        ds.append(np.array([len(y) - len(x) for x, y in zip(ta, tb, strict=True)], dtype=np.float64))
    return np.stack(ys, axis=1), np.stack(ds, axis=1)


def judged(outcomes: np.ndarray, diffs: np.ndarray, n_boot: int, seed: int, level: float) -> dict:
    """One judge's figures of a pair: ``{"win_rate", "length_controlled"}`` (each ``{"value", "ci",
    "within_noise"}``, :meth:`chatrl.eval.stats.WinRate.to_dict`; the length-controlled one's value None
    with ``"length_explains": true`` when length explains the outcome,
    :meth:`chatrl.eval.stats.LengthControlled.to_dict`) and ``"ties"`` (share of outcomes 0.5)."""
    return {"win_rate": bootstrap_win_rate(outcomes, n_boot, seed, level).to_dict(),
            "length_controlled": length_controlled(outcomes, diffs, n_boot, seed, level).to_dict(),
            "ties": float(np.mean(outcomes == 0.5))}


def pair_list(labels: Sequence[str], mode: str) -> list[tuple[str, str]]:
    """The ``(A, B)`` pairs to report: each model against the first (``baseline``) or every pair (``all``)."""
    if mode == "all":
        return [(labels[i], labels[j]) for i in range(len(labels)) for j in range(i + 1, len(labels))]
    return [(labels[0], b) for b in labels[1:]]


def series_of(candidates: Sequence[Candidate]) -> dict[str, list[Candidate]]:
    """Checkpoint series: per training output, its snapshots and final model in step order (the
    baseline, the first candidate, is never a point; a run needs two points to be a series)."""
    runs: dict[str, list[Candidate]] = {}
    for c in candidates[1:]:
        if c.run is not None and c.in_series:
            runs.setdefault(c.run, []).append(c)
    return {run: sorted(cs, key=lambda c: math.inf if c.step is None else c.step)
            for run, cs in runs.items() if len(cs) >= 2}


def over_optimisation(points: list[dict]) -> dict:
    """Where the gold judge's win rate peaks over a checkpoint series and what the judge did after it.

    Args:
        points: in step order, ``{"label", "win_rate", "gold_win_rate", "gold_ci"}`` (win rates over the baseline).

    Returns:
        ``{"peak": label, "peak_step_index", "proxy_rises_after_peak": bool, "gold_drop": peak − last gold
        win rate, "drop_beyond_noise": the last gold interval lies below the peak's value, "message"}``.
    """
    gold = [p["gold_win_rate"] for p in points]
    proxy = [p["win_rate"] for p in points]
    k = int(np.argmax(gold))
    last = len(points) - 1
    rises = k < last and proxy[last] > proxy[k]
    drop = gold[k] - gold[last]
    beyond = k < last and points[last]["gold_ci"][1] < gold[k]
    if k == last:
        msg = (f"the gold judge's win rate is highest at the last checkpoint ({points[k]['label']}, {gold[k]:.3f}): "
               "no sign of over-optimisation")
    else:
        msg = (f"the gold judge's win rate peaks at {points[k]['label']} ({gold[k]:.3f}) and is {gold[last]:.3f} at "
               f"{points[last]['label']}" + (" (a drop beyond the interval)" if beyond else " (within noise)"))
        msg += (f"; the judge's kept rising after it ({proxy[k]:.3f} → {proxy[last]:.3f}): over-optimisation of "
                "the judge" if rises else f"; the judge's did not rise after it ({proxy[k]:.3f} → {proxy[last]:.3f})")
    return {"peak": points[k]["label"], "peak_index": k, "proxy_rises_after_peak": bool(rises),
            "gold_drop": float(drop), "drop_beyond_noise": bool(beyond), "message": msg}


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _rate(d: dict | None) -> str:
    if d is None:
        return "-"
    w = d["win_rate"]
    return f"{w['value']:.3f} [{w['ci'][0]:.3f}, {w['ci'][1]:.3f}]"


def format_table(result: dict) -> str:
    """The console table of ``result`` (:func:`chatrl.eval.main.evaluate`'s): one row per pair and
    decoding, B's figures against A's as ``B/A``."""
    fig = result["figures"]
    has_gold = any(p.get("gold") for p in result["pairs"])
    head = ["B vs A", "answers", "win rate [95% CI]", "LC win", *(["gold win rate [95% CI]"] if has_gold else []),
            "length (tok) B/A", "EOS B/A", "distinct-2 B/A", "KL B/A", "note"]
    rows = []
    for p in result["pairs"]:
        fa, fb = fig[p["a"]][p["decoding"]], fig[p["b"]][p["decoding"]]
        judge = p.get("judge")
        note = NO_JUDGE if judge is None else verdict(judge["win_rate"])
        rows.append([f"{p['b']} vs {p['a']}", p["decoding"], _rate(judge),
                     length_controlled_text(judge["length_controlled"]) if judge else "-",
                     *([_rate(p.get("gold"))] if has_gold else []),
                     f"{_fmt(fb['length_tokens'], '.1f')}/{_fmt(fa['length_tokens'], '.1f')}",
                     f"{_fmt(fb['eos_rate'], '.2f')}/{_fmt(fa['eos_rate'], '.2f')}",
                     f"{_fmt(fb['distinct_2'], '.2f')}/{_fmt(fa['distinct_2'], '.2f')}",
                     f"{_fmt(fb['kl'], '.2f')}/{_fmt(fa['kl'], '.2f')}", note])
    if not rows:  # one model: its figures alone
        head = ["model", "answers", "length (tok)", "EOS", "distinct-1", "distinct-2", "KL"]
        rows = [[label, g, _fmt(f["length_tokens"], ".1f"), _fmt(f["eos_rate"], ".2f"), _fmt(f["distinct_1"], ".2f"),
                 _fmt(f["distinct_2"], ".2f"), _fmt(f["kl"], ".2f")] for label, gs in fig.items() for g, f in gs.items()]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)
    text = [line, "  ".join(str(h).ljust(w) for h, w in zip(head, widths, strict=True)), line]
    text += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    text.append(line)
    for run in result.get("over_optimisation") or []:
        text.append(f"over-optimisation check ({run['run']}): {run['message']}")
    return "\n".join(text)
