"""Critic-free losses and the reward failure check on 2 real gloo ranks (tests/stages/critic_free_worker.py)."""

from __future__ import annotations

import json
import re

import pytest

from tests.launch import REPO, run_ranks


@pytest.mark.slow
def test_two_gloo_ranks_match_one_process_and_a_reward_failure_stops_every_rank(tmp_path):
    out = tmp_path / "result.json"
    run_ranks([str(REPO / "tests" / "stages" / "critic_free_worker.py"), str(out)], timeout=180)
    r = json.loads(out.read_text())
    assert r["grad_norm"] > 1e-3
    for mode, diff in r["grad_diff"].items():
        assert diff <= 1e-6, (mode, diff)  # summed gradient over 2 ranks == 1-process gradient (fp32)
    assert r["reinforce_pp_diff"] <= 1e-6  # global whitening across ranks == whitening of the whole batch
    for key, (two_ranks, whole) in r["logp_diff"].items():
        assert two_ranks == pytest.approx(whole, abs=1e-12), key
    assert r["logp_diff"]["rollout/logp_diff_max"][0] == pytest.approx(0.07, abs=1e-6)
    assert r["pooled"]["reward/score_std"] == pytest.approx(0.5)  # the mean of the per-rank stds would be 0
    share = r["pooled_rank1_tokens"] / r["pooled_tokens"]  # rank 1's tokens weigh by their count
    assert r["pooled"]["entropy"] == pytest.approx(share, abs=1e-12)
    ok, failed = r["reward_failure"]
    assert ok["msg"] == "rank 0: reward failed at step 11 on rank(s) [1]; see their error"
    assert re.match(r"rank 1: reward failed at step 11: reward server http://127\.0\.0\.1:\d+/ at step 11: "
                    r"failed after 2 attempt\(s\): cannot connect", failed["msg"]), failed["msg"]
    assert ok["seconds"] < 10 and failed["seconds"] < 10  # within (retries + 1) × timeout + backoff, no hang
