"""How a tenant's policy scales its proprio (state) vector before its head and critic read it
(``TenantSpec.proprio_norm``).

- ``tanh``: tanh(x / 3), the same for every tenant, no statistics (the default).
- ``running``: each dimension standardized by the running mean and variance of the states of the tenant's
  training batches (SFT steps and RL updates; low-level ops leave them), clipped to ±5: the observation
  normalization of CleanRL's and Stable-Baselines3's PPO. A task whose informative states are small (PushCube's
  cube and goal positions: ~2-6 cm of spread, tanh(x / 3) makes them ~0.01) then reads them at unit scale: PPO on
  PushCube learned ~2x faster per update (``experiments/rl_learning/README.md``).

The statistics are buffers of the policy, so they travel with its weights: to the inference engines at each
weight sync, into checkpoints and exports. The actor folds a batch's states in *after* the update that trained
on it (:func:`nexus.actor.tasks.observe_states`): an update scores its batch with the statistics the
batch was collected under; the new version then collects its batch, and is trained on it, with the updated ones.
An SFT tenant's statistics settle on its dataset's states, so RL after SFT starts from the scale SFT trained at.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nexus.model.layers import normalize_proprio

PROPRIO_NORMS = ("tanh", "running")
CLIP = 5.0  # standardized states beyond ±5 are clipped (a rare joint-velocity spike stays bounded)
MIN_VAR = 1e-4  # a variance floor: a state that never moved (a constant flag) is not blown up by noise


def standardize(proprio: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor) -> torch.Tensor:
    """The running normalization's formula (one tenant's statistics, or each row's tenant's in the head bank)."""
    return ((proprio - mean) * inv_std).clamp(-CLIP, CLIP)


class TanhProprio(nn.Module):
    """tanh(x / 3): no statistics, no buffers (a tenant's state dict is what it was before this option)."""

    kind = "tanh"

    def normalize(self, proprio: torch.Tensor) -> torch.Tensor:
        """The state as the head reads it (called as a method, not a module: it is on every action's path)."""
        return normalize_proprio(proprio)

    forward = normalize

    def observe(self, states: np.ndarray | torch.Tensor) -> None:
        """Nothing to learn from states."""


class RunningProprio(nn.Module):
    """(x − mean) / sqrt(var + MIN_VAR), clipped to ±CLIP, from the states observed so far (none: mean 0, var 1)."""

    kind = "running"

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        # an integer: a policy cast to half precision keeps an exact count
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def normalize(self, proprio: torch.Tensor) -> torch.Tensor:
        return standardize(proprio, self.mean, self.inv_std())

    forward = normalize

    def inv_std(self) -> torch.Tensor:
        return torch.rsqrt(self.var + MIN_VAR)

    @torch.no_grad()
    def observe(self, states: np.ndarray | torch.Tensor) -> None:
        """Fold a batch of states [N, dim] into the statistics (Chan et al.'s parallel merge, in float64)."""
        x = np.asarray(states, np.float64).reshape(-1, self.mean.shape[0])
        if not len(x):
            return
        n, m = float(self.count), self.mean.double().cpu().numpy()
        b_n, b_mean, b_var = len(x), x.mean(0), x.var(0)
        total = n + b_n
        delta = b_mean - m
        mean = m + delta * b_n / total
        var = (self.var.double().cpu().numpy() * n + b_var * b_n + delta**2 * n * b_n / total) / total
        self.mean.copy_(torch.from_numpy(mean))
        self.var.copy_(torch.from_numpy(var))
        self.count.fill_(int(total))


def build_proprio_norm(kind: str, dim: int) -> TanhProprio | RunningProprio:
    if kind == "tanh":
        return TanhProprio()
    if kind == "running":
        return RunningProprio(dim)
    raise ValueError(f"unknown proprio_norm {kind!r} (one of {PROPRIO_NORMS})")
