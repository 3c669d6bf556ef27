"""The token-level inspector: what a step-3 training step learned from, one offline HTML file.

    python -m chatrl.tools.inspector OUTPUT --step N                   # writes OUTPUT/rollouts/step_N.html
    python -m chatrl.tools.inspector OUTPUT --step N --diff OTHER      # two runs at the same step, side by side

``OUTPUT`` is step 3's ``--output_dir`` (or ``train.py``'s, whose ``step3_rlhf/`` is used), run with
``--save_rollouts`` (:mod:`chatrl.evidence.rollout_records`). Every recorded rollout is shown as its tokens:
the prompt in grey, the answer coloured by one quantity at a time, chosen at the top: the loss mask,
the advantage, the sampler − trainer log-prob, the importance weight, the PPO ratio and the clip hits
of each PPO epoch, the per-token KL to the reference, the entropy, the value and the return; hovering
a token shows all of them. Beside each rollout: its score and the unweighted part of every reward
source, the KL and the length of its answer, and the version and checksum of the weights that
generated it. On top: the step's figures (losses, gradient norms, KL coefficient), and histograms of
the per-token quantities over every action token (plotly, embedded once: the file makes no network
request). Tokens are shown as the tokenizer spells them (``Ġ`` and ``▁`` as spaces).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import time
from pathlib import Path

import torch

from chatrl.evidence.rollout_records import read_step, recorded_steps, resolve_output, step_dir
from chatrl.models.causal_lm import load_tokenizer

#: The colourings offered (key, label, kind): ``diverging`` around ``center``, ``sequential`` from 0.
COLOURINGS = (
    ("mask", "loss mask", "mask", 0.0),
    ("advantages", "advantage", "diverging", 0.0),
    ("logp_gap", "sampler − trainer log-prob", "diverging", 0.0),
    ("is_weights", "importance weight", "diverging", 1.0),
    ("ratio", "PPO ratio (epoch)", "diverging", 1.0),
    ("clip", "clip hits (epoch)", "clip", 0.0),
    ("kl", "per-token KL", "diverging", 0.0),
    ("entropy", "entropy", "sequential", 0.0),
    ("values", "value", "diverging", 0.0),
    ("returns", "return", "diverging", 0.0),
)


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [f"[{i}]" for i in ids]
    out = []
    for tok in tokenizer.convert_ids_to_tokens(ids):
        tok = str(tok).replace("Ġ", " ").replace("▁", " ").replace("Ċ", "\n").replace("<0x0A>", "\n")
        out.append(tok)
    return out


def _load_tokenizer(path: str | None):
    if not path:
        return None
    try:
        return load_tokenizer(path)
    except Exception:  # noqa: BLE001 - the inspector shows token ids when the tokenizer is gone
        return None


def _finite(x):
    """``x`` with every non-finite float as None (JSON has no NaN; the page parses it with JSON.parse)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _round(t: torch.Tensor) -> list:
    return [None if not math.isfinite(v) else round(v, 6) for v in t.tolist()]


def samples_of(index: dict, ranks: list[dict], tokenizer) -> list[dict]:
    """Every rollout of a record as a JSON-able dict: prompt and answer tokens, the per-token
    quantities over the answer (:data:`COLOURINGS`), and the rollout's figures."""
    out = []
    for r, rank in enumerate(ranks):
        t, p_len = rank["tensors"], int(rank["prompt_len"])
        seq, mask, act = t["sequences"], t["attention_mask"], t["action_mask"]
        parts = sorted(k for k in t if k.startswith("reward/"))
        for b in range(seq.shape[0]):
            prompt_ids = seq[b, :p_len][mask[b, :p_len] > 0].tolist()
            n = int((act[b] > 0).sum())
            width = int(act.shape[1])
            answer_ids = seq[b, p_len:p_len + width].tolist()
            shown = min(width, n + 1) if n < width else width  # the answer, and the first pad after it
            per_token = {"mask": _round(act[b, :shown].float())}
            if "sampler_logp" in t and "logp" in t:
                per_token["logp_gap"] = _round(t["sampler_logp"][b, :shown] - t["logp"][b, :shown])
            for k in ("advantages", "is_weights", "kl", "entropy", "values", "returns", "logp",
                      "sampler_logp", "ref_logp", "rewards"):
                if k in t:
                    per_token[k] = _round(t[k][b, :shown])
            for k in ("ratio", "clip"):
                if k in t:
                    per_token[k] = [_round(t[k][e, b, :shown].float()) for e in range(t[k].shape[0])]
            kl_sum = float((t["kl"][b] * act[b]).sum()) if "kl" in t else None
            out.append({"rank": r, "row": b, "prompt": _token_texts(tokenizer, prompt_ids),
                        "answer": _token_texts(tokenizer, answer_ids[:shown]),
                        "answer_ids": answer_ids[:shown],
                        "tokens": per_token, "score": float(t["scores"][b]) if "scores" in t else None,
                        "parts": {k[7:]: float(t[k][b]) for k in parts}, "kl": kl_sum, "length": n,
                        "version": int(t["weight_version"][b]) if "weight_version" in t else None,
                        "checksum": float(t["weight_checksum"][b]) if "weight_checksum" in t else None})
    return out


def run_data(output: str | os.PathLike, step: int) -> dict:
    """The inspector's data for one run at one step (:func:`samples_of` and the step's index).

    Raises:
        FileNotFoundError: no record of ``step`` under ``output`` (naming the recorded steps).
    """
    folder = resolve_output(output)
    index, ranks = read_step(folder, step)
    tokenizer = _load_tokenizer(index.get("tokenizer"))
    return {"output": str(folder), "step": step, "index": {k: v for k, v in index.items() if k != "args"},
            "samples": samples_of(index, ranks, tokenizer), "epochs": int(index.get("ppo_epochs", 1))}


def _histograms(runs: list[dict]):
    import plotly.graph_objects as go

    figs = []
    for key, label, kind, _ in COLOURINGS:
        if kind == "mask":
            continue
        fig, any_data = go.Figure(), False
        for run in runs:
            values = []
            for s in run["samples"]:
                v, m = s["tokens"].get(key), s["tokens"]["mask"]
                if v is None:
                    continue
                if key in ("ratio", "clip"):
                    v = v[-1]  # the last PPO epoch
                values += [x for x, keep in zip(v, m, strict=False) if keep and x is not None]
            if values:
                any_data = True
                fig.add_trace(go.Histogram(x=values, name=Path(run["output"]).name, opacity=0.7, nbinsx=40))
        if any_data:
            fig.update_layout(title={"text": f"{label} over the action tokens", "font": {"size": 13}},
                              height=240, margin={"l": 40, "r": 10, "t": 36, "b": 30}, barmode="overlay",
                              template="plotly_white", showlegend=len(runs) > 1)
            figs.append(fig)
    return figs


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:20px;color:#222}
h1{font-size:20px;margin:0 0 4px} .sub{color:#666;font-size:13px} table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
#controls{position:sticky;top:0;background:#fff;padding:8px 0;border-bottom:1px solid #ddd;z-index:5}
#controls label{margin-right:10px;font-size:13px;white-space:nowrap}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(360px,1fr));gap:6px;margin:8px 0}
.cols{display:grid;gap:12px} .sample{border:1px solid #e3e3e3;border-radius:4px;padding:6px;margin:6px 0}
.meta{font-size:12px;color:#444;margin-bottom:4px} .toks{font-family:ui-monospace,Menlo,monospace;font-size:12px;
white-space:pre-wrap;line-height:1.7;word-break:break-all} .p{color:#999} .t{border-radius:2px;padding:0 0.5px}
.t.pad{opacity:.45;text-decoration:line-through} #legend{font-size:12px;margin-left:8px} .empty{color:#999}
"""

JS = r"""
const DATA = JSON.parse(document.getElementById('inspector-data').textContent);
const COLOURINGS = DATA.colourings;
function fmt(x){return Math.abs(x) < 1e-3 ? x.toExponential(2) : x.toPrecision(3);}
function esc(s){return s.replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));}
function scaleOf(key, kind, center, epoch){
  let m = 0;
  for (const run of DATA.runs) for (const s of run.samples) {
    let v = s.tokens[key]; if (!v) continue; if (key === 'ratio' || key === 'clip') v = v[Math.min(epoch, v.length-1)];
    v.forEach((x, i) => { if (x !== null && s.tokens.mask[i]) m = Math.max(m, Math.abs(x - center)); });
  }
  return m > 0 ? m : 1;
}
function colour(kind, x, center, scale, masked){
  if (kind === 'mask') return masked ? 'rgba(46,160,67,0.35)' : 'rgba(200,200,200,0.4)';
  if (x === null || x === undefined || !masked) return 'transparent';
  if (kind === 'clip') return x > 0 ? 'rgba(214,39,40,0.6)' : x < 0 ? 'rgba(31,119,180,0.6)' : 'transparent';
  let a = Math.min(1, Math.abs(x - center) / scale);
  if (kind === 'sequential') return `rgba(148,103,189,${(0.1 + 0.8*a).toFixed(3)})`;
  return x >= center ? `rgba(214,39,40,${(0.85*a).toFixed(3)})` : `rgba(31,119,180,${(0.85*a).toFixed(3)})`;
}
function tip(s, i, t){
  const parts = [`token ${i} "${t}" id ${s.answer_ids[i]}`];
  for (const [k, v] of Object.entries(s.tokens)) {
    if (Array.isArray(v[0])) parts.push(k + ' ' + v.map((e, j) => `e${j+1} ${e[i]}`).join(' '));
    else parts.push(`${k} ${v[i]}`);
  }
  return parts.join('\n');
}
function render(){
  const key = document.querySelector('input[name=colour]:checked').value;
  const epoch = Number(document.getElementById('epoch').value) - 1;
  const [, label, kind, center] = COLOURINGS.find(c => c[0] === key);
  const scale = scaleOf(key, kind, center, epoch);
  document.getElementById('legend').textContent = kind === 'mask' ? 'green: trained (action) tokens; grey: after the answer' :
    kind === 'clip' ? 'red: upper clip removed the gradient; blue: lower clip' :
    kind === 'sequential' ? `purple: 0 … ${fmt(scale)}` :
    `red: above ${center}, blue: below; full colour at ±${fmt(scale)}`;
  document.querySelectorAll('.sample').forEach(el => {
    const run = DATA.runs[Number(el.dataset.run)], s = run.samples[Number(el.dataset.idx)];
    let v = s.tokens[key]; if (v && (key === 'ratio' || key === 'clip')) v = v[Math.min(epoch, v.length-1)];
    el.querySelectorAll('.t').forEach((span, i) => {
      span.style.background = colour(kind, v ? v[i] : null, center, scale, s.tokens.mask[i] > 0);
    });
  });
  document.body.dataset.colour = key;
}
function build(){
  const cols = document.getElementById('cols');
  cols.style.gridTemplateColumns = `repeat(${DATA.runs.length}, minmax(0, 1fr))`;
  const n = Math.max(...DATA.runs.map(r => r.samples.length));
  for (let r = 0; r < DATA.runs.length; r++) {
    const col = document.createElement('div'); col.className = 'col';
    col.innerHTML = `<h3 class="sub">${esc(DATA.runs[r].output)}</h3>`;
    for (let i = 0; i < n; i++) {
      const s = DATA.runs[r].samples[i];
      const el = document.createElement('div'); el.className = 'sample';
      if (!s) { el.innerHTML = '<span class="empty">(no rollout)</span>'; col.appendChild(el); continue; }
      el.dataset.run = r; el.dataset.idx = i;
      const parts = Object.entries(s.parts).map(([k, v]) => `${esc(k)} ${v.toFixed(4)}`).join(', ');
      el.innerHTML = `<div class="meta">#${i} (rank ${s.rank}, row ${s.row}) · score <b>${s.score === null ? '-' : s.score.toFixed(4)}</b>` +
        (parts ? ` (${parts})` : '') + ` · KL ${s.kl === null ? '-' : s.kl.toFixed(4)} nats · ${s.length} tokens` +
        ` · weights v${s.version} (${s.checksum === null ? '-' : s.checksum.toPrecision(10)})</div>`;
      const toks = document.createElement('div'); toks.className = 'toks';
      toks.innerHTML = '<span class="p">' + esc(s.prompt.join('')) + '</span>' + s.answer.map((t, j) =>
        `<span class="t${s.tokens.mask[j] > 0 ? '' : ' pad'}" title="${esc(tip(s, j, t))}">${esc(t)}</span>`).join('');
      el.appendChild(toks); col.appendChild(el);
    }
    cols.appendChild(col);
  }
  document.querySelectorAll('input[name=colour], #epoch').forEach(x => x.addEventListener('change', render));
  render();
  document.body.dataset.ready = '1';
}
build();
"""


def _figures_table(run: dict) -> str:
    fig = run["index"].get("figures", {})
    m = fig.get("metrics") or {}
    rows = [("algorithm", run["index"].get("algorithm")), ("dtype", run["index"].get("dtype")),
            ("rollouts (all ranks)", len(run["samples"])), ("actor_loss", fig.get("actor_loss")),
            ("critic_loss", fig.get("critic_loss")),
            ("actor gradient norm per optimizer step", fig.get("actor_grad_norm")),
            ("critic gradient norm per optimizer step", fig.get("critic_grad_norm")),
            ("KL coefficient", fig.get("kl_coef")),
            ("reward/score_mean", m.get("reward/score_mean")), ("kl (nats per answer)", m.get("kl")),
            ("rollout/logp_diff_max", m.get("rollout/logp_diff_max")),
            ("checkpoint before the step (replay starts there)", run["index"].get("checkpoint"))]
    body = "".join(f"<tr><td>{html.escape(str(k))}</td>"
                   f"<td>{html.escape(json.dumps(v) if not isinstance(v, str) else v)}</td></tr>"
                   for k, v in rows if v is not None)
    return f'<table class="figures"><tr><th colspan="2">{html.escape(run["output"])}</th></tr>{body}</table>'


def build_html(output: str | os.PathLike, step: int, other: str | os.PathLike | None = None) -> str:
    """The inspector page of ``output`` (and ``other``, side by side) at ``step``, as one HTML string.

    Raises:
        FileNotFoundError: a run has no record of ``step``.
    """
    import plotly
    import plotly.offline

    runs = [run_data(output, step)] + ([run_data(other, step)] if other else [])
    epochs = max(r["epochs"] for r in runs)
    figs = _histograms(runs)
    charts = "".join(f.to_html(full_html=False, include_plotlyjs=False, div_id=f"hist-{i}",
                               config={"displaylogo": False, "responsive": True}) for i, f in enumerate(figs))
    available = {k for r in runs for s in r["samples"] for k in s["tokens"]}
    radios = "".join(f'<label><input type="radio" name="colour" value="{k}"'
                     f'{" checked" if k == "advantages" else ""}>{html.escape(label)}</label>'
                     for k, label, _, _ in COLOURINGS if k in available)
    data = {"runs": [{"output": r["output"], "samples": r["samples"]} for r in runs],
            "colourings": [list(c) for c in COLOURINGS if c[0] in available]}
    payload = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    title = f"chatrl inspector: step {step} of {Path(runs[0]['output']).name}" + (
        f" vs {Path(runs[1]['output']).name}" if other else "")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="chatrl-charts" content="{len(figs)}"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style>"
            f"<script>{plotly.offline.get_plotlyjs()}</script></head><body><h1>{html.escape(title)}</h1>"
            f"<p class=\"sub\">written {time.strftime('%Y-%m-%d %H:%M:%S')} · plotly {plotly.__version__} · "
            f"<code>python -m chatrl.tools.inspector {html.escape(str(output))} --step {step}"
            f"{' --diff ' + html.escape(str(other)) if other else ''}</code>; hover a token for every "
            "figure</p>"
            f'<div style="display:flex;gap:12px">{"".join(_figures_table(r) for r in runs)}</div>'
            f'<div class="charts">{charts}</div>'
            f'<div id="controls">colour by: {radios}<label>PPO epoch <input id="epoch" type="number" min="1" '
            f'max="{epochs}" value="{epochs}" style="width:3em"></label><span id="legend"></span></div>'
            f'<div id="cols" class="cols"></div>'
            f'<script type="application/json" id="inspector-data">{payload}</script>'
            f"<script>{JS}</script></body></html>")


def write_inspector(output: str | os.PathLike, step: int, other: str | os.PathLike | None = None,
                    path: str | os.PathLike | None = None) -> Path:
    """Write the page (default ``OUTPUT/rollouts/step_NNNNNN.html``, or ``..._vs_OTHER.html`` with
    ``other``) atomically; returns its path."""
    doc = build_html(output, step, other)
    if path is None:
        base = step_dir(resolve_output(output), step)
        path = base.with_name(base.name + (f"_vs_{Path(other).resolve().name}" if other else "") + ".html")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(doc, encoding="utf-8")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m chatrl.tools.inspector OUTPUT --step N [--diff OTHER] [--out FILE]``."""
    p = argparse.ArgumentParser(prog="python -m chatrl.tools.inspector", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="step 3's --output_dir (or train.py's --output-dir), run with "
                                  "--save_rollouts")
    p.add_argument("--step", type=int, default=None, help="the recorded step (default: the last one)")
    p.add_argument("--diff", default=None,
                   help="another run's output folder, shown beside it at the same step")
    p.add_argument("--out", default=None,
                   help="where to write the HTML (default: OUTPUT/rollouts/step_N.html)")
    a = p.parse_args(argv)
    step = a.step
    if step is None:
        have = recorded_steps(resolve_output(a.output))
        if not have:
            raise SystemExit(f"chatrl.tools.inspector: {a.output} holds no rollout record (run step 3 with "
                             "--save_rollouts N)")
        step = have[-1]
    try:
        path = write_inspector(a.output, step, a.diff, a.out)
    except FileNotFoundError as e:
        raise SystemExit(f"chatrl.tools.inspector: {e}") from None
    except ImportError as e:
        raise SystemExit(f"chatrl.tools.inspector needs {e.name}: pip install -e \".[web]\"") from None
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
