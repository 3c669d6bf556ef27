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
