"""Tiny, randomly initialised causal LMs for tests, benchmarks and the offline demo.

The models are real Hugging Face architectures (OPT, Llama, Qwen2) with a real tokenizer read from a
local folder (``../shared/tokenizers`` in this repository's layout), so every code path that serves a
13B model serves them too. They are written as ordinary HF folders that
``AutoModelForCausalLM.from_pretrained`` loads.

``scripts/make_tiny_models.py`` is the command-line front of :func:`make_tiny_model`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from chatrl.models.causal_lm import prepare_tokenizer, vocab_size_for

FAMILIES = ("opt", "llama", "qwen2")


@dataclass(frozen=True)
class TinySpec:
    """Size of a tiny model. ``ffn`` is the MLP width; ``heads`` must divide ``hidden``."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None
    ffn: int = 256
    max_positions: int = 512
    dropout: float = 0.0


def default_tokenizer_dir(family: str) -> Path:
    """The shared tokenizer each family uses by default: GPT-2 BPE for OPT/Llama, Qwen2 BPE for Qwen2."""
    shared = Path(os.environ.get("CHATRL_SHARED", Path(__file__).resolve().parents[3] / "shared"))
    return shared / "tokenizers" / ("qwen2" if family == "qwen2" else "gpt2")


def make_tiny_model(
    family: str,
    out_dir: str | os.PathLike,
    spec: TinySpec = TinySpec(),
    tokenizer_dir: str | os.PathLike | None = None,
    seed: int = 0,
):
    """Write a randomly initialised ``family`` model and its tokenizer to ``out_dir``.

    The tokenizer gets a pad token distinct from EOS (see :func:`chatrl.models.causal_lm.prepare_tokenizer`)
    and the vocabulary is padded to a multiple of 8.

    Args:
        family: one of ``opt``, ``llama``, ``qwen2``.
        out_dir: folder to create; an existing non-empty folder raises ``FileExistsError``.
        spec: sizes.
        tokenizer_dir: a local tokenizer folder; defaults to :func:`default_tokenizer_dir`.
        seed: torch seed for the initial weights.

    Returns:
        ``(model, tokenizer)`` as written.

    Raises:
        ValueError: unknown family. FileExistsError: ``out_dir`` holds files already.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )


    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; refusing to overwrite it")
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or default_tokenizer_dir(family)))
    prepare_tokenizer(tok)
    vocab = vocab_size_for(tok)
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=bos,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    if family == "opt":
        cfg = OPTConfig(
            ffn_dim=spec.ffn,
            word_embed_proj_dim=spec.hidden,
            dropout=spec.dropout,
            attention_dropout=spec.dropout,
            do_layer_norm_before=True,
            **common,
        )
        model = OPTForCausalLM(cfg)
    else:
        cls_cfg, cls_model = (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
        cfg = cls_cfg(
            intermediate_size=spec.ffn,
            num_key_value_heads=spec.kv_heads or spec.heads,
            attention_dropout=spec.dropout,
            **common,
        )
        model = cls_model(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = bos
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return model, tok
