"""Collators: lists of token examples → padded ``(B, T)`` batches with masks from lengths.

Masks are built from each row's length, never by comparing ids with ``pad_token_id`` (OPT's
BOS equals its EOS, and a pad equal to EOS would hide the real end of an answer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatrl.logprobs import IGNORE_INDEX


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
        raise ValueError("pad_token_id is None: prepare the tokenizer with chatrl.models.prepare_tokenizer")
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

    def __init__(self, pad_token_id: int, mask_prompt: bool = True, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.mask_prompt = mask_prompt
        self.padding_side = padding_side

    def __call__(self, batch: Sequence[dict]) -> dict[str, torch.Tensor]:
        ids, mask, starts = pad_sequences([x["input_ids"] for x in batch], self.pad_token_id, self.padding_side)
        labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
        if self.mask_prompt:
            keep = torch.zeros_like(mask, dtype=torch.bool)
            for b, x in enumerate(batch):
                s = int(starts[b])
                spans = x.get("trained_spans")
                spans = [int(v) for v in spans] if spans is not None else [int(x["prompt_len"]), len(x["input_ids"])]
                for a, e in zip(spans[::2], spans[1::2], strict=True):
                    keep[b, s + a:s + e] = True
            labels = labels.masked_fill(~keep, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PairCollator:
    """Phase-2 batches: ``input_ids (2B, T)`` (the ``B`` chosen rows, then the ``B`` rejected rows)
    and ``attention_mask (2B, T)``. Items are ``{"chosen_input_ids", "rejected_input_ids", …}``."""

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, batch: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [x["chosen_input_ids"] for x in batch] + [x["rejected_input_ids"] for x in batch]
        ids, mask, _ = pad_sequences(seqs, self.pad_token_id, self.padding_side)
        return {"input_ids": ids, "attention_mask": mask}


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
