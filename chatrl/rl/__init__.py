"""The RL maths of step 3, below the step program: :mod:`~chatrl.rl.core` (masks, KL, PPO's rewards
and GAE, the value and PTX losses, KL control), :mod:`~chatrl.rl.advantages` (one estimator per
algorithm), :mod:`~chatrl.rl.loss` (the policy loss and its aggregation, the sampler/trainer
agreement) and :mod:`~chatrl.rl.algorithms` (the registry ``--rl_algorithm`` reads)."""
