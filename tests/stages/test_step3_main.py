"""The step-3 program end to end over 2 CPU ranks: LoRA actor under ZeRO-3 with the hybrid engine, a
ZeRO-3-partitioned reference, EMA, PTX loss, the metrics log, a non-finite step skipped, and the three
HF folders it saves."""

import json
import math

import pytest
import torch

from tests.conftest import DATA, STORIES
from tests.launch import run_ranks

METRICS = ["reward/score_mean", "reward/score_std", "kl", "entropy", "actor_loss", "critic_loss", "clip_frac",
           "approx_kl", "explained_variance", "answer_len", "eos_rate", "time/generate", "time/train",
           "time/gather", "samples_per_s", "ptx_loss", "kl_coef", "rollout/logp_diff_max", "rollout/logp_diff_mean"]


@pytest.mark.slow
def test_step3_program_saves_actor_critic_and_ema(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model

    tok = load_tokenizer(str(STORIES))
    critic = load_reward_model(str(STORIES), tok, require_head=False)
    save_reward_model(critic, tok, tmp_path / "critic")
    out = tmp_path / "out"
    run_ranks(["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(STORIES),
               "--critic_model_name_or_path", str(tmp_path / "critic"), "--data_path", str(DATA / "prompts"),
               "--data_output_path", str(tmp_path / "cache"), "--max_prompt_seq_len", "32",
               "--max_answer_seq_len", "12", "--per_device_generation_batch_size", "4",
               "--per_device_training_batch_size", "4", "--max_steps", "3", "--actor_zero_stage", "3",
               "--critic_zero_stage", "2", "--enable_hybrid_engine", "--actor_lora_dim", "4",
               "--actor_learning_rate", "1e-3", "--num_warmup_steps", "0", "--enable_ema",
               "--partition_frozen_models", "always",  # the reference partitioned, as DeepSpeed-Chat does
               "--unsupervised_dataset_name", str(DATA / "alpaca-instructions[0:64]"), "--unsup_coef", "0.5",
               "--print_answers", "--print_answers_interval", "1", "--debug_nonfinite_steps", "2",
               "--output_dir", str(out),
               "--disable_progress_bar"], timeout=400)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in METRICS:
        assert all(key in r for r in rows), key
    assert rows[0]["ratio_mean"] == 1.0 and rows[0]["kl"] == 0.0
    # step 2's scores were made NaN: its PPO actor step and critic step were skipped (its PTX step, on
    # finite text, was not), and no step after it
    assert [r["skipped_steps"] for r in rows] == [0, 2, 2]
    assert [r["step"] for r in rows if "alert/nonfinite" in r] == [2]  # the run-health alert, logged once
    samples = [json.loads(x) for x in (out / "logs" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 2, 3]  # one rollout per --print_answers_interval, for the report
    assert all(isinstance(s["answer"], str) and s["prompt"] for s in samples) and math.isfinite(samples[0]["kl"])
    assert all(math.isfinite(rows[2][k]) for k in ("actor_loss", "critic_loss", "ptx_loss"))
    assert (out / "chatrl_run.json").exists()
    ids = torch.tensor([tok("Once upon a time").input_ids])
    actor = AutoModelForCausalLM.from_pretrained(out / "actor")
    ema = AutoModelForCausalLM.from_pretrained(out / "actor_ema")
    assert not any("lora" in k for k in actor.state_dict())
    assert torch.isfinite(actor(ids).logits).all() and torch.isfinite(ema(ids).logits).all()
    seq_cls = AutoModelForSequenceClassification.from_pretrained(out / "critic", num_labels=1)
    assert seq_cls.score.weight.shape == (1, 64)


@pytest.mark.slow
def test_ranks_sample_independently_and_reproducibly(tmp_path):
    """Two ranks given the same prompt drew the same answer token for token."""
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model

    tok = load_tokenizer(str(STORIES))
    save_reward_model(load_reward_model(str(STORIES), tok, require_head=False), tok, tmp_path / "critic")
    prompts = tmp_path / "same.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "Tell me a story about a cat."}) + "\n" for _ in range(8)))
    runs = []
    for name in ("a", "b"):
        result = tmp_path / f"{name}.json"
        run_ranks(["tests/stages/rollout_seed_worker.py", str(result), "--",
                   "--actor_model_name_or_path", str(STORIES), "--critic_model_name_or_path", str(tmp_path / "critic"),
                   "--data_path", str(prompts), "--data_output_path", str(tmp_path / "cache"),
                   "--max_prompt_seq_len", "32", "--max_answer_seq_len", "12", "--per_device_generation_batch_size", "2",
                   "--per_device_training_batch_size", "2", "--max_steps", "1", "--num_warmup_steps", "0",
                   "--output_dir", str(tmp_path / name), "--disable_progress_bar"], timeout=400)
        runs.append(json.loads(result.read_text())["answers"])
    rank0, rank1 = runs[0]
    assert len(rank0) == len(rank1) == 2
    assert sum(a == b for a, b in zip(rank0, rank1, strict=True)) == 0  # was 2 of 2 identical
    assert runs[1] == runs[0]  # the same run again draws the same answers on every rank


@pytest.mark.slow
def test_ppo_with_a_rule_reward_alone_and_summed_with_a_reward_model(tmp_path):
    """PPO takes the reward interface every algorithm takes: with --reward_fn alone (no reward model)
    the critic starts from the actor with a fresh value head, trains over 2 ranks and is saved beside
    the actor; with a reward model and a function the score is their weighted sum and each part is
    logged."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model

    base = ["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(STORIES), "--data_path", str(DATA / "prompts"),
            "--data_output_path", str(tmp_path / "cache"), "--max_prompt_seq_len", "32", "--max_answer_seq_len", "8",
            "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4", "--max_steps", "2",
            "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--num_warmup_steps", "0",
            "--disable_progress_bar"]
    rule = tmp_path / "rule"
    run_ranks([*base, "--reward_fn", "regex_format", "--output_dir", str(rule)], timeout=400)
    rows = [json.loads(x) for x in (rule / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("reward/regex_format" in r and "reward/model" not in r for r in rows)
    assert all(r["reward/score_mean"] == r["reward/regex_format"] for r in rows)  # the only part, weight 1
    assert all(math.isfinite(r["critic_loss"]) for r in rows)
    assert rows[0]["ratio_mean"] == 1.0 and rows[0]["kl"] == 0.0
    assert AutoModelForCausalLM.from_pretrained(rule / "actor") is not None
    critic = AutoModelForSequenceClassification.from_pretrained(rule / "critic", num_labels=1)
    assert critic.score.weight.shape == (1, 64) and torch.isfinite(critic.score.weight).all()

    tok = load_tokenizer(str(STORIES))
    save_reward_model(load_reward_model(str(STORIES), tok, require_head=False), tok, tmp_path / "rm")
    both = tmp_path / "both"
    run_ranks([*base, "--critic_model_name_or_path", str(tmp_path / "rm"), "--reward_model_name_or_path",
               str(tmp_path / "rm"), "--reward_fn", "0.5*regex_format",
               "--output_dir", str(both)], timeout=400)
    rows = [json.loads(x) for x in (both / "logs" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert {"reward/model", "reward/regex_format", "critic_loss"} <= set(r)
        # the score is the weighted sum of the parts (means over the same rollouts)
        assert r["reward/score_mean"] == pytest.approx(r["reward/model"] + 0.5 * r["reward/regex_format"], abs=1e-5)
    assert (both / "critic" / "config.json").exists()
