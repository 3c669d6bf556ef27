"""Step 2: the reward model (``python -m chatrl.step2_reward``; scoring: ``python -m chatrl.step2_reward.score``).

The model and its loading / saving live in :mod:`chatrl.models.reward_model`, which step 3 uses for its
critic and reward roles and the reward sources for scoring texts.
"""
