"""Which model families the hybrid engine serves, and their tensor-parallel layouts.

A layout is a ``torch.distributed.tensor.parallel`` plan: ``{module fqn pattern: ParallelStyle}``,
column-parallel for the projections that fan out (q/k/v, gate/up, fc1), row-parallel for the ones
that fan back in (out/o_proj, down/fc2). Llama-family configs ship the plan as
``config.base_model_tp_plan`` (strings, relative to the base model); OPT ships none, so its plan is
written here. The LM head is always split over the vocabulary (column-parallel, sharded output):
each rank then reads half the head's weights per token, the largest matrix of a small model.

After sharding, every attention module must see its per-rank head counts: :func:`shard_head_counts`
divides the attributes that HF attention modules read in ``forward``.
"""

from __future__ import annotations

import torch

#: ``config.model_type`` values the engine serves, mapped to the dotted path of the decoder layers
#: (a ``ModuleList``) inside the causal-LM model.
SUPPORTED_FAMILIES: dict[str, str] = {
    "opt": "model.decoder.layers",
    "llama": "model.layers",
    "qwen2": "model.layers",
    "mistral": "model.layers",
}

_OPT_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.out_proj": "rowwise",
    "fc1": "colwise",
    "fc2": "rowwise",
}

#: attributes of attention modules that count heads and must follow the shard.
_HEAD_COUNT_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads")


def family_of(model) -> str | None:
    """The engine's family key for an HF causal LM (``None`` when the engine does not serve it)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in SUPPORTED_FAMILIES else None


def decoder_layers(model) -> torch.nn.ModuleList:
    """The ``ModuleList`` of decoder layers of a supported HF causal LM.

    Raises:
        ValueError: the model's family is not supported.
    """
    family = family_of(model)
    if family is None:
        raise ValueError(f"hybrid engine does not serve model_type {model.config.model_type!r}")
    return model.get_submodule(SUPPORTED_FAMILIES[family])


def _layer_styles(model) -> dict[str, str]:
    """``{suffix inside a decoder layer: 'colwise'|'rowwise'}`` for ``model``'s family."""
    family = family_of(model)
    if family == "opt":
        return dict(_OPT_PLAN)
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    styles = {}
    for pattern, style in plan.items():
        if not pattern.startswith("layers.*."):
            continue
        styles[pattern[len("layers.*."):]] = style
    if not styles:
        raise ValueError(f"{type(model).__name__} config carries no base_model_tp_plan for its layers")
    unknown = {s for s in styles.values() if s not in ("colwise", "rowwise")}
    if unknown:
        raise ValueError(f"unsupported tensor-parallel styles {sorted(unknown)} in {type(model).__name__}'s plan")
    return styles


def check_tp_size(model, tp_size: int) -> None:
    """Raise ``ValueError`` unless every sharded dimension of ``model`` divides by ``tp_size``."""
    cfg = model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    ffn = getattr(cfg, "ffn_dim", None) or getattr(cfg, "intermediate_size", None)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads), ("ffn", ffn)):
        if value is not None and value % tp_size:
            raise ValueError(f"--inference_tp_size {tp_size} does not divide {name}={value}")


def tp_plan(model, tp_size: int) -> dict:
    """The ``parallelize_module`` plan for ``model`` (fqn patterns relative to the causal LM).

    Every style is built with ``src_data_rank=None``: the engine fills the shards itself, so
    sharding an empty skeleton needs no communication.

    Raises:
        ValueError: unsupported family, unknown style, or ``tp_size`` not dividing heads / FFN.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    check_tp_size(model, tp_size)
    layers_path = SUPPORTED_FAMILIES[family_of(model)]
    plan = {}
    for suffix, style in _layer_styles(model).items():
        plan[f"{layers_path}.*.{suffix}"] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    for style in plan.values():
        style.src_data_rank = None
    return plan


def shard_head_counts(model, tp_size: int) -> None:
    """Divide the head-count attributes of every attention module of ``model`` by ``tp_size``.

    HF attention modules reshape q/k/v with ``num_heads`` (OPT) or ``-1`` (Llama family); after
    column-parallel sharding each rank holds ``heads / tp_size`` heads, and the KV cache follows
    from the local key/value shapes.
    """
    for module in model.modules():
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
            continue
        for attr in _HEAD_COUNT_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int):
                setattr(module, attr, value // tp_size)
