"""The canonical sample and the adaptors that turn each public data schema into it.

Every data set chatrl reads is reduced to :class:`Sample`: a prompt conversation that ends with a
user turn, plus a preferred (``chosen``) and a dispreferred (``rejected``) answer. The adaptors
here are pure functions of one raw row; a row they cannot use raises :class:`RowSkip` with the
reason it is counted under in the :class:`~chatrl.data.report.SkipReport`.

Schemas (names accepted by ``schema=``):

- ``hh``: Anthropic hh-rlhf transcripts ``{chosen, rejected}``.
- ``pairs``: ``{prompt, chosen, rejected}`` (Dahoas, yitingxie), ``response`` standing in for
  ``chosen``; without ``rejected`` in the source it is SFT data.
- ``alpaca``: ``{instruction, input, output}`` (SFT only).
- ``sharegpt``: ``{conversations: [{from, value}], chosen?, rejected?}`` (LLaMA-Factory's
  ``function_call`` and ``observation`` turns are assistant and tool turns).
- ``messages``: ``{messages: [{role, content}]}`` (the OpenAI / TRL conversational layout), SFT on
  its assistant turns. ``hh`` and ``pairs`` rows whose ``chosen``/``rejected`` (and ``prompt``) are
  such message lists are conversation pairs whose last assistant turn differs.
- ``prompts``: a JSON string per row, or ``{prompt}`` / ``{text}`` (step-3 prompts only), optionally
  with a ``reference`` answer (string or number) and a ``metadata`` object for reward functions
  (``docs/rewards.md``).
- ``oasst``: Open-Assistant message trees ``{message_tree_id, prompt: {text, role, rank, replies}}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from chatrl.errors import UsageError

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"
TOOL = "\n\nTool:"  # a tool's output in the Human/Assistant convention (docs/multi_turn.md)

# What a source can feed: pairs go to every phase, SFT data to phase 1, prompts to phase 3.
KIND_PAIRS = "pairs"
KIND_SFT = "sft"
KIND_PROMPTS = "prompts"

SCHEMAS = ("hh", "pairs", "alpaca", "sharegpt", "prompts", "oasst", "messages")


@dataclass(frozen=True)
class Sample:
    """One canonical example.

    Attributes:
        messages: the prompt conversation, ``({"role": "user"|"assistant"|"system",
            "content": str}, ...)``, ending with a user turn.
        chosen: the preferred answer (also the SFT target); ``None`` for prompt-only data.
        rejected: the dispreferred answer; ``None`` unless the sample is a preference pair.
        metadata: for prompt-only rows, what reaches step 3's reward functions: the row's
            ``metadata`` object with its ``reference`` answer under ``"reference"``; ``None`` if
            the row has neither.
        conversation: the row is a conversation of turns (ShareGPT, Open-Assistant, message
            lists), laid out turn by turn (:mod:`chatrl.data.turns`: every earlier assistant turn
            ends with its end-of-turn token, and step 1 can train each of them); ``False`` for a
            transcript (hh-rlhf), whose earlier turns are prompt text as written.
    """

    messages: tuple[dict, ...]
    chosen: str | None = None
    rejected: str | None = None
    metadata: dict | None = None
    conversation: bool = False


class RowSkip(Exception):
    """A raw row that cannot be used; ``reason`` is the :class:`SkipReport` counter it goes to."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# field checks


def _field(row, key: str, *, required: bool = True, allow_empty: bool = False):
    """``row[key]`` as a string, raising RowSkip(missing_field | wrong_type | empty_field)."""
    if not isinstance(row, dict):
        raise RowSkip("wrong_type", f"row is a {type(row).__name__}, not an object")
    value = row.get(key)
    if value is None:
        if required:
            raise RowSkip("missing_field", key)
        return None
    if not isinstance(value, str):
        raise RowSkip("wrong_type", f"{key} is a {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise RowSkip("empty_field", key)
    return value


def is_identical_pair(sample: Sample) -> bool:
    """True for a pair whose answers are equal after ``strip()`` (no preference signal).

    Such samples are kept by the adaptors (their prompt and chosen answer still serve phases 1
    and 3) and skipped as ``identical_pair`` wherever pairs are needed.
    """
    return sample.rejected is not None and sample.chosen is not None and \
        sample.chosen.strip() == sample.rejected.strip()


def _strip_one_space(text: str) -> str:
    return text[1:] if text.startswith(" ") else text


# ---------------------------------------------------------------------------------------------
# Human/Assistant transcripts


def parse_transcript(prompt: str) -> tuple[dict, ...]:
    """Split a ``"\\n\\nHuman: … \\n\\nAssistant:"`` prompt into messages.

    Text before the first marker becomes a system message; one space after each marker is
    dropped. The trailing empty ``Assistant:`` turn is the generation slot and is not a message.

    Raises:
        RowSkip("bad_transcript"): no Human turn, or the conversation does not end with a user turn.
    """
    if prompt.endswith(ASSISTANT):
        prompt = prompt[: -len(ASSISTANT)]
    messages: list[dict] = []
    pos = 0
    role = None
    while True:
        h = prompt.find(HUMAN, pos)
        a = prompt.find(ASSISTANT, pos)
        nxt = min((i for i in (h, a) if i >= 0), default=-1)
        end = nxt if nxt >= 0 else len(prompt)
        text = prompt[pos:end]
        if role is None:
            if text.strip():
                messages.append({"role": "system", "content": text})
        else:
            messages.append({"role": role, "content": _strip_one_space(text)})
        if nxt < 0:
            break
        role = "user" if nxt == h else "assistant"
        pos = nxt + len(HUMAN if role == "user" else ASSISTANT)
    if not messages or messages[-1]["role"] != "user":
        raise RowSkip("bad_transcript", "prompt does not end with a Human turn")
    return tuple(messages)


def _split_transcript(text: str) -> tuple[str, str]:
    cut = text.rfind(ASSISTANT)
    if cut < 0:
        raise RowSkip("bad_transcript", "no '\\n\\nAssistant:' in transcript")
    cut += len(ASSISTANT)
    return text[:cut], text[cut:]


def _common_prompt(chosen: str, rejected: str) -> int:
    """End of the last ``\\n\\nAssistant:`` inside the common prefix of two transcripts."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    cut = chosen.rfind(ASSISTANT, 0, n)
    if cut < 0:
        raise RowSkip("bad_transcript", "chosen and rejected share no '\\n\\nAssistant:' prefix")
    return cut + len(ASSISTANT)


def adapt_hh(row) -> list[Sample]:
    """An hh-rlhf ``{chosen, rejected}`` transcript pair → one pair :class:`Sample`.

    An empty chosen answer is skipped (``empty_field``); an empty rejected answer is kept: a
    silent reply is a real, dispreferred answer (helpful-base has 4 such rows).
    """
    if isinstance(row, dict) and isinstance(row.get("chosen"), list):
        return [conversation_pair(None, row.get("chosen"), row.get("rejected"))]
    chosen = _field(row, "chosen")
    rejected = _field(row, "rejected")
    p_c, a_c = _split_transcript(chosen)
    p_r, a_r = _split_transcript(rejected)
    if p_c != p_r:
        cut = _common_prompt(chosen, rejected)
        p_c, a_c, a_r = chosen[:cut], chosen[cut:], rejected[cut:]
    a_c, a_r = _strip_one_space(a_c), _strip_one_space(a_r)
    if not a_c.strip():
        raise RowSkip("empty_field", "chosen answer")
    return [Sample(parse_transcript(p_c), a_c, a_r)]


# ---------------------------------------------------------------------------------------------
# conversations as message lists

#: Message roles; a ``tool`` turn carries a tool's output (an environment's observation, docs/multi_turn.md).
ROLES = ("system", "user", "assistant", "tool")


def message_list(value, what: str) -> list[dict]:
    """``value`` as a list of ``{"role", "content"}`` messages (a bare string: one assistant turn).

    Raises:
        RowSkip("missing_field" | "wrong_type" | "bad_conversation"): naming ``what`` and the turn.
    """
    if value is None:
        raise RowSkip("missing_field", what)
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowSkip("wrong_type", f"{what} is a {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RowSkip("wrong_type", f"{what}[{i}] is a {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise RowSkip("bad_conversation", f"{what}[{i}] has role {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise RowSkip("wrong_type", f"{what}[{i}].content is a {type(m.get('content')).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _split_last_answer(messages: list[dict], what: str) -> tuple[list[dict], str]:
    if not messages or messages[-1]["role"] != "assistant":
        raise RowSkip("bad_conversation", f"{what} does not end with an assistant turn")
    if not messages[-1]["content"].strip() and what != "rejected":
        raise RowSkip("empty_field", f"{what}'s last assistant turn")
    return messages[:-1], messages[-1]["content"].strip()


def conversation_pair(prompt, chosen, rejected) -> Sample:
    """A conversation pair (or, without ``rejected``, SFT): ``chosen`` and ``rejected`` message
    lists (after the ``prompt`` list, when given) that share every turn but their last assistant turn.

    Raises:
        RowSkip: a malformed message list, a side that does not end with an assistant turn, sides
            that differ before it (``bad_conversation``), or a prompt that does not end with a user
            or tool turn.
    """
    head = message_list(prompt, "prompt") if prompt is not None else []
    history, good = _split_last_answer(head + message_list(chosen, "chosen"), "chosen")
    bad = None
    if rejected is not None:
        other, bad = _split_last_answer(head + message_list(rejected, "rejected"), "rejected")
        if other != history:
            raise RowSkip("bad_conversation", "chosen and rejected differ before their last assistant turn")
    if not history or history[-1]["role"] not in ("user", "tool"):
        raise RowSkip("bad_conversation", "the turns before the answer do not end with a user or tool turn")
    return Sample(tuple(history), good, bad, conversation=True)


def adapt_messages(row) -> list[Sample]:
    """``{messages: [{role, content}, ...]}`` → an SFT :class:`Sample` whose answer is the last
    assistant turn (step 1 trains every assistant turn of it, ``--train_all_assistant_turns``)."""
    if not isinstance(row, dict):
        raise RowSkip("wrong_type", f"row is a {type(row).__name__}, not an object")
    return [conversation_pair(None, row.get("messages"), None)]


# ---------------------------------------------------------------------------------------------
# other schemas


def _prompt_messages(prompt: str) -> tuple[dict, ...]:
    """A ``prompt`` field: a Human/Assistant transcript (Dahoas) or a plain user message."""
    if HUMAN in prompt and prompt.rstrip().endswith("Assistant:"):
        return parse_transcript(prompt.rstrip())
    return ({"role": "user", "content": prompt.strip()},)


def adapt_pairs(row, *, pairs: bool) -> list[Sample]:
    """``{prompt, chosen | response, rejected}`` → a pair (``pairs``) or an SFT :class:`Sample`;
    with message lists, a conversation pair (:func:`conversation_pair`)."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), list):
        if pairs:
            return [conversation_pair(row["prompt"], row.get("chosen"), row.get("rejected"))]
        return [conversation_pair(row["prompt"], row.get("chosen", row.get("response")), None)]
    prompt = _field(row, "prompt")
    chosen = _field(row, "chosen", required=False)
    if chosen is None:
        chosen = _field(row, "response")
    rejected = _field(row, "rejected", allow_empty=True) if pairs else None
    return [Sample(_prompt_messages(prompt), chosen.strip(), rejected.strip() if rejected is not None else None)]


def adapt_alpaca(row) -> list[Sample]:
    """Alpaca ``{instruction, input, output}`` → an SFT :class:`Sample`."""
    instruction = _field(row, "instruction")
    extra = _field(row, "input", required=False, allow_empty=True)
    output = _field(row, "output")
    content = instruction.strip() + ("\n\n" + extra.strip() if extra and extra.strip() else "")
    return [Sample(({"role": "user", "content": content},), output.strip())]


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}


def _sharegpt_turn(turn, what: str, allow_empty: bool = False) -> dict:
    if isinstance(turn, str):
        turn = {"from": "gpt", "value": turn}
    if not isinstance(turn, dict):
        raise RowSkip("wrong_type", f"{what} is a {type(turn).__name__}")
    role = turn.get("from")
    if role not in _SHAREGPT_ROLES:
        raise RowSkip("bad_conversation", f"{what} has role {role!r}")
    value = turn.get("value")
    if value is None:
        raise RowSkip("missing_field", f"{what}.value")
    if not isinstance(value, str):
        raise RowSkip("wrong_type", f"{what}.value is a {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise RowSkip("empty_field", f"{what}.value")
    return {"role": _SHAREGPT_ROLES[role], "content": value}


def adapt_sharegpt(row, *, pairs: bool) -> list[Sample]:
    """ShareGPT ``{conversations, chosen?, rejected?}`` → a pair, or SFT on the last gpt turn."""
    if not isinstance(row, dict):
        raise RowSkip("wrong_type", f"row is a {type(row).__name__}, not an object")
    conv = row.get("conversations")
    if conv is None:
        raise RowSkip("missing_field", "conversations")
    if not isinstance(conv, list):
        raise RowSkip("wrong_type", f"conversations is a {type(conv).__name__}")
    messages = [_sharegpt_turn(t, f"conversations[{i}]") for i, t in enumerate(conv)]
    if pairs:
        for key in ("chosen", "rejected"):
            if row.get(key) is None:
                raise RowSkip("missing_field", key)
        chosen = _sharegpt_turn(row["chosen"], "chosen")["content"]
        rejected = _sharegpt_turn(row["rejected"], "rejected", allow_empty=True)["content"]
    else:
        if not messages or messages[-1]["role"] != "assistant":
            raise RowSkip("bad_conversation", "no final gpt turn to learn")
        chosen, rejected = messages.pop()["content"], None
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise RowSkip("bad_conversation", "the prompt does not end with a human or observation turn")
    return [Sample(tuple(messages), chosen.strip(), rejected.strip() if rejected is not None else None,
                   conversation=True)]


#: Optional fields of a prompt-only row that flow to the reward functions.
PROMPT_EXTRA_KEYS = ("reference", "metadata")


def _reward_metadata(row: dict) -> dict | None:
    """The ``metadata`` object of a prompt row with its ``reference`` added, or ``None``.

    Raises:
        RowSkip("wrong_type"): ``metadata`` not an object, ``reference`` not a string or number, or
            both a ``reference`` field and a different ``metadata.reference``.
    """
    meta, ref = row.get("metadata"), row.get("reference")
    if meta is None and ref is None:
        return None
    if meta is not None and not isinstance(meta, dict):
        raise RowSkip("wrong_type", f"metadata is a {type(meta).__name__}, not an object")
    if ref is not None and (isinstance(ref, bool) or not isinstance(ref, (str, int, float))):
        raise RowSkip("wrong_type", f"reference is a {type(ref).__name__}, not a string or number")
    out = dict(meta or {})
    if ref is not None:
        if out.get("reference", ref) != ref:
            raise RowSkip("wrong_type", "reference and metadata.reference differ")
        out["reference"] = ref
    return out


def adapt_prompt(row) -> list[Sample]:
    """A JSON string, ``{prompt}`` or ``{text}`` (with optional ``reference``, ``metadata``) → a
    prompt-only :class:`Sample`."""
    if isinstance(row, str):
        text = row
        if not text.strip():
            raise RowSkip("empty_field", "prompt")
        return [Sample(_prompt_messages(text))]
    if not isinstance(row, dict):
        raise RowSkip("wrong_type", f"row is a {type(row).__name__}")
    text = _field(row, "prompt" if "prompt" in row else "text")
    return [Sample(_prompt_messages(text), metadata=_reward_metadata(row))]


def _oasst_nodes(node, path: list[dict]) -> Iterator[Sample]:
    """Depth-first walk: each prompter node with ≥ 2 ranked assistant replies gives a pair."""
    if not isinstance(node, dict) or node.get("deleted") or not isinstance(node.get("text"), str):
        return
    role = "user" if node.get("role") == "prompter" else "assistant"
    here = path + [{"role": role, "content": node["text"]}]
    replies = [r for r in node.get("replies") or [] if isinstance(r, dict) and not r.get("deleted")]
    if role == "user":
        ranked = sorted((r for r in replies if isinstance(r.get("rank"), int) and isinstance(r.get("text"), str)
                         and r["text"].strip()), key=lambda r: r["rank"])
        if len(ranked) >= 2:
            yield Sample(tuple(here), ranked[0]["text"].strip(), ranked[1]["text"].strip(), conversation=True)
    for reply in replies:
        yield from _oasst_nodes(reply, here)


def adapt_oasst(row) -> list[Sample]:
    """An Open-Assistant message tree → one pair per prompter node with ≥ 2 ranked replies.

    The chosen answer is the best-ranked reply (rank 0), the rejected one the next; the pairs'
    chosen answers are the SFT targets. A tree without such a node is skipped as ``no_pair``.
    """
    if not isinstance(row, dict):
        raise RowSkip("wrong_type", f"row is a {type(row).__name__}")
    root = row.get("prompt")
    if root is None:
        raise RowSkip("missing_field", "prompt")
    if not isinstance(root, dict):
        raise RowSkip("wrong_type", f"prompt is a {type(root).__name__}")
    samples = list(_oasst_nodes(root, []))
    if not samples:
        raise RowSkip("no_pair", "no node with two ranked replies")
    return samples


# ---------------------------------------------------------------------------------------------
# detection


def detect_schema(rows: Iterable, where: str) -> tuple[str, str]:
    """Guess ``(schema, kind)`` of a file from the keys of its rows.

    ``kind`` is ``"pairs"``, ``"sft"`` or ``"prompts"``. The keys are the union over the rows, so
    that a row missing a field is counted as such rather than changing the guess.

    Raises:
        ValueError: no schema matches; the message names ``where`` and the keys seen.
    """
    keys: set[str] = set()
    n_str = n_dict = 0
    for row in rows:
        if isinstance(row, str):
            n_str += 1
        elif isinstance(row, dict):
            n_dict += 1
            keys.update(row)
    if n_str > n_dict:
        return "prompts", KIND_PROMPTS
    if "message_tree_id" in keys:
        return "oasst", KIND_PAIRS
    if "conversations" in keys:
        return "sharegpt", KIND_PAIRS if {"chosen", "rejected"} & keys else KIND_SFT
    if "messages" in keys:
        return "messages", KIND_SFT
    if {"instruction", "output"} <= keys:
        return "alpaca", KIND_SFT
    if "prompt" in keys and ({"chosen", "response"} & keys):
        return "pairs", KIND_PAIRS if "rejected" in keys else KIND_SFT
    if {"chosen", "rejected"} <= keys:
        return "hh", KIND_PAIRS
    if keys - set(PROMPT_EXTRA_KEYS) in ({"prompt"}, {"text"}):
        return "prompts", KIND_PROMPTS
    raise UsageError(f"{where}: unknown data schema; saw keys {sorted(keys)} (known: hh-rlhf "
                     "{chosen, rejected}; {prompt, chosen, rejected}; alpaca {instruction, input, output}; "
                     "sharegpt {conversations}; messages {messages}; prompts {prompt} | {text} | a JSON string, with optional reference "
                     "and metadata; oasst trees)")


def schema_kind(schema: str, rows: Iterable) -> str:
    """The kind of a forced ``schema``; for ``pairs``/``sharegpt`` it depends on the keys present."""
    if schema not in SCHEMAS:
        raise UsageError(f"unknown schema {schema!r}; choose from {SCHEMAS}")
    if schema in ("hh", "oasst"):
        return KIND_PAIRS
    if schema in ("alpaca", "messages"):
        return KIND_SFT
    if schema == "prompts":
        return KIND_PROMPTS
    has_rejected = any(isinstance(r, dict) and "rejected" in r for r in rows)
    return KIND_PAIRS if has_rejected else KIND_SFT


def adapt_row(row, schema: str, kind: str) -> list[Sample]:
    """Apply ``schema``'s adaptor to one raw row. Raises :class:`RowSkip`."""
    if schema == "hh":
        return adapt_hh(row)
    if schema == "pairs":
        return adapt_pairs(row, pairs=kind == KIND_PAIRS)
    if schema == "alpaca":
        return adapt_alpaca(row)
    if schema == "sharegpt":
        return adapt_sharegpt(row, pairs=kind == KIND_PAIRS)
    if schema == "prompts":
        return adapt_prompt(row)
    if schema == "oasst":
        return adapt_oasst(row)
    if schema == "messages":
        return adapt_messages(row)
    raise UsageError(f"unknown schema {schema!r}; choose from {SCHEMAS}")
