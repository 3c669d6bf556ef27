"""Write a tool-use task for the calculator environment (``--env calculator``, ``docs/multi_turn.md``):
multi-digit products ``a * b`` that a small model cannot compute but can look up.

Three files:

- ``sft.jsonl``: demonstrations as message lists (step 1 trains every assistant turn of them)::

    {"messages": [{"role": "user", "content": "What is 37 * 8?"},
                  {"role": "assistant", "content": "<calc>37*8</calc>"},
                  {"role": "tool", "content": "296"},
                  {"role": "assistant", "content": "296"}]}

- ``prompts.jsonl``: the same training problems as prompt rows with their ``reference`` (step 3);
- ``eval.jsonl``: held-out problems (never in the training files), prompt rows.

Usage::

    python scripts/make_tool_task.py --output_dir data/calc --train 400 --eval 100 --seed 0

Then step 1 on ``sft.jsonl``, step 3 with ``--env calculator --data_path prompts.jsonl``, and
``python scripts/eval_exact_match.py --model ACTOR --data eval.jsonl --env calculator`` (with the
tool) or without ``--env`` (the same model answering directly).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

TEMPLATE = "What is {a} * {b}?"


def demonstration(a: int, b: int) -> dict:
    """The messages of one solved problem: the call, the tool's answer, the final answer."""
    return {"messages": [{"role": "user", "content": TEMPLATE.format(a=a, b=b)},
                         {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
                         {"role": "tool", "content": str(a * b)},
                         {"role": "assistant", "content": str(a * b)}]}


def prompt_row(a: int, b: int) -> dict:
    """One prompt row with its reference answer."""
    return {"prompt": TEMPLATE.format(a=a, b=b), "reference": str(a * b), "metadata": {"a": a, "b": b}}


def make_task(n_train: int, n_eval: int, seed: int = 0, a_range: tuple[int, int] = (10, 99),
              b_range: tuple[int, int] = (2, 9)) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(train, eval)`` lists of distinct problems ``(a, b)`` with ``a`` and ``b`` in their
    (inclusive) ranges; no held-out problem is a training one.

    Raises:
        ValueError: more problems asked for than exist, or an empty range.
    """
    space = [(a, b) for a in range(a_range[0], a_range[1] + 1) for b in range(b_range[0], b_range[1] + 1)]
    if not space or n_train < 0 or n_eval < 0 or n_train + n_eval > len(space):
        raise ValueError(f"{n_train} + {n_eval} problems asked for, {len(space)} exist with a in {a_range}, "
                         f"b in {b_range}")
    picked = random.Random(seed).sample(space, n_train + n_eval)
    return picked[:n_train], picked[n_train:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--output_dir", required=True, help="folder for sft.jsonl, prompts.jsonl and eval.jsonl")
    p.add_argument("--train", type=int, default=400, help="training problems")
    p.add_argument("--eval", type=int, default=100, help="held-out problems")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--overwrite", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    files = {name: out / f"{name}.jsonl" for name in ("sft", "prompts", "eval")}
    existing = [str(f) for f in files.values() if f.exists()]
    if existing and not args.overwrite:
        p.error(f"{', '.join(existing)} already exist(s); pass --overwrite to replace")
    try:
        train, held_out = make_task(args.train, args.eval, args.seed)
    except ValueError as exc:
        p.error(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    rows = {"sft": [demonstration(a, b) for a, b in train], "prompts": [prompt_row(a, b) for a, b in train],
            "eval": [prompt_row(a, b) for a, b in held_out]}
    for name, content in rows.items():
        tmp = files[name].with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in content))
        tmp.replace(files[name])
    print(json.dumps({k: str(v) for k, v in files.items()}), file=sys.stdout)


if __name__ == "__main__":
    main()
