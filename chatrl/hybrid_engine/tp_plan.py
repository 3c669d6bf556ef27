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

from chatrl.errors import UsageError

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


def _sharded_sizes(cfg) -> dict[str, int]:
    """The dimensions the tensor-parallel plan splits: query heads, key/value heads, FFN width."""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    ffn = getattr(cfg, "ffn_dim", None) or getattr(cfg, "intermediate_size", None)
    return {k: v for k, v in (("query heads", heads), ("key/value heads", kv_heads), ("FFN width", ffn))
            if v is not None}


def tp_sizes_that_work(cfg, largest: int = 64) -> list[int]:
    """TP sizes up to ``largest`` that split every sharded dimension of a model config evenly (each
    rank then holds whole heads: a grouped-query model with 9 query and 3 key/value heads takes 1 or 3)."""
    sizes = _sharded_sizes(cfg)
    return [t for t in range(1, largest + 1) if all(v % t == 0 for v in sizes.values())]


def tp_size_problem(cfg, tp_size: int) -> str | None:
    """Why ``--inference_tp_size tp_size`` cannot shard a model of config ``cfg`` (one line naming the
    dimensions it does not divide and the sizes that work), or None when it can."""
    bad = [f"{v} {k}" for k, v in _sharded_sizes(cfg).items() if v % tp_size]
    if not bad:
        return None
    return (f"--inference_tp_size {tp_size} does not divide the model's {' and '.join(bad)} (each rank of a "
            f"tensor-parallel group holds whole heads); TP sizes that work: "
            f"{', '.join(map(str, tp_sizes_that_work(cfg)))}")


def check_inference_tp(path: str, tp_size: int, trust_remote_code: bool = False) -> None:
    """Check ``--inference_tp_size`` against the actor's config at ``path`` before any model loads.

    Raises:
        UsageError: :func:`tp_size_problem`'s line, naming the model.
    """
    from transformers import AutoConfig

    problem = tp_size_problem(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), tp_size)
    if problem:
        raise UsageError(f"{problem} ({path})")


def check_tp_size(model, tp_size: int) -> None:
    """Raise ``ValueError`` (:func:`tp_size_problem`'s line) unless every sharded dimension of ``model``
    divides by ``tp_size``."""
    problem = tp_size_problem(model.config, tp_size)
    if problem:
        raise ValueError(problem)


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
