"""Step 3's critic-free wiring at parse and plan level: the flags, the derived sizes checked in
sizes.plan_ppo, the reward checks, and train.py skipping step 2 when no reward model is needed."""

import pytest

from chatrl import config, sizes
from chatrl.step3_ppo.main import build_parser, check_reward_flags

BASE = ["--actor_model_name_or_path", "a", "--data_path", "d", "--output_dir", "o"]


def plan(**kw):
    args = dict(n_generation_batches=10, n_prompts=40, world_size=2, per_device_generation_batch_size=2,
                per_device_training_batch_size=4, generation_batches=1, ppo_epochs=1, gradient_accumulation_steps=1,
                num_train_epochs=1, max_steps=0, num_warmup_steps=0, ptx=False)
    args.update(kw)
    return sizes.plan_ppo(**args)


def test_step3_flags_reach_the_ppo_block():
    args = build_parser().parse_args(BASE + ["--rl_algorithm", "grpo", "--num_samples_per_prompt", "4",
                                             "--loss_agg_mode", "seq-mean-token-mean", "--cliprange_low", "0.1",
                                             "--cliprange_high", "0.3", "--rollout_is_cap", "2", "--kl_in", "loss",
                                             "--grpo_no_std_scaling", "--reward_fn", "exact_match",
                                             "0.5*regex_format", "--reward_url", "http://127.0.0.1:1/score"])
    s = config.from_args(config.PPOConfig, args)
    assert (s.rl_algorithm, s.num_samples_per_prompt, s.loss_agg_mode, s.kl_in) == \
        ("grpo", 4, "seq-mean-token-mean", "loss")
    assert (s.cliprange_low, s.cliprange_high, s.rollout_is_cap, s.grpo_no_std_scaling) == (0.1, 0.3, 2.0, True)
    assert args.reward_fn == ["exact_match", "0.5*regex_format"] and args.reward_url == ["http://127.0.0.1:1/score"]
    assert check_reward_flags(args) is False  # rules only: no reward model is loaded


def test_ppo_defaults_unchanged_and_need_a_critic():
    args = build_parser().parse_args(BASE)
    s = config.from_args(config.PPOConfig, args)
    assert (s.rl_algorithm, s.num_samples_per_prompt) == ("ppo", 1)
    with pytest.raises(ValueError, match="--critic_model_name_or_path"):
        check_reward_flags(args)
    args = build_parser().parse_args(BASE + ["--critic_model_name_or_path", "c", "--reward_fn", "exact_match"])
    with pytest.raises(ValueError, match="--reward_fn"):
        check_reward_flags(args)
    args = build_parser().parse_args(BASE + ["--rl_algorithm", "rloo"])
    with pytest.raises(ValueError, match="--reward_fn, --reward_url or --reward_model_name_or_path"):
        check_reward_flags(args)


def test_plan_counts_answers_and_no_critic_steps():
    p = plan(rl_algorithm="grpo", num_samples_per_prompt=4)
    assert p.rollouts_per_buffer == 2 * 4 * 2 and p.micro_batches_per_generation == 2
    assert p.critic_steps == 0 and p.actor_steps == 10 * 2
    ppo = plan(per_device_training_batch_size=2)
    assert ppo.critic_steps == ppo.actor_steps == 10 and ppo.rollouts_per_buffer == 4


@pytest.mark.parametrize("kw, flag", [
    (dict(rl_algorithm="grpo", num_samples_per_prompt=1), "--num_samples_per_prompt"),
    (dict(rl_algorithm="rloo", num_samples_per_prompt=3), "--per_device_training_batch_size 4"),
    (dict(rl_algorithm="grpo", num_samples_per_prompt=2, gradient_accumulation_steps=2, ppo_epochs=2,
          per_device_training_batch_size=4), "--gradient_accumulation_steps 2"),
    (dict(rl_algorithm="sppo"), "--rl_algorithm"),
])
def test_plan_errors_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        plan(**kw)


def test_train_py_skips_step2_without_reward_model():
    import train
    from chatrl.cli import normalize_argv

    parser = train.build_parser()
    a = parser.parse_args(normalize_argv(["--actor-model", "x", "--rl-algorithm", "grpo", "--reward-fn", "exact_match"],
                                         {x.dest for x in parser._actions}))
    steps, flags, why = train.plan_pipeline(a)
    assert steps == [1, 3] and "step 2 (reward model) skipped" in why
    assert flags[:4] == ["--rl_algorithm", "grpo", "--num_samples_per_prompt", "4"]
    assert flags[4:] == ["--reward_fn", "exact_match"]
    parsed = build_parser().parse_args(BASE + flags)  # step 3 accepts what train.py passes
    assert parsed.rl_algorithm == "grpo" and check_reward_flags(parsed) is False
    a = train.build_parser().parse_args(["--actor_model", "x", "--reward_model", "y", "--rl_algorithm", "rloo"])
    assert train.plan_pipeline(a)[0] == [1, 2, 3] and train.plan_pipeline(a)[2] is None
    a = train.build_parser().parse_args(["--actor_model", "x", "--reward_fn", "exact_match"])
    with pytest.raises(SystemExit, match="critic-free"):
        train.plan_pipeline(a)
