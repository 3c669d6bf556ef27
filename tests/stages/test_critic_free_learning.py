"""Critic-free RL learns a verifiable task: GRPO and RLOO (the real step 3 on 2 CPU ranks, the
built-in exact-match reward) raise greedy exact-match accuracy on HELD-OUT problems, which neither
step 1 nor step 3 sees, with the KL to the reference bounded (``docs/critic_free.md``, "Learning
on the synthetic arithmetic task").

The task is ``scripts/make_arith_task.py --max_operand 999 --max_second_operand 1 --ops +``
(``437 + 1``, ``52 + 0``): the held-out problems are new numbers, but the rule (copy the digits,
add to the last one, carry) is shared, so what RL sharpens on the training prompts carries over.
Step 1 is short on purpose (about 36% held-out accuracy): the model is partly right and RL has
something to sharpen. It is built once for the module.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, STORIES
from tests.launch import run_ranks

# The set-up measured in docs/critic_free.md; change both together.
TASK = dict(n_train=400, n_eval=100, seed=0, max_operand=999, ops=("+",), max_second_operand=1)
STEP1 = ["--max_seq_len", "64", "--per_device_train_batch_size", "16", "--learning_rate", "3e-3",
         "--lr_scheduler_type", "constant", "--num_train_epochs", "100", "--max_steps", "160", "--zero_stage", "0"]
STEP3 = ["--max_prompt_seq_len", "64", "--max_answer_seq_len", "6", "--per_device_generation_batch_size", "8",
         "--num_samples_per_prompt", "8", "--per_device_training_batch_size", "64", "--actor_learning_rate", "5e-4",
         "--init_kl_coef", "0.01", "--max_steps", "100", "--num_train_epochs", "5", "--actor_zero_stage", "0",
         "--enable_hybrid_engine", "--num_warmup_steps", "0"]


def _scripts():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import eval_exact_match
        import make_arith_task
    finally:
        sys.path.pop(0)
    return make_arith_task, eval_exact_match


@pytest.fixture(scope="module")
def arith_sft(tmp_path_factory):
    """The task (SFT rows and prompt rows of the same training problems, held-out prompt rows),
    stories260K after a short step 1 on the training problems, and its held-out greedy accuracy."""
    make_arith_task, eval_exact_match = _scripts()
    root = tmp_path_factory.mktemp("arith")
    train, held_out = make_arith_task.make_task(**TASK, with_answers=True)
    seen = {(r["metadata"]["a"], r["metadata"]["b"]) for r in train}
    assert not any((r["metadata"]["a"], r["metadata"]["b"]) in seen for r in held_out)
    prompts = [{k: v for k, v in r.items() if k != "chosen"} for r in train]
    for name, rows in (("sft", train), ("prompts", prompts)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path", str(root / "sft.jsonl"),
               "--data_split", "10,0,0", "--data_output_path", str(root / "cache"), *STEP1,
               "--output_dir", str(root / "sft"), "--disable_progress_bar"], timeout=300)
    before = eval_exact_match.evaluate(str(root / "sft"), held_out)
    # the premise: step 1 taught the format and part of the rule, and left room to learn
    assert 0.1 <= before <= 0.5, before
    return {"root": root, "held_out": held_out, "before": before}


# GRPO's held-out gain over the seeds 1234, 1 and 2 (2026-12-02, from 36%): fp32 +15, +15, +10 points,
# bf16 +11, +15, +11 (92% of fp32's mean; docs/precision.md). A run's gain moves by about 5 points
# with the seed, so every case, bf16 included, is held to the same bar of +10 points.
MIN_GAIN = 0.1


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("algorithm,dtype", [("grpo", "fp32"), ("rloo", "fp32"), ("grpo", "bf16")])
def test_critic_free_raises_held_out_accuracy(arith_sft, tmp_path, algorithm, dtype):
    _, eval_exact_match = _scripts()
    root, out = arith_sft["root"], tmp_path / algorithm
    run_ranks(["-m", "chatrl.step3_ppo", "--rl_algorithm", algorithm, "--reward_fn", "exact_match",
               "--actor_model_name_or_path", str(root / "sft"), "--data_path", str(root / "prompts.jsonl"),
               "--data_split", "0,0,10", "--data_output_path", str(root / "cache"), *STEP3, "--dtype", dtype,
               "--output_dir", str(out), "--disable_progress_bar"], timeout=600)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "kl" in r]
    assert len(rows) == 100
    reward = [r["reward/exact_match"] for r in rows]
    assert sum(reward[-10:]) > sum(reward[:10]) + 1.0, reward  # training prompts: sampled accuracy +10 points
    after = eval_exact_match.evaluate(str(out / "actor"), arith_sft["held_out"])
    print(f"LEARNING {algorithm} {dtype} held-out {arith_sft['before']:.2f} -> {after:.2f}, "
          f"kl max {max(r['kl'] for r in rows):.2f}")
    # measured on 100 held-out problems (seed 1234): 36% -> 51% (GRPO fp32), 47% (RLOO, GRPO bf16);
    # KL at most 1.40-1.45 nats (2026-12-02)
    assert after >= arith_sft["before"] + MIN_GAIN - 1e-9, (algorithm, dtype, arith_sft["before"], after)
    assert max(r["kl"] for r in rows) <= 4.0, [r["kl"] for r in rows]
