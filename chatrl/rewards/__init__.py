"""Reward sources for step 3, combinable with weights (``docs/rewards.md``).

- :class:`~chatrl.rewards.base.ModelReward`: a reward model's end score (the PPO default);
- :class:`~chatrl.rewards.function.FunctionReward`: a Python function ``module:function`` of the
  prompts, decoded answers and per-row metadata; built-ins in :mod:`chatrl.rewards.builtin`
  (exact-match maths answer, regular-expression format check);
- :class:`~chatrl.rewards.remote.HttpReward`: a reward server over HTTP (``python -m chatrl.tools.reward_server``);
- :class:`~chatrl.rewards.base.EpisodeReward`: an environment's reward of multi-turn episodes (``--env``).

Each kind of source is a class registered in :mod:`chatrl.rewards.kinds`, which the flags, step 3,
``train.py`` and the evaluation's judges read. :class:`~chatrl.rewards.base.WeightedReward` sums
several; :func:`~chatrl.rewards.base.score_on_all_ranks`
makes a failure on one rank an error on every rank instead of a hang.
"""

from chatrl.config import RewardConfig
from chatrl.rewards import kinds
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
from chatrl.rewards.function import BUILTIN_REWARD_FNS, FunctionReward, load_reward_fn
from chatrl.rewards.kinds import RewardContext, RewardKind, check_reward_metadata
from chatrl.rewards.model import reward_model_scores
from chatrl.rewards.remote import HttpReward, decode_request, decode_response, encode_request

__all__ = [
    "BUILTIN_REWARD_FNS",
    "EpisodeReward",
    "FunctionReward",
    "HttpReward",
    "ModelReward",
    "RewardBatch",
    "RewardContext",
    "RewardKind",
    "RewardError",
    "RewardSource",
    "WeightedReward",
    "build_reward",
    "build_rlhf_reward",
    "check_reward_metadata",
    "check_scores",
    "decode_request",
    "decode_response",
    "encode_request",
    "kinds",
    "load_reward_fn",
    "reward_batch_from_tokens",
    "score_on_all_ranks",
    "split_weight",
]


def build_reward(settings: RewardConfig, context: RewardContext | None = None, model: str | None = None,
                 episodes: bool = False) -> WeightedReward:
    """The weighted sum of the sources the run names, each built by its kind (:mod:`chatrl.rewards.kinds`).

    Args:
        settings: the run's reward block: ``--reward_fn`` values (``[WEIGHT*]module:function``, a
            built-in name, ``path/to/file.py:function`` or a registered kind's ``name:TARGET``),
            ``--reward_url`` values (``[WEIGHT*]http://host:port/path``) and the HTTP settings.
        context: what the program offers the kinds (step 3's reward engine); default: nothing.
        model: the reward model to score with (weight 1; the ``model`` kind), or None.
        episodes: multi-turn episodes (``--env``): the environment's reward (:class:`EpisodeReward`,
            weight 1) comes first.

    Raises:
        ValueError: no source at all, a bad weight; ImportError/AttributeError/TypeError from
            :func:`load_reward_fn` (naming the spec).
    """
    context = context or RewardContext()
    parts: list[tuple[float, RewardSource]] = [(1.0, EpisodeReward())] if episodes else []
    if model is not None:
        parts.append((1.0, kinds.KINDS["model"].source(model, settings, context)))
    return WeightedReward(parts + kinds.sources(settings, context))


def build_rlhf_reward(settings: RewardConfig, reward_engine, reward_path: str | None, micro_batch: int,
                      pad_token_id: int | None = None, episodes: bool = False, score_fn=None) -> WeightedReward:
    """Step 3's weighted reward, the same for every algorithm (:func:`build_reward`): the reward model
    at ``reward_path`` scored by ``reward_engine`` when loaded (:func:`chatrl.rewards.model.reward_model_scores`,
    ``micro_batch`` rollouts per pass, on packed rows with ``pad_token_id``), the environment's reward
    with ``episodes``, the ``--reward_fn`` and ``--reward_url`` sources. ``score_fn`` (a test hook,
    ``score_fn(sequences, attention_mask, prompt_len) -> (B,)``) replaces all of them."""
    if score_fn is not None:
        return WeightedReward([(1.0, ModelReward(score_fn, name="score_fn"))])
    scores = reward_model_scores(reward_engine, micro_batch, pad_token_id) if reward_engine is not None else None
    return build_reward(settings, RewardContext(model_scores=scores), reward_path if scores is not None else None,
                        episodes=episodes)
