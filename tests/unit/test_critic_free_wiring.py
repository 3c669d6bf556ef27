"""Step 3's wiring at parse and plan level, for every algorithm: the flags, the algorithm's defaults,
the derived sizes checked in sizes.plan_ppo, which models the reward and critic need, and train.py
skipping step 2 when the reward comes from rules alone."""

import pytest

from chatrl import config
from chatrl.errors import UsageError
from chatrl.pipeline import plan as planning
from chatrl.rl import algorithms
from chatrl.step3_ppo.main import build_parser
from chatrl.step3_ppo.settings import Step3Settings
from tests.unit.test_plans import plan_from_flags

BASE = ["--actor_model_name_or_path", "a", "--data_path", "d", "--output_dir", "o"]


def settings(*argv) -> Step3Settings:
    return config.read(Step3Settings, build_parser().parse_args([*BASE, *argv]))


def plan(rl_algorithm="ppo", **kw):
    algorithm = algorithms.get(rl_algorithm)
    args = dict(n_generation_batches=10, n_prompts=40, world_size=2, per_device_generation_batch_size=2,
                per_device_training_batch_size=4, generation_batches=1, ppo_epochs=1, gradient_accumulation_steps=1,
                num_train_epochs=1, max_steps=0, num_warmup_steps=0, ptx=False, algorithm=algorithm,
                loss_agg_mode=algorithm.loss_agg_mode)
    args.update(kw)
    return plan_from_flags(**args)


def test_step3_flags_reach_the_ppo_block():
    s = settings("--rl_algorithm", "grpo", "--num_samples_per_prompt", "4", "--loss_agg_mode", "seq-mean-token-mean",
                 "--cliprange_low", "0.1", "--cliprange_high", "0.3", "--rollout_is_cap", "2", "--kl_in", "loss",
                 "--grpo_no_std_scaling", "--reward_fn", "exact_match", "0.5*regex_format", "--reward_url",
                 "http://127.0.0.1:1/score")
    p = s.ppo
    assert (p.rl_algorithm, p.samples_per_prompt, p.loss_aggregation, p.kl_in) == ("grpo", 4, "seq-mean-token-mean", "loss")
    assert (p.clip_bounds, p.rollout_is_cap, p.grpo_no_std_scaling) == ((0.1, 0.3), 2.0, True)
    assert s.reward.reward_fn == ["exact_match", "0.5*regex_format"]
    assert s.reward.reward_url == ["http://127.0.0.1:1/score"]
    assert s.reward_model_path() is None and s.critic_source() is None  # rules only: no reward model, no critic


def test_algorithm_defaults_fill_unset_flags():
    ppo = settings().ppo
    assert (ppo.rl_algorithm, ppo.samples_per_prompt, ppo.loss_aggregation, ppo.clip_bounds) == \
        ("ppo", 1, "token-mean", (0.2, 0.2))
    grpo = settings("--rl_algorithm", "grpo").ppo
    assert (grpo.samples_per_prompt, grpo.loss_aggregation) == (4, "token-mean")
    assert settings("--rl_algorithm", "reinforce_pp").ppo.samples_per_prompt == 1
    assert settings("--rl_algorithm", "ppo", "--loss_agg_mode", "micro-batch-token-mean").ppo.loss_aggregation == \
        "micro-batch-token-mean"
    assert set(algorithms.names()) == {"ppo", "grpo", "rloo", "reinforce_pp"}
    choices = next(a.choices for a in build_parser()._actions if a.dest == "rl_algorithm")
    assert list(choices) == list(algorithms.names())  # the flag's choices are the registry


def test_which_models_the_reward_and_the_critic_need():
    s = settings("--critic_model_name_or_path", "rm")
    assert s.reward_model_path() == "rm" and s.critic_source() == ("rm", True)  # DeepSpeed-Chat's set-up
    s = settings("--reward_fn", "regex_format")  # PPO with a rule reward alone: critic from the actor
    assert s.reward_model_path() is None and s.critic_source() == ("a", False)
    s = settings("--critic_model_name_or_path", "c", "--reward_model_name_or_path", "rm", "--reward_fn", "exact_match")
    assert s.reward_model_path() == "rm" and s.critic_source() == ("c", True)  # both, summed
    with pytest.raises(UsageError, match="--critic_model_name_or_path"):
        settings().critic_source()
    with pytest.raises(UsageError, match="--reward_fn, --reward_url, --env or --reward_model_name_or_path"):
        settings("--rl_algorithm", "rloo").reward_model_path()


def test_an_environment_gives_a_reward_and_sizes_its_episodes():
    s = settings("--env", "calculator", "--max_prompt_seq_len", "32", "--max_answer_seq_len", "8")
    assert s.reward_model_path() is None and s.critic_source() == ("a", False)  # PPO: a critic from the actor
    e = s.episodes().plan
    assert (e.max_turns, e.max_total_tokens, e.max_prompt_len) == (4, 32 + 7 * 8, 32)  # an observation as long as a turn
    e = settings("--env", "calculator", "--max_turns", "2", "--max_total_tokens", "300").episodes().plan
    assert (e.max_turns, e.max_total_tokens) == (2, 300)
    assert settings().episodes() is None
    with pytest.raises(UsageError, match="--max_turns needs --env"):
        settings("--reward_fn", "exact_match", "--max_turns", "3").episodes()
    with pytest.raises(UsageError, match="--max_turns must be >= 1"):
        settings("--env", "calculator", "--max_turns", "0").episodes()
    with pytest.raises(UsageError, match="leaves no room"):
        settings("--env", "calculator", "--max_total_tokens", "256").episodes()


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


def test_train_py_skips_step2_when_rules_give_the_reward():
    import train
    from chatrl.cli import normalize_argv

    def pipeline(*argv):
        parser = train.build_parser()
        return config.read(planning.PipelineSettings,
                           parser.parse_args(normalize_argv(list(argv), {x.dest for x in parser._actions})))

    steps, flags, why = planning.plan_pipeline(pipeline("--actor-model", "x", "--rl-algorithm", "grpo",
                                                     "--reward-fn", "exact_match"))
    assert steps == [1, 3] and "step 2 (reward model) skipped" in why
    argv = config.to_argv(build_parser(), flags)
    assert argv == ["--rl_algorithm", "grpo", "--reward_fn", "exact_match"]  # N: the algorithm's default
    s = settings(*argv)  # step 3 accepts what train.py passes
    assert s.ppo.rl_algorithm == "grpo" and s.ppo.samples_per_prompt == 4 and s.reward_model_path() is None
    assert planning.plan_pipeline(pipeline("--actor_model", "x", "--reward_model", "y", "--rl_algorithm", "rloo"))[0] == \
        [1, 2, 3]
    steps, flags, why = planning.plan_pipeline(pipeline("--actor_model", "x", "--reward_fn", "exact_match"))
    assert steps == [1, 3] and "critic starts from step 1's actor" in why  # PPO with a rule reward
