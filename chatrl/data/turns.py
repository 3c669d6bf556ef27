"""Conversations as token ids, built turn by turn: the multi-turn layout shared by step 1's
every-turn SFT, step 3's environment episodes and chat sessions with tools (``docs/multi_turn.md``,
``docs/tokenization.md`` rules 4-6).

A conversation's ids are segments appended in order and never re-tokenized:

- **the first prompt**: the messages before the first assistant turn and the generation prompt,
  :func:`chatrl.data.formatting.encode_prompt`'s ids (what generation starts from);
- **an assistant turn**: its content and the end-of-turn token, trained. In SFT these are the
  ids of the joined text prompt + answer (rule 1, :func:`chatrl.data.formatting.encode_example`);
  in a rollout, the ids the model sampled;
- **an observation**: the user, tool or system turns after an assistant turn and the next
  generation prompt: the text the layout writes after the previous turn's end-of-turn token,
  tokenized on its own (:func:`observation_ids`), never trained.

Under a chat template the observation is the difference of two renderings of the template (the
conversation with and without the new turns); under the Human/Assistant convention it is
``"\\n\\nHuman: …"`` / ``"\\n\\nTool: …"`` and ``"\\n\\nAssistant:"``, and every assistant turn
ends with the EOS token. (A single-turn prompt of an hh-rlhf transcript keeps the transcript's text,
whose earlier answers carry no EOS: ``docs/tokenization.md``.)

Whether these ids equal what the template gives when it renders the whole conversation at once
(prefix preservation) is what ``python -m chatrl.tools.check_template`` checks
(:mod:`chatrl.data.template_check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chatrl.data.formatting import (
    check_messages,
    encode_example,
    encode_prompt,
    encode_rendered,
    format_answer,
    plain_turn,
    uses_chat_template,
)
from chatrl.data.schema import ASSISTANT
from chatrl.models.causal_lm import end_of_turn_token_id, special_token_texts

#: A stand-in history for templates that re-render earlier turns (see :func:`observation_ids`).
_BASE_HISTORY = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


@dataclass
class ConversationIds:
    """A conversation's ids and which of them are trained.

    Attributes:
        ids: ``(T,)`` token ids.
        trained: ``(T,)`` 1 on assistant tokens (content and end-of-turn token), 0 elsewhere: the
            loss mask of SFT and the action mask of a rollout.
        turns: ``[start, end)`` of each assistant turn in ``ids``.
    """

    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)

    def append(self, ids: Sequence[int], trained: bool) -> None:
        """Append ``ids``; a trained segment is one assistant turn."""
        if trained:
            self.turns.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += [int(i) for i in ids]
        self.trained += [int(trained)] * len(ids)


def end_of_turn_text(tokenizer) -> str:
    """The text of the end-of-turn token (:func:`chatrl.models.causal_lm.end_of_turn_token_id`)."""
    return tokenizer.convert_ids_to_tokens(end_of_turn_token_id(tokenizer))


def special_prefix_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text with ``add_special_tokens=True`` (Llama's BOS; none for GPT-2)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return list(full[:i])
    return []


def _apply(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template's own error (jinja2 raise_exception, ...)
        roles = [m["role"] for m in messages]
        raise ValueError(f"the chat template cannot render the turns {roles}: {type(exc).__name__}: {exc}") from exc


def assistant_end(tokenizer, text: str, head: str, content: str, eot_text: str) -> int:
    """Where the last assistant turn of a chat-template rendering ``text`` ends: just after the
    end-of-turn text that follows its ``content`` (``head`` is the rendering of the turns before it
    with the generation prompt); ``len(text)`` when the template writes no end-of-turn token."""
    content = format_answer(tokenizer, content)
    start = len(head) if text.startswith(head) else 0
    at = text.find(content, start) if content else -1
    if at < 0 and content:
        at = text.rfind(content)
    search = at + len(content) if at >= 0 else start
    end = text.find(eot_text, search)
    return len(text) if end < 0 else end + len(eot_text)


def _template_delta(tokenizer, history: Sequence[dict], new: Sequence[dict], generation_prompt: bool,
                    eot_text: str) -> str | None:
    """The text a chat template writes after ``history``'s last assistant turn (its end-of-turn
    token) for the ``new`` turns, or None when rendering ``history + new`` does not extend
    the rendering of ``history`` up to that point (the template re-renders earlier turns)."""
    before = _apply(tokenizer, history, False)
    head = _apply(tokenizer, history[:-1], True) if len(history) > 1 else ""
    cut = assistant_end(tokenizer, before, head, history[-1]["content"], eot_text)
    after = _apply(tokenizer, [*history, *new], generation_prompt)
    return after[cut:] if after.startswith(before[:cut]) else None


def observation_ids(tokenizer, history: Sequence[dict], new_messages: Sequence[dict], *,
                    generation_prompt: bool = True) -> list[int]:
    """The ids to append after an assistant turn for ``new_messages`` (user, tool or system turns)
    and, with ``generation_prompt``, the next assistant turn's generation prompt.

    With a chat template: the text ``apply_chat_template(history + new_messages)`` writes after
    the end-of-turn token of ``history``'s last (assistant) turn, where the template's rendering of
    ``history`` is a prefix of it; where it is not (a template that re-renders earlier turns, such
    as one that drops ``<think>`` blocks of past answers) the same difference on a stand-in
    history ``[user, assistant]``. Data text in the new messages never becomes a special token
    (rule 2). Without a template: ``"\\n\\nHuman: …"`` / ``"\\n\\nTool: …"`` per message and
    ``"\\n\\nAssistant:"``, tokenized on their own.

    Args:
        history: the conversation so far, ending with an assistant turn.
        new_messages: the turns to append (none of them an assistant turn; may be empty).

    Returns:
        ``(O,)`` ids, never trained.

    Raises:
        ValueError: a malformed message, a history that does not end with an assistant turn, an
            assistant turn among ``new_messages``, or a template that cannot render them.
    """
    check_messages(history, prompt=False)
    if history[-1]["role"] != "assistant":
        raise ValueError(f"observation_ids: the history must end with an assistant turn, not {history[-1]['role']!r}")
    if new_messages:
        check_messages(new_messages, prompt=False)
    if any(m["role"] == "assistant" for m in new_messages):
        raise ValueError("observation_ids: an observation holds no assistant turn")
    if not uses_chat_template(tokenizer):
        text = "".join(plain_turn(m) for m in new_messages) + (ASSISTANT if generation_prompt else "")
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]) if text else []
    eot_text = end_of_turn_text(tokenizer)
    delta = _template_delta(tokenizer, history, new_messages, generation_prompt, eot_text)
    if delta is None:
        delta = _template_delta(tokenizer, _BASE_HISTORY, new_messages, generation_prompt, eot_text)
    if delta is None:
        raise ValueError("the chat template re-renders earlier turns when new ones follow, even after a plain "
                         "[user, assistant] history: observation ids cannot be appended")
    return encode_rendered(tokenizer, delta, [m["content"] for m in new_messages], special_token_texts(tokenizer))[0]


def encode_conversation(tokenizer, messages: Sequence[dict], *, generation_prompt: bool = False) -> ConversationIds:
    """The ids of a conversation in the multi-turn layout (module docstring), every assistant turn trained.

    Args:
        messages: ``{"role", "content"}`` turns (system, user, assistant, tool); the first
            assistant turn must follow at least one other turn.
        generation_prompt: append the generation prompt of a next assistant turn (a prompt).

    Returns:
        :class:`ConversationIds`; ``trained`` is 1 exactly on each assistant turn's content and
        end-of-turn token. Without an assistant turn (and with ``generation_prompt``) it is
        :func:`chatrl.data.formatting.encode_prompt`'s ids.

    Raises:
        ValueError: a malformed message, an assistant turn first, a turn before an assistant turn
            that is not a user or tool turn, no assistant turn and no generation prompt, or a
            template that cannot render the turns.
    """
    check_messages(messages, prompt=False)
    n = len(messages)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), n)
    if first == 0:
        raise ValueError("a conversation's first assistant turn must follow a user, system or tool turn")
    if first == n and not generation_prompt:
        raise ValueError("a conversation without an assistant turn needs generation_prompt=True")
    out = ConversationIds()
    out.append(encode_prompt(tokenizer, messages[:first]), trained=False)
    k = first
    while k < n:
        _, answer = encode_example(tokenizer, messages[:k], messages[k]["content"])
        out.append(answer, trained=True)
        j = k + 1
        while j < n and messages[j]["role"] != "assistant":
            j += 1
        more = j < n or generation_prompt
        if j > k + 1 or more:
            out.append(observation_ids(tokenizer, messages[:k + 1], messages[k + 1:j], generation_prompt=more),
                       trained=False)
        k = j
    return out


def _plain_pieces(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> list[str]:
    """The Human/Assistant transcript as the texts between its EOS tokens (one more piece than EOS tokens)."""
    pieces, text = [], ""
    for m in messages:
        if m["role"] == "assistant":
            pieces.append(text + ASSISTANT + format_answer(tokenizer, m["content"]))
            text = ""
        else:
            text += plain_turn(m)
    return [*pieces, text + (ASSISTANT if generation_prompt else "")]


def render_conversation(tokenizer, messages: Sequence[dict], *, generation_prompt: bool = False) -> str:
    """The whole conversation as ONE text, the reference the turn-by-turn ids are checked against.

    With a chat template: ``apply_chat_template(messages)``, cut after the last assistant turn's
    end-of-turn token when the conversation ends with one (ChatML's ``"\\n"`` after
    ``<|im_end|>`` is not part of it). Without: the Human/Assistant transcript with each assistant
    turn ``" {answer}"`` followed by the EOS token's text.

    Raises:
        ValueError: as :func:`encode_conversation`.
    """
    check_messages(messages, prompt=False)
    if uses_chat_template(tokenizer):
        text = _apply(tokenizer, messages, generation_prompt)
        if messages[-1]["role"] == "assistant" and not generation_prompt:
            head = _apply(tokenizer, messages[:-1], True)
            text = text[:assistant_end(tokenizer, text, head, messages[-1]["content"], end_of_turn_text(tokenizer))]
        return text
    eos = tokenizer.convert_ids_to_tokens(tokenizer.eos_token_id)
    return eos.join(_plain_pieces(tokenizer, messages, generation_prompt))


def encode_rendered_conversation(tokenizer, messages: Sequence[dict], *, generation_prompt: bool = False) -> list[int]:
    """The ids of :func:`render_conversation`'s text tokenized at once: the template's (or the
    transcript's) special tokens kept, data text never a special token (rule 2). Without a
    template: the tokenizer's leading special tokens (BOS), then the transcript's pieces between
    its EOS tokens, each tokenized as the tokenizer treats text between two special tokens."""
    if uses_chat_template(tokenizer):
        text = render_conversation(tokenizer, messages, generation_prompt=generation_prompt)
        contents = [format_answer(tokenizer, m["content"]) if m["role"] == "assistant" else m["content"]
                    for m in messages]
        return encode_rendered(tokenizer, text, contents, special_token_texts(tokenizer))[0]
    check_messages(messages, prompt=False)
    ids = special_prefix_ids(tokenizer)
    pieces = _plain_pieces(tokenizer, messages, generation_prompt)
    for i, piece in enumerate(pieces):
        if piece:
            ids += tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if i < len(pieces) - 1:
            ids.append(tokenizer.eos_token_id)
    return ids
