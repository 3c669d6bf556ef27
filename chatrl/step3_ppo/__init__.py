"""Step 3: PPO (proximal policy optimization) against the reward model; `core` holds the pure maths."""
