"""A chat conversation on a trained actor, shared by the terminal chat (``chat.py``) and the web chat
(:mod:`chatrl.web_chat`): the history trimmed to the context window, and the answer cut at the
next ``Human:`` turn for models without a chat template."""

from __future__ import annotations

from chatrl.data import encode_prompt

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
