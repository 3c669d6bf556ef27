"""The kinds of reward source, declared once: each is a class that reads a flag's values and builds a
:class:`~chatrl.rewards.base.RewardSource` from one of them.

A reward value on the command line is ``[WEIGHT*]TARGET`` (``--reward_fn 0.5*exact_match``,
``--reward_url http://host:8000/``); the registry finds the kind whose :meth:`RewardKind.claims` takes
``TARGET`` among the kinds that read that flag, the last registered first, so that a user's kind is
asked before the built-in ones. The kinds registered here:

* ``function``: a Python function ``module:function`` or ``path/to/file.py:function``
  (:class:`~chatrl.rewards.function.FunctionReward`); it takes every other ``--reward_fn`` value, and
  refuses a malformed one with the message that names the forms;
* ``builtin``: a built-in function's short name (:data:`~chatrl.rewards.function.BUILTIN_REWARD_FNS`),
  with the prompt-row field it cannot score without (``exact_match``: ``reference``);
* ``http``: a reward server, ``--reward_url http(s)://...`` (:class:`~chatrl.rewards.remote.HttpReward`);
* ``model``: a reward model's folder (``--reward_model_name_or_path``; step 3 scores the actor's token
  ids with its engine, a judge or the reward server re-encodes texts,
  :class:`~chatrl.rewards.model.TextRewardModel`).

The flags (:func:`check`: ``chatrl.cli.parse`` and ``train.py`` refuse a bad value in one line), step 3
(:func:`chatrl.rewards.build_reward`), ``train.py``'s plan (the prompt-row fields a reward needs,
:func:`check_reward_metadata`) and the evaluation's judges (``chatrl.eval.judges.load_judge``) read this
registry. Adding a kind (``docs/architecture.md``, "Where to add")::

    from chatrl.rewards import kinds

    class LengthKind(kinds.RewardKind):
        name = "length"                      # claims "length:TARGET" values of --reward_fn
        summary = "minus the distance of the answer's length in characters to TARGET"

        def source(self, target, settings, context):
            return LengthReward(int(target.split(":", 1)[1]))   # any RewardSource

    kinds.register(LengthKind())

Registered before the command line is parsed, ``--reward_fn 0.5*length:40`` is a reward of every
algorithm, and ``--judge length:40`` a judge of the evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from chatrl.config import RewardConfig
from chatrl.errors import UsageError
from chatrl.rewards.base import ModelReward, RewardSource, split_weight
from chatrl.rewards.function import BUILTIN_REWARD_FNS, FunctionReward, load_reward_fn
from chatrl.rewards.model import TextRewardModel
from chatrl.rewards.remote import HttpReward

ScoreTokens = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``score(sequences (B, T), attention_mask (B, T), prompt_len) -> (B,)``: step 3's reward engine."""


@dataclass
class RewardContext:
    """What the program offers a kind beside the flags' values.

    Attributes:
        model_scores: step 3's reward engine on the actor's token ids (:data:`ScoreTokens`), or None
            where no engine exists (the reward server, a judge): the ``model`` kind then loads the
            folder and re-encodes texts (:class:`~chatrl.rewards.model.TextRewardModel`).
        max_seq_len, batch_size, dtype, device: that text model's tokens per sequence, sequences per
            forward pass, dtype (``fp32``, ``bf16``, ``fp16``, ``auto``) and torch device.
    """

    model_scores: ScoreTokens | None = None
    max_seq_len: int = 512
    batch_size: int = 8
    dtype: str = "fp32"
    device: object = None


class RewardKind:
    """One kind of reward source; subclass it and :func:`register` an instance.

    Attributes:
        name: the kind's name (its parts are logged as ``reward/<source name>``; a user's kind claims
            the values ``name:TARGET`` unless it overrides :meth:`claims`).
        flag: the flag whose values it reads (``--reward_fn``, ``--reward_url``).
        summary: one line for the docs.
    """

    name: str = ""
    flag: str = "--reward_fn"
    summary: str = ""

    def claims(self, target: str) -> bool:
        """Whether ``target`` (a flag value without its weight) is of this kind."""
        return target.startswith(f"{self.name}:")

    def check(self, target: str) -> None:
        """Refuse a bad ``target`` cheaply, before any model loads (default: nothing to check).

        Raises:
            UsageError (or ValueError): naming the flag and the value.
        """

    def required_metadata(self, target: str) -> str | None:
        """The prompt-row metadata field this source cannot score an answer without, or None."""
        return None

    def source(self, target: str, settings: RewardConfig, context: RewardContext) -> RewardSource:
        """The source ``target`` names; ``settings`` is the run's reward block (``--reward_*`` flags)."""
        raise NotImplementedError(f"reward kind {self.name!r} builds no source")


class FunctionKind(RewardKind):
    """A Python function ``module:function`` or ``path/to/file.py:function`` (``docs/rewards.md``)."""

    name, summary = "function", "a Python function f(prompts, answers, metadata) -> scores"

    def claims(self, target: str) -> bool:
        return ":" in target

    def check(self, target: str) -> None:
        load_reward_fn(target)

    def source(self, target: str, settings: RewardConfig, context: RewardContext) -> RewardSource:
        return FunctionReward(target)


#: The prompt-row field a built-in reward cannot score an answer without (``docs/rewards.md``).
REQUIRED_METADATA = {"exact_match": "reference"}


class BuiltinKind(FunctionKind):
    """A built-in function by its short name (:data:`~chatrl.rewards.function.BUILTIN_REWARD_FNS`) or its
    ``module:function`` path."""

    name, summary = "builtin", "a built-in function: " + ", ".join(BUILTIN_REWARD_FNS)

    def claims(self, target: str) -> bool:
        return target in BUILTIN_REWARD_FNS or target in BUILTIN_REWARD_FNS.values()

    def short_name(self, target: str) -> str:
        """The built-in's short name (``exact_match``) for its short name or its path."""
        return {v: k for k, v in BUILTIN_REWARD_FNS.items()}.get(target, target)

    def required_metadata(self, target: str) -> str | None:
        return REQUIRED_METADATA.get(self.short_name(target))


class HttpKind(RewardKind):
    """A reward server (``python -m chatrl.tools.reward_server``, or any server of the protocol of
    :mod:`chatrl.rewards.remote`), asked with the ``--reward_http_*`` settings."""

    name, flag, summary = "http", "--reward_url", "a reward server over HTTP"

    def claims(self, target: str) -> bool:
        return target.startswith(("http://", "https://"))

    def check(self, target: str) -> None:
        HttpReward(target)

    def source(self, target: str, settings: RewardConfig, context: RewardContext) -> RewardSource:
        return HttpReward(target, timeout=settings.reward_http_timeout, retries=settings.reward_http_retries,
                          batch_size=settings.reward_http_batch_size)


class ModelKind(RewardKind):
    """A reward model's folder (step 2's output): its end score."""

    name, flag, summary = "model", "--reward_model_name_or_path", "a reward model's end score"

    def claims(self, target: str) -> bool:
        return Path(target).is_dir()

    def source(self, target: str, settings: RewardConfig, context: RewardContext) -> RewardSource:
        if context.model_scores is not None:
            return ModelReward(context.model_scores)
        return TextRewardModel(target, context.max_seq_len, context.batch_size, context.dtype, context.device)


KINDS: dict[str, RewardKind] = {}


def register(kind: RewardKind) -> RewardKind:
    """Add ``kind`` to the registry (replacing one of the same name); returns it.

    Raises:
        ValueError: a kind without a name or without a flag.
    """
    if not kind.name or not kind.flag.startswith("--"):
        raise ValueError(f"reward kind {type(kind).__name__}: give it a name and the flag it reads (--...)")
    KINDS.pop(kind.name, None)
    KINDS[kind.name] = kind
    return kind


def names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(KINDS)


def find(target: str, flag: str | None = None) -> RewardKind | None:
    """The kind that claims ``target`` among those reading ``flag`` (every kind for None), the last
    registered first; None when none does."""
    for kind in reversed(list(KINDS.values())):
        if (flag is None or kind.flag == flag) and kind.claims(target):
            return kind
    return None


def resolve(spec: str, flag: str) -> tuple[float, RewardKind, str]:
    """``(weight, kind, target)`` of a flag's value ``[WEIGHT*]TARGET``. A value no kind claims goes to
    the first kind registered for ``flag`` (``function`` for ``--reward_fn``, ``http`` for
    ``--reward_url``), whose check names the forms it expects.

    Raises:
        ValueError: a bad weight, or no kind reads ``flag`` (a UsageError naming it).
    """
    weight, target = split_weight(spec, flag)
    kind = find(target, flag) or next((k for k in KINDS.values() if k.flag == flag), None)
    if kind is None:
        raise UsageError(f"{flag} {spec!r}: no reward kind reads {flag} (registered: {', '.join(KINDS)})")
    return weight, kind, target


def check(spec: str, flag: str) -> None:
    """Refuse a bad reward value in one line before anything loads (:meth:`RewardKind.check`).

    Raises:
        ValueError: a UsageError naming the flag and the value (a misspelt module, function or URL),
            or a bad weight.
    """
    _, kind, target = resolve(spec, flag)
    kind.check(target)


def specs(settings: RewardConfig) -> list[tuple[str, str]]:
    """``(flag, value)`` of every reward value of the run's reward block, in the order they are summed."""
    return [*(("--reward_fn", v) for v in settings.reward_fn),
            *(("--reward_url", v) for v in settings.reward_url)]


def sources(settings: RewardConfig, context: RewardContext) -> list[tuple[float, RewardSource]]:
    """``[(weight, source)]`` of every ``--reward_fn`` and ``--reward_url`` value.

    Raises:
        ValueError: as :func:`resolve`; what a kind's :meth:`RewardKind.source` raises (naming the value).
    """
    out = []
    for flag, spec in specs(settings):
        weight, kind, target = resolve(spec, flag)
        out.append((weight, kind.source(target, settings, context)))
    return out


def check_reward_metadata(reward_fns: Sequence[str], metadata: Sequence[dict | None], where: str) -> None:
    """Refuse rule rewards whose field is missing from the prompt rows before any answer is generated:
    ``exact_match`` on rows without a ``reference`` failed at step 1's scoring, after the models had
    loaded, with a traceback per rank (the field is the kind's :meth:`RewardKind.required_metadata`).

    Args:
        reward_fns: ``--reward_fn`` values (``[W*]spec``). metadata: each prompt row's metadata.
        where: the rows' source, for the message (``--data_path a.jsonl``).

    Raises:
        UsageError: naming the reward, the field, how many rows lack it and the first such row.
    """
    for spec in reward_fns:
        _, kind, target = resolve(spec, "--reward_fn")
        key = kind.required_metadata(target)
        if key is None:
            continue
        missing = [i for i, m in enumerate(metadata) if (m or {}).get(key) is None]
        if missing:
            name = kind.short_name(target) if isinstance(kind, BuiltinKind) else target
            raise UsageError(f"--reward_fn {name} scores each answer against its prompt row's "
                             f"\"{key}\", and {len(missing)} of the {len(metadata)} step-3 prompt rows of "
                             f"{where} have none (row {missing[0]} first): give prompt rows with a \"{key}\" "
                             "(scripts/make_arith_task.py writes them; docs/rewards.md)")


register(FunctionKind())
register(BuiltinKind())
register(HttpKind())
register(ModelKind())
