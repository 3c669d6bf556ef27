"""The environment interface of step 3's multi-turn episodes (``docs/multi_turn.md``).

An environment class is named like a reward function (``--env module:Class``,
``--env path/to/file.py:Class`` or a built-in, :data:`BUILTIN_ENVS`) and constructed with the
``--env_args`` JSON object as keyword arguments, once per episode, in every rank's process. An
episode::

    env = EnvClass(**env_args)
    messages = env.reset(row)                     # the opening turns, ending with a user (or tool) turn
    while True:                                   # up to --max_turns assistant turns
        text = <the model's next assistant turn>  # sampled token ids, decoded for the environment only
        new_messages, reward, done, info = env.step(messages + [assistant text], text)
        if done or new_messages is None: break
        messages += [assistant text] + new_messages   # their ids are appended, never re-tokenized

``row`` is ``{"messages": the data row's prompt turns, "metadata": its reward metadata (the
``reference`` answer, ...), "seed": an integer for the episode's own randomness}`` (the same seed
for the same step, rank and row, so a resumed run replays it). In a chat (``chat.py --env``)
``metadata`` is ``{"chat": True}``: there is no reference, nothing is trained. ``reward`` is the step's reward (a
finite number); the episode's reward is their sum (``docs/multi_turn.md``, "Rewards").
``new_messages`` are user, tool or system turns: the observation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

from chatrl.data.schema import ROLES


class EnvError(RuntimeError):
    """An environment failed (raised, or returned something that is not a step), on some rank."""


class Environment(Protocol):
    """One episode's environment (module docstring)."""

    def reset(self, row: dict) -> list[dict]:
        """The episode's opening turns (``{"role", "content"}``), ending with a user or tool turn."""

    def step(self, messages: list[dict], assistant_text: str) -> tuple[list[dict] | None, float, bool, dict]:
        """React to the assistant turn ``assistant_text`` (the last of ``messages``): ``(new
        messages or None, reward, done, info)``."""


StepResult = tuple[list[dict] | None, float, bool, dict]


def check_messages_out(messages, where: str, *, observation: bool) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` dicts (copies).

    Raises:
        EnvError: not a list of such dicts, an unknown role, an assistant turn in an observation,
            or (for a reset, ``observation=False``) opening turns that do not end with a user or tool turn.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise EnvError(f"{where} returned a {type(messages).__name__}, expected a list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise EnvError(f"{where}: message {i} is {m!r}, expected {{'role': one of {ROLES}, 'content': str}}")
        if observation and m["role"] == "assistant":
            raise EnvError(f"{where}: message {i} is an assistant turn; an observation holds user, tool or system turns")
        out.append({"role": m["role"], "content": m["content"]})
    if not observation and (not out or out[-1]["role"] not in ("user", "tool")):
        raise EnvError(f"{where}: the opening turns must end with a user or tool turn")
    return out


def check_step(result, where: str) -> StepResult:
    """A step's return value checked: ``(messages or None, float reward, bool done, dict info)``.

    Raises:
        EnvError: a wrong shape or type, or a non-finite reward (names ``where``).
    """
    if not isinstance(result, tuple) or len(result) != 4:
        raise EnvError(f"{where} returned {type(result).__name__} {result!r:.80}, expected (new_messages | None, "
                       "reward, done, info)")
    new, reward, done, info = result
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"{where}: reward {reward!r} is not a finite number")
    if not isinstance(done, bool):
        raise EnvError(f"{where}: done is a {type(done).__name__}, expected a bool")
    if info is not None and not isinstance(info, dict):
        raise EnvError(f"{where}: info is a {type(info).__name__}, expected a dict")
    return (None if new is None else check_messages_out(new, where, observation=True)), float(reward), done, \
        dict(info or {})


#: Short names of the built-in environments (``--env calculator``).
BUILTIN_ENVS = {
    "calculator": "chatrl.envs.calculator:CalculatorEnv",
    "guess_number": "chatrl.envs.guess:GuessNumberEnv",
}

EnvFactory = Callable[[], Environment]
