"""``python -m chatrl.eval``: did RLHF make the chat model better, by how much, and is it real?

    python -m chatrl.eval --models output/step1_actor output/step3_rlhf --prompts DATA --judge output/step2_reward \\
        --reference output/step1_actor --prompts_split 2,4,4 --output_dir output/eval

Read top to bottom: the inputs are checked (models and their tokenizers, judges, prompts) before any
model is loaded; each model answers every prompt greedily and sampled over ``--seeds`` (its own
tokenizer and prompt format, batched, one progress bar), with the KL of each answer to
``--reference``; the judges compare each pair of models prompt by prompt (:mod:`chatrl.eval.judges`);
the figures (:mod:`chatrl.eval.summary`, :mod:`chatrl.eval.stats`) go to ``OUTPUT_DIR/eval.json``,
the answers with their scores to ``OUTPUT_DIR/answers.jsonl``, and one table to the console.

A step-3 output folder in ``--models`` stands for its checkpoint series: the HF snapshots step 3
writes with ``--save_hf_interval N`` (``snapshots/step_N``), then ``actor/`` (and ``actor_ema/``).
With ``--gold_judge`` the report sets the judge's and the gold judge's win rates side by side over
the series and marks where the gold one peaks. ``docs/evaluation.md`` explains every figure.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from chatrl import cli, config
from chatrl.distributed.dist import place_threads_for_load
from chatrl.distributed.resilience import report_failure
from chatrl.errors import UsageError
from chatrl.eval import ANSWERS_FILE, EVAL_FILE
from chatrl.eval.answers import Reference, answer_prompts, decodings, encode_eval_prompts
from chatrl.eval.inputs import expand_models, load_model_tokenizer, load_prompts
from chatrl.eval.judges import (
    ScoreCache,
    conversation_key,
    is_pairwise,
    load_judge,
    transcript,
)
from chatrl.eval.settings import EvalSettings
from chatrl.eval.summary import (
    format_table,
    groups,
    headline_group,
    judged,
    model_figures,
    over_optimisation,
    pair_list,
    pair_outcomes,
    series_of,
)
from chatrl.models.causal_lm import context_window, load_causal_lm, sampling_settings
from chatrl.models.reward_model import has_reward_head


def build_parser():
    """The evaluation's flags (:class:`~chatrl.eval.settings.EvalSettings`)."""
    return config.program_parser(EvalSettings, "chatrl evaluation: win rates of chat models against each other, "
                                               "with intervals, length control and the over-optimisation check",
                                 prog="python -m chatrl.eval")


def check_settings(s: EvalSettings) -> list[str]:
    """The decoding names; refuses bad numbers and judges that are not judges before anything loads.

    Raises:
        UsageError: naming the flag.
    """
    e, r = s.eval, s.rollout
    for flag, value, ok in (("--bootstrap_samples", e.bootstrap_samples, e.bootstrap_samples >= 1),
                            ("--confidence", e.confidence, 0 < e.confidence < 1),
                            ("--tie_margin", e.tie_margin, e.tie_margin >= 0),
                            ("--max_prompt_seq_len", r.max_prompt_seq_len, r.max_prompt_seq_len >= 1),
                            ("--max_answer_seq_len", r.max_answer_seq_len, r.max_answer_seq_len >= 1),
                            ("--per_device_generation_batch_size", r.per_device_generation_batch_size,
                             r.per_device_generation_batch_size >= 1),
                            ("--judge_batch_size", e.judge_batch_size, e.judge_batch_size >= 1)):
        if not ok:
            raise UsageError(f"{flag} {value} is out of range")
    sampling_settings(s.sampling.temperature, s.sampling.top_k, s.sampling.top_p)
    for flag, spec in (("--judge", e.judge), ("--gold_judge", e.gold_judge)):
        if spec and Path(spec).is_dir() and not has_reward_head(spec):
            raise UsageError(f"{flag} {spec} is not a reward model: it has no scalar 'score' head (a causal LM such "
                             "as step 1's output?). A judge is a reward model (step 2's output) or module:function")
        if spec and not Path(spec).is_dir():
            load_judge(spec, flag)  # a function is imported now (cheap); a missing folder is named now
    try:
        return decodings(e.seeds, not e.no_greedy)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _prompt_budget(path: str, s: EvalSettings, trust_remote_code: bool) -> int:
    """``--max_prompt_seq_len``, lowered (and said once) when prompt + answer would pass the model's window.

    Raises:
        UsageError: the window cannot hold ``--max_answer_seq_len`` plus one prompt token.
    """
    from transformers import AutoConfig

    window = context_window(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    r = s.rollout
    if window is None or r.max_prompt_seq_len + r.max_answer_seq_len <= window:
        return r.max_prompt_seq_len
    if r.max_answer_seq_len >= window:
        raise UsageError(f"--max_answer_seq_len {r.max_answer_seq_len} leaves no room for a prompt in the "
                         f"{window}-position window of {path}")
    print(f"chatrl.eval: {path} attends over {window} positions: prompts are cut to "
          f"{window - r.max_answer_seq_len} tokens (--max_prompt_seq_len {r.max_prompt_seq_len})", flush=True)
    return window - r.max_answer_seq_len


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class AnswerProgress:
    """What the evaluation says while its models answer: after the first batch, how long all the answers
    will take at that pace; then, every ``every_s`` seconds, how many are done and the time left (the
    progress bar's job when it is shown: ``lines`` False). Called with the answers of each batch.

    The estimate is the elapsed time per answer so far times the answers left (model loading between
    models included once it has happened); the first batch holds the longest prompts, so the first
    estimate errs long.

    Args:
        total: answers to generate. write: prints one line. lines: print the running lines.
        clock: seconds (monotonic; a stand-in in tests). every_s: seconds between running lines.
    """

    def __init__(self, total: int, write: Callable[[str], None], lines: bool,
                 clock: Callable[[], float] = time.monotonic, every_s: float = 30.0):
        self.total, self.write, self.lines, self.clock, self.every_s = total, write, lines, clock, every_s
        self.done, self.start = 0, clock()
        self.last = self.start

    def __call__(self, n: int) -> None:
        """``n`` more answers are done."""
        first = self.done == 0
        self.done += n
        now = self.clock()
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        if first:
            self.write(f"chatrl.eval: the first {self.done} answers took {_duration(elapsed)}: about "
                       f"{_duration(elapsed / self.done * self.total)} for all {self.total} (then the judges)")
            self.last = now
        elif self.lines and (now - self.last >= self.every_s or self.done == self.total):
            self.write(f"chatrl.eval: {self.done}/{self.total} answers ({self.done / self.total:.0%}) in "
                       f"{_duration(elapsed)}" + (f", about {_duration(left)} left" if self.done < self.total else ""))
            self.last = now


def generate_all(s: EvalSettings, candidates, tokenizers, prompts, names, device) -> dict:
    """Every candidate's answers (:func:`chatrl.eval.answers.answer_prompts`), one model loaded at a time."""
    from tqdm.auto import tqdm

    e = s.eval
    reference = None
    if e.reference:
        ref_tok = load_model_tokenizer(e.reference, "--reference", s.model.trust_remote_code)
        reference = Reference(e.reference, ref_tok, s.model.dtype, device, s.model.trust_remote_code)
    total = len(candidates) * len(names) * len(prompts)
    bar = tqdm(total=total, desc="chatrl.eval: answering", unit="answer", disable=e.disable_progress_bar,
               dynamic_ncols=True)
    said = AnswerProgress(total, lambda line: bar.write(line) if not bar.disable else print(line, flush=True),
                          lines=bool(bar.disable))

    def progress(n: int) -> None:
        bar.update(n)
        said(n)

    out = {}
    for c in candidates:
        tok = tokenizers[c.label]
        if reference is not None and not reference.reads(tok):
            bar.write(f"chatrl.eval: no KL for {c.label}: its tokenizer differs from --reference's")
        model = load_causal_lm(c.path, tok, dtype=s.model.dtype, trust_remote_code=s.model.trust_remote_code)
        model = model.to(device).eval()
        ids = encode_eval_prompts(tok, [p.messages for p in prompts],
                                  _prompt_budget(c.path, s, s.model.trust_remote_code))
        bar.set_postfix_str(c.label)
        out[c.label] = answer_prompts(model, tok, ids, names, s.sampling, s.rollout.per_device_generation_batch_size,
                                      s.rollout.max_answer_seq_len, reference, progress)
        del model
    bar.close()
    return out


def judge_pairs(s: EvalSettings, candidates, prompts, answers, names, device) -> tuple[list, dict]:
    """Every pair's figures per decoding group and judge, and each pointwise judge's score of every answer
    (``{judge key: ScoreCache}``)."""
    e = s.eval
    conversations = [p.messages for p in prompts]
    specs = {"judge": e.judge, "gold": e.gold_judge}
    judges = {k: load_judge(v, f"--{'judge' if k == 'judge' else 'gold_judge'}", e.judge_max_seq_len,
                            e.judge_batch_size, s.model.dtype, device) for k, v in specs.items() if v}
    for judge in judges.values():  # a function judge reads each prompt row's metadata (exact_match: its reference)
        if hasattr(judge, "metadata"):
            judge.metadata = {conversation_key(p.messages): p.metadata or {} for p in prompts}
    caches = {k: ScoreCache(j) for k, j in judges.items() if not is_pairwise(j)}
    for cache in caches.values():  # every answer scored once, in one pass per judge
        cache.fill(conversations, [[a.text for a in answers[c.label][n]] for c in candidates for n in names])
    pairs = []
    for a, b in pair_list([c.label for c in candidates], e.pairs):
        for group, members in groups(names).items():
            row = {"a": a, "b": b, "decoding": group}
            for k, judge in judges.items():
                ys, ds = pair_outcomes(judge, conversations, answers, a, b, members, e.tie_margin, caches.get(k))
                row[k] = judged(ys, ds, e.bootstrap_samples, e.bootstrap_seed, e.confidence)
            pairs.append(row)
    return pairs, caches


def series_figures(candidates, pairs: list, figures: dict, names) -> tuple[list, list]:
    """Per checkpoint series (:func:`chatrl.eval.summary.series_of`) the points of the KL / win-rate frontier
    and, with a gold judge, the over-optimisation check (:func:`chatrl.eval.summary.over_optimisation`)."""
    group = headline_group(names)
    baseline = candidates[0].label
    by_b = {p["b"]: p for p in pairs if p["a"] == baseline and p["decoding"] == group}
    series, checks = [], []
    for run, points in series_of(candidates).items():
        rows = []
        for c in points:
            p = by_b.get(c.label, {})
            rows.append({"run": run, "label": c.label, "step": c.step, "decoding": group,
                         "kl": figures[c.label][group]["kl"],
                         "win_rate": p["judge"]["win_rate"]["value"] if "judge" in p else None,
                         "ci": p["judge"]["win_rate"]["ci"] if "judge" in p else None,
                         "gold_win_rate": p["gold"]["win_rate"]["value"] if "gold" in p else None,
                         "gold_ci": p["gold"]["win_rate"]["ci"] if "gold" in p else None})
        series += rows
        if all(r["gold_win_rate"] is not None and r["win_rate"] is not None for r in rows):
            checks.append({"run": run, **over_optimisation(rows)})
    return series, checks


def examples(prompts, candidates, answers, caches: dict, n: int) -> list[dict]:
    """The first ``n`` prompts with every model's first-decoding answer (and judge scores), for the report."""
    out = []
    for i in range(min(n, len(prompts))):
        row = {"prompt": transcript(prompts[i].messages), "answers": {}}
        for c in candidates:
            name = next(iter(answers[c.label]))
            text = answers[c.label][name][i].text
            row["answers"][c.label] = {"decoding": name, "text": text,
                                       **{f"{k}_score": cache(i, text) for k, cache in caches.items()}}
        out.append(row)
    return out


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, allow_nan=True), encoding="utf-8")
    os.replace(tmp, path)


def write_answers(path: Path, prompts, candidates, answers, caches: dict) -> None:
    """``answers.jsonl``: one row per model, decoding and prompt, with the judges' scores when pointwise."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for c in candidates:
            for name, column in answers[c.label].items():
                for i, a in enumerate(column):
                    row = {"model": c.label, "decoding": name, "prompt_index": i, "source": prompts[i].source,
                           "row": prompts[i].row, "answer": a.text, "tokens": a.tokens, "ended": a.ended, "kl": a.kl,
                           **{f"{k}_score": cache(i, a.text) for k, cache in caches.items()}}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def evaluate(s: EvalSettings) -> dict:
    """Run the evaluation of ``s`` and return what ``eval.json`` holds (module docstring).

    Raises:
        UsageError: bad flags, a model without a tokenizer, prompts of an unknown schema, a judge that is
            not a reward model (or cannot be loaded), a window too small for the answer budget.
    """
    t0 = time.time()
    e = s.eval
    names = check_settings(s)
    candidates = expand_models(e.models)
    tokenizers = {c.label: load_model_tokenizer(c.path, "--models", s.model.trust_remote_code) for c in candidates}
    prompts = load_prompts(e.prompts, e.prompts_schema, e.prompts_split, e.split_seed, e.eval_fraction,
                           e.max_prompts)
    device = torch.device(e.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(place_threads_for_load("chatrl.eval"), flush=True)
    print(f"chatrl.eval: {len(candidates)} models × {len(prompts)} prompts × {len(names)} decodings "
          f"({', '.join(names)}) = {len(candidates) * len(prompts) * len(names)} answers of up to "
          f"{s.rollout.max_answer_seq_len} tokens on {device}; a time estimate follows the first batch", flush=True)
    if not e.judge and len(candidates) > 1:
        print("chatrl.eval: no --judge: the models' answers are compared by length, EOS rate, distinct-n and KL, "
              "without a win rate ('-'); give --judge a reward model (step 2's output) or module:function",
              flush=True)
    answers = generate_all(s, candidates, tokenizers, prompts, names, device)
    pairs, caches = judge_pairs(s, candidates, prompts, answers, names, device)
    figures = {c.label: model_figures(answers[c.label], names) for c in candidates}
    series, checks = series_figures(candidates, pairs, figures, names)
    result = {
        "models": [{"label": c.label, "path": c.path, "run": c.run, "step": c.step, "in_series": c.in_series}
                   for c in candidates],
        "baseline": candidates[0].label,
        "prompts": {"count": len(prompts), "sources": list(e.prompts), "split": e.prompts_split,
                    "split_seed": e.split_seed, "eval_fraction": e.eval_fraction},
        "decodings": groups(names), "headline": headline_group(names),
        "judges": {"judge": e.judge, "gold": e.gold_judge, "reference": e.reference},
        "figures": figures, "pairs": pairs, "series": series, "over_optimisation": checks,
        "examples": examples(prompts, candidates, answers, caches, e.shown_answers),
        "settings": {"seeds": list(e.seeds), "greedy": not e.no_greedy, "temperature": s.sampling.temperature,
                     "top_k": s.sampling.top_k, "top_p": s.sampling.top_p,
                     "max_answer_seq_len": s.rollout.max_answer_seq_len, "bootstrap_samples": e.bootstrap_samples,
                     "bootstrap_seed": e.bootstrap_seed, "confidence": e.confidence, "tie_margin": e.tie_margin},
    }
    out = Path(e.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_answers(out / ANSWERS_FILE, prompts, candidates, answers, caches)
    result["seconds"] = time.time() - t0
    _write_json(out / EVAL_FILE, result)
    print(format_table(result), flush=True)
    print(f"chatrl.eval: {out / EVAL_FILE} and {out / ANSWERS_FILE} ({result['seconds']:.1f} s)", flush=True)
    return result


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default ``sys.argv[1:]``) and :func:`evaluate`; a usage error prints its message alone
    and exits with code 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with report_failure():
        settings: EvalSettings = config.read(EvalSettings, cli.parse(build_parser(),
                                                                      sys.argv[1:] if argv is None else argv))
        return evaluate(settings)


if __name__ == "__main__":
    main()
