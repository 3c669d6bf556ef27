"""Derived sizes of each step (chatrl.sizes.plan_steps / plan_ppo): hand-derived counts, and errors
that name the flags and a fix for inexact divisions and impossible combinations."""

from dataclasses import fields

import pytest

from chatrl.config import OptimConfig, PackingConfig, PPOConfig, RolloutConfig
from chatrl.rl import algorithms
from chatrl.sizes import BatchSizes, PromptCounts, plan_ppo, plan_steps


def ppo(**kw):
    base = dict(n_generation_batches=10, n_prompts=80, world_size=2, per_device_generation_batch_size=4,
                per_device_training_batch_size=2, generation_batches=2, ppo_epochs=2, gradient_accumulation_steps=1,
                num_train_epochs=3, max_steps=0, num_warmup_steps=0, ptx=False, algorithm=algorithms.get("ppo"))
    return plan_from_flags(**{**base, **kw})


def plan_from_flags(ptx=False, algorithm=None, adaptive_kl=False, **kw):
    """:func:`plan_ppo` of its flags' values, each put in its block (the PPO block names the algorithm;
    unset here: one answer per prompt and the token-mean aggregation)."""
    ppo = {"num_samples_per_prompt": 1, "loss_agg_mode": "token-mean",
           "kl_ctl": "adaptive" if adaptive_kl else "fixed"}
    blocks = {PromptCounts: {}, RolloutConfig: {}, PPOConfig: ppo, OptimConfig: {}, PackingConfig: {}}
    if algorithm is not None:
        blocks[PPOConfig]["rl_algorithm"] = algorithm.name
    for name, value in kw.items():
        block = next(b for b in blocks if name in {f.name for f in fields(b)})
        blocks[block][name] = value
    counts, rollout, ppo, optim, packing = (b(**v) for b, v in blocks.items())
    return plan_ppo(counts, rollout, ppo, optim, packing, ptx)


def test_ppo_plan_counts():
    p = ppo()
    # 10 generation batches per epoch / 2 per buffer = 5 buffers, x 3 epochs
    assert (p.buffers_per_epoch, p.total_buffers) == (5, 15)
    assert p.rollouts_per_buffer == 2 * 4 * 2 and p.micro_batches_per_generation == 2
    assert p.micro_batches_per_buffer == 2 * 2 * 2  # generation batches x PPO epochs x micro-batches
    assert p.critic_steps == p.actor_steps == 15 * 8
    ptx = ppo(ptx=True, gradient_accumulation_steps=4, max_steps=6, loss_agg_mode="micro-batch-token-mean")
    assert ptx.total_buffers == 6 and ptx.critic_steps == 6 * 8 // 4 and ptx.actor_steps == 2 * ptx.critic_steps


@pytest.mark.parametrize("kw, says", [
    (dict(per_device_generation_batch_size=5), "--per_device_generation_batch_size 5 is not a multiple of "
                                               "--per_device_training_batch_size 2"),
    (dict(gradient_accumulation_steps=3, loss_agg_mode="micro-batch-token-mean"),
     "--gradient_accumulation_steps 3 does not divide the 8 training micro-batches"),
    (dict(gradient_accumulation_steps=3), "--gradient_accumulation_steps 3 does not divide the 4 micro-batches of "
                                          "one pass over a buffer"),
    (dict(n_generation_batches=1), "lower --per_device_generation_batch_size or --generation_batches"),
    (dict(num_warmup_steps=120), "--num_warmup_steps 120 must be shorter than the run (120 critic optimizer steps)"),
    (dict(num_warmup_steps=-1), "--num_warmup_steps -1 must be >= 0"),
    (dict(num_warmup_steps=2.5), "--num_warmup_steps 2.5 must be >= 0 and a whole number of steps"),
    (dict(ppo_epochs=0), "--ppo_epochs must be >= 1"),
    (dict(print_answers_interval=0), "--print_answers_interval must be >= 1, got 0"),
    (dict(kl_horizon=0.0), "--kl_horizon must be > 0 rollouts"),
])
def test_ppo_plan_errors_name_the_flags(kw, says):
    with pytest.raises(ValueError) as err:
        ppo(**kw)
    assert says in str(err.value)


def test_step_plan_counts_and_errors():
    p = plan_steps(n_batches=25, n_samples=100, batch=BatchSizes(4, 2, 1), num_train_epochs=2, max_steps=0,
                   num_warmup_steps=3)
    assert (p.steps_per_epoch, p.total_steps) == (12, 24)  # the epoch's trailing half step is dropped
    assert plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 5, 0).total_steps == 5
    with pytest.raises(ValueError, match="lower --per_device_train_batch_size or --gradient_accumulation_steps"):
        plan_steps(1, 4, BatchSizes(4, 2, 1), 1, 0, 0)
    with pytest.raises(ValueError, match="--num_warmup_steps 24 must be shorter than the run"):
        plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 0, 24)


def test_run_length_defaults_adapt_to_a_short_run_and_say_so_once():
    """`--max_steps 3` with step 3's defaults: DeepSpeed-Chat's 100 warm-up steps used to refuse the run
    (`--num_warmup_steps 100 must be >= 0 and shorter than the run (3 critic optimizer steps)`). Unset,
    every run-length default adapts with one note each; a value the user gives is kept or refused."""
    for algorithm, unit in (("ppo", "critic"), ("grpo", "actor")):
        short = ppo(max_steps=3, num_warmup_steps=None, generation_batches=1, ppo_epochs=1,
                    algorithm=algorithms.get(algorithm), num_samples_per_prompt=1 if algorithm == "ppo" else 2,
                    kl_horizon=None, adaptive_kl=True)
        steps = 3 * (2 if algorithm == "ppo" else 4)  # micro-batches per buffer: 4 prompts (x 2 answers) / 2
        assert (short.total_buffers, short.num_warmup_steps, short.print_answers_interval) == (3, steps // 10, 1)
        assert short.kl_horizon == 3 * short.rollouts_per_buffer
        assert short.notes == (
            f"--num_warmup_steps unset: the default 100 is longer than a tenth of this run ({steps} {unit} optimizer "
            f"steps); using {steps // 10}. Set it to choose another",
            f"--kl_horizon unset: the default 10000 rollouts is longer than this run (3 steps of "
            f"{short.rollouts_per_buffer} rollouts); using {short.kl_horizon:g}",
            "--print_answers_interval unset: a rollout is recorded every 1 step(s) of this 3-step run (default 10)")
    assert ppo(max_steps=3, num_warmup_steps=None, kl_horizon=None).notes[1:] == (
        "--print_answers_interval unset: a rollout is recorded every 1 step(s) of this 3-step run (default 10)",)
    # long enough: the defaults as before, and nothing to say
    long = ppo(n_generation_batches=4000, num_warmup_steps=None, kl_horizon=None, adaptive_kl=True)
    assert (long.num_warmup_steps, long.kl_horizon, long.print_answers_interval, long.notes) == (100, 10000, 10, ())
    assert ppo(n_generation_batches=200, max_steps=100, num_warmup_steps=None).num_warmup_steps == 80  # 800 steps / 10
    # given values: kept when they fit (a fraction of the run too), refused otherwise
    given = ppo(max_steps=3, num_warmup_steps=2, kl_horizon=50.0, adaptive_kl=True, print_answers_interval=7)
    assert (given.num_warmup_steps, given.kl_horizon, given.print_answers_interval, given.notes) == (2, 50.0, 7, ())
    assert ppo(max_steps=3, num_warmup_steps=0.125).num_warmup_steps == 3  # ceil(0.125 x 24)
    with pytest.raises(ValueError, match=r"--num_warmup_steps 100 must be shorter than the run \(24 critic"):
        ppo(max_steps=3, num_warmup_steps=100)
    # steps 1-2 and DPO: the default 0 always fits; a fraction gives transformers' ceil(ratio x steps)
    assert plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 3, None).notes == ()
    assert plan_steps(114, 1, BatchSizes(1, 1, 1), 1, 0, 0.08).num_warmup_steps == 10
    assert plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 3, None, default_warmup=5).num_warmup_steps == 0


def test_a_given_warmup_too_long_is_a_usage_error_and_a_run_ending_before_max_steps_says_so():
    """A per-step script's `--num_warmup_steps 10` with a user's `--max_steps 10` ended in a traceback
    per rank (a ValueError): it is a usage error now, printed alone. `--max_steps` is only a cap: a run
    that ends before it (step 1 ran 24 of a documented 160) says so once, at its end."""
    from chatrl.errors import UsageError

    with pytest.raises(UsageError, match="--num_warmup_steps 10 must be shorter than the run"):
        plan_steps(25, 100, BatchSizes(4, 2, 1), 1, 10, 10)
    with pytest.raises(UsageError, match="--per_device_generation_batch_size"):
        ppo(per_device_generation_batch_size=3)
    short = plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 160, 0)  # 12 steps per epoch, 2 epochs: 24 of 160
    assert short.total_steps == 24
    assert short.cap_note == ("--max_steps 160 is a cap: this run ended after 24 optimizer steps, when its 2 epochs "
                              "of 100 samples ran out (--num_train_epochs, or more data, for a longer run)")
    assert plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 24, 0).cap_note is None  # the cap is reached
    assert plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 0, 0).cap_note is None  # no cap
    # step 3: 10 generation batches / 2 per buffer = 5 buffers per epoch, 3 epochs: 15 of 40
    assert ppo(max_steps=40).cap_note == ("--max_steps 40 is a cap: this run ended after 15 steps (experience buffers), "
                                          "when its 3 epochs of 80 prompts ran out (--num_train_epochs, or more prompts, "
                                          "for a longer run)")
    assert ppo(max_steps=15).cap_note is None and ppo(max_steps=4).cap_note is None


def test_an_unset_loss_aggregation_that_does_not_fit_adapts_in_the_plan_and_the_block_is_left_as_read():
    """The plan holds the loss aggregation: the PTX loss with accumulated micro-batches takes
    micro-batch-token-mean, a token budget takes token-mean over an algorithm's micro-batch-token-mean
    default; each says so in a note, a given value is kept, and the PPO block is never written."""
    from chatrl.rl.advantages import Advantages

    block = PPOConfig(rl_algorithm="ppo")
    ptx = plan_ppo(PromptCounts(10, 80, 2), RolloutConfig(generation_batches=2), block,
                   OptimConfig(gradient_accumulation_steps=2, num_warmup_steps=0), PackingConfig(), ptx=True)
    assert ptx.loss_agg_mode == "micro-batch-token-mean" and block.loss_agg_mode is None
    assert ptx.notes[0].startswith("the PTX loss with --gradient_accumulation_steps > 1 needs a per-micro")
    with pytest.raises(ValueError, match="--loss_agg_mode token-mean needs --gradient_accumulation_steps 1"):
        ppo(ptx=True, gradient_accumulation_steps=4, loss_agg_mode="token-mean")  # a given value is kept
    algorithms.register(algorithms.Algorithm("per_micro_batch", lambda inputs, s: Advantages(inputs.scores),
                                             "a toy", loss_agg_mode="micro-batch-token-mean"))
    try:
        block = PPOConfig(rl_algorithm="per_micro_batch")
        budget = plan_ppo(PromptCounts(10, 80, 2), RolloutConfig(), block, OptimConfig(num_warmup_steps=0),
                          PackingConfig(max_tokens_per_micro_batch=64), ptx=False)
        assert budget.loss_agg_mode == "token-mean" and block.loss_agg_mode is None
        assert budget.notes[0].startswith("--max_tokens_per_micro_batch: the loss aggregation is token-mean")
        assert plan_ppo(PromptCounts(10, 80, 2), RolloutConfig(), block, OptimConfig(num_warmup_steps=0),
                        PackingConfig(), ptx=False).loss_agg_mode == "micro-batch-token-mean"
    finally:
        algorithms.ALGORITHMS.pop("per_micro_batch")
