"""Shared fixtures: offline hub, paths to ../shared, and tiny models built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))
DATA = SHARED / "data"
TOKENIZERS = SHARED / "tokenizers"
STORIES = SHARED / "models" / "stories260K"


@pytest.fixture(scope="session")
def shared() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"offline assets not found at {SHARED} (set CHATRL_SHARED)")
    return SHARED


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, shared) -> dict[str, Path]:
    """Tiny random OPT and Llama folders (hidden 64, 2 layers, 4 heads, GPT-2 BPE + pad)."""
    from chatrl.models.tiny import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for family in ("opt", "llama"):
        make_tiny_model(family, root / family, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
        out[family] = root / family
    return out


@pytest.fixture(scope="session")
def tiny_opt(tiny_models) -> Path:
    return tiny_models["opt"]


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, shared) -> Path:
    """A tiny random Qwen2 (hidden 64, 2 layers, 4 heads, Qwen2 BPE with its chat template)."""
    from chatrl.models.tiny import TinySpec, make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "qwen2"
    make_tiny_model("qwen2", out, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
    return out


def forget_process_group() -> None:
    """Destroy the one-rank process group an in-process main started, and DeepSpeed's cached clone of its
    world group (``deepspeed.utils.groups._WORLD_GROUP``), which would otherwise name a destroyed group
    when a later module starts a main in the same process ("Group ... is not registered")."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    try:
        from deepspeed.utils import groups
    except ImportError:
        return
    groups._WORLD_GROUP = None
