"""A reward from a Python function named on the command line: ``--reward_fn module:function``.

The function is called once per batch as ``fn(prompts, answers, metadata)`` with three lists of
equal length ``B`` (prompt texts, decoded answers, per-row metadata dicts; see
:class:`~chatrl.rewards.base.RewardBatch`) and returns ``B`` finite numbers (a list, tuple or
1-D tensor). The target may be ``package.module:function``, ``path/to/file.py:function``, or a
built-in name from :data:`BUILTIN_REWARD_FNS`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chatrl.plugins import import_object
from chatrl.rewards.base import RewardBatch, RewardFunctionError, check_scores

#: Short names of the built-in reward functions (``--reward_fn exact_match``).
BUILTIN_REWARD_FNS = {
    "exact_match": "chatrl.rewards.builtin:exact_match",
    "regex_format": "chatrl.rewards.builtin:regex_format",
}


def load_reward_fn(spec: str) -> Callable:
    """Import the function named by ``spec`` (``module:function``, ``file.py:function`` or a built-in).

    Raises:
        ValueError: ``spec`` is not of the form ``X:function``.
        ImportError: the module or file cannot be imported (the message names the spec and why).
        AttributeError: the module has no such attribute. TypeError: the attribute is not callable.
    """
    return import_object(spec, "--reward_fn", BUILTIN_REWARD_FNS)


class FunctionReward:
    """A :class:`~chatrl.rewards.base.RewardSource` calling a Python reward function.

    Args:
        spec: as :func:`load_reward_fn`, or a callable (then ``name`` labels it).
        name: log label (default: the function's name).

    Raises:
        as :func:`load_reward_fn` at construction.
        RewardError: at call time, when the function raises, returns the wrong number of scores,
            a non-number or a non-finite value (the message names the spec and the step).
    """

    def __init__(self, spec: str | Callable, name: str | None = None):
        self.fn = load_reward_fn(spec) if isinstance(spec, str) else spec
        self.spec = spec if isinstance(spec, str) else getattr(spec, "__name__", "reward_fn")
        self.name = name or getattr(self.fn, "__name__", self.spec)

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        where = f"--reward_fn {self.spec!r} at step {batch.step}"
        try:
            values = self.fn(list(batch.prompts), list(batch.answers), [dict(m) for m in batch.metadata])
        except Exception as exc:
            raise RewardFunctionError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        return check_scores(values, len(batch), where)
