"""The reward model: a causal-LM backbone and a bias-free linear head to one scalar per token.

The model is built on an HF ``*ForSequenceClassification`` instance with ``num_labels=1`` of the
backbone's own family, so that its parameter names (``model.…`` for the backbone, ``score.weight``
for the head) are the ones ``AutoModelForSequenceClassification.from_pretrained`` expects. What
chatrl adds is the forward pass:

* position ids follow the attention mask, so a left-padded row sees the same positions as the
  same row unpadded;
* the head is applied at every position (``values``, used by step 3's critic);
* the sequence's score (``end_scores``) is read at its *last real token*, the last position whose
  attention mask is 1. Token ids are never compared with ``pad_token_id``: OPT's BOS, EOS and (in
  some set-ups) pad share an id, and a pad equal to EOS would hide the end of an answer.

A sequence's end score therefore does not depend on padding side, padding amount or batch size
(``tests/unit/test_reward_model.py`` checks each within 1e-5).

The pairwise loss is the Bradley–Terry negative log-likelihood used by InstructGPT
(Ouyang et al., 2022, eq. 1): ``-log σ(r_chosen - r_rejected)``, with Llama 2's optional margin
(Touvron et al., 2023, eq. 2): ``-log σ(r_chosen - r_rejected - m)``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from chatrl.config import LoraConfig
from chatrl.data.examples import left_cut
from chatrl.data.formatting import encode_examples
from chatrl.data.schema import HUMAN, parse_transcript
from chatrl.distributed.weights import save_hf_model
from chatrl.models.causal_lm import (
    apply_lora,
    base_model,
    fit_embeddings,
    forward_inputs,
    lora_enabled,
    torch_dtype,
)
from chatrl.models.precision import attention_kwargs, compute_in_fp32
from chatrl.packing import PackedRows

log = logging.getLogger(__name__)

HEAD = "score"
"""Attribute name of the scalar head in HF's ``*ForSequenceClassification`` classes (and ours)."""


class MissingRewardHeadError(ValueError):
    """A folder that should hold a trained reward head (``score.weight``) lacks it or has the wrong shape."""


# --------------------------------------------------------------------------------------------
# Pure tensor functions
# --------------------------------------------------------------------------------------------


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row: ``(B,)`` long.

    Found from the mask alone, so it is right for left padding, right padding and rows without
    padding alike.

    Args:
        attention_mask: ``(B, T)``, 1 on real tokens, 0 on pads.

    Raises:
        ValueError: a row has no real token at all (its score would be meaningless).
    """
    mask = attention_mask.long()
    if not bool((mask.sum(-1) > 0).all()):
        raise ValueError("a row of attention_mask has no real token; cannot read its end score")
    positions = torch.arange(mask.shape[-1], device=mask.device)
    # positions * mask is strictly increasing over real tokens, so argmax is the last of them.
    return (positions * mask).argmax(-1)


def gather_end_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The value at each row's last real token: ``values (B, T)`` → ``(B,)``."""
    idx = last_token_index(attention_mask)
    return values.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


def pairwise_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Bradley–Terry loss of each pair, ``-log σ(chosen - rejected - margin)``: ``(B,)`` float32
    (see :func:`pairwise_loss`, their mean)."""
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.to(diff)
    return -F.logsigmoid(diff)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None) -> torch.Tensor:
    """Mean Bradley–Terry loss over pairs: ``mean(-log σ(chosen - rejected - margin))``.

    Computed with ``F.logsigmoid``, which is exact and finite for any finite difference
    (``-log σ(x) = softplus(-x)``): at a difference of -1e4 the loss is 1e4, at +1e4 it is 0, and
    gradients stay in ``[-1, 0]``. Computed in float32 whatever the model's dtype.

    Args:
        chosen: ``(B,)`` end scores of the preferred answers.
        rejected: ``(B,)`` end scores of the other answers.
        margin: optional ``(B,)`` required gap (Llama 2, eq. 2); zero when absent.

    Returns:
        A scalar tensor.
    """
    return pairwise_losses(chosen, rejected, margin).mean()


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs that eval metrics are built from (summed over ranks, then divided by ``count``).

    Keys: ``count``, ``correct`` (pairs with chosen strictly above rejected; ties count as wrong),
    ``chosen`` and ``rejected`` (score sums), ``margin`` (sum of chosen - rejected). Float64 scalars.
    """
    c, r = chosen.detach().double(), rejected.detach().double()
    return {
        "count": torch.tensor(float(c.numel()), dtype=torch.float64, device=c.device),
        "correct": (c > r).double().sum(),
        "chosen": c.sum(),
        "rejected": r.sum(),
        "margin": (c - r).sum(),
    }


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


class RewardOutput(NamedTuple):
    """``values``: ``(B, T)`` the head at every position (0 at pads); ``end_scores``: ``(B,)``."""

    values: torch.Tensor
    end_scores: torch.Tensor


class RewardModel(nn.Module):
    """A scalar reward (or value) per token and per sequence from an HF sequence-classification model.

    Args:
        seq_cls: an HF ``*ForSequenceClassification`` with ``num_labels == 1`` and a ``score``
            head, or a peft model wrapping one (LoRA layers are injected in place, so running the
            wrapped backbone runs them).

    Attributes:
        hf: ``seq_cls`` as given; save it with :func:`save_reward_model`.

    Raises:
        ValueError: the model has no ``score`` head or its output is not one scalar.
    """

    def __init__(self, seq_cls: nn.Module):
        super().__init__()
        self.hf = seq_cls
        inner = base_model(seq_cls)
        head = getattr(inner, HEAD, None)
        if not isinstance(head, nn.Linear) or head.out_features != 1:
            raise ValueError(f"{type(inner).__name__} has no one-output linear '{HEAD}' head; "
                             "build it with num_labels=1")
        compute_in_fp32(head)  # scores and values in float32 whatever the backbone's dtype (docs/precision.md)

    @property
    def config(self):
        """The backbone's HF config."""
        return base_model(self.hf).config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                packed: PackedRows | None = None) -> RewardOutput:
        """Score every position and read each sequence's score at its last real token.

        Args:
            input_ids: ``(B, T)`` token ids, padded on either side.
            attention_mask: ``(B, T)``, 1 on real tokens, 0 on pads.
            packed: packed rows (:class:`chatrl.packing.PackedRows`) instead of a padded batch:
                ``input_ids`` are its rows ``(R, W)`` and ``attention_mask`` is ignored.

        Returns:
            :class:`RewardOutput` ``(values (B, T), end_scores (B,))`` in float32 whatever the
            backbone's dtype (the head runs in float32: :func:`chatrl.models.precision.compute_in_fp32`);
            ``values`` is 0 at pad positions. With ``packed``: ``values (R, W)`` (0 on the rows'
            trailing pads) and ``end_scores (N,)``, one per packed sequence in its order, each
            equal to the sequence's padded end score.
        """
        inner = base_model(self.hf)
        backbone = getattr(inner, inner.base_model_prefix)
        out = backbone(**forward_inputs(self, input_ids, attention_mask, packed), use_cache=False)
        values = getattr(inner, HEAD)(out.last_hidden_state).squeeze(-1)
        if packed is not None:
            last = packed.last_slots()
            values = values.masked_fill(packed.seq_ids < 0, 0.0)
            return RewardOutput(values, values[last.rows, last.cols])
        values = values.masked_fill(attention_mask == 0, 0.0)
        return RewardOutput(values, gather_end_scores(values, attention_mask))


# --------------------------------------------------------------------------------------------
# Loading and saving
# --------------------------------------------------------------------------------------------


def _checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]] | None:
    """Parameter name → shape of the weights in a local HF folder, without loading them.

    Reads safetensors headers (single file or sharded index); falls back to a ``.bin`` file
    (loaded on the meta device). Returns ``None`` when ``path`` is not a local folder.
    """
    folder = Path(path)
    if not folder.is_dir():
        return None
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
        else sorted(folder.glob("*.safetensors"))
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    if not files:
        for f in sorted(folder.glob("pytorch_model*.bin")):
            state = torch.load(f, map_location="meta", weights_only=True)
            shapes.update({k: tuple(v.shape) for k, v in state.items()})
    return shapes


def has_reward_head(path: str, hidden_size: int | None = None) -> bool:
    """True when the local checkpoint at ``path`` holds ``score.weight`` of shape ``(1, hidden_size)``.

    ``hidden_size`` ``None`` accepts any ``(1, H)``. A hub name (not a local folder) returns False.
    """
    shapes = _checkpoint_shapes(path) or {}
    shape = shapes.get(f"{HEAD}.weight")
    if shape is None or len(shape) != 2 or shape[0] != 1:
        return False
    return hidden_size is None or shape[1] == hidden_size


def check_reward_head(path: str, hidden_size: int) -> None:
    """Raise unless ``path`` holds a scalar head of the right width.

    Raises:
        MissingRewardHeadError: ``score.weight`` is absent, or its shape is not ``(1, hidden_size)``;
            the message names what was found.
    """
    shapes = _checkpoint_shapes(path)
    if shapes is None:
        raise MissingRewardHeadError(f"{path!r} is not a local folder; a reward/critic checkpoint must be one")
    shape = shapes.get(f"{HEAD}.weight")
    if shape is None:
        heads = [k for k in shapes if k.endswith(("lm_head.weight", "v_head.weight", "score.weight"))]
        raise MissingRewardHeadError(
            f"{path} has no '{HEAD}.weight' (found {heads or 'no head'}): it is not a chatrl / HF "
            "sequence-classification reward model. Train one with `python -m chatrl.step2_reward`.")
    if tuple(shape) != (1, hidden_size):
        raise MissingRewardHeadError(
            f"{path}: '{HEAD}.weight' has shape {tuple(shape)}, expected (1, {hidden_size}) for this backbone")


def _apply_dropout(config, dropout: float | None) -> None:
    if dropout is None:
        return
    for key in ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout", "resid_pdrop",
                "embd_pdrop", "attn_pdrop", "classifier_dropout"):
        if hasattr(config, key) and not (key == "classifier_dropout" and getattr(config, key) is None):
            setattr(config, key, dropout)


def load_reward_model(
    path: str,
    tokenizer,
    dtype: str = "fp32",
    require_head: bool = True,
    dropout: float | None = None,
    trust_remote_code: bool = False,
) -> RewardModel:
    """Load a :class:`RewardModel` from a causal-LM or reward-model folder (or hub name).

    * ``require_head=False`` (step 2's start): the backbone weights come from ``path`` (a causal LM
      such as step 1's output, or a reward model to continue training); the head is read from the
      checkpoint when it holds one of the right shape, else freshly initialised
      (normal, std ``config.initializer_range``, as HF does).
    * ``require_head=True`` (step 3's critic and reward): the checkpoint must hold a trained head;
      anything else raises instead of silently starting from a random head.

    The tokenizer (passed through :func:`chatrl.models.causal_lm.prepare_tokenizer`) fixes the embedding size
    and ``config.pad_token_id`` (a pad distinct from EOS, so HF's own pad-based pooling agrees with
    ours on saved folders).

    Args:
        path: local folder or hub name.
        tokenizer: the prepared tokenizer.
        dtype: ``fp32`` | ``bf16`` | ``fp16``.
        require_head: see above.
        dropout: if given, overrides every dropout probability of the config.
        trust_remote_code: passed to transformers.

    Raises:
        MissingRewardHeadError: ``require_head`` and the checkpoint lacks ``score.weight`` of
            shape ``(1, hidden)``.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    config.num_labels = 1
    config.problem_type = "regression"
    _apply_dropout(config, dropout)
    hidden = _head_width(config)
    if require_head:
        check_reward_head(path, hidden)
    elif os.path.isdir(path) and not has_reward_head(path, hidden):
        log.info("%s has no reward head: initialising a fresh '%s' head", path, HEAD)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, config=config, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
        **attention_kwargs(dtype))
    fit_embeddings(model, tokenizer)
    return RewardModel(model)


def _head_width(config) -> int:
    """Input width of the ``score`` head: OPT projects to ``word_embed_proj_dim``, others use ``hidden_size``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    width = getattr(text, "word_embed_proj_dim", None)
    return int(width if width is not None else text.hidden_size)


def save_reward_model(model: nn.Module, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save a :class:`RewardModel` (maybe DeepSpeed- or peft-wrapped, maybe ZeRO-3 partitioned) as an HF folder.

    All ranks must call it. The folder holds the sequence-classification class of the backbone's
    family (``architectures`` e.g. ``["OPTForSequenceClassification"]``), ``num_labels=1``, the
    pad id of ``tokenizer``, LoRA merged, and the tokenizer: it loads with
    ``AutoModelForSequenceClassification.from_pretrained(out_dir, num_labels=1)`` and with
    :func:`load_reward_model` ``(require_head=True)``.
    """
    reward = getattr(model, "module", model)  # a DeepSpeed engine holds the module as .module
    if not isinstance(reward, RewardModel):
        raise TypeError(f"expected a RewardModel, got {type(reward).__name__}")
    inner = base_model(reward.hf)
    if tokenizer is not None:
        inner.config.pad_token_id = tokenizer.pad_token_id
    inner.config.num_labels = 1
    save_hf_model(reward.hf, tokenizer, out_dir)


def with_lora(reward: RewardModel, lora: LoraConfig) -> RewardModel:
    """Wrap ``reward``'s backbone with LoRA adapters (:func:`chatrl.models.causal_lm.apply_lora`); the head keeps training.

    DeepSpeed-Chat's ``--only_optimize_lora`` freezes everything but the adapters, the value head
    included, which leaves a reward model with a random head. Here the ``score`` head always stays
    trainable. Returns ``reward`` itself when LoRA is off.
    """
    if not lora_enabled(lora):
        return reward
    peft_model = apply_lora(reward.hf, lora)
    getattr(base_model(peft_model), HEAD).weight.requires_grad_(True)
    return RewardModel(peft_model)


# --------------------------------------------------------------------------------------------
# Scoring texts
# --------------------------------------------------------------------------------------------


def prompt_messages(prompt: str) -> tuple[dict, ...]:
    """A prompt text as messages: a Human/Assistant transcript is split into its turns, anything
    else is one user message."""
    text = prompt.rstrip()
    if HUMAN in text and text.endswith("Assistant:"):
        return parse_transcript(text)
    return ({"role": "user", "content": prompt.strip()},)


def encode_rows(tokenizer, samples, max_seq_len: int) -> list[tuple[list[int], list[int] | None] | None]:
    """Token ids per sample: ``(prompt + chosen, prompt + rejected or None)``, or ``None`` when an
    answer alone does not fit ``max_seq_len``. Both sides share one left-cut prompt, as in training."""
    messages = [s.messages for s in samples]
    chosen = encode_examples(tokenizer, messages, [s.chosen for s in samples])
    rejected = [a for _, a in encode_examples(tokenizer, messages, [s.rejected or "" for s in samples])]
    out = []
    for s, (p, c), r in zip(samples, chosen, rejected, strict=True):
        r = r if s.rejected is not None else None
        cut = left_cut(p, max_seq_len - max(len(c), len(r or [])), tokenizer.bos_token_id)
        out.append(None if cut is None else (cut + c, None if r is None else cut + r))
    return out


@torch.no_grad()
def score_sequences(model, seqs: list[list[int]], pad_id: int, batch_size: int, device) -> list[float]:
    """End scores of token sequences, right-padded in batches of ``batch_size`` (float, one per sequence)."""
    scores: list[float] = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i:i + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(chunk):
            ids[j, :len(s)] = torch.tensor(s)
            mask[j, :len(s)] = 1
        scores += model(ids.to(device), mask.to(device)).end_scores.float().cpu().tolist()
    return scores
