"""Loading a model to train, the same way in every step: load → LoRA → gradient checkpointing.

Then :func:`chatrl.distributed.dist.trained_engine` wraps it with its optimizer and schedule. Steps 1 and DPO
train causal LMs, step 2 a reward model, step 3 both (the actor, and the critic from a reward model).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from chatrl.config import LoraConfig, ModelConfig
from chatrl.models.causal_lm import apply_lora, enable_gradient_checkpointing, load_causal_lm
from chatrl.models.reward_model import RewardModel, load_reward_model, with_lora

KINDS = ("causal_lm", "reward")


class Trainable(NamedTuple):
    """A model ready for its engine, and the deep copy asked for (``None`` otherwise)."""

    model: torch.nn.Module
    copy: torch.nn.Module | None


def load_trainable(kind: str, tokenizer, model: ModelConfig, lora: LoraConfig, *, require_head: bool = False,
                   keep_copy: str | None = None) -> Trainable:
    """Load ``model.model_name_or_path`` for training.

    1. load: a causal LM (:func:`chatrl.models.causal_lm.load_causal_lm`) or a reward model
       (:func:`chatrl.models.reward_model.load_reward_model`; ``require_head``: the folder must hold a
       trained head, else a fresh one starts), in ``model.dtype``, with ``--dropout`` /
       ``--disable_dropout`` and ``--fp32_lm_head`` applied;
    2. LoRA (:func:`chatrl.models.causal_lm.apply_lora`; for a reward model its head keeps training);
    3. gradient checkpointing (``--gradient_checkpointing``).

    Args:
        kind: ``causal_lm`` or ``reward``.
        tokenizer: the prepared tokenizer (embeddings are fitted to it).
        model, lora: the model's blocks (for step 3, read with the model's prefix).
        keep_copy: ``"base"``: also return a deep copy taken before LoRA (DPO's frozen reference: the
            same weights, pad row included); ``"adapted"``: one taken after LoRA, before checkpointing
            (step 3's EMA: the same parameters as the trained model, one by one).

    Raises:
        ValueError: an unknown ``kind`` or ``keep_copy``; ``--lora_module_name`` matching nothing.
        FileNotFoundError / OSError: as the load functions (naming the path);
        chatrl.models.reward_model.MissingRewardHeadError: ``require_head`` and no trained head.
    """
    if kind not in KINDS:
        raise ValueError(f"load_trainable: kind must be one of {KINDS}, got {kind!r}")
    if keep_copy not in (None, "base", "adapted"):
        raise ValueError(f"load_trainable: keep_copy must be None, 'base' or 'adapted', got {keep_copy!r}")
    path = model.model_name_or_path
    if kind == "causal_lm":
        net = load_causal_lm(path, tokenizer, model.dtype, dropout=model.dropout_override,
                             trust_remote_code=model.trust_remote_code, fp32_lm_head=model.fp32_lm_head)
    else:
        net = load_reward_model(path, tokenizer, model.dtype, require_head=require_head,
                                dropout=model.dropout_override, trust_remote_code=model.trust_remote_code)
    kept = copy.deepcopy(net) if keep_copy == "base" else None
    net = with_lora(net, lora) if isinstance(net, RewardModel) else apply_lora(net, lora)
    if keep_copy == "adapted":
        kept = copy.deepcopy(net)
    if model.gradient_checkpointing:
        enable_gradient_checkpointing(net.hf if isinstance(net, RewardModel) else net)
    return Trainable(net, kept)
