"""Step 3 over 2 CPU ranks, ZeRO-3 and the hybrid engine: the first PPO epoch is exact, and PPO learns
a rule-based reward (5 × share of answer tokens containing "e") while the KL stays bounded."""

import json

import pytest

from tests.launch import run_ranks


@pytest.mark.slow
def test_ppo_first_epoch_exact_and_reward_rises_with_bounded_kl(tmp_path):
    result = tmp_path / "ppo.json"
    run_ranks(["tests/stages/ppo_worker.py", str(result), str(tmp_path), "--steps", "30", "--hybrid"], timeout=600)
    res = json.loads(result.read_text())
    first = res["first"]
    # actor == reference with dropout 0.1 in the config: eval-mode passes give exact equality
    assert first["max_abs_kl"] == 0.0 and first["logp_equals_ref"]
    assert first["ratio_mean"] == 1.0 and first["clip_frac"] == 0.0 and first["approx_kl"] == 0.0
    reward, kl = res["reward"], res["kl"]
    end = sum(reward[-5:]) / 5
    assert end > reward[0] + 0.4, reward  # seen: 0.73 -> 1.36
    assert max(kl) < 8.0, kl  # seen: at most 4.2 nats per answer with beta 0.3
