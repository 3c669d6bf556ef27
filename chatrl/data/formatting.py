"""Prompt and answer formatting: the one place that turns messages into text and token ids.

Every step (SFT, reward model, PPO) and the chat demo format prompts here, so that the prompt a
model is trained on is the prompt it later sees. Two conventions:

- the tokenizer's chat template, when ``tokenizer.chat_template`` is set;
- otherwise the ``Human:``/``Assistant:`` convention of Anthropic hh-rlhf and DeepSpeed-Chat:
  ``"{system}\\n\\nHuman: {user}\\n\\nAssistant: {assistant}…\\n\\nHuman: {user}\\n\\nAssistant:"``
  and the answer ``" {answer}"``. This reproduces hh-rlhf transcripts byte for byte.

How text becomes ids (``docs/tokenization.md`` states each rule and the test that pins it):

- a training example is the tokenization of the JOINED text prompt + answer, never of the two
  tokenized apart (SentencePiece would otherwise start the answer with a lone ``▁``); its prompt
  part is the tokens that start inside the prompt text (:func:`encode_examples`);
- data text (messages and answers) never produces special-token ids: text spelling ``</s>`` or
  ``<|im_end|>`` is tokenized as plain text; only the tokenizer (BOS) and the chat template's own
  scaffold put special tokens in;
- an answer ends with exactly one end-of-turn token: the chat template's (``<|im_end|>`` for
  ChatML), else the tokenizer's EOS (:func:`chatrl.models.causal_lm.end_of_turn_token_id`). Generation,
  step 3's action mask, EOS metrics and chat stop on it (:func:`chatrl.models.causal_lm.stop_token_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence

from chatrl.data.schema import ASSISTANT, HUMAN, ROLES, TOOL
from chatrl.models.causal_lm import end_of_turn_token_id, special_token_texts

# Bump when the text or token layout produced here changes: it invalidates the token caches.
FORMAT_VERSION = 3

def check_messages(messages: Sequence[dict], *, prompt: bool = True) -> None:
    """Raise ValueError unless ``messages`` are ``{"role": one of ROLES, "content": str}`` dicts
    (at least one) and, for a ``prompt``, the last one is a user or tool turn."""
    if not messages:
        raise ValueError("a prompt needs at least one message")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"bad message {m!r}: need {{'role': one of {ROLES}, 'content': str}}")
    if prompt and messages[-1]["role"] not in ("user", "tool"):
        raise ValueError(f"a prompt must end with a user or tool turn, not {messages[-1]['role']!r}")


_PLAIN_MARKERS = {"user": HUMAN, "tool": TOOL, "assistant": ASSISTANT}


def plain_turn(message: dict) -> str:
    """One message in the Human/Assistant convention: a system turn as its text, a user turn
    ``"\\n\\nHuman: {content}"``, a tool turn ``"\\n\\nTool: {content}"``, an assistant turn
    ``"\\n\\nAssistant: {content}"`` (a prompt's history; a trained answer is :func:`format_answer`)."""
    role, content = message["role"], message["content"]
    if role == "system":
        return content
    return f"{_PLAIN_MARKERS[role]} {content}"


def uses_chat_template(tokenizer) -> bool:
    """True when ``tokenizer`` carries a chat template (and so :func:`format_prompt` uses it)."""
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(tokenizer, messages: Sequence[dict]) -> str:
    """The prompt text for ``messages``, ready for the answer to follow.

    With a chat template: ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``. Without: system turns as leading text, each user turn
    ``"\\n\\nHuman: {content}"``, each tool turn ``"\\n\\nTool: {content}"``, each assistant turn
    ``"\\n\\nAssistant: {content}"`` (:func:`plain_turn`), and a final ``"\\n\\nAssistant:"``.

    Raises:
        ValueError: no messages, a malformed message, or the last message is not a user or tool turn.
    """
    check_messages(messages)
    if uses_chat_template(tokenizer):
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    return "".join(plain_turn(m) for m in messages) + ASSISTANT


def format_answer(tokenizer, answer: str) -> str:
    """The answer text that follows :func:`format_prompt`'s text (without EOS).

    ``" " + answer.strip()`` for the Human/Assistant convention (so ``" "`` for an empty answer,
    as hh-rlhf writes it); the stripped answer alone under a chat template.
    """
    answer = answer.strip()
    return answer if uses_chat_template(tokenizer) else " " + answer


def _texts_contain(texts: Sequence[str], specials: Sequence[str]) -> bool:
    return any(sp in t for t in texts for sp in specials)


def _content_spans(text: str, contents: Sequence[str]) -> list[tuple[int, int]] | None:
    """Character spans of ``contents`` found in order in ``text`` (None if one is not found)."""
    spans, at = [], 0
    for c in contents:
        if not c:
            continue
        i = text.find(c, at)
        if i < 0:
            return None
        spans.append((i, i + len(c)))
        at = i + len(c)
    return spans


def encode_rendered(tokenizer, text: str, contents: Sequence[str], specials: Sequence[str]
                    ) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Ids ``(T,)`` (and character offsets, when the tokenizer gives them) of a chat-template rendering.

    The template's scaffold keeps its special tokens (``specials``: their texts); data ``contents``
    that spell a special token are tokenized as plain text (the text is cut at the content spans
    and the pieces encoded apart, rule 2 of ``docs/tokenization.md``).
    """
    if not _texts_contain(contents, specials):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
        return list(enc["input_ids"]), enc.get("offset_mapping")
    spans = _content_spans(text, contents)
    if spans is None:  # the template rewrote a message's text: no span to protect can be found
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
        return list(enc["input_ids"]), enc.get("offset_mapping")
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    at = 0
    for a, b in [*spans, (len(text), len(text))]:
        for lo, hi, split in ((at, a, False), (a, b, True)):
            if hi <= lo:
                continue
            enc = tokenizer(text[lo:hi], add_special_tokens=False, split_special_tokens=split,
                            return_offsets_mapping=tokenizer.is_fast)
            ids += enc["input_ids"]
            offsets += [(lo + x, lo + y) for x, y in enc.get("offset_mapping") or [(0, 0)] * len(enc["input_ids"])]
        at = b
    return ids, offsets if tokenizer.is_fast else None


def encode_prompts(tokenizer, conversations: Sequence[Sequence[dict]]) -> list[list[int]]:
    """Batch form of :func:`encode_prompt`: one id list per conversation."""
    if not conversations:
        return []
    texts = [format_prompt(tokenizer, msgs) for msgs in conversations]
    if uses_chat_template(tokenizer):
        specials = special_token_texts(tokenizer)
        return [encode_rendered(tokenizer, t, [m["content"] for m in msgs], specials)[0]
                for t, msgs in zip(texts, conversations, strict=True)]
    # The plain convention's text is all data: no special token may come from it; the tokenizer
    # adds its own (e.g. Llama's BOS).
    return [list(x) for x in tokenizer(texts, add_special_tokens=True, split_special_tokens=True)["input_ids"]]


def _strip_end(ids: list[int], ends: set[int]) -> list[int]:
    while ids and ids[-1] in ends:
        ids.pop()
    return ids


def encode_answers(tokenizer, answers: Sequence[str]) -> list[list[int]]:
    """Batch form of :func:`encode_answer`: one id list per answer, each ending with one end-of-turn id.

    The answer alone, as if nothing preceded it; a training example uses :func:`encode_examples`.
    """
    eot = end_of_turn_token_id(tokenizer)
    if not answers:
        return []
    texts = [format_answer(tokenizer, a) for a in answers]
    out = []
    for ids in tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]:
        out.append(_strip_end(list(ids), {eot, tokenizer.eos_token_id}) + [eot])
    return out


def _prompt_part(full: list[int], offsets, prompt: list[int], prompt_chars: int) -> int:
    """How many leading tokens of ``full`` are the prompt's: ``len(prompt)`` when the prompt's own
    ids are a prefix, else the tokens that start inside the first ``prompt_chars`` characters."""
    if full[:len(prompt)] == prompt:
        return len(prompt)
    if offsets is None:
        return -1
    n = 0
    for i, (a, b) in enumerate(offsets):
        if b > a and a >= prompt_chars:  # the first real token starting after the prompt text
            break
        n = i + 1
    return min(n, len(full) - 1)


def encode_examples(tokenizer, conversations: Sequence[Sequence[dict]], answers: Sequence[str]
                    ) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, answer_ids)`` per conversation: the ids of the JOINED text prompt + answer.

    ``prompt_ids + answer_ids`` is the tokenization of ``format_prompt(...) + format_answer(...)``
    (under a chat template: ``apply_chat_template`` of the conversation with the answer, up to and
    including the template's end-of-turn token) without any special token from data text, and
    ``answer_ids`` ends with exactly one end-of-turn id (:func:`chatrl.models.causal_lm.end_of_turn_token_id`).
    ``prompt_ids`` are the prompt text's own ids (what generation sees) whenever they are a prefix of
    the joined ids; where a token straddles the boundary (not seen with the plain convention's
    ``" " + answer``) the prompt part is the tokens starting inside the prompt text.

    Raises:
        ValueError: as :func:`format_prompt`; the tokenizer has no EOS token.
    """
    eot = end_of_turn_token_id(tokenizer)
    if not conversations:
        return []
    prompts = encode_prompts(tokenizer, conversations)
    ends = {eot, tokenizer.eos_token_id}
    out = []
    if uses_chat_template(tokenizer):
        specials = special_token_texts(tokenizer)
        eot_text = tokenizer.convert_ids_to_tokens(eot)
        for msgs, answer, prompt in zip(conversations, answers, prompts, strict=True):
            answer = format_answer(tokenizer, answer)
            head = format_prompt(tokenizer, msgs)
            full_text = tokenizer.apply_chat_template([*map(dict, msgs), {"role": "assistant", "content": answer}],
                                                      tokenize=False)
            at = full_text.find(answer, len(head)) if full_text.startswith(head) else -1
            if at < 0:  # the template does not write the answer after the generation prompt
                full_text, at = head + answer + eot_text, len(head)
            end = full_text.find(eot_text, at + len(answer))
            full_text = full_text[:end + len(eot_text)] if end >= 0 else full_text[:at + len(answer)]
            contents = [m["content"] for m in msgs] + [answer]
            full, offsets = encode_rendered(tokenizer, full_text, contents, specials)
            n = _prompt_part(full, offsets, prompt, len(head))
            if n < 0:
                full, n = prompt + encode_rendered(tokenizer, full_text[len(head):], [answer], specials)[0], len(prompt)
            body = _strip_end(full[n:], ends)
            out.append((full[:n], body + [eot]))
        return out
    heads = [format_prompt(tokenizer, msgs) for msgs in conversations]
    texts = [h + format_answer(tokenizer, a) for h, a in zip(heads, answers, strict=True)]
    enc = tokenizer(texts, add_special_tokens=True, split_special_tokens=True,
                    return_offsets_mapping=tokenizer.is_fast)
    for i, (head, prompt) in enumerate(zip(heads, prompts, strict=True)):
        full = list(enc["input_ids"][i])
        n = _prompt_part(full, enc["offset_mapping"][i] if tokenizer.is_fast else None, prompt, len(head))
        if n < 0:  # a slow tokenizer without offsets: the prompt's ids, then the answer's
            out.append((prompt, encode_answers(tokenizer, [answers[i]])[0]))
            continue
        out.append((full[:n], _strip_end(full[n:], ends) + [eot]))
    return out


def encode_example(tokenizer, messages: Sequence[dict], answer: str) -> tuple[list[int], list[int]]:
    """One :func:`encode_examples` pair ``(prompt_ids (P,), answer_ids (A,))`` for ``messages`` and ``answer``."""
    return encode_examples(tokenizer, [messages], [answer])[0]


def encode_prompt(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of :func:`format_prompt` (``(P,)`` ints): what generation sees.

    The plain convention gets the tokenizer's own special tokens (e.g. Llama's BOS); a chat
    template's text already holds its special tokens, so none are added to it. Text in the
    messages never produces a special-token id.

    Raises:
        ValueError: as :func:`format_prompt`.
    """
    return list(encode_prompts(tokenizer, [messages])[0])


def encode_answer(tokenizer, answer: str) -> list[int]:
    """Token ids of :func:`format_answer` alone, without special tokens from its text, plus exactly
    one end-of-turn id at the end (a training example uses :func:`encode_example` instead).

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    return encode_answers(tokenizer, [answer])[0]
