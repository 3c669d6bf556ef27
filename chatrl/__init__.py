"""chatrl: RLHF for causal language models (SFT → reward model → PPO) with a hybrid engine."""

__version__ = "0.1.0"
