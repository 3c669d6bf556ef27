"""Step 3 over 2 CPU ranks, ZeRO-3 and the hybrid engine: the first PPO epoch is exact, and PPO learns
a rule-based reward (5 × share of answer tokens containing "e") while the KL stays bounded."""

import json

import pytest

from tests.launch import run_ranks

# The gain (mean score of the last five steps minus the first step's), measured 2026-12-01 with seeds
# 1234 (this test's), 1 and 2: fp32 0.496, 0.533, 0.464 (mean 0.498); bf16 0.393, 0.530, 0.485 (mean
# 0.469, 94% of fp32's). One run's gain varies by about +-0.07 with the seed in either dtype, so a
# single bf16 run is held to 75% of this seed's fp32 gain; the mean over seeds is docs/precision.md's.
PPO_FP32_GAIN = 0.496


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.extended)])
def test_ppo_first_epoch_exact_and_reward_rises_with_bounded_kl(tmp_path, dtype):
    result = tmp_path / "ppo.json"
    run_ranks(["tests/stages/ppo_worker.py", str(result), str(tmp_path), "--steps", "30", "--hybrid", "--",
               "--dtype", dtype], timeout=600)
    res = json.loads(result.read_text())
    first = res["first"]
    # actor == reference with dropout 0.1 in the config: eval-mode passes give exact equality, in bf16 too
    assert first["max_abs_kl"] == 0.0 and first["logp_equals_ref"]
    assert first["ratio_mean"] == 1.0 and first["clip_frac"] == 0.0 and first["approx_kl"] == 0.0
    reward, kl = res["reward"], res["kl"]
    end = sum(reward[-5:]) / 5
    print(f"PPO {dtype}: score {reward[0]:.3f} -> {end:.3f} (last five), KL max {max(kl):.2f}")
    assert end > reward[0] + (0.4 if dtype == "fp32" else 0.75 * PPO_FP32_GAIN), reward  # fp32 seen: 0.75 -> 1.25
    assert max(kl) < 8.0, kl  # seen: at most 4.2 nats per answer with beta 0.3


def test_first_training_pass_as_experience_matches_the_separate_passes(tmp_path):
    """The default path (one micro-batch per rollout batch: the first training step's forwards give the
    old log-probs and values) against --separate_experience_pass (the actor's and critic's own
    experience forwards), 3 steps of 2 PPO epochs on 2 ranks, ZeRO-0 with the hybrid engine: every
    logged figure of every step agrees to float32 rounding, and both first epochs have ratio 1."""
    rows, first = {}, {}
    for name, extra in {"fused": [], "separate": ["--", "--separate_experience_pass"]}.items():
        result = tmp_path / f"{name}.json"
        run_ranks(["tests/stages/ppo_worker.py", str(result), str(tmp_path / name), "--steps", "3", "--zero", "0",
                   "--hybrid", *extra], timeout=600)
        res = json.loads(result.read_text())
        rows[name], first[name] = res["rows"], res["first"]
    keys = ["reward/score_mean", "kl", "entropy", "actor_loss", "critic_loss", "ratio_mean", "approx_kl",
            "explained_variance", "reward/mean"]
    assert len(rows["fused"]) == len(rows["separate"]) == 3
    for a, b in zip(rows["fused"], rows["separate"], strict=True):
        for k in keys:
            assert a[k] == pytest.approx(b[k], abs=1e-6, rel=1e-5), (a["step"], k, a[k], b[k])
    assert first["separate"]["ratio_mean"] == 1.0 and first["separate"]["max_abs_kl"] == 0.0
    assert first["fused"]["ratio_mean"] == 1.0 and first["fused"]["max_abs_kl"] == 0.0
    assert rows["fused"][0]["time/experience"] < rows["separate"][0]["time/experience"]


@pytest.mark.slow
@pytest.mark.extended
def test_release_inference_cache_frees_the_copy_during_training(tmp_path):
    """Actor (and critic) under ZeRO-3 on 2 ranks with the hybrid engine: with
    --release_inference_cache every rollout's copy is freed (time/release > 0 at each step) and each
    rank's resident memory while training is within 10% of the engine-off run's (the kept copy's
    cost, without the flag, is stated in docs/hybrid_engine.md)."""
    from chatrl.models.tiny import TinySpec, make_tiny_model

    model = tmp_path / "llama"  # ~30M parameters (120 MB fp32): a copy that shows in the RSS
    make_tiny_model("llama", model, TinySpec(hidden=256, layers=4, heads=4, ffn=1024))
    # ("kept": ["--enable_hybrid_engine"] alone measures the kept copy's cost for the docs; not run here)
    runs = {"off": [], "release": ["--enable_hybrid_engine", "--release_inference_cache"]}
    rows = {}
    for name, extra in runs.items():
        result = tmp_path / f"{name}.json"
        run_ranks(["tests/stages/ppo_worker.py", str(result), str(tmp_path / name), "--steps", "3",
                   "--model", str(model), "--", "--per_device_generation_batch_size", "8",
                   "--per_device_training_batch_size", "8", *extra], timeout=600)
        rows[name] = json.loads(result.read_text())["rows"]
    assert all(r["time/release"] > 0 for r in rows["release"]), [r["time/release"] for r in rows["release"]]
    rss = {name: max(r["memory/rss_train_max_mb"] for r in rs) for name, rs in rows.items()}
    print("per-rank RSS while training (MiB, max over ranks and steps):", rss)
    assert rss["release"] <= 1.10 * rss["off"], rss
