"""The decode loop of the hybrid engine: prefill once, then one token per step from a KV cache.

It reproduces Hugging Face ``generate`` for decoder-only models (same position ids from the
attention mask, same logits processing: min-new-tokens, temperature, top-k, top-p; greedy takes the
argmax, sampling draws with ``torch.multinomial``) and adds what the layout needs:

* the model body runs on the whole tensor-parallel group's batch (prompts gathered from every rank
  of the group), the LM head's vocabulary shards are exchanged so that each rank gets full logits
  for its own rows only, and each rank picks its own tokens;
* one small all-gather per step shares the picked tokens and "finished" flags within the group;
  nothing crosses groups, so groups stop independently and a rank never waits for another group;
* keys and values are written into buffers preallocated for ``prompt + max_new_tokens`` positions
  (transformers' ``DynamicCache`` concatenates, copying the whole cache every step); where the model
  attends in float32 on bf16 or fp16 weights (:data:`chatrl.models.precision.FP32_SDPA`), the buffers are
  float32, so that attention reads the cache as it is instead of converting all of it in every layer
  at every step (the same values: the conversion is exact);
* on CPU, bf16 linear layers decode with their weights reordered once per :func:`decode` call into
  oneDNN's blocked layout (:class:`PrepackedLinears`) instead of at every product, where that gives
  the same bits as ``F.linear`` (checked once per weight shape in the process).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from chatrl.logprobs import logprobs_from_logits, sampling_filter
from chatrl.models.precision import FP32_SDPA, computes_in_fp32

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationSettings:
    """How to pick tokens; the semantics are those of HF ``generate``.

    ``top_k=0`` and ``top_p=1.0`` disable those filters; ``eos_token_ids`` empty means no EOS;
    ``min_new_tokens`` masks EOS until that many tokens are out.
    """

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    min_new_tokens: int = 0


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer writing into buffers of ``capacity`` positions and returning views of them.

    Keys and values have shape ``(batch, local_heads, positions, head_dim)``; head counts come from
    the first update, so a tensor-parallel shard caches only its own heads. ``store_dtype``: the
    buffers' dtype (default: the keys'); float32 for a model whose attention converts keys and values
    to float32 anyway (:func:`make_cache`), which then reads them without a copy.
    """

    def __init__(self, capacity: int, store_dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity = capacity
        self.store_dtype = store_dtype
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the key and value buffers from the first update's shapes, dtype (or ``store_dtype``) and device."""
        self.dtype, self.device = self.store_dtype or key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._k = key_states.new_empty(b, h, self.capacity, d, dtype=self.dtype)
        self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1], dtype=self.dtype)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new keys and values after the cached ones; returns views of everything cached so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} positions > capacity {self.capacity}")
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions cached so far."""
        return self.length


def make_cache(config, capacity: int) -> Cache:
    """A KV cache for ``capacity`` positions; HF's ``DynamicCache`` when a sliding window would bite.

    A model that attends with :data:`chatrl.models.precision.FP32_SDPA` (bf16 or fp16 weights on CPU) gets
    float32 buffers: its attention computes on float32 copies of the keys and values, so storing them
    converted once (exactly) saves converting the whole cache in every layer at every step.
    """
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and capacity > window:
        return DynamicCache(config=config)
    store = torch.float32 if getattr(config, "_attn_implementation", None) == FP32_SDPA else None
    return Cache(layers=[PreallocatedLayer(capacity, store) for _ in range(config.num_hidden_layers)])


def cache_keyword(body: torch.nn.Module) -> str:
    """The keyword by which ``body`` (an HF model's decoder stack, ``model.model``) takes its KV cache.

    transformers 5 (5.24 here) renamed ``past_key_values`` to ``cache`` in the models' ``forward``
    (the old name still works with a ``FutureWarning`` until its removal in 5.40, after which it
    would fall into ``**kwargs`` and be ignored: no cache, wrong tokens); earlier 5.x releases and
    remote-code models take ``past_key_values``. Read from the signature, so every release of the
    supported range gets the name it reads.
    """
    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


def process_logits(logits: torch.Tensor, s: GenerationSettings, step: int) -> torch.Tensor:
    """Scores after HF's processors: EOS masked before ``min_new_tokens``, then the sampling warpers.

    Args:
        logits: ``(rows, vocab)`` fp32 logits of the current step. step: index of the new token (0-based).
    """
    scores = logits
    if step < s.min_new_tokens and s.eos_token_ids:
        scores = scores.clone()
        scores[:, list(s.eos_token_ids)] = -float("inf")
    if not s.do_sample:
        return scores
    if s.temperature != 1.0:
        scores = scores / s.temperature
    return sampling_filter(scores, s.top_k, s.top_p)


def pick_tokens(scores: torch.Tensor, s: GenerationSettings, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(rows,)`` next tokens from processed ``scores``: argmax, or a draw from their softmax."""
    if not s.do_sample:
        return scores.argmax(dim=-1)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


class TPGroup:
    """This rank's tensor-parallel group: ``size`` ranks, this one at ``index`` (``group`` None for TP 1)."""

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.index = dist.get_rank(group) if group is not None else 0

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """``t`` from every rank of the group, in rank order (``[t]`` for a group of one)."""
        if self.size == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out


@dataclass
class GroupBatch:
    """The group's prompts stacked: rows ``[row_start, row_start + rows)`` belong to this rank."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_start: int
    rows: int
    left_extra: int
    counts: tuple[int, ...] = ()


def gather_prompts(input_ids, attention_mask, group: TPGroup, pad_token_id: int, max_new_tokens: int) -> GroupBatch:
    """All-gather left-padded prompts within the group, padding to a common width and row count.

    Extra left padding changes nothing (positions come from the mask). A rank with a smaller batch
    sends filler rows so that the gather has one shape; they are dropped on arrival.

    Raises:
        ValueError: ranks of the group disagree on ``max_new_tokens`` (their outputs must share a shape).
    """
    b, p = input_ids.shape
    if group.size == 1:
        return GroupBatch(input_ids, attention_mask, 0, b, 0, (b,))
    meta = torch.tensor([b, p, max_new_tokens], dtype=torch.long, device=input_ids.device)
    metas = torch.stack(group.all_gather(meta)).tolist()
    if len({m[2] for m in metas}) != 1:
        raise ValueError(f"ranks of a tensor-parallel group asked for different max_new_tokens: {metas}")
    max_b, max_p = max(m[0] for m in metas), max(m[1] for m in metas)
    ids = input_ids.new_full((max_b, max_p), pad_token_id)
    mask = attention_mask.new_zeros((max_b, max_p))
    ids[:b, max_p - p:] = input_ids
    mask[:b, max_p - p:] = attention_mask
    mask[b:, -1] = 1
    all_ids = group.all_gather(ids)
    all_mask = group.all_gather(mask)
    keep = [torch.arange(m[0]) + i * max_b for i, m in enumerate(metas)]
    rows = torch.cat(keep).to(input_ids.device)
    start = sum(m[0] for m in metas[:group.index])
    counts = tuple(m[0] for m in metas)
    return GroupBatch(torch.cat(all_ids)[rows], torch.cat(all_mask)[rows], start, b, max_p - p, counts)


#: ``(out_features, in_features, rows) → bool``: whether oneDNN's product with a reordered bf16 weight
#: gave exactly ``F.linear``'s bits for that shape on this machine (checked at its first use).
_PACKED_EQUAL: dict[tuple[int, int, int], bool] = {}


def can_prepack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` may be reordered for oneDNN: a whole (not ZeRO-3-partitioned) bf16 matrix on
    CPU, with torch's oneDNN linear ops present."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and not hasattr(weight, "ds_id") and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedWeight:
    """A bf16 matrix ``(out, in)`` reordered once into oneDNN's layout for products with ``rows`` rows.

    ``linear(x)`` equals ``F.linear(x, weight, bias)`` bit for bit: an ``x`` of another row count, or of
    a weight shape whose first product differed from ``F.linear``'s on this machine, takes
    ``F.linear`` itself. Why: torch's bf16 ``F.linear`` on CPU hands oneDNN the plain weight, which it
    re-blocks at every product; for the few rows of a decoding step that costs about as much as the
    product (SmolLM2's 576 × 1536 layer, 8 rows, one core: 0.41 → 0.29 ms; its 49,160-row LM head
    18 → 10 ms; ``bench/decode_floor.py``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
        self.weight, self.bias, self.rows = weight, bias, rows
        self.key = (weight.shape[0], weight.shape[1], rows)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight, bias)``, through the reordered weight where that is the same."""
        if x.numel() != self.rows * x.shape[-1] or x.dtype != torch.bfloat16:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        equal = _PACKED_EQUAL.get(self.key)
        if equal is False:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if equal is None:
            plain = torch.nn.functional.linear(x, self.weight, self.bias)
            _PACKED_EQUAL[self.key] = equal = torch.equal(out, plain)
            if not equal:
                log.info("decode: oneDNN's reordered bf16 product differs from F.linear for %s; F.linear kept",
                         self.key)
                return plain
        return out


class PrepackedLinears(contextlib.AbstractContextManager):
    """Inside the block, every plain ``torch.nn.Linear`` of ``module`` with a whole bf16 weight on CPU
    computes through a :class:`PackedWeight` for ``rows`` rows (reordered on entry; the weights are
    read as they are then, so enter after any weight update). Other modules (LoRA layers, ZeRO-3
    partitions, fp32 or GPU weights) are left alone. The reordered copies are dropped on exit."""

    def __init__(self, module: torch.nn.Module, rows: int):
        self.modules = [m for m in module.modules() if type(m) is torch.nn.Linear and can_prepack(m.weight)]
        self.rows = rows

    def __enter__(self):
        for m in self.modules:
            m.forward = PackedWeight(m.weight, m.bias, self.rows).linear
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.__dict__.pop("forward", None)
        return False


def head_weight(head: torch.nn.Module) -> torch.Tensor:
    """The matrix the LM head multiplies by while decoding: its weight, or a float32 copy of it when
    the head computes in float32 (``--fp32_lm_head``, :func:`chatrl.models.precision.compute_in_fp32`),
    made once per :func:`decode` call rather than once per token."""
    return head.weight.float() if computes_in_fp32(head) else head.weight


def project_head(head: torch.nn.Module, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                 packed: PackedWeight | None = None) -> torch.Tensor:
    """``head(hidden)`` for the last positions, ``(rows, vocab shard)``, in ``weight``'s dtype.

    ``weight``: the head's matrix (:func:`head_weight`; default ``head.weight``); ``hidden`` is cast
    to its dtype, so a float32 matrix gives float32 logits from a bf16 body, as the training
    forward's float32 head does. On a CPU with a few rows of an fp32 matrix, ``W @ hᵀ`` streams the
    large vocabulary matrix once in the layout the BLAS prefers and runs faster than ``h @ Wᵀ``; a bf16
    matrix is the other way round, so it keeps ``h @ Wᵀ``, HF's form (4 rows, 512 × 50272, one EPYC
    core: fp32 11.4 ms as ``W @ hᵀ`` against 20.6 ms; bf16 7.0–8.4 ms as ``h @ Wᵀ`` against 10.6–12.0 ms;
    ``bench/results/decode_floor_rows4_2026-12-02.json``). The forms differ only in summation order.
    ``packed``: the same bf16 matrix reordered for oneDNN (:class:`PackedWeight`, the same bits).
    """
    weight = head.weight if weight is None else weight
    hidden = hidden.to(weight.dtype)
    if packed is not None and packed.weight is weight:
        return packed.linear(hidden)
    bias = getattr(head, "bias", None)
    if hidden.device.type == "cpu" and bias is None and hidden.shape[0] <= 8 and weight.dtype == torch.float32:
        return torch.mm(weight, hidden.t()).t()
    return torch.nn.functional.linear(hidden, weight, None if bias is None else bias.to(weight.dtype))


def _own_logits(head_out: torch.Tensor, batch: GroupBatch, group: TPGroup) -> torch.Tensor:
    """Full-vocabulary fp32 logits for this rank's rows from each rank's vocabulary shard of all rows."""
    if group.size == 1:
        return head_out.float()
    shards = group.all_gather(head_out)
    own = slice(batch.row_start, batch.row_start + batch.rows)
    return torch.cat([s[own] for s in shards], dim=-1).float()


@torch.no_grad()
def decode(model, batch: GroupBatch, s: GenerationSettings, group: TPGroup, *,
           generator: torch.Generator | None = None, keep_logits: bool = False, keep_logprobs: bool = False):
    """Generate for the group's batch; return this rank's rows.

    Args:
        model: an HF causal LM (``.model`` body, ``.lm_head``), possibly tensor-parallel over ``group``.
        batch: the group's left-padded prompts (:func:`gather_prompts`).
        s: generation settings. generator: RNG for sampling (global RNG when ``None``).
        keep_logits: also return the raw per-step logits of this rank's rows.
        keep_logprobs: also return the sampler's log-prob of every sampled token under the
            distribution it was drawn from: the log-softmax of the processed fp32 scores (after
            temperature, top-k and top-p; greedy: the raw logits), by the training forward's formula
            (:func:`chatrl.logprobs.logprobs_from_logits`), for ``rollout/logp_diff``.

    Returns:
        ``(tokens, logits)``: ``tokens`` ``(rows, max_new_tokens)`` with ``pad_token_id`` after EOS
        and after the group stopped; ``logits`` ``(rows, steps, vocab)`` fp32, or ``None``. With
        ``keep_logprobs``, a third item ``(rows, max_new_tokens)`` fp32 (0 after the stop).
    """
    ids, mask = batch.input_ids, batch.attention_mask
    n_rows, width = ids.shape
    own = slice(batch.row_start, batch.row_start + batch.rows)
    device = ids.device
    full_mask = torch.cat([mask, mask.new_ones(n_rows, s.max_new_tokens)], dim=1)
    position = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache = make_cache(model.config, width + s.max_new_tokens)
    eos = torch.tensor(s.eos_token_ids, dtype=torch.long, device=device)
    out = ids.new_full((batch.rows, s.max_new_tokens), s.pad_token_id)
    kept = []
    logprobs = torch.zeros(batch.rows, s.max_new_tokens, dtype=torch.float32, device=device) if keep_logprobs else None
    finished = torch.zeros(n_rows, dtype=torch.bool, device=device)
    body_in = dict(input_ids=ids, position_ids=position)
    weight = head_weight(model.lm_head)
    cached = {cache_keyword(model.model): cache}
    packed_head = None
    with contextlib.ExitStack() as packs:
        for step in range(s.max_new_tokens):
            if step == 1:  # the decoding steps' products: n_rows rows each (the prefill's keep F.linear)
                packs.enter_context(PrepackedLinears(model.model, n_rows))
                if can_prepack(weight) and getattr(model.lm_head, "bias", None) is None:
                    packed_head = PackedWeight(weight, None, n_rows)
            hidden = model.model(attention_mask=full_mask[:, :width + step], use_cache=True, **cached,
                                 **body_in).last_hidden_state[:, -1]
            logits = _own_logits(project_head(model.lm_head, hidden, weight, packed_head), batch, group)
            if keep_logits:
                kept.append(logits)
            scores = process_logits(logits, s, step)
            tokens = pick_tokens(scores, s, generator)
            tokens = torch.where(finished[own], torch.full_like(tokens, s.pad_token_id), tokens)
            if logprobs is not None:
                logprobs[:, step] = logprobs_from_logits(scores[:, None], tokens[:, None]).squeeze(1)
            done = finished[own] | (torch.isin(tokens, eos) if eos.numel() else torch.zeros_like(finished[own]))
            out[:, step] = tokens
            all_tokens, finished = _share(tokens, done, batch, group)
            if bool(finished.all()) or step == s.max_new_tokens - 1:
                break
            position = position[:, -1:] + 1
            body_in = dict(input_ids=all_tokens[:, None], position_ids=position)
    logits = torch.stack(kept, dim=1) if keep_logits else None
    return (out, logits, logprobs) if keep_logprobs else (out, logits)


def _share(tokens, done, batch: GroupBatch, group: TPGroup):
    """Tokens and finished flags of every row of the group (one small all-gather per step)."""
    if group.size == 1:
        return tokens, done
    packed = torch.stack([tokens, done.long()])
    width = max(batch.counts)
    if width > packed.shape[1]:
        packed = torch.cat([packed, packed.new_zeros(2, width - packed.shape[1])], dim=1)
    parts = group.all_gather(packed)
    merged = torch.cat([p[:, :n] for p, n in zip(parts, batch.counts, strict=True)], dim=1)
    return merged[0], merged[1].bool()
