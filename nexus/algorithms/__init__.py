"""Learning algorithms on a tenant policy: PPO (online RL) and SFT (behaviour cloning)."""
