"""Each step's ``main([...])`` in this process, on one rank and a 2-layer model: fast, and runnable
under a debugger (the 2-rank stage tests next to it run the same programs under the launcher).

Also the actor's learning-rate schedule with the PTX loss on: the PTX step is a second actor
optimizer step per PPO micro-batch, so the schedule is sized for twice the critic's steps; the
learning rate reaches its final value at the last actor step and never rises after the warm-up.
"""

import json
import math

import pytest
import torch

from tests.conftest import DATA, forget_process_group

HH = str(DATA / "hh-rlhf" / "helpful-base")
PROMPTS = str(DATA / "prompts")
ALPACA = str(DATA / "alpaca-instructions") + "[0:200]"


def _rows(out):
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group_left_behind():
    """The mains here start a one-rank process group in this (pytest's) process and put RANK,
    MASTER_PORT, ... in its environment; afterwards both go, so that the programs later tests start
    as subprocesses neither inherit the port nor find it taken."""
    import os


    saved = dict(os.environ)
    yield
    forget_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_llama):
    """Steps 1 and 2 in process on the tiny Llama: a step-1 actor and a step-2 reward model folder."""
    from chatrl.step1_sft.main import main as step1
    from chatrl.step2_reward.main import main as step2

    root = tmp_path_factory.mktemp("inproc")
    common = ["--data_path", HH, "--data_output_path", str(root / "cache"), "--max_seq_len", "64",
              "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--eval_iters", "1",
              "--max_steps", "4", "--disable_progress_bar"]
    m1 = step1(["--model_name_or_path", str(tiny_llama), *common, "--data_split", "10,0,0",
                "--output_dir", str(root / "step1")])
    m2 = step2(["--model-name-or-path", str(tiny_llama), *common, "--data_split", "0,10,0",
                "--output_dir", str(root / "step2")])
    return root, m1, m2


def test_steps_1_and_2_main_in_process(pipeline):
    root, m1, m2 = pipeline
    assert math.isfinite(m1["eval/loss"]) and m1["eval/tokens"] > 0
    assert 0.0 <= m2["eval/accuracy"] <= 1.0 and m2["eval/pairs"] > 0
    assert [r["step"] for r in _rows(root / "step1") if "train/loss" in r] == [1, 2, 3, 4]
    for step in ("step1", "step2"):
        assert (root / step / "chatrl_run.json").exists() and (root / step / "config.json").exists()


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_step3_main_actor_lr_follows_schedule_with_ptx(pipeline, schedule):
    from chatrl.step3_ppo.main import main as step3

    root, _, _ = pipeline
    out = root / f"step3_{schedule}"
    warmup, buffers, lr = 2, 6, 1e-3
    metrics = step3(["--actor_model_name_or_path", str(root / "step1"), "--critic_model_name_or_path",
                     str(root / "step2"), "--data_path", PROMPTS, "--data_output_path", str(root / "cache"),
                     "--unsupervised_dataset_name", ALPACA, "--unsup_coef", "0.5",
                     "--max_prompt_seq_len", "32", "--max_answer_seq_len", "8",
                     "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "2",
                     "--max_steps", str(buffers), "--lr_scheduler_type", schedule, "--num_warmup_steps", str(warmup),
                     "--actor_learning_rate", str(lr), "--critic_learning_rate", str(lr),
                     "--output_dir", str(out), "--disable_progress_bar"])
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, buffers + 1))
    actor, critic = [r["actor_lr"] for r in rows], [r["critic_lr"] for r in rows]
    # 2 PPO micro-batches per buffer: the critic makes 2 optimizer steps per buffer, the actor 4 (PTX)
    critic_total, actor_total = 2 * buffers, 4 * buffers
    assert actor[-1] == pytest.approx(0.0, abs=1e-12) and critic[-1] == pytest.approx(0.0, abs=1e-12)
    assert actor[-2] > 0 and critic[-2] > 0  # the end is reached at the last step, not before
    # after the warm-up the schedule never rises (a schedule sized for the critic's steps would
    # climb back under cosine, and sit at 0 from mid-run under linear)
    assert all(b <= a + 1e-15 for a, b in zip(actor, actor[1:], strict=False)), actor
    # hand-derived values at the first buffer: actor after 4 steps, critic after 2 (warm-up 2)
    frac_a = (4 - warmup) / (actor_total - warmup)
    frac_c = (2 - warmup) / (critic_total - warmup)
    expect = (lambda f: lr * 0.5 * (1 + math.cos(math.pi * f))) if schedule == "cosine" else (lambda f: lr * (1 - f))
    assert actor[0] == pytest.approx(expect(frac_a), rel=1e-6) and critic[0] == pytest.approx(expect(frac_c), rel=1e-6)
    assert math.isfinite(metrics["ptx_loss"]) and (out / "actor" / "config.json").exists()


def test_a_toy_algorithm_plugs_in_through_the_documented_path(pipeline):
    """docs/architecture.md, "An RL algorithm": register an Algorithm with its estimator before step 3's
    parser is built, and --rl_algorithm takes it; the loop calls the estimator on each buffer and trains
    with its advantages, with no critic (the algorithm needs none)."""
    from chatrl.rl import algorithms
    from chatrl.rl.advantages import Advantages, outcome_per_token
    from chatrl.step3_ppo.main import main as step3

    calls = []

    def mean_baseline(inputs, settings):  # REINFORCE with the batch mean as baseline
        adv = outcome_per_token(inputs.scores - inputs.scores.mean(), inputs)
        calls.append((inputs.scores.clone(), inputs.action_mask.clone(), adv.clone()))
        return Advantages(adv)

    algorithms.register(algorithms.Algorithm("mean_baseline", mean_baseline, "REINFORCE with a batch-mean baseline"))
    root, _, _ = pipeline
    out = root / "step3_toy"
    try:
        metrics = step3(["--rl_algorithm", "mean_baseline", "--reward_fn", "regex_format", "--kl_in", "loss",
                         "--actor_model_name_or_path", str(root / "step1"), "--data_path", PROMPTS,
                         "--data_output_path", str(root / "cache"), "--max_prompt_seq_len", "32",
                         "--max_answer_seq_len", "8", "--per_device_generation_batch_size", "4",
                         "--per_device_training_batch_size", "4", "--max_steps", "2", "--num_warmup_steps", "0",
                         "--output_dir", str(out), "--disable_progress_bar"])
    finally:
        algorithms.ALGORITHMS.pop("mean_baseline")
    assert len(calls) == 2  # once per experience buffer
    for scores, mask, adv in calls:
        expected = (scores - scores.mean())[:, None].expand_as(adv) * (mask > 0)
        assert torch.equal(adv, expected)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2] and "critic_lr" not in rows[0] and "critic_loss" not in rows[0]
    assert math.isfinite(metrics["actor_loss"]) and (out / "actor" / "config.json").exists()
    assert not (out / "critic").exists()
    assert "mean_baseline" not in algorithms.names()


def test_a_toy_reward_kind_plugs_in_through_the_documented_path(pipeline):
    """docs/architecture.md, "A reward": a kind is one RewardKind subclass and one kinds.register line;
    --reward_fn then takes its values (with a weight), step 3 builds its source and sums it, and the
    logged reward is the weighted score of the answers the source was given."""
    from chatrl.rewards import kinds
    from chatrl.step3_ppo.main import main as step3

    seen = []  # (step, answers, scores) of each batch the source scored

    class Length:
        name = "length"

        def __init__(self, n):
            self.n = n

        def __call__(self, batch):
            scores = torch.tensor([-abs(len(a) - self.n) for a in batch.answers], dtype=torch.float32)
            seen.append((batch.step, list(batch.answers), scores))
            return scores

    class LengthKind(kinds.RewardKind):
        name, summary = "length", "minus the distance of the answer's length to TARGET characters"

        def source(self, target, settings, context):
            return Length(int(target.split(":", 1)[1]))

    kinds.register(LengthKind())
    root, _, _ = pipeline
    out = root / "step3_toy_reward"
    try:
        metrics = step3(["--rl_algorithm", "reinforce_pp", "--reward_fn", "0.5*length:12", "--kl_in", "loss",
                         "--actor_model_name_or_path", str(root / "step1"), "--data_path", PROMPTS,
                         "--data_output_path", str(root / "cache"), "--max_prompt_seq_len", "32",
                         "--max_answer_seq_len", "8", "--per_device_generation_batch_size", "4",
                         "--per_device_training_batch_size", "4", "--max_steps", "2",
                         "--num_warmup_steps", "0", "--output_dir", str(out), "--disable_progress_bar"])
    finally:
        kinds.KINDS.pop("length")
    assert [step for step, _, _ in seen] == [1, 2]  # one generation batch per experience buffer
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row, (_, answers, scores) in zip(rows, seen, strict=True):
        assert scores.tolist() == [-abs(len(a) - 12) for a in answers]
        assert row["reward/length"] == pytest.approx(scores.mean().item(), abs=1e-6)
        assert row["reward/score_mean"] == pytest.approx(0.5 * scores.mean().item(), abs=1e-6)
    assert math.isfinite(metrics["actor_loss"]) and "length" not in kinds.names()
