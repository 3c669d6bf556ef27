"""chatrl.packing: rows, positions, the block-diagonal mask, windows read back per sequence and
micro-batches by token budget, each against values worked out by hand."""

import pytest
import torch

from chatrl.errors import UsageError
from chatrl.packing import (
    BLOCK_MASK,
    POSITION_IDS,
    attention_style,
    block_diagonal_mask,
    micro_batch_groups,
    pack,
    split_to_count,
    token_budget_groups,
    token_cost,
)

PAD = 0


def test_pack_fills_rows_first_fit_longest_first():
    # lengths 3, 1, 2; rows of 3 tokens: seq 0 fills row 0, seq 2 opens row 1, seq 1 joins it
    p = pack([[5, 6, 7], [8], [9, 10]], PAD)
    assert p.input_ids.tolist() == [[5, 6, 7], [9, 10, 8]]
    assert p.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert p.seq_ids.tolist() == [[0, 0, 0], [2, 2, 1]]
    assert (p.row.tolist(), p.start.tolist(), p.length.tolist()) == ([0, 1, 1], [0, 2, 0], [3, 1, 2])
    assert p.n_seqs == 3 and p.tokens == 6


def test_pack_into_wider_rows_and_trailing_pads():
    one = pack([[5, 6, 7], [8], [9, 10]], PAD, row_tokens=8)
    assert one.input_ids.tolist() == [[5, 6, 7, 9, 10, 8]]  # as wide as the fullest row, not 8
    assert one.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    three = pack([[1, 2], [3, 4], [5]], PAD)  # rows of 2: the third sequence cannot join a full row
    assert three.input_ids.tolist() == [[1, 2], [3, 4], [5, PAD]]
    assert three.seq_ids.tolist() == [[0, 0], [1, 1], [2, -1]]
    assert three.position_ids.tolist() == [[0, 1], [0, 1], [0, 0]]


def test_pack_refuses_what_it_cannot_lay_out():
    for seqs, pad, match in (([], PAD, "no sequences"), ([[1], []], PAD, "at least one token"),
                             ([[1]], None, "pad_token_id")):
        with pytest.raises(ValueError, match=match):
            pack(seqs, pad)


def test_block_diagonal_mask_by_hand():
    seq_ids = torch.tensor([[0, 0, 1, -1]])
    m = block_diagonal_mask(seq_ids, torch.float32)
    assert m.shape == (1, 1, 4, 4)
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0],   # token 0 of sequence 0 sees itself
                       [1, 1, 0, 0],   # token 1 sees sequence 0 up to itself
                       [0, 0, 1, 0],   # sequence 1 starts afresh
                       [0, 0, 0, 1]]   # a trailing pad sees only itself (no empty softmax row)
    assert m[0, 0, 0, 1].item() == torch.finfo(torch.float32).min
    assert block_diagonal_mask(seq_ids, torch.bfloat16).dtype == torch.bfloat16


def test_slots_windows_and_scatter():
    p = pack([[5, 6, 7], [8], [9, 10]], PAD)  # rows [[5,6,7],[9,10,8]]
    s = p.slots(torch.tensor([1, 0, 0]), torch.tensor([2, 0, 2]))
    assert s.rows.tolist() == [0, 0, 1, 1] and s.cols.tolist() == [1, 2, 0, 1]
    assert s.seq.tolist() == [0, 0, 2, 2] and s.offset.tolist() == [0, 1, 0, 1]
    assert p.input_ids[s.rows, s.cols].tolist() == [6, 7, 9, 10]
    assert s.scatter(torch.tensor([1.0, 2.0, 3.0, 4.0]), 3, 2).tolist() == [[1, 2], [0, 0], [3, 4]]
    last = p.last_slots()
    assert p.input_ids[last.rows, last.cols].tolist() == [7, 8, 10]
    with pytest.raises(ValueError, match="outside its sequence"):
        p.slots(1, 2)  # sequence 1 has one token


def test_unpack_gives_each_sequence_left_aligned():
    p = pack([[5, 6, 7], [8], [9, 10]], PAD)
    assert p.unpack(p.input_ids).tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert p.unpack(p.position_ids.float()).tolist() == [[0, 1, 2], [0, 0, 0], [0, 1, 0]]


def test_scatter_is_differentiable():
    p = pack([[1, 2, 3], [4, 5]], PAD)
    s = p.slots(0, p.length)
    v = torch.ones(5, requires_grad=True)
    (s.scatter(v * torch.arange(5.0), 2, 3).sum()).backward()
    assert v.grad.tolist() == [0, 1, 2, 3, 4]


def test_token_cost_and_budget_groups():
    assert token_cost([3, 2, 4], packed=True) == 9 and token_cost([3, 2, 4], packed=False) == 12
    units = [(3,), (2,), (4,), (1,)]
    assert token_budget_groups(units, 5, packed=True) == [[0, 1], [2, 3]]
    assert token_budget_groups(units, 6, packed=False) == [[0, 1], [2], [3]]  # 2 × 4 = 8 > 6
    assert token_budget_groups([(7,), (1,)], 5, packed=True) == [[0], [1]]  # over budget alone
    pairs = [(3, 2), (2, 2), (1, 1)]  # a pair's two sides stay together
    assert token_budget_groups(pairs, 9, packed=True) == [[0, 1], [2]]
    assert token_budget_groups(pairs, 12, packed=False) == [[0, 1], [2]]  # 4 × 3 = 12
    with pytest.raises(ValueError, match="budget"):
        token_budget_groups(units, 0, packed=True)


def test_split_to_count_splits_the_largest_groups_in_order():
    assert split_to_count([[0, 1, 2], [3]], 3) == [[0, 1], [2], [3]]
    assert split_to_count([[0, 1, 2, 3]], 4) == [[0], [1], [2], [3]]
    assert split_to_count([[0], [1]], 2) == [[0], [1]]
    with pytest.raises(ValueError):
        split_to_count([[0], [1]], 3)


def test_micro_batch_groups_by_count_and_by_budget():
    units = [(3,), (2,), (4,), (1,), (2,)]
    assert micro_batch_groups(units, 2, 0, packed=True) == [[0, 1], [2, 3], [4]]
    assert micro_batch_groups(units, 2, 6, packed=True) == [[0, 1], [2, 3], [4]]
    seen = []

    def as_if_another_rank_needs_4(t):
        seen.append(float(t))
        return torch.tensor(4.0)

    assert micro_batch_groups(units, 2, 6, packed=True, all_reduce_max=as_if_another_rank_needs_4) == \
        [[0], [1], [2, 3], [4]]
    assert seen == [3.0]


def test_attention_style_by_family():
    assert attention_style("llama") == attention_style("qwen2", "sdpa") == POSITION_IDS
    assert attention_style("opt", "sdpa") == attention_style("opt", "eager") == BLOCK_MASK
    with pytest.raises(UsageError, match="'gpt2'.*drop --packing"):
        attention_style("gpt2", what="my/model")
    with pytest.raises(UsageError, match="flash_attention_2"):
        attention_style("opt", "flash_attention_2")
