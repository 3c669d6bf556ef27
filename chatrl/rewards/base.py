"""The reward-source interface, the weighted sum, and the cross-rank failure check."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from chatrl.errors import UsageError

AllReduce = Callable[[torch.Tensor], torch.Tensor]


class RewardError(RuntimeError):
    """A reward source failed (bad return value, server error, failure on another rank)."""


class RewardFunctionError(RewardError, UsageError):
    """A ``--reward_fn`` raised on the batch it was given (the user's function or the data it needs, such
    as a prompt row without the ``reference`` of ``exact_match``): printed alone, as a usage error."""


@dataclass
class RewardBatch:
    """What a reward source gets for ``B`` answers.

    Attributes:
        prompts: ``B`` prompt texts (decoded, special tokens removed).
        answers: ``B`` answer texts (decoded up to the first EOS, special tokens removed).
        metadata: ``B`` dicts, each the row's ``metadata`` object with its ``reference`` answer
            under ``"reference"`` when the row has one (``docs/rewards.md``); ``{}`` otherwise.
        step: the training step (for error messages and the HTTP request).
        sequences: optional ``(B, T)`` token ids (prompt + answer), for a reward model.
        attention_mask: optional ``(B, T)``.
        prompt_len: width ``P`` of the (left-padded) prompt block of ``sequences``.
        formatted_texts: optional ``B`` texts of the whole conversation as the model saw it: the
            prompt with its chat-template markers and special tokens, then the answer through its
            stop token, padding dropped (one decode of the ids below). What a reward model scores.
        token_ids: optional ``B`` lists of the same token ids (prompt + answer, no padding).
        episode_rewards: for multi-turn episodes (``--env``), each episode's summed environment
            rewards (:class:`EpisodeReward`); ``answers`` are then the last assistant turns and
            ``sequences`` the whole episodes.
    """

    prompts: list[str]
    answers: list[str]
    metadata: list[dict] = field(default_factory=list)
    step: int = 0
    sequences: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    prompt_len: int | None = None
    formatted_texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    episode_rewards: list[float] | None = None

    def __post_init__(self):
        if not self.metadata:
            self.metadata = [{} for _ in self.answers]
        if not len(self.prompts) == len(self.answers) == len(self.metadata):
            raise ValueError(f"RewardBatch: {len(self.prompts)} prompts, {len(self.answers)} answers and "
                             f"{len(self.metadata)} metadata rows must be as many")
        for name in ("formatted_texts", "token_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self.answers):
                raise ValueError(f"RewardBatch: {len(value)} {name} for {len(self.answers)} answers")

    def __len__(self) -> int:
        return len(self.answers)


def reward_batch_from_tokens(tokenizer, sequences: torch.Tensor, attention_mask: torch.Tensor,
                             action_mask: torch.Tensor, prompt_len: int, metadata: Sequence[dict] | None = None,
                             step: int = 0) -> RewardBatch:
    """A :class:`RewardBatch` of step 3's rollouts: prompts and answers decoded, tokens kept.

    The prompt is the block ``sequences[:, :prompt_len]`` where ``attention_mask`` is non-zero
    (left padding dropped); the answer the tokens where ``action_mask`` is non-zero (through the
    first stop token). ``prompts`` and ``answers`` are decoded with ``skip_special_tokens=True`` (for
    rule rewards); ``formatted_texts`` is prompt and answer decoded together with every marker and
    special token kept, and ``token_ids`` the same ids as lists: what a reward model behind a
    server must score to give the in-process score (``docs/rewards.md``).

    Args:
        tokenizer: the actor's tokenizer.
        sequences, attention_mask: ``(B, P + A)``. action_mask: ``(B, A)``. prompt_len: ``P``.
        metadata: ``B`` dicts (each row's reward metadata, repeated for the ``N`` answers of a
            prompt), or ``None`` for ``{}`` each.
        step: the training step.

    Raises:
        ValueError: shapes or lengths that do not match.
    """
    b, t = sequences.shape
    if tuple(attention_mask.shape) != (b, t) or tuple(action_mask.shape) != (b, t - prompt_len):
        raise ValueError(f"reward_batch_from_tokens: sequences {tuple(sequences.shape)}, attention_mask "
                         f"{tuple(attention_mask.shape)} and action_mask {tuple(action_mask.shape)} do not fit "
                         f"prompt_len {prompt_len}")
    if metadata is not None and len(metadata) != b:
        raise ValueError(f"reward_batch_from_tokens: {len(metadata)} metadata rows for {b} sequences")
    seq, mask, actions = sequences.cpu(), attention_mask.cpu(), action_mask.cpu()
    prompt_ids = [seq[i, :prompt_len][mask[i, :prompt_len] != 0].tolist() for i in range(b)]
    answer_ids = [seq[i, prompt_len:][actions[i] != 0].tolist() for i in range(b)]
    prompts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids]
    answers = [tokenizer.decode(a, skip_special_tokens=True) for a in answer_ids]
    token_ids = [p + a for p, a in zip(prompt_ids, answer_ids, strict=True)]
    formatted = [decode_exactly(tokenizer, ids) for ids in token_ids]
    meta = [dict(m) for m in metadata] if metadata is not None else [{} for _ in range(b)]
    return RewardBatch(prompts, answers, meta, step, sequences, attention_mask, prompt_len, formatted, token_ids)


def decode_exactly(tokenizer, ids: Sequence[int]) -> str:
    """``ids`` as text with every special token and chat-template marker kept and no clean-up of
    spaces: the text the model saw."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class RewardSource(Protocol):
    """A reward: ``source(batch) -> (B,)`` float32 scores; ``name`` labels its log line."""

    name: str

    def __call__(self, batch: RewardBatch) -> torch.Tensor: ...


def _bool_error(where: str, i: int | None, v) -> RewardError:
    what = f": score {i} is a boolean ({v!r})" if i is not None else f" returned booleans ({v})"
    return RewardError(f"{where}{what}; return numbers (float(ok) gives 1.0 / 0.0)")


def _number(v, i: int, where: str) -> float:
    """Score ``i`` as a float: a real number (Python, NumPy, or a one-element torch tensor / NumPy array)."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        size = v.numel() if isinstance(v, torch.Tensor) else v.size
        if size != 1:
            raise RewardError(f"{where}: score {i} is an array of {size} numbers, expected one number")
        if isinstance(v, torch.Tensor):
            kind = "b" if v.dtype == torch.bool else "c" if v.is_complex() else "f"
        else:
            kind = v.dtype.kind
        if kind == "b":
            raise _bool_error(where, i, v)
        if kind == "c":
            raise RewardError(f"{where}: score {i} is complex ({v!r}), expected a real number")
        v = v.item()
    if isinstance(v, (bool, np.bool_)):
        raise _bool_error(where, i, v)
    if not isinstance(v, numbers.Real):
        raise RewardError(f"{where}: score {i} is a {type(v).__name__} ({v!r}), expected a number")
    return float(v)


def check_scores(values, n: int, where: str) -> torch.Tensor:
    """``values`` as a ``(n,)`` float32 CPU tensor.

    Accepted: any real numbers, as a list or tuple (of Python, NumPy or one-element torch/NumPy
    numbers), a NumPy array or a torch tensor of integer or floating dtype (``np.float32``,
    ``np.int64``, ``torch.bfloat16``, …), flattened. Booleans (Python, NumPy, torch) are refused:
    a check's outcome becomes a score only by a choice of values, ``float(ok)`` (docs/rewards.md);
    so are complex numbers, strings and non-finite values.

    Raises:
        RewardError: wrong length, not real numbers, a boolean or a non-finite value; the message
            names ``where`` and the first bad index.
    """
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool:
            raise _bool_error(where, None, "a torch.bool tensor")
        if values.is_complex():
            raise RewardError(f"{where} returned a complex tensor, expected real numbers")
        values = values.detach().to(torch.float64).cpu().reshape(-1).tolist()
    elif isinstance(values, np.ndarray):
        if values.dtype.kind == "b":
            raise _bool_error(where, None, "a NumPy bool array")
        if values.dtype.kind in "iuf":
            values = values.astype(np.float64).reshape(-1).tolist()
        elif values.dtype.kind == "O":
            values = list(values.reshape(-1))
        else:
            raise RewardError(f"{where} returned a NumPy array of dtype {values.dtype}, expected real numbers")
    elif isinstance(values, (str, bytes, numbers.Number, np.generic)):
        raise RewardError(f"{where} returned a {type(values).__name__}, expected one number per answer (a list, "
                          "array or tensor)")
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"{where} returned a {type(values).__name__}, expected one float per answer") from None
    if len(values) != n:
        raise RewardError(f"{where} returned {len(values)} scores for {n} answers")
    out = []
    for i, v in enumerate(values):
        x = _number(v, i, where)
        if not math.isfinite(x):
            raise RewardError(f"{where}: score {i} is not finite ({x})")
        out.append(x)
    return torch.tensor(out, dtype=torch.float32)


class ModelReward:
    """A reward model's score, adapting the step-3 ``score_fn(sequences, attention_mask, prompt_len)``.

    Args:
        score_fn: returns ``(B,)`` end scores for ``(B, T)`` token ids (the reward engine).
        name: log label.
    """

    def __init__(self, score_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], name: str = "model"):
        self.score_fn, self.name = score_fn, name

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        if batch.sequences is None or batch.attention_mask is None or batch.prompt_len is None:
            raise RewardError("the reward model needs the batch's token ids (sequences, attention_mask, prompt_len)")
        scores = self.score_fn(batch.sequences, batch.attention_mask, batch.prompt_len)
        return check_scores(scores, len(batch), f"reward model (step {batch.step})")


class EpisodeReward:
    """The environment's reward of multi-turn episodes (``--env``, ``docs/multi_turn.md``): each
    episode's summed step rewards, carried by the batch (:attr:`RewardBatch.episode_rewards`)."""

    name = "env"

    def __call__(self, batch: RewardBatch) -> torch.Tensor:
        if batch.episode_rewards is None:
            raise RewardError("the environment's reward needs episodes (RewardBatch.episode_rewards)")
        return check_scores(batch.episode_rewards, len(batch), f"environment (step {batch.step})")


class WeightedReward:
    """``sum_k w_k * source_k(batch)``, with each part kept for logging.

    Args:
        parts: ``[(weight, source), ...]``, at least one; names must differ (a repeated name gets
            ``#2``, ``#3`` appended).

    Raises:
        ValueError: no part, or a non-finite weight.
    """

    def __init__(self, parts: Sequence[tuple[float, RewardSource]]):
        if not parts:
            raise ValueError("no reward source: give a reward model, --reward_fn or --reward_url")
        self.parts: list[tuple[float, str, RewardSource]] = []
        seen: dict[str, int] = {}
        for w, src in parts:
            if not math.isfinite(float(w)):
                raise ValueError(f"reward weight of {src.name!r} is not finite ({w})")
            seen[src.name] = seen.get(src.name, 0) + 1
            name = src.name if seen[src.name] == 1 else f"{src.name}#{seen[src.name]}"
            self.parts.append((float(w), name, src))

    @property
    def needs_reward_model(self) -> bool:
        """Whether one of the parts is a reward model's score (it needs the token ids)."""
        return any(isinstance(src, ModelReward) for _, _, src in self.parts)

    def __call__(self, batch: RewardBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns ``(total (B,), {"reward/<name>": (B,) unweighted scores})``, float32 on CPU."""
        total = torch.zeros(len(batch), dtype=torch.float32)
        parts = {}
        for w, name, src in self.parts:
            s = src(batch).float().cpu()
            parts[f"reward/{name}"] = s
            total = total + w * s
        return total, parts


_WEIGHT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*(.+)$")


def split_weight(spec: str, flag: str) -> tuple[float, str]:
    """``"0.5*target"`` -> ``(0.5, "target")``; ``"target"`` -> ``(1.0, "target")``.

    Raises:
        ValueError: empty target; the message names ``flag``.
    """
    m = _WEIGHT.match(spec)
    weight, target = (float(m.group(1)), m.group(2).strip()) if m else (1.0, spec.strip())
    if not target:
        raise ValueError(f"{flag} {spec!r}: nothing to call after the weight")
    return weight, target


def score_on_all_ranks(score: Callable[[], torch.Tensor], *, rank: int, world_size: int,
                       all_reduce_sum: AllReduce | None, step: int, device=None) -> torch.Tensor:
    """Run ``score()`` on every rank and fail on EVERY rank if it failed on any, instead of hanging.

    Each rank computes its own scores, then all ranks all-reduce a ``(world_size,)`` vector of
    failure flags (one slot per rank). If any slot is set, every rank raises :class:`RewardError`:
    the failing rank with its own error chained, the others naming the failed ranks. The next
    collective (the training step's all-reduce) is then never entered by only some ranks.

    Args:
        score: the rank's scoring call, returning ``(B,)`` scores.
        rank, world_size: this rank and the number of ranks.
        all_reduce_sum: sums a tensor over ranks (a collective); ``None`` for one rank.
        step: for the message. device: where the flag tensor lives (CUDA for NCCL).

    Returns:
        ``score()``'s result.

    Raises:
        RewardError: a rank failed.
    """
    err: BaseException | None = None
    scores = None
    try:
        scores = score()
    except Exception as exc:  # noqa: BLE001 - every failure must reach the collective below
        err = exc
    flags = torch.zeros(world_size, dtype=torch.float32, device=device)
    flags[rank] = 1.0 if err is not None else 0.0
    if all_reduce_sum is not None:
        flags = all_reduce_sum(flags)
    failed = [r for r in range(world_size) if float(flags[r]) > 0]
    if err is not None:
        raise RewardError(f"rank {rank}: reward failed at step {step}: {err}") from err
    if failed:
        raise RewardError(f"rank {rank}: reward failed at step {step} on rank(s) {failed}; see their error")
    return scores
