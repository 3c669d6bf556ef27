"""DPO batches: the phase-2 preference pairs of :mod:`chatrl.data`, with answer masks and row indices.

A batch holds the ``B`` chosen rows then the ``B`` rejected rows in one ``(2B, T)`` tensor (one
forward pass for both sides), as :class:`chatrl.data.PairCollator` does for the reward model, plus
an answer mask built from each row's length and its ``prompt_len`` (never from token ids) and the
pairs' indices in the data set (the key of precomputed reference log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chatrl.data.collate import pad_sequences


class IndexedPairs(torch.utils.data.Dataset):
    """A phase-2 data set whose items also carry ``"index"``, their position in it."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        return {**self.pairs[i], "index": i}


class DPOCollator:
    """Items ``{"chosen_input_ids", "rejected_input_ids", "prompt_len", "index"?}`` → a batch of

    * ``input_ids (2B, T)``, ``attention_mask (2B, T)``: chosen rows, then rejected rows;
    * ``answer_mask (2B, T)``: 1 on each row's answer tokens (after its ``prompt_len`` prompt
      tokens, EOS included), 0 on prompt tokens and pads;
    * ``index (B,)``: the pairs' ``index`` fields (``-1`` when absent).

    Raises:
        ValueError: an empty batch or an unknown ``padding_side`` (from ``pad_sequences``).
    """

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, batch: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [x["chosen_input_ids"] for x in batch] + [x["rejected_input_ids"] for x in batch]
        ids, mask, starts = pad_sequences(seqs, self.pad_token_id, self.padding_side)
        answer = mask.clone()
        prompt_lens = [int(x["prompt_len"]) for x in batch] * 2
        for row, (s, p) in enumerate(zip(starts.tolist(), prompt_lens, strict=True)):
            answer[row, s:s + p] = 0
        index = torch.tensor([int(x.get("index", -1)) for x in batch], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": mask, "answer_mask": answer, "index": index}


def split_pairs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2B, …)`` values of a :class:`DPOCollator` batch → ``(chosen (B, …), rejected (B, …))``."""
    b = t.shape[0] // 2
    return t[:b], t[b:]
