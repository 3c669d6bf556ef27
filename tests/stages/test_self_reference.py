"""Step 3 with the actor as its own reference: at the first step the reference's log-probs equal the
actor's bit for bit, so the KL is exactly 0, and every ratio of the first optimizer step (taken
before any update) is exactly 1, in fp32 and in bf16, with the experience's passes deferred to the
first training forward (a buffer of one micro-batch) or run on their own (two micro-batches, where
the ratio compares two forwards), and with top-k / top-p filters. A reference loaded in another
precision, or a training forward that differs from the experience forward, shows here as a non-zero
first-step KL or a ratio off 1 (the reference loaded in fp32 beside a bf16 actor: KL -0.016)."""

import json

import pytest
import torch

from tests.conftest import DATA, STORIES, forget_process_group


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group_left_behind():
    """As in test_in_process.py: the one-rank process group and its environment go afterwards."""
    import os

    saved = dict(os.environ)
    yield
    forget_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["deferred", "separate", "filtered"])
def test_first_step_with_the_actor_as_reference_has_kl_zero_and_ratio_one(tmp_path, dtype, layout):
    from chatrl.evidence.rollout_records import read_step
    from chatrl.step3_ppo.main import main as step3

    out = tmp_path / "step3"
    # 8 rollouts (4 prompts x 2 answers): one micro-batch (the experience's passes are the first training
    # forward), or 2 micro-batches of 4 accumulated into one optimizer step with the experience's passes
    # on their own; every ratio of the step is taken before the actor's first update
    # (filtered: the first with --top_k 5 --top_p 0.5, which the actor and the reference apply alike)
    micro, gas = ("4", "2") if layout == "separate" else ("8", "1")
    filters = ["--top_k", "5", "--top_p", "0.5"] if layout == "filtered" else []
    argv = ["--actor_model_name_or_path", str(STORIES), "--rl_algorithm", "rloo", "--num_samples_per_prompt", "2",
            "--reward_fn", "regex_format", "--data_path", str(DATA / "prompts"), "--data_split", "0,0,10",
            "--data_output_path", str(tmp_path / "cache"), "--max_prompt_seq_len", "16",
            "--max_answer_seq_len", "6", "--per_device_generation_batch_size", "4",
            "--per_device_training_batch_size", micro, "--gradient_accumulation_steps", gas, "--max_steps", "1",
            "--num_warmup_steps", "0", "--dtype", dtype, "--save_rollouts", "1", "--output_dir", str(out),
            "--disable_progress_bar", *filters]
    step3(argv)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1 and "kl" in r)
    assert first["kl"] == 0.0 and first["ratio_mean"] == 1.0 and first["approx_kl"] == 0.0, first
    _, ranks = read_step(out, 1)
    t = ranks[0]["tensors"]
    action = t["action_mask"].bool()
    assert int(action.sum()) > 0
    assert torch.equal(t["logp"][action], t["ref_logp"][action])
    assert bool((t["kl"][action] == 0).all())
    assert t["ratio"].shape[0] == 1 and bool((t["ratio"][0][action] == 1).all())
    if dtype == "fp32":  # the sampler drew from the distribution the trainer scores (bf16: docs/precision.md)
        assert first["rollout/logp_diff_max"] < 1e-4, first
