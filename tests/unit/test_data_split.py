"""Phase split and evaluation hold-out: chatrl.data.split."""

from __future__ import annotations

import numpy as np
import pytest

from chatrl.data import parse_data_split
from chatrl.data.split import n_eval_rows, phase_parts, phase_rows

W = parse_data_split("2,4,4")


def test_parse_data_split():
    assert W == pytest.approx((0.2, 0.4, 0.4))
    assert parse_data_split("0, 1, 0") == (0.0, 1.0, 0.0)
    for bad in ("2,4", "a,b,c", "0,0,0", "-1,1,1", "1,nan,1"):
        with pytest.raises(ValueError, match="--data_split"):
            parse_data_split(bad)


def test_parts_disjoint_covering_reproducible():
    parts = phase_parts(100, W, seed=1234)
    assert [len(p) for p in parts] == [20, 40, 40]
    assert sorted(np.concatenate(parts).tolist()) == list(range(100))
    again = phase_parts(100, W, seed=1234)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not np.array_equal(parts[0], phase_parts(100, W, seed=1)[0])
    # numpy's PCG64 stream, fixed across processes and machines
    assert [p.tolist() for p in phase_parts(10, W, seed=1234)] == [[8, 9], [5, 0, 2, 6], [4, 7, 1, 3]]


def test_eval_hold_out_disjoint_from_train():
    seen = []
    for phase in (1, 2, 3):
        train, evals = phase_rows(100, "pairs", phase, W, seed=7, eval_fraction=0.05)
        assert len(evals) == {1: 1, 2: 2, 3: 2}[phase]
        assert not set(train.tolist()) & set(evals.tolist())
        seen += train.tolist() + evals.tolist()
    assert sorted(seen) == list(range(100))
    assert [n_eval_rows(n, 0.05) for n in (0, 1, 2, 40, 100)] == [0, 0, 1, 2, 5]
    assert n_eval_rows(10, 0.0) == 0
    train, evals = phase_rows(100, "pairs", 2, W, seed=7, eval_fraction=0.05, hold_out=False)
    assert (len(train), len(evals)) == (40, 0)


def test_kinds_go_to_their_phases_and_zero_weights():
    sizes = {(kind, phase): tuple(len(x) for x in phase_rows(50, kind, phase, W, seed=0, eval_fraction=0.1))
             for kind in ("sft", "prompts") for phase in (1, 2, 3)}
    assert sizes == {("sft", 1): (45, 5), ("sft", 2): (0, 0), ("sft", 3): (0, 0),
                     ("prompts", 1): (0, 0), ("prompts", 2): (0, 0), ("prompts", 3): (45, 5)}
    only_rm = parse_data_split("0,1,0")
    assert [len(phase_rows(50, "pairs", p, only_rm, seed=0)[0]) for p in (1, 2, 3)] == [0, 48, 0]
