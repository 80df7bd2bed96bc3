"""Learning algorithms on a tenant policy: PPO and GRPO (online RL, Gaussian heads) and SFT (every family)."""
