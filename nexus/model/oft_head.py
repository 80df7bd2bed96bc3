"""OFT-style action head (StarVLA's QwenOFT): learned action queries decoded in parallel by an MLP.

OFT ("optimized fine-tuning") predicts a whole action chunk in parallel from learned action queries
instead of decoding action tokens. Each query is combined with the (frozen, pooled) backbone feature
and the tenant's proprio vector and decoded by a shared MLP into one step of the chunk. The output is
the mean of a Gaussian policy with a state-independent learned std, so the same head serves SFT
(regress the mean) and RL (PPO / GRPO on exact log-probabilities).

Action space: the Gaussian lives in unbounded R^A; environments take actions in [-1, 1]. Samples are
NOT clipped here, so the log-probability stays exact for PPO: the caller clips the action it sends to
the environment and keeps the unclipped sample for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nexus.model.backbone_features import BackboneFeatures
from nexus.model.layers import mlp, mlp_plain


class OFTActionHead(nn.Module):
    """Learned action queries + pooled feature + proprio -> MLP -> Gaussian mean [N, chunk*action_dim]."""

    prefix_layers: tuple[int, ...] = ()  # pooled features only: no prefix tokens needed

    def __init__(self, feat_dim: int, proprio_dim: int, action_dim: int, hidden_dim: int = 256,
                 chunk: int = 1, init_log_std: float = -0.5) -> None:
        super().__init__()
        self.action_dim, self.chunk = action_dim, chunk
        self.feat_proj = nn.Linear(feat_dim, hidden_dim)
        self.proprio_proj = nn.Linear(proprio_dim, hidden_dim) if proprio_dim > 0 else None
        self.action_queries = nn.Parameter(torch.randn(chunk, hidden_dim) * 0.02)
        # small last layer: the initial policy mean is ~0 (centre of the action box)
        self.decoder = mlp(hidden_dim, hidden_dim, action_dim, out_std=0.01)
        # state-independent exploration noise, one per action dimension of the chunk
        self.log_std = nn.Parameter(torch.full((chunk * action_dim,), float(init_log_std)))

    def forward(self, feat: torch.Tensor | BackboneFeatures, proprio: torch.Tensor,
                plain: bool = False) -> torch.Tensor:
        """The Gaussian mean, [N, chunk*action_dim], of ``proprio`` as the policy normalized it
        (:mod:`nexus.model.proprio_norm`). ``plain``: the same ops without a module call per layer
        (inference on a plain module: see :func:`~nexus.model.layers.mlp_plain`)."""
        pooled = feat.pooled if isinstance(feat, BackboneFeatures) else feat
        if plain:
            ctx = F.linear(pooled, self.feat_proj.weight, self.feat_proj.bias)
            if self.proprio_proj is not None:
                ctx = ctx + F.linear(proprio, self.proprio_proj.weight, self.proprio_proj.bias)
            return mlp_plain(self.decoder, ctx.unsqueeze(1) + self.action_queries.unsqueeze(0)).flatten(1)
        ctx = self.feat_proj(pooled)
        if self.proprio_proj is not None:
            ctx = ctx + self.proprio_proj(proprio)
        tokens = ctx.unsqueeze(1) + self.action_queries.unsqueeze(0)  # [N, chunk, hidden]
        return self.decoder(tokens).flatten(1)
