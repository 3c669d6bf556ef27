"""The number-guessing game: the environment thinks of a number, the model guesses, the environment
answers "higher" or "lower" in a user turn, until the guess is right or the turns run out
(``docs/multi_turn.md``, "Built-in environments"). A feedback game: every turn after the first
depends on what the model said before.
"""

from __future__ import annotations

import random
import re

#: The last integer of a guess (ASCII digits, at most 9: longer numbers are no guess).
_INTEGER = re.compile(r"-?\b\d{1,9}\b")


class GuessNumberEnv:
    """Guess a number between ``low`` and ``high`` (inclusive): one instance per episode.

    The secret is the row's ``metadata["secret"]`` when it has one, else drawn from the episode's
    ``seed`` (so a resumed run replays it). A right guess ends the episode with reward 1; a wrong one
    gets ``"higher"`` or ``"lower"`` and ``turn_reward`` (default 0; negative to reward speed); a
    turn without a number gets a reminder.

    Raises:
        ValueError: ``low > high``, or a secret outside the range.
    """

    def __init__(self, low: int = 1, high: int = 100, turn_reward: float = 0.0):
        if low > high:
            raise ValueError(f"guess_number: low {low} > high {high}")
        self.low, self.high, self.turn_reward = int(low), int(high), float(turn_reward)
        self.secret = None

    def reset(self, row: dict) -> list[dict]:
        """The row's prompt turns, or the game's own question when the row has none."""
        meta = row.get("metadata") or {}
        secret = meta.get("secret")
        self.secret = int(secret) if secret is not None else random.Random(row.get("seed", 0)).randint(self.low,
                                                                                                       self.high)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess_number: secret {self.secret} outside [{self.low}, {self.high}]")
        messages = [dict(m) for m in row.get("messages") or []]
        return messages or [{"role": "user", "content": f"I am thinking of a number between {self.low} and "
                                                        f"{self.high}. Guess it: answer with the number only."}]

    def step(self, messages: list[dict], assistant_text: str):
        """``higher``/``lower`` as a user turn, or the end of the game."""
        found = _INTEGER.findall(assistant_text[-200:])
        if not found:
            return [{"role": "user", "content": "Please answer with a number."}], self.turn_reward, False, {}
        guess = int(found[-1])
        if guess == self.secret:
            return None, 1.0, True, {"guess": guess}
        return ([{"role": "user", "content": "higher" if guess < self.secret else "lower"}], self.turn_reward, False,
                {"guess": guess})
