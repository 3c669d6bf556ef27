"""Collators: exact padded tensors, masks from lengths, prompt-masked labels."""

from __future__ import annotations

import torch

from chatrl.data import PairCollator, PromptCollator, SFTCollator

P = 8  # a pad id that also occurs as a real token: masks must come from lengths
T = torch.tensor


def sft_batch():
    return [{"input_ids": T([5, 6, 7, 8]), "prompt_len": 2}, {"input_ids": T([9, 8]), "prompt_len": 1}]


def test_sft_right_padding_masks_prompt_and_pads():
    out = SFTCollator(P)(sft_batch())
    assert torch.equal(out["input_ids"], T([[5, 6, 7, 8], [9, 8, P, P]]))
    assert torch.equal(out["attention_mask"], T([[1, 1, 1, 1], [1, 1, 0, 0]]))
    assert torch.equal(out["labels"], T([[-100, -100, 7, 8], [-100, 8, -100, -100]]))


def test_sft_left_padding_and_unmasked_prompt():
    out = SFTCollator(P, padding_side="left")(sft_batch())
    assert torch.equal(out["input_ids"], T([[5, 6, 7, 8], [P, P, 9, 8]]))
    assert torch.equal(out["attention_mask"], T([[1, 1, 1, 1], [0, 0, 1, 1]]))
    assert torch.equal(out["labels"], T([[-100, -100, 7, 8], [-100, -100, -100, 8]]))
    out = SFTCollator(P, mask_prompt=False)(sft_batch())
    assert torch.equal(out["labels"], T([[5, 6, 7, 8], [9, 8, -100, -100]]))


def test_pair_collator_chosen_rows_then_rejected_rows():
    batch = [{"chosen_input_ids": T([1, 2, 3]), "rejected_input_ids": T([1, 4]), "prompt_len": 1},
             {"chosen_input_ids": T([5]), "rejected_input_ids": T([5, 6, 7, 8]), "prompt_len": 1}]
    out = PairCollator(0)(batch)
    assert torch.equal(out["input_ids"], T([[1, 2, 3, 0], [5, 0, 0, 0], [1, 4, 0, 0], [5, 6, 7, 8]]))
    assert torch.equal(out["attention_mask"], T([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    left = PairCollator(0, padding_side="left")(batch)
    assert torch.equal(left["input_ids"][1], T([0, 0, 0, 5]))


def test_prompt_collator_left_pads():
    out = PromptCollator(P)([{"prompt_ids": T([1, 2, 3])}, {"prompt_ids": T([8])}])
    assert torch.equal(out["input_ids"], T([[1, 2, 3], [P, P, 8]]))
    assert torch.equal(out["attention_mask"], T([[1, 1, 1], [0, 0, 1]]))
    assert out["input_ids"].dtype == torch.long
