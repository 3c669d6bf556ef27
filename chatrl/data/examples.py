"""Turning samples into the token examples of each phase, with chatrl's truncation rules.

- Phase 1 (SFT): ``{"input_ids": prompt + answer + end-of-turn, "prompt_len", "trained_spans"}``
  (the ids of the joined text, :func:`chatrl.data.formatting.encode_examples`). ``trained_spans``
  is the flat list ``[start_0, end_0, start_1, end_1, ...]`` of the token ranges in the loss: the
  answer ``[prompt_len, len)`` of a single-turn example; each assistant turn of a conversation
  laid out turn by turn (:func:`chatrl.data.turns.encode_conversation`) with
  ``--train_all_assistant_turns``, where ``prompt_len`` is where the last turn starts.
- Phase 2 (reward model): ``{"chosen_input_ids", "rejected_input_ids", "prompt_len"}``, both
  sides sharing one prompt.
- Phase 3 (PPO): ``{"prompt_ids", "metadata", "messages"}``; ``metadata`` is the sample's reward
  metadata as a JSON object text (``"{}"`` when it has none), see :class:`~chatrl.data.schema.Sample`;
  ``messages`` its prompt turns as a JSON list (an environment's episode starts from them).

Conversation samples (:attr:`chatrl.data.schema.Sample.conversation`) are laid out turn by turn in
every phase: their prompt is :func:`chatrl.data.turns.encode_conversation`'s (the same ids as
:func:`~chatrl.data.formatting.encode_prompt`'s under a prefix-preserving template; under the
Human/Assistant convention each earlier answer ends with EOS, as step 1 trains it and as step 3's
episodes sample it).

Over-long sequences lose prompt tokens from the LEFT, so that answers keep their ends (the part a
reward model judges most); in a conversation, earlier turns are cut first (a trained turn cut in
the middle keeps its tail trained). A leading BOS is kept when the prompt is cut. A sample whose answer
(with EOS) leaves no room for one prompt token is skipped as ``too_long``. In phase 2 a pair whose
answers are equal after ``strip()``, or whose sides are identical token for token after
truncation, is skipped as ``identical_pair``; phases 1 and 3 still use its prompt and chosen answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from chatrl.data.formatting import encode_examples, encode_prompts
from chatrl.data.schema import Sample, is_identical_pair
from chatrl.data.turns import encode_conversation

# Column layout of each phase (all token ids are int32 on disk, int64 tensors in memory).
PHASE_COLUMNS = {
    1: ("input_ids", "prompt_len", "trained_spans"),
    2: ("chosen_input_ids", "rejected_input_ids", "prompt_len"),
    3: ("prompt_ids", "metadata", "messages"),
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
    """``{"input_ids", "prompt_len", "trained_spans"}`` with ``len(input_ids) ≤ max_seq_len``, or ``"too_long"``."""
    cut = left_cut(prompt, max_seq_len - len(answer), bos_token_id)
    if cut is None:
        return "too_long"
    ids = cut + list(answer)
    return {"input_ids": ids, "prompt_len": len(cut), "trained_spans": [len(cut), len(ids)]}


def conversation_example(ids: Sequence[int], turns: Sequence[tuple[int, int]], max_seq_len: int,
                         bos_token_id: int | None = None) -> dict | str:
    """A phase-1 example of a conversation laid out turn by turn, training the turns ``turns``
    (``[start, end)`` each, the last one the final answer), or ``"too_long"``.

    Over-long: tokens are cut from the left (a leading BOS kept); a turn cut in the middle keeps
    its remaining tokens trained; ``too_long`` when the last turn leaves no room for one prompt token.
    """
    ids = list(ids)
    last_start = turns[-1][0]
    keep_bos = bos_token_id is not None and ids and ids[0] == bos_token_id
    cut_ids = left_cut(ids[:last_start], max_seq_len - (len(ids) - last_start), bos_token_id)
    if cut_ids is None:
        return "too_long"
    shift = last_start - len(cut_ids)  # tokens removed (after the kept BOS, when cut)
    floor = 1 if keep_bos and shift else 0
    spans: list[int] = []
    for a, b in turns:
        a, b = (max(a - shift, floor) if shift else a), b - shift
        if b > a:
            spans += [a, b]
    return {"input_ids": cut_ids + ids[last_start:], "prompt_len": len(cut_ids), "trained_spans": spans}


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


#: ``--train_all_assistant_turns`` values: ``auto`` trains every turn of conversation samples only.
ALL_TURNS_CHOICES = ("auto", "true", "false")


def _turn_by_turn(sample: Sample, all_turns: str) -> bool:
    return sample.conversation or all_turns == "true"


def _prompts(tokenizer, samples: Sequence[Sample]) -> list[list[int]]:
    """Each sample's prompt ids for generation: turn by turn for conversation samples, else
    :func:`~chatrl.data.formatting.encode_prompts`'s."""
    plain = encode_prompts(tokenizer, [s.messages for s in samples])
    return [encode_conversation(tokenizer, s.messages, generation_prompt=True).ids if s.conversation else p
            for s, p in zip(samples, plain, strict=True)]


def _sft_examples(tokenizer, samples: Sequence[Sample], max_seq_len: int, all_turns: str, bos
                  ) -> list[tuple[dict | str, bool]]:
    out: list[tuple[dict | str, bool]] = []
    single = encode_examples(tokenizer, [s.messages for s in samples], [s.chosen or "" for s in samples])
    for s, (p, a) in zip(samples, single, strict=True):
        if s.chosen is None:
            out.append(("missing_field", False))
            continue
        if not _turn_by_turn(s, all_turns):
            ex = sft_example(p, a, max_seq_len, bos)
            out.append((ex, isinstance(ex, dict) and ex["prompt_len"] < len(p)))
            continue
        conv = encode_conversation(tokenizer, [*s.messages, {"role": "assistant", "content": s.chosen}])
        turns = conv.turns if all_turns != "false" else conv.turns[-1:]
        ex = conversation_example(conv.ids, turns, max_seq_len, bos)
        out.append((ex, isinstance(ex, dict) and ex["prompt_len"] < conv.turns[-1][0]))
    return out


def tokenize_samples(phase: int, samples: Sequence[Sample], tokenizer, max_seq_len: int,
                     max_prompt_len: int, all_turns: str = "auto") -> list[tuple[dict | str, bool]]:
    """One ``(example or skip reason, truncated)`` per sample for ``phase``.

    ``truncated`` is true when a prompt was cut from the left (and kept). ``all_turns``
    (``--train_all_assistant_turns``, phase 1): ``auto`` trains every assistant turn of
    conversation samples and the last answer of the others; ``true`` lays out every sample turn by
    turn and trains every turn; ``false`` trains the last answer only.

    Raises:
        ValueError: a phase outside 1–3, an unknown ``all_turns``.
    """
    if phase not in PHASE_COLUMNS:
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    if all_turns not in ALL_TURNS_CHOICES:
        raise ValueError(f"--train_all_assistant_turns must be one of {ALL_TURNS_CHOICES}, got {all_turns!r}")
    bos = tokenizer.bos_token_id
    out: list[tuple[dict | str, bool]] = []
    if phase == 3:
        for s, p in zip(samples, _prompts(tokenizer, samples), strict=True):
            cut = left_cut(p, max_prompt_len, bos)
            if cut is None:
                out.append(("too_long", False))
            else:
                meta = json.dumps(s.metadata or {}, sort_keys=True, ensure_ascii=False)
                msgs = json.dumps([dict(m) for m in s.messages], ensure_ascii=False)
                out.append(({"prompt_ids": cut, "metadata": meta, "messages": msgs}, len(cut) < len(p)))
        return out
    # Prompt + answer tokenized as one text (formatting.encode_examples): the ids at the boundary
    # are those of the joined text, and no data text becomes a special token.
    if phase == 1:
        return _sft_examples(tokenizer, samples, max_seq_len, all_turns, bos)
    messages = [s.messages for s in samples]
    chosen = encode_examples(tokenizer, messages, [s.chosen or "" for s in samples])
    rejected = encode_examples(tokenizer, messages, [s.rejected or "" for s in samples])
    prompts = [encode_conversation(tokenizer, s.messages, generation_prompt=True).ids if s.conversation else p
               for s, (p, _) in zip(samples, chosen, strict=True)]
    for s, (_, c), (_, r), p in zip(samples, chosen, rejected, prompts, strict=True):
        if s.chosen is None or s.rejected is None:
            ex = "missing_field"
        elif is_identical_pair(s):
            ex = "identical_pair"
        else:
            ex = pair_example(p, c, r, max_seq_len, bos)
        out.append((ex, isinstance(ex, dict) and ex["prompt_len"] < len(p)))
    return out
