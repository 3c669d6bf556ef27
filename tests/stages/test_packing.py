"""The step programs with ``--packing --max_tokens_per_micro_batch`` make the first optimizer step's
gradient of the default padded micro-batches, on one rank (ZeRO-0) and on two (ZeRO-3), for step 1,
step 2, DPO, GRPO and PPO (actor and critic) on a tiny OPT, the family packed with an explicit
block-diagonal mask (tests/stages/packing_worker.py)."""

import json

import pytest

from tests.launch import REPO, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("ranks, stage", [(1, "0"), pytest.param(2, "3", marks=pytest.mark.extended)])
def test_token_budget_packed_micro_batches_give_the_padded_step_gradient(tmp_path, tiny_opt, ranks, stage):
    out = tmp_path / "result.json"
    run_ranks([str(REPO / "tests" / "stages" / "packing_worker.py"), str(out), str(tmp_path), str(tiny_opt), stage],
              nprocs=ranks, timeout=1500)
    results = json.loads(out.read_text())
    assert set(results) == {"step1", "step2", "dpo", "grpo", "ppo"}
    assert [len(v) for v in results.values()] == [1, 1, 1, 1, 2]  # PPO: the actor and the critic
    for program, engines in results.items():
        for e in engines:
            assert e["max"] > 1e-4, (program, e)
            # float32 sums in another order: a few ulps of the gradient's largest entries
            assert e["diff"] <= 1e-5 * max(1.0, e["max"]), (program, e)
            padded, packed = e["micro"]
            assert padded == 2 and packed > 2, (program, e)  # the budget cut the step differently
