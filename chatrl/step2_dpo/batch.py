"""DPO batches: the phase-2 preference pairs of :mod:`chatrl.data`, with answer masks and row indices.

A batch holds the ``B`` chosen rows then the ``B`` rejected rows in one ``(2B, T)`` tensor (one
forward pass for both sides), as :class:`chatrl.data.PairCollator` does for the reward model, plus
an answer mask built from each row's length and its ``prompt_len`` (never from token ids) and the
pairs' indices in the data set (the key of precomputed reference log-probs). With ``--packing`` the
``2B`` sequences are laid end to end in rows instead (:class:`PackedDPOCollator`); either batch's
answer log-probs come from :func:`batch_answer_logps`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from chatrl.data.collate import PackedPairCollator, PairCollator, pad_sequences, to_device
from chatrl.logprobs import token_logprobs
from chatrl.models.causal_lm import token_logits_at


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

    packs = False
    lengths = staticmethod(PairCollator.lengths)

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


class PackedDPOCollator(PackedPairCollator):
    """:class:`DPOCollator`'s pairs as packed rows: :class:`chatrl.data.collate.PackedPairCollator`'s
    batch (``packed``: the ``B`` chosen sequences then the ``B`` rejected ones; ``input_ids`` its rows,
    ``attention_mask`` None) with ``prompt_len (2B,)`` and ``index (B,)``. ``row_tokens``: see
    :func:`chatrl.packing.pack`."""

    def __call__(self, batch: Sequence[dict]) -> dict:
        out = super().__call__(batch)
        out["prompt_len"] = torch.tensor([int(x["prompt_len"]) for x in batch] * 2, dtype=torch.long)
        out["index"] = torch.tensor([int(x.get("index", -1)) for x in batch], dtype=torch.long)
        return out


def batch_answer_logps(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps (2B,), n_tokens (2B,))``: the summed log-probability of each answer of a DPO batch
    under ``model`` (padded or packed: the same numbers) and its token count; differentiable.

    The LM head runs on the ``M`` positions that predict an answer token only
    (:func:`chatrl.models.causal_lm.token_logits_at`): a pair's prompt, most of its tokens on chat data, needs
    no vocabulary projection, so the step's largest matmul shrinks with it; the log-probs are taken a
    few positions at a time (:func:`chatrl.logprobs.token_logprobs`) for bf16 logits, never as an ``(M, V)``
    float32 copy. The numbers are :func:`chatrl.step2_dpo.loss.answer_logps` over full logits,
    padded or packed (``tests/unit/test_dpo_loss.py``); a sequence's first token is never scored
    (nothing predicts it).
    """
    b = to_device(batch, device)
    packed = b.get("packed")
    if packed is not None:
        first = torch.minimum(b["prompt_len"].to(packed.length).clamp(min=1), packed.length)  # first answer token
        slots = packed.slots(first - 1, packed.length - first)  # the positions that predict the answer tokens
        rows, cols, seq, n, ids = slots.rows, slots.cols, slots.seq, packed.n_seqs, packed.input_ids
    else:
        rows, cols = b["answer_mask"][:, 1:].nonzero(as_tuple=True)
        seq, n, ids = rows, b["input_ids"].shape[0], b["input_ids"]
    logits = token_logits_at(model, rows, cols, b["input_ids"], b["attention_mask"], packed)
    targets = ids[rows, cols + 1]
    if logits.dtype == torch.float32:  # fp32 logits: the log-softmax as always (the same bits as earlier runs)
        token_logp = -F.cross_entropy(logits, targets, reduction="none")
    else:  # a few positions at a time: no (M, V) float32 copy of bf16 logits
        token_logp = token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0)).squeeze(0)
    return token_logp.new_zeros(n).index_add(0, seq, token_logp), torch.bincount(seq, minlength=n)


def split_pairs(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2B, …)`` values of a :class:`DPOCollator` batch → ``(chosen (B, …), rejected (B, …))``."""
    b = t.shape[0] // 2
    return t[:b], t[b:]
