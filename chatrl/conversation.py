"""A chat conversation on a trained actor, shared by the terminal chat (``chat.py``) and the web chat
(:mod:`chatrl.tools.web_chat`): the history trimmed to the context window, and the answer cut at the
next ``Human:`` turn for models without a chat template; and a chat with an environment's tools
(:class:`ToolSession`, ``chat.py --env``), token-in/token-out as step 3's episodes."""

from __future__ import annotations

from collections.abc import Sequence

from chatrl.data import encode_prompt
from chatrl.data.turns import ConversationIds, encode_conversation, observation_ids
from chatrl.envs import EnvFactory, check_messages_out, check_step

HUMAN_MARKER = "\n\nHuman:"


def prompt_ids_within(tokenizer, history: list[dict], budget: int) -> tuple[list[int], list[dict]]:
    """Token ids of the conversation ``history`` (ending with a user turn) that fit ``budget`` tokens.

    Whole turns are dropped from the oldest (a user turn together with the answer that followed it),
    never cut mid-text; system turns are kept; the newest user turn is always kept, cut from the
    left only if it alone is too long. Returns ``(ids, kept_history)``.
    """

    kept = list(history)
    while True:
        ids = encode_prompt(tokenizer, kept)
        if len(ids) <= budget:
            return ids, kept
        first_user = next(i for i, m in enumerate(kept) if m["role"] == "user")
        if first_user == len(kept) - 1:
            return ids[-budget:], kept
        drop_to = first_user + 1
        while drop_to < len(kept) - 1 and kept[drop_to]["role"] != "user":
            drop_to += 1
        kept = [m for m in kept[:first_user] if m["role"] == "system"] + kept[drop_to:]


class StopAtMarker:
    """Streams answer text up to (not including) ``marker``: text that might be the start of the
    marker is held back until the next piece decides. ``feed(piece)`` returns the text safe to show;
    ``stopped`` turns true once the marker was seen (later pieces are dropped)."""

    def __init__(self, marker: str = HUMAN_MARKER):
        self.marker, self.held, self.stopped = marker, "", False

    def feed(self, piece: str) -> str:
        """Add newly generated token ids; returns whether the text now holds the marker."""
        if self.stopped:
            return ""
        text = self.held + piece
        cut = text.find(self.marker)
        if cut >= 0:
            self.stopped, self.held = True, ""
            return text[:cut]
        keep = next((n for n in range(min(len(self.marker) - 1, len(text)), 0, -1)
                     if self.marker.startswith(text[-n:])), 0)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The held-back text at the end of the answer (it was not the marker after all)."""
        out, self.held = self.held, ""
        return out


class ToolSession:
    """A chat whose assistant turns go to an environment (``chat.py --env calculator``), laid out as
    step 3 lays out an episode (:mod:`chatrl.envs.rollout`): the model's sampled ids are kept as
    they are, and the user's turns and the environment's observations are appended as ids, never
    re-tokenized; so the model sees in chat what it was trained on.

    Each user turn starts a fresh environment (``reset`` gets the conversation so far with
    ``metadata={"chat": True}``: no reference answer), whose opening turns are used for the first
    user turn only; the model then answers, and while the environment returns an observation (a
    tool's result) and fewer than ``max_turns`` answers were given to this user turn, it answers again.

    Args:
        tokenizer: the model's. make_env: :func:`chatrl.envs.load_environment`'s factory.
        max_turns: assistant turns per user turn. stop_ids: :func:`chatrl.models.causal_lm.stop_token_ids`, the
            end-of-turn token first (only an answer ending with it is followed by an observation).
    """

    def __init__(self, tokenizer, make_env: EnvFactory, max_turns: int, stop_ids: Sequence[int]):
        self.tokenizer, self.make_env, self.max_turns = tokenizer, make_env, max_turns
        self.stops, self.eot = set(int(i) for i in stop_ids), int(stop_ids[0])
        self.clear()

    def clear(self) -> None:
        """Forget the conversation."""
        self.messages: list[dict] = []
        self.ids = ConversationIds()
        self.env, self.turns = None, 0

    def user(self, text: str) -> list[int]:
        """Add a user turn; returns the ids to generate the next answer from.

        Raises:
            chatrl.envs.EnvError: the environment's ``reset`` returned something wrong.
        """
        turn = {"role": "user", "content": text}
        self.env, self.turns = self.make_env(), 0
        row = {"messages": [*self.messages, turn], "metadata": {"chat": True}, "seed": len(self.messages)}
        opening = check_messages_out(self.env.reset(row), "reset", observation=False)
        if not self.messages:
            self.messages = opening
            self.ids.append(encode_conversation(self.tokenizer, opening, generation_prompt=True).ids, trained=False)
        else:
            self.ids.append(observation_ids(self.tokenizer, self.messages, [turn]), trained=False)
            self.messages.append(turn)
        return list(self.ids.ids)

    def answer(self, sampled: Sequence[int]) -> list[dict] | None:
        """Add the model's answer (its sampled ids, cut after the first stop token); returns the
        environment's observation turns when the model answers again (the ids to generate from are
        then :attr:`ids`), else None (the next turn is the user's).

        An answer that does not end with the end-of-turn token (cut by ``--max_new_tokens``, or
        ended by another stop token such as ChatML's ``<|endoftext|>``) is closed as the layout
        closes every assistant turn: the other stop token is dropped (its text is not part of the
        answer) and the end-of-turn token appended, so that :attr:`ids` stay the template's
        rendering of :attr:`messages` and the next user turn follows a closed turn. Such an answer
        ends the tool calls of this user turn (as it ends a step-3 episode).

        Raises:
            chatrl.envs.EnvError: the environment's ``step`` returned something wrong.
        """
        sampled = list(sampled)
        cut = next((i + 1 for i, t in enumerate(sampled) if t in self.stops), None)
        sampled = sampled[:cut]
        ended = bool(sampled) and sampled[-1] == self.eot
        if not ended:
            sampled = (sampled[:-1] if cut is not None else sampled) + [self.eot]
        self.ids.append(sampled, trained=True)
        text = self.tokenizer.decode(sampled, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        new, _, done, _ = check_step(self.env.step([dict(m) for m in self.messages], text), "step")
        if done or new is None or not ended or self.turns >= self.max_turns:
            return None
        self.ids.append(observation_ids(self.tokenizer, self.messages, new), trained=False)
        self.messages += new
        return new
