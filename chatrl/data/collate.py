"""Collators: lists of token examples → padded ``(B, T)`` batches with masks from lengths, or packed
rows (:mod:`chatrl.packing`); an optimizer step's examples → its micro-batches (:class:`MicroBatches`).

Masks are built from each row's length, never by comparing ids with ``pad_token_id`` (OPT's
BOS equals its EOS, and a pad equal to EOS would hide the real end of an answer).

A packed batch holds ``"packed"`` (:class:`chatrl.packing.PackedRows`), its rows as ``"input_ids"``
``(R, W)`` and ``"attention_mask": None``: the forward helpers (:func:`chatrl.models.causal_lm.causal_lm_logits`,
:class:`chatrl.models.reward_model.RewardModel`) read the rows' positions and mask from ``"packed"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatrl.logprobs import IGNORE_INDEX
from chatrl.packing import micro_batch_groups, pack


def _as_ids(x) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.long)
    if t.ndim != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    return t


def pad_sequences(seqs: Sequence, pad_token_id: int, padding_side: str = "right"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad 1-D id sequences into ``(ids (B, T), attention_mask (B, T), starts (B,))``.

    ``T`` is the longest length; ``starts[b]`` is where row ``b``'s tokens begin (0 when right
    padded). The mask is 1 on real tokens, 0 on pads.

    Raises:
        ValueError: an empty batch, ``pad_token_id`` None, or an unknown ``padding_side``.
    """
    if pad_token_id is None:
        raise ValueError("pad_token_id is None: prepare the tokenizer with chatrl.models.causal_lm.prepare_tokenizer")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if not seqs:
        raise ValueError("cannot collate an empty batch")
    rows = [_as_ids(s) for s in seqs]
    lengths = torch.tensor([len(r) for r in rows])
    width = int(lengths.max())
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    starts = width - lengths if padding_side == "left" else torch.zeros_like(lengths)
    for b, r in enumerate(rows):
        s = int(starts[b])
        ids[b, s:s + len(r)] = r
        mask[b, s:s + len(r)] = 1
    return ids, mask, starts


class SFTCollator:
    """Phase-1 batches: ``input_ids (B, T)``, ``attention_mask (B, T)``, ``labels (B, T)``.

    ``labels`` equal ``input_ids`` (aligned: the model shifts them) with ``-100`` on pads and, when
    ``mask_prompt``, everywhere outside each row's trained spans: its ``trained_spans``
    ``[start_0, end_0, ...]`` (the answer, or every assistant turn of a conversation; each
    turn's end-of-turn token is a label), else the tokens after ``prompt_len``. Items are
    ``{"input_ids": (T_i,), "prompt_len": int, "trained_spans"?: (2S,)}``.
    """

    packs = False

    def __init__(self, pad_token_id: int, mask_prompt: bool = True, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.mask_prompt = mask_prompt
        self.padding_side = padding_side

    @staticmethod
    def lengths(item: dict) -> tuple[int]:
        """The token count of the one sequence an item contributes."""
        return (len(item["input_ids"]),)

    def __call__(self, batch: Sequence[dict]) -> dict[str, torch.Tensor]:
        ids, mask, starts = pad_sequences([x["input_ids"] for x in batch], self.pad_token_id, self.padding_side)
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        if self.mask_prompt:
            keep = torch.zeros_like(mask, dtype=torch.bool)
            for b, x in enumerate(batch):
                s = int(starts[b])
                for a, e in trained_spans(x):
                    keep[b, s + a:s + e] = True
            labels = labels.masked_fill(~keep, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trained_spans(item: dict) -> list[tuple[int, int]]:
    """The ``[start, end)`` token spans of a phase-1 item that carry labels: its ``trained_spans``
    (every assistant turn of a conversation) or everything after ``prompt_len``."""
    spans = item.get("trained_spans")
    spans = [int(v) for v in spans] if spans is not None else [int(item["prompt_len"]), len(item["input_ids"])]
    return list(zip(spans[::2], spans[1::2], strict=True))


class PairCollator:
    """Phase-2 batches: ``input_ids (2B, T)`` (the ``B`` chosen rows, then the ``B`` rejected rows)
    and ``attention_mask (2B, T)``. Items are ``{"chosen_input_ids", "rejected_input_ids", …}``."""

    packs = False

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    @staticmethod
    def lengths(item: dict) -> tuple[int, int]:
        """The token counts of a pair's two sequences (they stay in one micro-batch)."""
        return len(item["chosen_input_ids"]), len(item["rejected_input_ids"])

    def __call__(self, batch: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [x["chosen_input_ids"] for x in batch] + [x["rejected_input_ids"] for x in batch]
        ids, mask, _ = pad_sequences(seqs, self.pad_token_id, self.padding_side)
        return {"input_ids": ids, "attention_mask": mask}


class PackedSFTCollator(SFTCollator):
    """Phase-1 batches as packed rows: ``packed`` (the ``B`` sequences in order), ``input_ids`` its
    rows ``(R, W)``, ``attention_mask`` None and ``labels (R, W)``: each sequence's labels as
    :class:`SFTCollator` makes them (:func:`trained_spans`), its first token unlabelled (nothing of its own sequence
    predicts it), ``-100`` on the rows' trailing pads. ``row_tokens``: see :func:`chatrl.packing.pack`."""

    packs = True

    def __init__(self, pad_token_id: int, mask_prompt: bool = True, row_tokens: int = 0):
        super().__init__(pad_token_id, mask_prompt)
        self.row_tokens = row_tokens

    def __call__(self, batch: Sequence[dict]) -> dict:
        packed = pack([x["input_ids"] for x in batch], self.pad_token_id, self.row_tokens)
        labels = packed.input_ids.masked_fill(packed.seq_ids < 0, IGNORE_INDEX)
        for i, x in enumerate(batch):
            r, s, n = int(packed.row[i]), int(packed.start[i]), len(x["input_ids"])
            keep = torch.zeros(n, dtype=torch.bool)
            for a, e in (trained_spans(x) if self.mask_prompt else [(0, n)]):
                keep[a:e] = True
            keep[0] = False  # nothing of its own sequence predicts its first token
            labels[r, s:s + n] = labels[r, s:s + n].masked_fill(~keep, IGNORE_INDEX)
        return {"input_ids": packed.input_ids, "attention_mask": None, "labels": labels, "packed": packed}


class PackedPairCollator(PairCollator):
    """Phase-2 batches as packed rows: ``packed`` holds the ``B`` chosen sequences then the ``B``
    rejected ones (the order of :class:`PairCollator`'s rows), ``input_ids`` its rows, ``attention_mask`` None."""

    packs = True

    def __init__(self, pad_token_id: int, row_tokens: int = 0):
        super().__init__(pad_token_id)
        self.row_tokens = row_tokens

    def __call__(self, batch: Sequence[dict]) -> dict:
        packed = pack([x["chosen_input_ids"] for x in batch] + [x["rejected_input_ids"] for x in batch],
                      self.pad_token_id, self.row_tokens)
        return {"input_ids": packed.input_ids, "attention_mask": None, "packed": packed}


def to_device(batch: dict, device) -> dict:
    """``batch`` with its tensors and packed rows on ``device`` (``None`` and lists kept); a packed
    batch's ``input_ids`` stay its rows' ids."""
    out = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
    if out.get("packed") is not None:
        out["input_ids"] = out["packed"].input_ids
    return out


class MicroBatches:
    """One optimizer step's examples (a rank's) → its micro-batches, collated and on ``device``.

    Consecutive groups of ``per_micro_batch`` examples, or with ``max_tokens > 0`` consecutive
    groups of at most that many tokens, as many on every rank as the rank that needs most
    (:func:`chatrl.packing.micro_batch_groups`; ``all_reduce_max`` is the maximum over ranks, every
    rank calls it then). Tokens are counted as ``collate`` lays them out: summed when it packs
    (``collate.packs``), count × longest when it pads; an example's sequences come from
    ``collate.lengths(example)``. Each micro-batch holds ``sample_index`` ``(b,)`` when the examples
    carry theirs (:func:`chatrl.distributed.dist.seeded_loader` with ``collate=list``).
    """

    def __init__(self, collate, per_micro_batch: int, max_tokens: int, device, all_reduce_max=None):
        self.collate, self.per_micro_batch, self.max_tokens = collate, per_micro_batch, max_tokens
        self.device, self.all_reduce_max = device, all_reduce_max

    def __call__(self, examples: Sequence[dict]) -> list[dict]:
        groups = micro_batch_groups([self.collate.lengths(x) for x in examples], self.per_micro_batch,
                                    self.max_tokens, self.collate.packs, self.all_reduce_max)
        out = []
        for g in groups:
            part = [examples[i] for i in g]
            batch = to_device(self.collate(part), self.device)
            if part and "sample_index" in part[0]:  # from chatrl.distributed.dist.seeded_loader: the data accounting's
                batch["sample_index"] = torch.tensor([int(x["sample_index"]) for x in part], dtype=torch.long)
            out.append(batch)
        return out


class PromptCollator:
    """Phase-3 batches for generation: LEFT-padded ``input_ids (B, T)`` and ``attention_mask (B, T)``.
    Items are ``{"prompt_ids": (P_i,), "metadata": dict, "messages"?: list}``. With ``with_metadata``
    the batch also holds ``"metadata"``: the ``B`` rows' reward metadata dicts (a list, not a
    tensor), and ``"messages"``: their prompt turns (an environment's episodes start from them)."""

    def __init__(self, pad_token_id: int, with_metadata: bool = False):
        self.pad_token_id, self.with_metadata = pad_token_id, with_metadata

    def __call__(self, batch: Sequence[dict]) -> dict:
        ids, mask, _ = pad_sequences([x["prompt_ids"] for x in batch], self.pad_token_id, "left")
        out = {"input_ids": ids, "attention_mask": mask}
        if self.with_metadata:
            out["metadata"] = [dict(x.get("metadata") or {}) for x in batch]
            out["messages"] = [list(x.get("messages") or []) for x in batch]
        return out
