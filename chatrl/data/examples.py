"""Turning samples into the token examples of each phase, with chatrl's truncation rules.

- Phase 1 (SFT): ``{"input_ids": prompt + answer + end-of-turn, "prompt_len"}`` (the ids of the
  joined text, :func:`chatrl.data.formatting.encode_examples`).
- Phase 2 (reward model): ``{"chosen_input_ids", "rejected_input_ids", "prompt_len"}``, both
  sides sharing one prompt.
- Phase 3 (PPO): ``{"prompt_ids", "metadata"}``; ``metadata`` is the sample's reward metadata as
  a JSON object text (``"{}"`` when it has none), see :class:`~chatrl.data.schema.Sample`.

Over-long sequences lose prompt tokens from the LEFT, so that answers keep their ends (the part a
reward model judges most). A leading BOS is kept when the prompt is cut. A sample whose answer
(with EOS) leaves no room for one prompt token is skipped as ``too_long``. In phase 2 a pair whose
answers are equal after ``strip()``, or whose sides are identical token for token after
truncation, is skipped as ``identical_pair``; phases 1 and 3 still use its prompt and chosen answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from chatrl.data.formatting import encode_examples, encode_prompts
from chatrl.data.schema import Sample, is_identical_pair

# Column layout of each phase (all token ids are int32 on disk, int64 tensors in memory).
PHASE_COLUMNS = {
    1: ("input_ids", "prompt_len"),
    2: ("chosen_input_ids", "rejected_input_ids", "prompt_len"),
    3: ("prompt_ids", "metadata"),
}


def left_cut(ids: Sequence[int], keep: int, bos_token_id: int | None = None) -> list[int] | None:
    """The last ``keep`` tokens of ``ids`` (all of them if it is short enough).

    If ``ids`` starts with ``bos_token_id`` and must be cut, the BOS stays in front and the last
    ``keep - 1`` tokens follow it. Returns ``None`` when no real token would be left
    (``keep < 1``, or ``keep < 2`` with a kept BOS).
    """
    ids = list(ids)
    if len(ids) <= keep:
        return ids if keep >= 1 else None
    if bos_token_id is not None and ids and ids[0] == bos_token_id:
        return [ids[0]] + ids[len(ids) - (keep - 1):] if keep >= 2 else None
    return ids[len(ids) - keep:] if keep >= 1 else None


def sft_example(prompt: Sequence[int], answer: Sequence[int], max_seq_len: int,
                bos_token_id: int | None = None) -> dict | str:
    """``{"input_ids", "prompt_len"}`` with ``len(input_ids) ≤ max_seq_len``, or ``"too_long"``."""
    cut = left_cut(prompt, max_seq_len - len(answer), bos_token_id)
    if cut is None:
        return "too_long"
    return {"input_ids": cut + list(answer), "prompt_len": len(cut)}


def pair_example(prompt: Sequence[int], chosen: Sequence[int], rejected: Sequence[int], max_seq_len: int,
                 bos_token_id: int | None = None) -> dict | str:
    """``{"chosen_input_ids", "rejected_input_ids", "prompt_len"}`` or a skip reason.

    The prompt is cut once, to fit the longer answer, so both sides see the same prompt.
    Returns ``"too_long"`` when either answer leaves no room for a prompt token, and
    ``"identical_pair"`` when both sides are the same ids.
    """
    cut = left_cut(prompt, max_seq_len - max(len(chosen), len(rejected)), bos_token_id)
    if cut is None:
        return "too_long"
    c, r = cut + list(chosen), cut + list(rejected)
    if c == r:
        return "identical_pair"
    return {"chosen_input_ids": c, "rejected_input_ids": r, "prompt_len": len(cut)}


def tokenize_samples(phase: int, samples: Sequence[Sample], tokenizer, max_seq_len: int,
                     max_prompt_len: int) -> list[tuple[dict | str, bool]]:
    """One ``(example or skip reason, truncated)`` per sample for ``phase``.

    ``truncated`` is true when a prompt was cut from the left (and kept).

    Raises:
        ValueError: a phase outside 1–3.
    """
    if phase not in PHASE_COLUMNS:
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    bos = tokenizer.bos_token_id
    out: list[tuple[dict | str, bool]] = []
    if phase == 3:
        for s, p in zip(samples, encode_prompts(tokenizer, [s.messages for s in samples]), strict=True):
            cut = left_cut(p, max_prompt_len, bos)
            if cut is None:
                out.append(("too_long", False))
            else:
                meta = json.dumps(s.metadata or {}, sort_keys=True, ensure_ascii=False)
                out.append(({"prompt_ids": cut, "metadata": meta}, len(cut) < len(p)))
        return out
    # Prompt + answer tokenized as one text (formatting.encode_examples): the ids at the boundary
    # are those of the joined text, and no data text becomes a special token.
    messages = [s.messages for s in samples]
    chosen = encode_examples(tokenizer, messages, [s.chosen or "" for s in samples])
    if phase == 1:
        for s, (p, a) in zip(samples, chosen, strict=True):
            ex = "missing_field" if s.chosen is None else sft_example(p, a, max_seq_len, bos)
            out.append((ex, isinstance(ex, dict) and ex["prompt_len"] < len(p)))
        return out
    rejected = encode_examples(tokenizer, messages, [s.rejected or "" for s in samples])
    for s, (p, c), (_, r) in zip(samples, chosen, rejected, strict=True):
        if s.chosen is None or s.rejected is None:
            ex = "missing_field"
        elif is_identical_pair(s):
            ex = "identical_pair"
        else:
            ex = pair_example(p, c, r, max_seq_len, bos)
        out.append((ex, isinstance(ex, dict) and ex["prompt_len"] < len(p)))
    return out
