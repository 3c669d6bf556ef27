"""Score your own answers with a trained reward model.

One pair from the command line::

    python -m chatrl.step2_reward.score --model out/step2 \\
        --prompt "How do I boil an egg?" --chosen "Put it in boiling water for 8 minutes." \\
        --rejected "No."

or every row of a file that chatrl's data layer reads (hh-rlhf ``{chosen, rejected}``
transcripts, ``{prompt, chosen, rejected}``, ShareGPT, …; ``.jsonl``/``.json``/``.parquet``,
optionally ``.gz``, optionally with a row slice ``file.jsonl[0:100]``)::

    python -m chatrl.step2_reward.score --model out/step2 --pairs my_pairs.jsonl

Output: one JSON object per pair on stdout (``index``: the row's position in the file, or in its
slice; ``chosen``, ``rejected``, ``margin``; ``rejected`` and ``margin`` are ``null`` for a row
without a rejected answer), then a summary object (``pairs``, ``accuracy``, ``mean_chosen``,
``mean_rejected``, ``mean_margin``, ``skipped``: rows not scored, ``skip_reasons``: their count per
reason, as in the data layer's reports: ``empty_field``, ``malformed_json``, ``too_long``, …).
A usage error (an unknown schema, a length beyond the model's window) prints its message alone.

Texts are formatted exactly as in training (:func:`chatrl.data.formatting.format_prompt`: the
tokenizer's chat template, else the ``Human: … Assistant:`` convention), answers end with one end-of-turn token,
and an over-long prompt loses its oldest tokens. A prompt that is a ``"\\n\\nHuman: …
\\n\\nAssistant:"`` transcript is split into its turns; any other prompt is one user message.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

import torch

from chatrl import config
from chatrl.cli import normalize_argv
from chatrl.config import REQUIRED, setting
from chatrl.data.schema import Sample, is_identical_pair
from chatrl.data.sources import read_source
from chatrl.errors import UsageError
from chatrl.models.causal_lm import check_context_window, load_tokenizer
from chatrl.models.precision import resolve_dtype
from chatrl.models.reward_model import encode_rows, load_reward_model, prompt_messages, score_sequences


@dataclass
class ScoreConfig:
    """Scoring."""

    model: str = setting(REQUIRED, "reward-model folder (step 2's --output_dir)", type=str)
    prompt: str | None = setting(None, "the user's prompt (plain text or a Human/Assistant transcript)", type=str)
    chosen: str | None = setting(None, "an answer to score (the one you expect to win)", type=str)
    rejected: str | None = setting(None, "a second answer to score against --chosen", type=str)
    pairs: str | None = setting(None, "a data file of pairs instead of --prompt/--chosen/--rejected", type=str)
    schema: str | None = setting(None, "the file's schema when auto-detection fails (hh, pairs, sharegpt...)", type=str)
    batch_size: int = setting(8, "pairs per forward pass", unit="pairs")
    device: str | None = setting(None, "torch device (default: cuda if available, else cpu)", type=str)


def build_parser() -> argparse.ArgumentParser:
    """The scoring tool's flags."""
    p = config.new_parser("score prompt/answer pairs with a chatrl (or HF seq-cls) reward model",
                          prog="python -m chatrl.step2_reward.score")
    config.add_block(p, ScoreConfig)
    config.add_block(p, config.DataConfig, only=("max_seq_len",))
    config.add_block(p, config.ModelConfig, only=("dtype",))
    return p


def file_samples(entry: str, schema: str | None, skips: dict[str, int]) -> tuple[list, list[int]]:
    """The scorable samples of a data file and, for each, its row's position in the file (or slice).

    Rows that cannot be scored are counted into ``skips`` by reason: the data layer's row skips
    (``empty_field``, ``malformed_json``, …), ``missing_field`` for a row without an answer and
    ``identical_pair`` for equal answers.

    Raises:
        FileNotFoundError / ValueError: as :func:`chatrl.data.sources.read_source`
            (:class:`chatrl.errors.UsageError` for an unknown schema).
    """
    src = read_source(entry, schema)
    for reason in src.row_skips.values():
        skips[reason] = skips.get(reason, 0) + 1
    samples, rows = [], []
    for s, row in zip(src.samples, src.sample_rows, strict=True):
        reason = "missing_field" if s.chosen is None else "identical_pair" if is_identical_pair(s) else None
        if reason:
            skips[reason] = skips.get(reason, 0) + 1
        else:
            samples.append(s)
            rows.append(row)
    return samples, rows


def main(argv: list[str] | None = None, out=None) -> dict:
    """Score the pairs given by ``argv`` and print them (to ``out``, default stdout); returns the summary.

    Raises:
        SystemExit: neither ``--pairs`` nor ``--prompt`` with ``--chosen`` was given.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(normalize_argv(list(sys.argv[1:] if argv is None else argv)))
    out = out or sys.stdout
    if bool(args.pairs) == bool(args.prompt is not None and args.chosen is not None):
        parser.error("give either --pairs FILE or --prompt with --chosen (and optionally --rejected)")

    import transformers

    transformers.logging.set_verbosity_error()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        check_context_window(args.model, {"--max_seq_len": args.max_seq_len})
    except ValueError as e:
        parser.error(str(e))
    tokenizer = load_tokenizer(args.model)
    dtype, why = resolve_dtype(args.dtype, device.type)
    if why:
        print(f"{dtype} ({why})", file=sys.stderr)
    model = load_reward_model(args.model, tokenizer, dtype=dtype, require_head=True).to(device).eval()
    skips: dict[str, int] = {}
    if args.pairs:
        try:
            samples, rows_of = file_samples(args.pairs, args.schema, skips)
        except UsageError as e:
            parser.error(str(e))
    else:
        samples, rows_of = [Sample(prompt_messages(args.prompt), args.chosen, args.rejected)], [0]

    encoded = encode_rows(tokenizer, samples, args.max_seq_len)
    kept = [i for i, e in enumerate(encoded) if e is not None]
    if len(kept) < len(encoded):
        skips["too_long"] = skips.get("too_long", 0) + len(encoded) - len(kept)
    seqs = [encoded[i][0] for i in kept] + [encoded[i][1] for i in kept if encoded[i][1] is not None]
    scores = iter(score_sequences(model, seqs, tokenizer.pad_token_id, args.batch_size, device))
    chosen = [next(scores) for _ in kept]
    rows = []
    for i, c in zip(kept, chosen, strict=True):
        r = next(scores) if encoded[i][1] is not None else None
        rows.append({"index": rows_of[i], "chosen": c, "rejected": r, "margin": None if r is None else c - r})
        print(json.dumps(rows[-1]), file=out)
    pairs = [r for r in rows if r["rejected"] is not None]

    def mean(xs):
        return sum(xs) / len(xs) if xs else math.nan

    summary = {"pairs": len(pairs), "accuracy": mean([float(r["margin"] > 0) for r in pairs]),
               "mean_chosen": mean([r["chosen"] for r in rows]),
               "mean_rejected": mean([r["rejected"] for r in pairs]),
               "mean_margin": mean([r["margin"] for r in pairs]), "skipped": sum(skips.values()),
               "skip_reasons": dict(sorted(skips.items()))}
    print(json.dumps(summary), file=out)
    return summary


if __name__ == "__main__":
    main()
