"""Learning algorithms on a tenant's policy, one file each (CleanRL's habit: hyper-parameters, advantages,
loss and update together): PPO and GRPO (online RL, Gaussian heads) and SFT (every family).

``ppo`` and ``grpo`` import torch inside their functions only: the control plane validates jobs against
their configs (``nexus.spec.RLJob.ppo`` / ``.grpo``, chosen by ``RLJob.algorithm``), and the scheduler process never
imports torch.
"""
