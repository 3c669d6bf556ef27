"""Write a synthetic, verifiable integer-arithmetic task as chatrl prompt rows (train + held-out).

Each row is a prompt-only record (``docs/rewards.md``)::

    {"prompt": "What is 23 + 58? Answer with the number only.",
     "reference": "81",
     "metadata": {"a": 23, "b": 58, "op": "+", "format_regex": "^\\\\s*-?\\\\d+\\\\s*$"}}

so that ``--reward_fn exact_match`` (the final number equals the reference) and
``--reward_fn regex_format`` (the answer is one integer) score answers without a reward model.
With ``--with_answers`` each row also gets ``"chosen"`` (the reference), which makes the file SFT
data for a short step 1 on the task's format (``{prompt, chosen}``).

Usage::

    python scripts/make_arith_task.py --output_dir data/arith --train 2000 --eval 200 --seed 0

writes ``train.jsonl`` and ``eval.jsonl`` (problems of the held-out file never occur in the train
file) and refuses to overwrite them unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OPS = ("+", "-", "*")
FORMAT_REGEX = r"^\s*-?\d+\s*$"
TEMPLATE = "What is {a} {op} {b}? Answer with the number only."


def solve(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b``."""
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_row(a: int, op: str, b: int, with_answers: bool = False) -> dict:
    """One prompt row for ``a op b`` (see the module docstring)."""
    answer = str(solve(a, op, b))
    row = {"prompt": TEMPLATE.format(a=a, op=op, b=b), "reference": answer,
           "metadata": {"a": a, "b": b, "op": op, "format_regex": FORMAT_REGEX}}
    if with_answers:
        row["chosen"] = answer
    return row


def make_task(n_train: int, n_eval: int, seed: int = 0, max_operand: int = 99, ops=OPS,
              with_answers: bool = False, max_second_operand: int | None = None) -> tuple[list[dict], list[dict]]:
    """``(train, eval)`` rows of distinct problems ``a op b`` with ``0 <= a <= max_operand`` and
    ``0 <= b <= max_second_operand`` (default: ``max_operand``).

    A small ``max_second_operand`` makes a task whose held-out problems are new operand pairs but
    whose rule is shared: ``437 + 2`` copies the leading digits and adds to the last one (with a
    carry now and then), which a tiny model can learn from other problems.

    Raises:
        ValueError: more problems asked for than exist, an unknown operator or a bad size.
    """
    max_b = max_operand if max_second_operand is None else max_second_operand
    if n_train < 0 or n_eval < 0 or max_operand < 1 or max_b < 0:
        raise ValueError(f"sizes must be >= 0, max_operand >= 1 and max_second_operand >= 0, got {n_train}, "
                         f"{n_eval}, {max_operand}, {max_b}")
    unknown = set(ops) - set(OPS)
    if unknown or not ops:
        raise ValueError(f"unknown operators {sorted(unknown)}; choose among {OPS}")
    space = (max_operand + 1) * (max_b + 1) * len(ops)
    if n_train + n_eval > space:
        raise ValueError(f"{n_train} + {n_eval} problems asked for, but only {space} distinct ones exist "
                         f"with --max_operand {max_operand}, --max_second_operand {max_b} and operators "
                         f"{''.join(ops)}")
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    problems = []
    while len(problems) < n_train + n_eval:
        p = (rng.randint(0, max_operand), rng.choice(list(ops)), rng.randint(0, max_b))
        if p not in seen:
            seen.add(p)
            problems.append(p)
    rows = [make_row(a, op, b, with_answers) for a, op, b in problems]
    return rows[:n_train], rows[n_train:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output_dir", required=True, help="folder for train.jsonl and eval.jsonl")
    p.add_argument("--train", type=int, default=2000, help="training problems")
    p.add_argument("--eval", type=int, default=200, help="held-out problems")
    p.add_argument("--max_operand", type=int, default=99, help="largest operand")
    p.add_argument("--max_second_operand", type=int, default=None,
                   help="largest second operand b (unset: --max_operand)")
    p.add_argument("--ops", default="+-", help="operators among + - *")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--with_answers", action="store_true", help="add the reference as 'chosen' (SFT rows)")
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    files = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    existing = [str(f) for f in files.values() if f.exists()]
    if existing and not args.overwrite:
        p.error(f"{', '.join(existing)} already exist(s); pass --overwrite to replace")
    try:
        train, evals = make_task(args.train, args.eval, args.seed, args.max_operand, tuple(args.ops),
                                 args.with_answers, args.max_second_operand)
    except ValueError as exc:
        p.error(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", evals)):
        tmp = files[name].with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(files[name])  # atomic: a reader never sees half a file
    print(json.dumps({"train": str(files["train"]), "eval": str(files["eval"]), "n_train": len(train),
                      "n_eval": len(evals)}), file=sys.stdout)


if __name__ == "__main__":
    main()
