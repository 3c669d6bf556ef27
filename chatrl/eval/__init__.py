"""Evaluation of chat models against each other (``python -m chatrl.eval``, ``docs/evaluation.md``).

- :mod:`chatrl.eval.main`: the program (inputs checked, answers, judges, figures, ``eval.json``, the table);
- :mod:`chatrl.eval.inputs`: held-out prompts in any schema, the models (checkpoint series of step-3 and DPO outputs);
- :mod:`chatrl.eval.answers`: each model's answers (greedy, sampled over seeds) and their KL to a reference;
- :mod:`chatrl.eval.judges`: reward-model, function and pairwise judges, compared in both orders;
- :mod:`chatrl.eval.stats`: win rates, bootstrap intervals, the length-controlled win rate, distinct-n;
- :mod:`chatrl.eval.summary`: the figures per model and pair, the over-optimisation check, the table;
- :mod:`chatrl.eval.settings`: the flags, and ``train.py``'s evaluation block.
"""

EVAL_FILE = "eval.json"
"""The figures of an evaluation, in its ``--output_dir`` (``OUTPUT/eval/`` under ``train.py``)."""
ANSWERS_FILE = "answers.jsonl"
"""Every answer with its length, EOS, KL and judge scores, beside :data:`EVAL_FILE`."""

#: The note of a pair without a judge (its win rate is "-"): why there is no win rate.
NO_JUDGE = "no judge (--judge): no win rate"

#: What the table and the report print in the length-controlled column when length explains the outcome.
LENGTH_EXPLAINS = "length explains the outcome"


def length_controlled_text(lc: dict) -> str:
    """The length-controlled win rate of a pair as the table and the report print it (``eval.json``'s
    ``length_controlled``: ``{"value", "length_explains"}``): three decimals, or :data:`LENGTH_EXPLAINS`."""
    if lc.get("length_explains"):
        return LENGTH_EXPLAINS
    return "-" if lc.get("value") is None else format(lc["value"], ".3f")


def verdict(win_rate: dict) -> str:
    """The note on a win rate (``{"value", "within_noise"}``) in the table and the report: "difference
    within noise" when its interval holds 0.5, whichever side of 0.5 the point estimate lies, else "B
    better" or "A better"."""
    if win_rate["within_noise"]:
        return "difference within noise"
    return "B better" if win_rate["value"] > 0.5 else "A better"
