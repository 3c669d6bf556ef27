"""Reward sources for step 3, combinable with weights (``docs/rewards.md``).

- :class:`~chatrl.rewards.base.ModelReward`: a reward model's end score (the PPO default);
- :class:`~chatrl.rewards.function.FunctionReward`: a Python function ``module:function`` of the
  prompts, decoded answers and per-row metadata; built-ins in :mod:`chatrl.rewards.builtin`
  (exact-match maths answer, regular-expression format check);
- :class:`~chatrl.rewards.http.HttpReward`: a reward server over HTTP (``python -m chatrl.reward_server``);
- :class:`~chatrl.rewards.base.EpisodeReward`: an environment's reward of multi-turn episodes (``--env``).

:class:`~chatrl.rewards.base.WeightedReward` sums several; :func:`~chatrl.rewards.base.score_on_all_ranks`
makes a failure on one rank an error on every rank instead of a hang.
"""

from chatrl.rewards.base import (
    EpisodeReward,
    ModelReward,
    RewardBatch,
    RewardError,
    RewardSource,
    WeightedReward,
    check_scores,
    reward_batch_from_tokens,
    score_on_all_ranks,
    split_weight,
)
from chatrl.rewards.function import BUILTIN_REWARD_FNS, FunctionReward, check_reward_metadata, load_reward_fn
from chatrl.rewards.http import HttpReward, decode_request, decode_response, encode_request

__all__ = [
    "BUILTIN_REWARD_FNS",
    "EpisodeReward",
    "FunctionReward",
    "HttpReward",
    "ModelReward",
    "RewardBatch",
    "RewardError",
    "RewardSource",
    "WeightedReward",
    "build_reward",
    "check_reward_metadata",
    "check_scores",
    "decode_request",
    "decode_response",
    "encode_request",
    "load_reward_fn",
    "reward_batch_from_tokens",
    "score_on_all_ranks",
    "split_weight",
]


def build_reward(reward_fns=(), reward_urls=(), model: ModelReward | None = None, model_weight: float = 1.0, *,
                 http_timeout: float = 60.0, http_retries: int = 2, http_batch_size: int = 256,
                 episodes: bool = False) -> WeightedReward:
    """The weighted sum of the sources named on the command line.

    Args:
        reward_fns: ``--reward_fn`` values, each ``[WEIGHT*]module:function`` (or a built-in name,
            see :data:`BUILTIN_REWARD_FNS`, or ``path/to/file.py:function``).
        reward_urls: ``--reward_url`` values, each ``[WEIGHT*]http://host:port/path``.
        model: the reward-model source, if any, with weight ``model_weight``.
        http_timeout, http_retries, http_batch_size: for every URL, see :class:`HttpReward`.
        episodes: multi-turn episodes (``--env``): the environment's reward (:class:`EpisodeReward`,
            weight 1) comes first.

    Raises:
        ValueError: no source at all, a bad weight; ImportError/AttributeError/TypeError from
            :func:`load_reward_fn` (naming the spec).
    """
    parts: list[tuple[float, RewardSource]] = [(1.0, EpisodeReward())] if episodes else []
    if model is not None:
        parts.append((float(model_weight), model))
    for spec in reward_fns:
        w, target = split_weight(spec, "--reward_fn")
        parts.append((w, FunctionReward(target)))
    for spec in reward_urls:
        w, target = split_weight(spec, "--reward_url")
        parts.append((w, HttpReward(target, timeout=http_timeout, retries=http_retries, batch_size=http_batch_size)))
    return WeightedReward(parts)
