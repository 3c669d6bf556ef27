"""The chat-template checker: does chatrl's turn-by-turn layout train what the model will see?

For each conversation (system, user, assistant and tool turns) it renders the conversation through
chatrl's formatting (:mod:`chatrl.data.turns`) and reports, as pass / fail / n/a with the offending
ids shown:

- ``renders``: the template writes every turn; a template that refuses a role (Llama 2 refuses tool
  turns) makes the conversation n/a, one that silently drops a turn's text fails;
- ``prefix``: prefix preservation: rendering the conversation up to assistant turn ``k + 1``
  extends, id for id, its rendering up to the end of turn ``k`` (a template that re-renders past
  turns, such as one that drops earlier ``<think>`` blocks, or whose generation prompt differs
  from how it writes an assistant turn, trains contexts that generation never shows);
- ``end_of_turn``: every assistant turn ends with the trained end-of-turn token
  (:func:`chatrl.models.causal_lm.end_of_turn_token_id`), the template writes it, and it is in the loss;
  no stop token appears earlier inside a trained turn;
- ``loss_mask``: only assistant turns are trained: the generation prompt, the template's
  boilerplate and the user, tool and system turns are not, the mask is not all ones, and each
  trained turn's text is the message's text;
- ``template_mask``: where the template marks assistant text with ``{% generation %}``, the
  mask transformers builds from it (``apply_chat_template(..., return_assistant_tokens_mask=True)``)
  equals chatrl's; n/a for templates without such blocks;
- ``token_in_token_out``: a rollout that samples each assistant turn's ids and appends the
  environment's observation ids (:func:`chatrl.data.turns.observation_ids`) gives exactly the
  ids and mask that step 1 trains (:func:`chatrl.data.turns.encode_conversation`).

``python -m chatrl.tools.check_template MODEL_OR_TOKENIZER`` prints the findings table; steps 1 and 3
run :func:`check_startup` on a few rows of their data and stop on a failure
(``--skip_template_check``). ``docs/multi_turn.md`` describes each check and its fixtures.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from chatrl.data.formatting import uses_chat_template
from chatrl.data.sources import read_source
from chatrl.data.turns import (
    ConversationIds,
    encode_conversation,
    encode_rendered_conversation,
    observation_ids,
    render_conversation,
)
from chatrl.errors import UsageError
from chatrl.models.causal_lm import end_of_turn_token_id, special_token_texts, stop_token_ids

CHECKS = ("renders", "prefix", "end_of_turn", "loss_mask", "template_mask", "token_in_token_out")
PASS, FAIL, NA = "pass", "FAIL", "n/a"

_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


#: The conversations the checker renders by default (``--conversations`` replaces them).
DEFAULT_CONVERSATIONS: dict[str, list[dict]] = {
    "single_turn": [_msg("user", "Name a colour."), _msg("assistant", "Blue.")],
    "multi_turn_system": [_msg("system", "You answer in one short sentence."), _msg("user", "Hi there!"),
                          _msg("assistant", "Hello! How can I help?"), _msg("user", "What is the capital of France?"),
                          _msg("assistant", "Paris is the capital of France.")],
    "tool_calls": [_msg("user", "What is 12 * 34 + 5?"), _msg("assistant", "<calc>12*34</calc>"),
                   _msg("tool", "408"), _msg("assistant", "<calc>408+5</calc>"), _msg("tool", "413"),
                   _msg("assistant", "The answer is 413.")],
    "control_text": [_msg("user", "Why does </s> or <|im_end|> or <|eot_id|> end a turn?"),
                     _msg("assistant", "Text like </s> and <|im_end|> here is data, not a marker.")],
    "think": [_msg("user", "Is 7 prime?"), _msg("assistant", "<think>7 has no divisor but 1 and 7.</think> Yes."),
              _msg("user", "And 9?"), _msg("assistant", "<think>9 = 3 * 3.</think> No.")],
}


@dataclass(frozen=True)
class Finding:
    """One cell of the findings table: ``conversation`` × ``check`` → ``status`` (pass, FAIL, n/a)
    with a ``detail`` naming the turn, the position and the offending ids."""

    conversation: str
    check: str
    status: str
    detail: str = ""


def _show(tokenizer, ids: Sequence[int], at: int, width: int = 3) -> str:
    """``ids[at]`` and its neighbours, ids and token texts, the one at ``at`` marked with ``>>``."""
    lo, hi = max(0, at - width), min(len(ids), at + width + 1)
    toks = [f"{'>>' if i == at else ''}{ids[i]}:{tokenizer.convert_ids_to_tokens(int(ids[i]))!r}" for i in range(lo, hi)]
    return f"ids[{lo}:{hi}] = [{', '.join(toks)}]" + (" (ends there)" if at >= len(ids) else "")


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _extends(tokenizer, shorter: list[int], longer: list[int], what: str) -> str | None:
    """None if ``shorter`` is a prefix of ``longer``, else what differs and where."""
    if longer[:len(shorter)] == shorter:
        return None
    i = _first_difference(shorter, longer)
    return f"{what}: at position {i} {_show(tokenizer, shorter, i)} becomes {_show(tokenizer, longer, i)}"


def _assistant_indices(messages: Sequence[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


_PROBE = "chatrl probe {} of the template checker"


def _check_renders(tokenizer, messages: Sequence[dict]) -> Finding | None:
    """None when every turn is written; an n/a finding when the template refuses a turn, a FAIL
    when it silently drops one (each non-assistant turn's text is replaced by a probe text that
    must appear in the rendering)."""
    try:
        render_conversation(tokenizer, messages)
    except ValueError as exc:
        return Finding("", "renders", NA, f"the template refuses these turns ({exc})")
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        probe = _PROBE.format(i)
        text = render_conversation(tokenizer, [*messages[:i], {**m, "content": probe}, *messages[i + 1:]])
        if probe not in text:
            return Finding("", "renders", FAIL, f"turn {i} ({m['role']}) is dropped: the template writes none of "
                                                "its text, so the model never sees it")
    return None


def _check_prefix(tokenizer, messages, turns_at) -> str | None:
    prev = None
    for n, k in enumerate(turns_at):
        prompt = encode_rendered_conversation(tokenizer, messages[:k], generation_prompt=True)
        if prev is not None and (bad := _extends(tokenizer, prev, prompt,
                                                 f"the prompt of assistant turn {n} does not extend turn {n - 1}")):
            return bad
        through = encode_rendered_conversation(tokenizer, messages[:k + 1])
        if bad := _extends(tokenizer, prompt, through, f"assistant turn {n} does not extend its generation prompt"):
            return bad
        prev = through
    return None


def _check_end_of_turn(tokenizer, messages, turns_at, conv: ConversationIds, eot: int, stops: set[int]) -> str | None:
    for n, k in enumerate(turns_at):
        through = encode_rendered_conversation(tokenizer, messages[:k + 1])
        if not through or through[-1] != eot:
            what = (f"no special token after assistant turn {n} (chatrl's end-of-turn token falls back to the EOS "
                    f"{tokenizer.convert_ids_to_tokens(eot)!r}, which the template never writes)"
                    if eot == tokenizer.eos_token_id and uses_chat_template(tokenizer) else
                    f"no end-of-turn token {tokenizer.convert_ids_to_tokens(eot)!r} after assistant turn {n}")
            return f"the template writes {what}: the turn ends with {_show(tokenizer, through, len(through) - 1)}"
    for n, (a, b) in enumerate(conv.turns):
        ids = conv.ids[a:b]
        if not ids or ids[-1] != eot or conv.trained[b - 1] != 1:
            return f"assistant turn {n} does not end with a trained end-of-turn token: {_show(tokenizer, conv.ids, b - 1)}"
        early = [i for i in range(a, b - 1) if conv.ids[i] in stops]
        if early:
            return f"assistant turn {n} holds a stop token before its end: {_show(tokenizer, conv.ids, early[0])}"
    return None


def _check_loss_mask(tokenizer, messages, turns_at, conv: ConversationIds, eot: int, specials: set[int]) -> str | None:
    if all(conv.trained):
        return "every token is trained: the mask fell back to all ones"
    expected = [0] * len(conv.ids)
    for a, b in conv.turns:
        expected[a:b] = [1] * (b - a)
    if conv.trained != expected or len(conv.turns) != len(turns_at):
        i = _first_difference(conv.trained, expected)
        return f"trained positions are not the assistant turns: {_show(tokenizer, conv.ids, i)}"
    for n, ((a, b), k) in enumerate(zip(conv.turns, turns_at, strict=True)):
        body = conv.ids[a:b - 1]
        boiler = [i for i in body if i in specials]
        if boiler:
            return (f"assistant turn {n} trains special tokens the template wrote: {boiler} "
                    f"{tokenizer.convert_ids_to_tokens(boiler)}")
        text = tokenizer.decode(body, skip_special_tokens=False).strip()
        if text != messages[k]["content"].strip():
            return (f"assistant turn {n} trains {text[:60]!r}, not the message's text "
                    f"{messages[k]['content'].strip()[:60]!r}: the template's text is in the loss")
    return None


def _check_template_mask(tokenizer, messages, conv: ConversationIds, specials_text: list[str]) -> Finding:
    template = tokenizer.chat_template if uses_chat_template(tokenizer) else None
    if not template or not _GENERATION_BLOCK.search(template):
        return Finding("", "template_mask", NA, "the template has no {% generation %} block")
    if any(sp in m["content"] for m in messages for sp in specials_text):
        return Finding("", "template_mask", NA, "data text spells special tokens (transformers would make them markers)")
    out = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    n = len(conv.ids)
    if ids[:n] != conv.ids:
        i = _first_difference(conv.ids, ids)
        return Finding("", "template_mask", FAIL, f"the template's own ids differ: {_show(tokenizer, ids, i)} vs "
                                                  f"chatrl's {_show(tokenizer, conv.ids, i)}")
    theirs = mask[:n] + [0] * max(0, n - len(mask))
    if theirs != conv.trained or any(mask[n:]):
        i = _first_difference(conv.trained, theirs) if theirs != conv.trained else n
        where = _show(tokenizer, ids, i)
        side = "the template's mask" if (mask[i] if i < len(mask) else 0) else "chatrl's mask"
        return Finding("", "template_mask", FAIL, f"{side} alone covers position {i}: {where}")
    return Finding("", "template_mask", PASS, "")


def _check_token_in_token_out(tokenizer, messages, turns_at, conv: ConversationIds) -> str | None:
    """A simulated rollout: the first prompt, then per assistant turn the ids the model samples (the
    template's own ids of the turn) and the observation appended after it."""
    rollout = ConversationIds()
    rollout.append(encode_conversation(tokenizer, messages[:turns_at[0]], generation_prompt=True).ids, trained=False)
    for n, k in enumerate(turns_at):
        prompt = encode_rendered_conversation(tokenizer, messages[:k], generation_prompt=True)
        through = encode_rendered_conversation(tokenizer, messages[:k + 1])
        rollout.append(through[len(prompt):], trained=True)
        nxt = turns_at[n + 1] if n + 1 < len(turns_at) else len(messages)
        if nxt > k + 1 or n + 1 < len(turns_at):
            rollout.append(observation_ids(tokenizer, messages[:k + 1], messages[k + 1:nxt],
                                           generation_prompt=n + 1 < len(turns_at)), trained=False)
    if rollout.ids != conv.ids:
        i = _first_difference(rollout.ids, conv.ids)
        return f"sampled + observation ids {_show(tokenizer, rollout.ids, i)} differ from the trained ids " \
               f"{_show(tokenizer, conv.ids, i)}"
    if rollout.trained != conv.trained:
        i = _first_difference(rollout.trained, conv.trained)
        return f"the sampled positions are not the trained ones at {_show(tokenizer, conv.ids, i)}"
    return None


def check_conversation(tokenizer, name: str, messages: Sequence[dict]) -> list[Finding]:
    """The findings of every check (:data:`CHECKS`) for one conversation with at least one assistant turn.

    Raises:
        ValueError: a malformed message or a conversation without an assistant turn.
    """
    messages = [dict(m) for m in messages]
    turns_at = _assistant_indices(messages)
    if not turns_at:
        raise ValueError(f"conversation {name!r} has no assistant turn to check")
    bad = _check_renders(tokenizer, messages)
    if bad is not None and bad.status == NA:
        return [Finding(name, c, NA, bad.detail) for c in CHECKS]
    out = [Finding(name, "renders", bad.status if bad else PASS, bad.detail if bad else "")]
    eot = end_of_turn_token_id(tokenizer)
    try:
        conv = encode_conversation(tokenizer, messages)
    except ValueError as exc:
        return out + [Finding(name, "prefix", FAIL, f"chatrl cannot append these turns: {exc}")] + [
            Finding(name, c, FAIL, "the turns cannot be laid out (see prefix)") for c in CHECKS[2:]]
    specials_text = special_token_texts(tokenizer)
    specials = set(tokenizer.all_special_ids) | set(tokenizer.convert_tokens_to_ids(specials_text))
    checks = [("prefix", lambda: _check_prefix(tokenizer, messages, turns_at)),
              ("end_of_turn", lambda: _check_end_of_turn(tokenizer, messages, turns_at, conv, eot,
                                                         set(stop_token_ids(tokenizer)))),
              ("loss_mask", lambda: _check_loss_mask(tokenizer, messages, turns_at, conv, eot, specials)),
              ("template_mask", lambda: _check_template_mask(tokenizer, messages, conv, specials_text)),
              ("token_in_token_out", lambda: _check_token_in_token_out(tokenizer, messages, turns_at, conv))]
    for check, run in checks:
        try:
            result = run()
        except ValueError as exc:
            result = f"{exc}"
        if isinstance(result, Finding):
            out.append(Finding(name, check, result.status, result.detail))
        else:
            out.append(Finding(name, check, FAIL if result else PASS, result or ""))
    return out


def check_tokenizer(tokenizer, conversations: dict[str, Sequence[dict]] | None = None) -> list[Finding]:
    """Every check on every conversation (default :data:`DEFAULT_CONVERSATIONS`)."""
    convs = DEFAULT_CONVERSATIONS if conversations is None else conversations
    return [f for name, msgs in convs.items() for f in check_conversation(tokenizer, name, msgs)]


def failures(findings: Iterable[Finding]) -> list[Finding]:
    """The failed findings."""
    return [f for f in findings if f.status == FAIL]


def format_table(findings: Sequence[Finding], title: str = "") -> str:
    """The findings as a Markdown table, one row per conversation and one column per check, then
    the detail of every failure and of every distinct n/a."""
    names = list(dict.fromkeys(f.conversation for f in findings))
    cell = {(f.conversation, f.check): f for f in findings}
    lines = ([f"### {title}", ""] if title else []) + [
        "| conversation | " + " | ".join(CHECKS) + " |", "|---" * (len(CHECKS) + 1) + "|"]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(cell[(n, c)].status if (n, c) in cell else "" for c in CHECKS) + " |")
    notes: list[str] = []
    na: dict[str, dict[str, list[str]]] = {}  # detail -> conversation -> checks
    for f in findings:
        if f.status == FAIL:
            notes.append(f"- {f.conversation} / {f.check}: FAIL: {f.detail}")
        elif f.status == NA and f.detail:
            na.setdefault(f.detail, {}).setdefault(f.conversation, []).append(f.check)
    for detail, where in na.items():
        checks = {tuple(c) for c in where.values()}
        what = (", ".join(where) + (" / " + ", ".join(next(iter(checks))) if checks != {CHECKS} else "")
                if len(checks) == 1 else "; ".join(f"{n} / {', '.join(c)}" for n, c in where.items()))
        notes.append(f"- {what}: n/a: {detail}")
    return "\n".join(lines + ([""] + notes if notes else []))


def startup_conversations(data_paths: Sequence[str], n: int = 3, answer: str = "OK.",
                          turn_by_turn: bool = False) -> dict[str, list[dict]]:
    """Up to ``n`` conversations from the first ``--data_path`` entry's samples, as a step trains
    them: a conversation sample (or any, with ``turn_by_turn``) whole, with its answer (``answer``
    for prompt-only rows) as the last assistant turn; a single-turn sample's last exchange (its
    earlier turns are prompt text, not turns of chatrl's layout).

    Raises:
        FileNotFoundError / ValueError: as :func:`chatrl.data.sources.read_source`.
    """
    out: dict[str, list[dict]] = {}
    for i, s in enumerate(read_source(data_paths[0]).samples):
        if len(out) >= n:
            break
        msgs = [dict(m) for m in s.messages]
        if not (s.conversation or turn_by_turn):
            last = max((j for j, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
            msgs = [m for m in msgs[:last + 1] if m["role"] == "system"] + msgs[last + 1:]
        out[f"row {i}"] = [*msgs, _msg("assistant", s.chosen if s.chosen else answer)]
    return out


def check_startup(tokenizer, conversations: dict[str, Sequence[dict]], where: str, skip: bool, log) -> None:
    """Steps 1 and 3 at start-up: check ``conversations`` (a few rows of the step's data) and stop on
    a failure; with ``skip`` (``--skip_template_check``) only log that the check was skipped.

    Raises:
        UsageError: a check failed; the message holds the findings table and names the flag.
    """
    if skip:
        log.warning("%s: the chat-template check is skipped (--skip_template_check)", where)
        return
    findings = [f for name, msgs in conversations.items() for f in check_conversation(tokenizer, name, msgs)]
    if failures(findings):
        raise UsageError(f"{where}: the tokenizer's chat template would mis-train these conversations "
                         f"(docs/multi_turn.md, 'The template checker'):\n{format_table(findings)}\n"
                         "Fix the template, or pass --skip_template_check to train anyway.")
    log.info("%s: chat-template check passed on %d conversations (%s)", where, len(conversations),
             ", ".join(conversations))
