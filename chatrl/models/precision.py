"""Numerical precision: which dtype a run holds its weights in, and the layers that stay float32.

``--dtype auto`` picks bf16 where the device computes it natively and float32 elsewhere
(:func:`resolve_dtype`): a CUDA device that supports bf16, or a CPU with the AVX512-BF16 or AMX-BF16
instructions (``torch.cpu.get_capabilities()``). On CPUs without them torch emulates bf16
matrix products through float32 and gains nothing.

Float32 islands (``docs/precision.md`` lists every one): the maths that reads a distribution or a
scalar score promotes its inputs to at least float32 (:func:`chatrl.logprobs.float_dtype`). Two
layers are computed in float32 inside the model's forward, whatever its weights' dtype, by
:func:`compute_in_fp32`: the scalar head of the reward model and critic (always; it is one row,
and a bf16 score would keep 3 significant digits) and, with ``--fp32_lm_head``, the LM head of
the causal LMs (the sampler's and the trainer's logits then carry no bf16 rounding; the
vocabulary matrix is cast once per forward).

On CPU, attention is a third island (:func:`attention_implementation`): bf16 and fp16 models load
with :data:`FP32_SDPA`, torch's scaled-dot-product attention on float32 copies of the queries, keys
and values. Precision first: the sampler's KV-cache decoding and the trainer's full forward then
agree to float32 rounding in attention, which removes most of their bf16 log-prob gap at TP 1
(``docs/precision.md``). Speed on this CPU (``bench/attention_cpu.py``, forward + backward): for rows
of up to 256 tokens torch's flash kernel runs bf16 no faster than float32 (its backward slower at
small head widths), so there the island is 1.1-1.7x faster than bf16 SDPA; for rows of 512-1024
tokens bf16 SDPA is the faster and the island runs at 0.78-0.86x. CUDA devices keep the model's
attention in its dtype.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "fp32", "bf16", "fp16")
"""Values of ``--dtype``: ``auto`` resolves to ``bf16`` or ``fp32`` (:func:`resolve_dtype`)."""

FP32_SDPA = "chatrl_sdpa_fp32"
"""The attention implementation :func:`attention_implementation` gives low-precision models on CPU: transformers'
``sdpa`` computed on float32 copies of its inputs (registered with transformers by :func:`register_fp32_sdpa`)."""

FP32_ATTR = "_chatrl_fp32_forward"
"""Attribute set on a module whose forward :func:`compute_in_fp32` made float32."""


@functools.cache
def native_bf16(device_type: str | None = None) -> str | None:
    """Why this machine runs bf16 natively, or None when it does not.

    Args:
        device_type: ``"cuda"`` or ``"cpu"``; default: CUDA when a CUDA device is visible, else CPU.

    Returns:
        ``"CUDA device with bf16"``, ``"CPU with AMX-BF16"``, ``"CPU with AVX512-BF16"``, or None
        (a CUDA device without bf16, such as a V100; a CPU without those instructions).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        return "CUDA device with bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    if caps.get("amx_bf16"):
        return "CPU with AMX-BF16"
    if caps.get("avx512_bf16"):
        return "CPU with AVX512-BF16"
    return None


def resolve_dtype(name: str, device_type: str | None = None) -> tuple[str, str]:
    """The concrete ``--dtype`` for ``name`` and a one-line reason.

    ``auto`` gives ``bf16`` where :func:`native_bf16` says the device supports it, else ``fp32``;
    any other value is returned as it is.

    Returns:
        ``(dtype, reason)``, e.g. ``("bf16", "--dtype auto: CPU with AVX512-BF16")``; the reason is
        ``""`` for an explicit dtype.

    Raises:
        ValueError: a name outside :data:`DTYPE_CHOICES`.
    """
    if name not in DTYPE_CHOICES:
        raise ValueError(f"--dtype must be one of {DTYPE_CHOICES}, got {name!r}")
    if name != "auto":
        return name, ""
    why = native_bf16(device_type)
    if why is not None:
        return "bf16", f"--dtype auto: {why}"
    where = "this CUDA device" if (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda" \
        else "this CPU"
    return "fp32", f"--dtype auto: {where} has no native bf16"


def _sdpa_in_fp32(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention on float32 copies of ``query`` ``(B, H, L, D)``, ``key`` and ``value``
    ``(B, H_kv, L_kv, D)`` (grouped-query heads repeated by transformers), and of a floating
    ``attention_mask`` (a boolean one is used as it is); the output ``(B, L, H, D)`` is cast back to
    ``query``'s dtype. Softmax, scores and the weighted sum are all
    float32, in the forward and the backward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


@functools.cache
def register_fp32_sdpa() -> str:
    """Register :data:`FP32_SDPA` with transformers' attention and mask interfaces (once per process;
    its masks are SDPA's); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FP32_SDPA, _sdpa_in_fp32)
    AttentionMaskInterface.register(FP32_SDPA, sdpa_mask)
    return FP32_SDPA


def attention_implementation(dtype: str, device_type: str | None = None) -> str | None:
    """The attention a model of weights ``dtype`` loads with on ``device_type``; None: transformers' default.

    :data:`FP32_SDPA` for ``bf16`` and ``fp16`` weights on CPU (registered here; the module
    docstring says why), None elsewhere (CUDA, or float32 weights).

    Args:
        dtype: ``fp32`` | ``bf16`` | ``fp16`` (resolved: not ``auto``).
        device_type: ``"cuda"`` or ``"cpu"``; default: CUDA when a CUDA device is visible, else CPU
            (the device chatrl's programs run on).

    Raises:
        ValueError: ``dtype`` is not a resolved dtype.
    """
    if dtype not in DTYPE_CHOICES or dtype == "auto":
        raise ValueError(f"attention_implementation: dtype must be fp32, bf16 or fp16, got {dtype!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype in ("bf16", "fp16") and device_type == "cpu":
        return register_fp32_sdpa()
    return None


def attention_kwargs(dtype: str, device_type: str | None = None) -> dict:
    """``from_pretrained`` keyword arguments for :func:`attention_implementation`: ``{}`` or
    ``{"attn_implementation": name}``."""
    name = attention_implementation(dtype, device_type)
    return {} if name is None else {"attn_implementation": name}


def _fp32_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    bias = getattr(self, "bias", None)
    return F.linear(x.float(), self.weight.float(), None if bias is None else bias.float())


def compute_in_fp32(module: torch.nn.Module) -> torch.nn.Module:
    """Make ``module`` (an ``nn.Linear``: an LM head or a scalar head) compute in float32, in place.

    Its forward becomes ``F.linear(x.float(), W.float(), b.float())``: float32 outputs from
    weights held in any dtype; gradients flow back to the weights in their own dtype. Only the
    instance's ``forward`` is replaced, so hooks on the module (DeepSpeed ZeRO-3's parameter
    gathers, peft's) run as before, and ``copy.deepcopy`` carries it. A no-op for float32 weights
    (``.float()`` returns the tensor itself). Returns ``module``.

    Raises:
        TypeError: ``module`` is not an ``nn.Linear``.
    """
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"compute_in_fp32: expected an nn.Linear, got {type(module).__name__}")
    module.forward = types.MethodType(_fp32_linear_forward, module)
    setattr(module, FP32_ATTR, True)
    return module


def computes_in_fp32(module: torch.nn.Module | None) -> bool:
    """Whether :func:`compute_in_fp32` was applied to ``module``."""
    return bool(getattr(module, FP32_ATTR, False))
