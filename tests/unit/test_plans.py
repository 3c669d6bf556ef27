"""Derived sizes of each step (chatrl.sizes.plan_steps / plan_ppo): hand-derived counts, and errors
that name the flags and a fix for inexact divisions and impossible combinations."""

import pytest

from chatrl.rl import algorithms
from chatrl.sizes import BatchSizes, plan_ppo, plan_steps


def ppo(**kw):
    base = dict(n_generation_batches=10, n_prompts=80, world_size=2, per_device_generation_batch_size=4,
                per_device_training_batch_size=2, generation_batches=2, ppo_epochs=2, gradient_accumulation_steps=1,
                num_train_epochs=3, max_steps=0, num_warmup_steps=0, ptx=False, algorithm=algorithms.get("ppo"))
    return plan_ppo(**{**base, **kw})


def test_ppo_plan_counts():
    p = ppo()
    # 10 generation batches per epoch / 2 per buffer = 5 buffers, x 3 epochs
    assert (p.buffers_per_epoch, p.total_buffers) == (5, 15)
    assert p.rollouts_per_buffer == 2 * 4 * 2 and p.micro_batches_per_generation == 2
    assert p.micro_batches_per_buffer == 2 * 2 * 2  # generation batches x PPO epochs x micro-batches
    assert p.critic_steps == p.actor_steps == 15 * 8
    ptx = ppo(ptx=True, gradient_accumulation_steps=4, max_steps=6)
    assert ptx.total_buffers == 6 and ptx.critic_steps == 6 * 8 // 4 and ptx.actor_steps == 2 * ptx.critic_steps


@pytest.mark.parametrize("kw, says", [
    (dict(per_device_generation_batch_size=5), "--per_device_generation_batch_size 5 is not a multiple of "
                                               "--per_device_training_batch_size 2"),
    (dict(gradient_accumulation_steps=3), "--gradient_accumulation_steps 3 does not divide the 8 PPO micro-batches"),
    (dict(n_generation_batches=1), "lower --per_device_generation_batch_size or --generation_batches"),
    (dict(num_warmup_steps=120), "--num_warmup_steps 120 must be >= 0 and shorter than the run (120 critic"),
    (dict(ppo_epochs=0), "--ppo_epochs must be >= 1"),
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
    with pytest.raises(ValueError, match="--num_warmup_steps 24 must be >= 0 and shorter than the run"):
        plan_steps(25, 100, BatchSizes(4, 2, 1), 2, 0, 24)
