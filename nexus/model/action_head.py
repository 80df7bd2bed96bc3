"""A tenant's own trainable modules: an OFT-style Gaussian action head and a value head.

OFT ("optimized fine-tuning") predicts a whole action chunk in parallel from learned action queries
instead of decoding action tokens. Here each query is combined with the (frozen, pooled) backbone
feature and the tenant's proprio vector and decoded by a shared MLP into one step of the chunk.

Action space: the head's Gaussian lives in unbounded R^A; environments take actions in [-1, 1].
Samples are NOT clipped here, so the log-probability stays exact for PPO: the caller clips the action
it sends to the environment and keeps the unclipped sample for training (``VLAFramework.group_act``
returns both).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nexus.features import TenantSchema
from nexus.spec import TenantSpec

PROPRIO_SCALE = 3.0  # tanh(x / 3): ~linear for |x| < 1.5, saturating for large joint velocities etc.


def normalize_proprio(proprio: torch.Tensor) -> torch.Tensor:
    """Fixed, statistics-free squashing so raw simulator states of any scale stay in (-1, 1)."""
    return torch.tanh(proprio / PROPRIO_SCALE)


def _mlp(d_in: int, hidden: int, d_out: int, out_std: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                        nn.Linear(hidden, d_out))
    # Small last layer: the initial policy mean is ~0 (centre of the action box), values start ~0.
    nn.init.normal_(net[-1].weight, std=out_std)
    nn.init.zeros_(net[-1].bias)
    return net


class OFTActionHead(nn.Module):
    """Learned action queries + backbone feature + proprio -> MLP -> action chunk [N, chunk*action_dim]."""

    def __init__(self, feat_dim: int, proprio_dim: int, action_dim: int, hidden_dim: int = 256,
                 chunk: int = 1, init_log_std: float = -0.5) -> None:
        super().__init__()
        self.action_dim, self.chunk = action_dim, chunk
        self.feat_proj = nn.Linear(feat_dim, hidden_dim)
        self.proprio_proj = nn.Linear(proprio_dim, hidden_dim) if proprio_dim > 0 else None
        self.action_queries = nn.Parameter(torch.randn(chunk, hidden_dim) * 0.02)
        self.decoder = _mlp(hidden_dim, hidden_dim, action_dim, out_std=0.01)
        # State-independent exploration noise, one per action dimension of the chunk.
        self.log_std = nn.Parameter(torch.full((chunk * action_dim,), float(init_log_std)))

    def forward(self, feat: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        """The Gaussian mean, [N, chunk*action_dim]."""
        ctx = self.feat_proj(feat)
        if self.proprio_proj is not None:
            ctx = ctx + self.proprio_proj(normalize_proprio(proprio))
        tokens = ctx.unsqueeze(1) + self.action_queries.unsqueeze(0)  # [N, chunk, hidden]
        return self.decoder(tokens).flatten(1)


class ValueHead(nn.Module):
    """MLP(feature ⊕ normalized proprio) -> scalar state value."""

    def __init__(self, feat_dim: int, proprio_dim: int, hidden_dim: int = 256) -> None:
        super().__init__()
        self.net = _mlp(feat_dim + proprio_dim, hidden_dim, 1, out_std=0.01)

    def forward(self, feat: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([feat, normalize_proprio(proprio)], dim=-1)).squeeze(-1)


class TenantPolicy(nn.Module):
    """Everything a tenant trains: the Gaussian action head (``head``) and the critic (``value``)."""

    def __init__(self, head: OFTActionHead, value: ValueHead) -> None:
        super().__init__()
        self.head = head
        self.value = value

    @classmethod
    def from_spec(cls, spec: TenantSpec, schema: TenantSchema, feat_dim: int, chunk: int = 1) -> TenantPolicy:
        """Deterministic init from ``spec.seed`` (the caller's global RNG stream is left untouched)."""
        if spec.action_dim is not None and spec.action_dim != schema.action_dim:
            raise ValueError(f"tenant {spec.name!r}: spec action_dim={spec.action_dim} but the schema has "
                             f"action_dim={schema.action_dim}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            head = OFTActionHead(feat_dim, schema.proprio_dim, schema.action_dim, spec.hidden_dim, chunk,
                                 spec.init_log_std)
            value = ValueHead(feat_dim, schema.proprio_dim, spec.hidden_dim)
        return cls(head, value)

    @property
    def action_size(self) -> int:
        """Flat action size A = chunk * action_dim."""
        return self.head.chunk * self.head.action_dim

    @property
    def device(self) -> torch.device:
        return self.head.log_std.device

    def _inputs(self, feat: torch.Tensor | np.ndarray,
                proprio: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        dev, dt = self.head.log_std.device, self.head.log_std.dtype
        return torch.as_tensor(feat).to(dev, dt), torch.as_tensor(proprio).to(dev, dt)

    def mean_action(self, feat: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        feat, proprio = self._inputs(feat, proprio)
        return self.head(feat, proprio)

    def _dist(self, feat: torch.Tensor, proprio: torch.Tensor) -> torch.distributions.Normal:
        mean = self.head(feat, proprio)
        return torch.distributions.Normal(mean, self.head.log_std.exp().expand_as(mean))

    @torch.no_grad()
    def act(self, feat: torch.Tensor, proprio: torch.Tensor, deterministic: bool = False,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample (or take the mean) -> (unclipped action [N, A], logprob [N], value [N])."""
        feat, proprio = self._inputs(feat, proprio)
        dist = self._dist(feat, proprio)
        if deterministic:
            action = dist.mean
        else:
            noise = torch.randn(dist.mean.shape, generator=generator, device=dist.mean.device,
                                dtype=dist.mean.dtype)
            action = dist.mean + dist.stddev * noise
        return action, dist.log_prob(action).sum(-1), self.value(feat, proprio)

    def evaluate(self, feat: torch.Tensor, proprio: torch.Tensor,
                 action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """With autograd: (logprob [N], entropy [N], value [N]) of given (unclipped) actions."""
        feat, proprio = self._inputs(feat, proprio)
        dist = self._dist(feat, proprio)
        action = torch.as_tensor(action).to(dist.mean.device, dist.mean.dtype)
        return dist.log_prob(action).sum(-1), dist.entropy().sum(-1), self.value(feat, proprio)

