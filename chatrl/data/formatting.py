"""Prompt and answer formatting: the one place that turns messages into text and token ids.

Every step (SFT, reward model, PPO) and the chat demo format prompts here, so that the prompt a
model is trained on is the prompt it later sees. Two conventions:

- the tokenizer's chat template, when ``tokenizer.chat_template`` is set;
- otherwise the ``Human:``/``Assistant:`` convention of Anthropic hh-rlhf and DeepSpeed-Chat:
  ``"{system}\\n\\nHuman: {user}\\n\\nAssistant: {assistant}…\\n\\nHuman: {user}\\n\\nAssistant:"``
  and the answer ``" {answer}"``. This reproduces hh-rlhf transcripts byte for byte.

Prompts and answers are tokenized separately, so the prompt ids are exactly what generation sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatrl.data.schema import ASSISTANT, HUMAN

# Bump when the text or token layout produced here changes: it invalidates the token caches.
FORMAT_VERSION = 1

_ROLES = ("system", "user", "assistant")


def _check_messages(messages: Sequence[dict]) -> None:
    if not messages:
        raise ValueError("a prompt needs at least one message")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"bad message {m!r}: need {{'role': one of {_ROLES}, 'content': str}}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"a prompt must end with a user turn, not {messages[-1]['role']!r}")


def uses_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` carries a chat template (and so :func:`format_prompt` uses it)."""
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(tokenizer, messages: Sequence[dict]) -> str:
    """The prompt text for ``messages``, ready for the answer to follow.

    With a chat template: ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``. Without: system turns as leading text, each user turn
    ``"\\n\\nHuman: {content}"``, each assistant turn ``"\\n\\nAssistant: {content}"``, and a final
    ``"\\n\\nAssistant:"``.

    Raises:
        ValueError: no messages, a malformed message, or the last message is not a user turn.
    """
    _check_messages(messages)
    if uses_chat_template(tokenizer):
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"])
        else:
            parts.append(f"{HUMAN if m['role'] == 'user' else ASSISTANT} {m['content']}")
    return "".join(parts) + ASSISTANT


def format_answer(tokenizer, answer: str) -> str:
    """The answer text that follows :func:`format_prompt`'s text (without EOS).

    ``" " + answer.strip()`` for the Human/Assistant convention (so ``" "`` for an empty answer,
    as hh-rlhf writes it); the stripped answer alone under a chat template.
    """
    answer = answer.strip()
    return answer if uses_chat_template(tokenizer) else " " + answer


def encode_prompts(tokenizer, conversations: Sequence[Sequence[dict]]) -> list[list[int]]:
    """Batch form of :func:`encode_prompt`: one id list per conversation."""
    if not conversations:
        return []
    texts = [format_prompt(tokenizer, msgs) for msgs in conversations]
    # A chat template writes its own special tokens (BOS included); the plain convention relies on
    # the tokenizer adding them.
    return tokenizer(texts, add_special_tokens=not uses_chat_template(tokenizer))["input_ids"]


def encode_answers(tokenizer, answers: Sequence[str]) -> list[list[int]]:
    """Batch form of :func:`encode_answer`: one id list per answer, each ending with one EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token")
    if not answers:
        return []
    texts = [format_answer(tokenizer, a) for a in answers]
    out = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids = list(ids)
        while ids and ids[-1] == eos:  # an answer that spells out EOS still ends with exactly one
            ids.pop()
        out.append(ids + [eos])
    return out


def encode_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of :func:`format_prompt` (``(P,)`` ints).

    The plain convention gets the tokenizer's own special tokens (e.g. Llama's BOS); a chat
    template's text already holds its special tokens, so none are added to it.

    Raises:
        ValueError: as :func:`format_prompt`.
    """
    return list(encode_prompts(tokenizer, [messages])[0])


def encode_answer(tokenizer, answer: str) -> list[int]:
    """Token ids of :func:`format_answer` without special tokens, plus exactly one EOS id at the end.

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    return encode_answers(tokenizer, [answer])[0]
