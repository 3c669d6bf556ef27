"""Judges of an evaluation: who prefers which answer.

Two kinds share one entry point, :func:`compare`:

* a **pointwise** judge scores each answer alone, ``judge.score(prompts, answers) -> N floats``
  (:class:`RewardModelJudge`, the built-in: a chatrl / HF sequence-classification reward model; or
  :class:`FunctionJudge` over a reward function ``f(prompts, answers, metadata)``; or
  :class:`SourceJudge` over the source of any other registered reward kind, :mod:`chatrl.rewards.kinds`,
  a reward server say); B beats A when
  its score is higher (:func:`chatrl.eval.stats.outcome`, ties within ``--tie_margin`` count half);
* a **pairwise** judge reads both answers at once, ``judge.prefer(prompts, first, second) -> N
  probabilities that the first is better`` (a function marked ``f.pairwise = True``, e.g. an LLM
  judge). It is asked in both orders and the two answers averaged, which cancels a preference for
  the first (or second) position: ``outcome = (prefer(x, b, a) + 1 − prefer(x, a, b)) / 2``.

Judges read text: a reward-model judge re-encodes each prompt and answer with its own tokenizer
(as :class:`chatrl.rewards.model.TextRewardModel` does), so models with other tokenizers than the
judge's are compared fairly. Identical answers are a tie without asking the judge.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from chatrl.config import RewardConfig
from chatrl.data.formatting import format_prompt
from chatrl.data.schema import Sample
from chatrl.errors import UsageError
from chatrl.eval.stats import outcome
from chatrl.models.reward_model import MissingRewardHeadError, encode_rows, score_sequences
from chatrl.rewards import kinds
from chatrl.rewards.base import RewardBatch, RewardError, check_scores
from chatrl.rewards.function import BUILTIN_REWARD_FNS, load_reward_fn
from chatrl.rewards.model import TextRewardModel

Conversation = tuple[dict, ...]


class PointwiseJudge(Protocol):
    """Scores answers one at a time: ``score(prompts, answers) -> N`` finite floats, higher is better."""

    name: str

    def score(self, prompts: Sequence[Conversation], answers: Sequence[str]) -> list[float]: ...


class PairwiseJudge(Protocol):
    """Compares two answers to one prompt: ``prefer(prompts, first, second) -> N`` probabilities in
    ``[0, 1]`` that ``first`` is the better answer (0.5: no preference)."""

    name: str

    def prefer(self, prompts: Sequence[Conversation], first: Sequence[str], second: Sequence[str]) -> list[float]: ...


def transcript(messages: Sequence[dict]) -> str:
    """A conversation as text for judges that read plain text: the Human/Assistant convention
    (``"\\n\\nHuman: … \\n\\nAssistant:"``, :func:`chatrl.data.formatting.format_prompt` without a template),
    which :func:`chatrl.models.reward_model.prompt_messages` splits back into its turns."""
    return format_prompt(None, messages)


class RewardModelJudge:
    """A reward model as a pointwise judge: the end score of prompt + answer, re-encoded with the judge's
    tokenizer exactly as in step 2's training (:func:`chatrl.models.reward_model.encode_rows`: the prompt
    in the judge's format, cut from the left to fit ``max_seq_len``; the answer with its end-of-turn token).

    Args:
        path: the reward model's folder (step 2's ``--output_dir``). flag: the flag that named it
            (for messages). max_seq_len, batch_size, dtype, device: as :class:`TextRewardModel`.

    Raises:
        UsageError: ``path`` does not exist, holds no tokenizer, or is not a reward model (no scalar
            ``score`` head: e.g. a causal LM such as step 1's output).
    """

    def __init__(self, path: str, flag: str = "--judge", max_seq_len: int = 512, batch_size: int = 16,
                 dtype: str = "fp32", device=None):
        self.flag, self.path, self.name = flag, path, Path(path).name or path
        try:
            self.rm = TextRewardModel(path, max_seq_len=max_seq_len, batch_size=batch_size, dtype=dtype,
                                      device=device, name=self.name)
        except MissingRewardHeadError as e:
            raise UsageError(f"{flag} {path} is not a reward model ({e}). A judge is a reward model (step 2's "
                             "output, python -m chatrl.step2_reward) or module:function") from None
        except (OSError, ValueError) as e:
            raise UsageError(f"{flag} {path}: cannot load a reward model there ({type(e).__name__}: "
                             f"{str(e).strip()[:300]})") from None

    def score(self, prompts: Sequence[Conversation], answers: Sequence[str]) -> list[float]:
        """End scores of each prompt + answer.

        Raises:
            UsageError: an answer that alone does not fit ``--judge_max_seq_len`` (names the answer).
        """
        samples = [Sample(tuple(p), a) for p, a in zip(prompts, answers, strict=True)]
        encoded = encode_rows(self.rm.tokenizer, samples, self.rm.max_seq_len)
        for i, e in enumerate(encoded):
            if e is None:
                raise UsageError(f"{self.flag} {self.path}: answer {i} ({answers[i][:60]!r}…) does not fit "
                                 f"--judge_max_seq_len {self.rm.max_seq_len}; raise it")
        return score_sequences(self.rm.model, [e[0] for e in encoded], self.rm.tokenizer.pad_token_id,
                               self.rm.batch_size, self.rm.device)


class FunctionJudge:
    """A Python function as a judge (``--judge module:function`` or ``file.py:function``).

    Pointwise: a reward function (``docs/rewards.md``), ``f(prompts, answers, metadata) -> N`` numbers,
    with the prompts as Human/Assistant transcripts (:func:`transcript`) and each prompt row's metadata
    (its ``reference`` for ``exact_match``; :attr:`metadata`, filled by the evaluation, else empty); a
    built-in reward's short name (``exact_match``) is one too, so a run with a rule reward is judged by it.
    Pairwise: a function with ``f.pairwise = True``, ``f(prompts, first, second) -> N`` probabilities
    that ``first`` is better.

    Raises:
        UsageError: the spec cannot be imported, or is not callable.
    """

    def __init__(self, spec: str, flag: str = "--judge"):
        try:
            self.fn = load_reward_fn(spec)
        except (ValueError, ImportError, AttributeError, TypeError) as e:
            raise UsageError(f"{flag} {spec}: " + str(e).replace(f"--reward_fn {spec!r}: ", "")) from None
        self.flag, self.spec, self.name = flag, spec, getattr(self.fn, "__name__", spec)
        self.pairwise = bool(getattr(self.fn, "pairwise", False))
        self.metadata: dict[str, dict] = {}  # conversation_key(prompt) → its row's metadata

    def _metadata(self, prompts: Sequence[Conversation]) -> list[dict]:
        return [dict(self.metadata.get(conversation_key(p), {})) for p in prompts]

    def _values(self, values, n: int, lo: float = -math.inf, hi: float = math.inf) -> list[float]:
        try:
            out = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
        except (TypeError, ValueError):
            raise UsageError(f"{self.flag} {self.spec} returned {type(values).__name__}, expected {n} numbers") from None
        if len(out) != n or not all(lo <= v <= hi and math.isfinite(v) for v in out):
            raise UsageError(f"{self.flag} {self.spec} returned {len(out)} values for {n} answers, or a value "
                             f"outside [{lo}, {hi}] or not finite")
        return out

    def score(self, prompts: Sequence[Conversation], answers: Sequence[str]) -> list[float]:
        """The function's score of each answer (pointwise judges)."""
        values = self.fn([transcript(p) for p in prompts], list(answers), self._metadata(prompts))
        return self._values(values, len(answers))

    def prefer(self, prompts: Sequence[Conversation], first: Sequence[str], second: Sequence[str]) -> list[float]:
        """The probability that ``first`` is better (pairwise judges)."""
        values = self.fn([transcript(p) for p in prompts], list(first), list(second))
        return self._values(values, len(first), 0.0, 1.0)


class SourceJudge:
    """The source of any reward kind (:mod:`chatrl.rewards.kinds`: a reward server, a user's kind) as a
    pointwise judge: each answer scored with the prompt as a Human/Assistant transcript (:func:`transcript`)
    and its row's metadata, as :class:`FunctionJudge` calls a function.

    Args:
        kind: the kind that claimed ``spec``. spec: the flag's value. flag: the flag, for messages.
        context: what the kind may build its source from (:class:`chatrl.rewards.kinds.RewardContext`).

    Raises:
        UsageError: at call time, the source failed or returned bad scores (names the flag and the value).
    """

    def __init__(self, kind: kinds.RewardKind, spec: str, flag: str, context: kinds.RewardContext):
        self.source = kind.source(spec, RewardConfig(), context)
        self.flag, self.spec, self.name = flag, spec, getattr(self.source, "name", kind.name)
        self.metadata: dict[str, dict] = {}  # conversation_key(prompt) → its row's metadata

    def score(self, prompts: Sequence[Conversation], answers: Sequence[str]) -> list[float]:
        """The source's score of each answer."""
        batch = RewardBatch([transcript(p) for p in prompts], list(answers),
                            [dict(self.metadata.get(conversation_key(p), {})) for p in prompts])
        try:
            return check_scores(self.source(batch), len(answers), f"{self.flag} {self.spec}").tolist()
        except RewardError as e:
            raise UsageError(str(e)) from None


def load_judge(spec: str, flag: str, max_seq_len: int = 512, batch_size: int = 16, dtype: str = "fp32",
               device=None) -> PointwiseJudge | PairwiseJudge:
    """The judge named by ``--judge`` / ``--gold_judge``, by the reward kind that claims it
    (:func:`chatrl.rewards.kinds.find`): a folder is a reward model (:class:`RewardModelJudge`), a
    function or built-in a :class:`FunctionJudge`, any other kind's value a :class:`SourceJudge`.

    Raises:
        UsageError: no kind claims ``spec`` (a missing folder, say), or the judge cannot be loaded.
    """
    kind = kinds.find(spec)
    if kind is None:
        own = [f"{k}:..." for k in kinds.names() if k not in ("function", "builtin", "http", "model")]
        raise UsageError(f"{flag} {spec}: no such folder; a judge is a reward-model folder (step 2's "
                         "output), module:function / file.py:function or a built-in reward "
                         f"({', '.join(BUILTIN_REWARD_FNS)})"
                         + (f" or a registered reward kind's value ({', '.join(own)})" if own else ""))
    if kind.name == "model":
        return RewardModelJudge(spec, flag, max_seq_len, batch_size, dtype, device)
    if isinstance(kind, kinds.FunctionKind):
        return FunctionJudge(spec, flag)
    return SourceJudge(kind, spec, flag, kinds.RewardContext(max_seq_len=max_seq_len, batch_size=batch_size,
                                                             dtype=dtype, device=device))


def conversation_key(conversation: Conversation) -> str:
    """A conversation (a prompt's messages) as a key: its JSON with sorted keys."""
    return json.dumps([dict(m) for m in conversation], sort_keys=True)


def is_pairwise(judge) -> bool:
    """Whether ``judge`` compares two answers at once (else it scores one)."""
    return bool(getattr(judge, "pairwise", False)) or (hasattr(judge, "prefer") and not hasattr(judge, "score"))


class ScoreCache:
    """A pointwise judge's scores, each (prompt, answer text) scored once: an answer that two models (or two
    decodings) share gets exactly the same score, whatever batch it was scored in."""

    def __init__(self, judge: PointwiseJudge):
        self.judge, self.scores = judge, {}

    def fill(self, prompts: Sequence[Conversation], answers: Sequence[Sequence[str]]) -> None:
        """Score every answer of ``answers`` (lists parallel to ``prompts``) not scored yet."""
        todo = {(i, a) for column in answers for i, a in enumerate(column)} - set(self.scores)
        # longest first, so that a judge's batches hold texts of similar length (less padding)
        size = {i: len(transcript(prompts[i])) for i in {i for i, _ in todo}}
        todo = sorted(todo, key=lambda x: (-(size[x[0]] + len(x[1])), x))
        if todo:
            values = self.judge.score([prompts[i] for i, _ in todo], [a for _, a in todo])
            self.scores.update(zip(todo, values, strict=True))

    def __call__(self, i: int, answer: str) -> float:
        return self.scores[(i, answer)]


def compare(judge, prompts: Sequence[Conversation], answers_a: Sequence[str], answers_b: Sequence[str],
            tie_margin: float = 0.0, cache: ScoreCache | None = None) -> np.ndarray:
    """``(N,)`` outcomes of B's answers against A's, one per prompt: 1 B better, 0 A better, 0.5 a tie
    (equal texts, or scores within ``tie_margin``); a pairwise judge gives the mean of both orders
    (module docstring). ``cache`` keeps a pointwise judge's scores across calls."""
    n = len(prompts)
    if not len(answers_a) == len(answers_b) == n:
        raise ValueError(f"compare: {n} prompts, {len(answers_a)} and {len(answers_b)} answers")
    out = np.full(n, 0.5)
    differ = [i for i in range(n) if answers_a[i] != answers_b[i]]
    if not differ:
        return out
    if is_pairwise(judge):
        xs = [prompts[i] for i in differ]
        a, b = [answers_a[i] for i in differ], [answers_b[i] for i in differ]
        b_first, a_first = judge.prefer(xs, b, a), judge.prefer(xs, a, b)
        out[differ] = [(p + 1.0 - q) / 2 for p, q in zip(b_first, a_first, strict=True)]
        return out
    cache = cache or ScoreCache(judge)
    cache.fill(prompts, [answers_a, answers_b])
    for i in differ:
        out[i] = outcome(cache(i, answers_a[i]), cache(i, answers_b[i]), tie_margin)
    return out
