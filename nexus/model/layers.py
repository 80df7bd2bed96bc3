"""Small building blocks shared by the action-module families."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PROPRIO_SCALE = 3.0  # tanh(x / 3): ~linear for |x| < 1.5, saturating for large joint velocities etc.
# One GELU module for every mlp of the process: it holds no state (no parameters, buffers or hooks), and a
# module's bookkeeping (~2.2 KiB of dicts) counts when a thousand tenants each hold several
# (experiments/scale/slot_memory.py). Never register hooks on it: they would run for every tenant.
_GELU = nn.GELU()


def gelu_module() -> nn.Module:
    """The process's shared stateless GELU module."""
    return _GELU


def normalize_proprio(proprio: torch.Tensor) -> torch.Tensor:
    """Fixed, statistics-free squashing so raw simulator states of any scale stay in (-1, 1)."""
    return torch.tanh(proprio / PROPRIO_SCALE)


def mlp(d_in: int, hidden: int, d_out: int, out_std: float | None = None) -> nn.Sequential:
    """Two hidden GELU layers; ``out_std`` shrinks the last layer (outputs start near 0)."""
    net = nn.Sequential(nn.Linear(d_in, hidden), gelu_module(), nn.Linear(hidden, hidden), gelu_module(),
                        nn.Linear(hidden, d_out))
    if out_std is not None:
        nn.init.normal_(net[-1].weight, std=out_std)
        nn.init.zeros_(net[-1].bias)
    return net


def mlp_plain(net: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``net(x)`` of an :func:`mlp` as functional ops, without a module call per layer: for the row or two of a
    tenant in an inference group the calls cost more than the matmuls. Plain modules only: it skips the
    layers' hooks (a ZeRO-3-partitioned module needs them to gather its weights), so never in training."""
    first, _, second, _, last = net
    x = F.gelu(F.linear(x, first.weight, first.bias))
    x = F.gelu(F.linear(x, second.weight, second.bias))
    return F.linear(x, last.weight, last.bias)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding [N, dim] of flow times t in [0, 1] (scaled by 1000, as DiT / GR00T do)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb.to(t.dtype) if t.is_floating_point() else emb


class MultiHeadAttention(nn.Module):
    """Attention of ``x`` [N, S, W] over keys/values ``kv`` [N, K, D_kv] with a boolean mask (True = attend).

    ``mask`` broadcasts to [N, S, K]; it is what keeps padding and future blocks out.
    """

    def __init__(self, width: int, heads: int, kv_dim: int | None = None) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(kv_dim or width, width)
        self.v = nn.Linear(kv_dim or width, width)
        self.o = nn.Linear(width, width)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        n, s, w = x.shape
        return x.view(n, s, self.heads, w // self.heads).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Heads-split q [N, h, S, d], k/v [N, h, K, d] -> output projection [N, S, W]."""
        attn_mask = None if mask is None else mask.unsqueeze(1)  # broadcast over heads
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        n, h, s, d = out.shape
        return self.o(out.transpose(1, 2).reshape(n, s, h * d))

    def forward(self, x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.attend(self.split(self.q(x)), self.split(self.k(kv)), self.split(self.v(kv)), mask)
