"""Jobs and flows: the job manager and records, the three flows (SFT, RL, Eval), low-level ops, external rollouts, op
runs and exports."""
