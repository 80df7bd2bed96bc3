"""GR00T-style action head (StarVLA's QwenGR00T, after GR00T N1): a flow-matching DiT.

The sequence is [state token, action tokens]: the state token comes from an MLP state encoder, each
noisy action of the chunk from an action encoder that mixes it with the flow-time embedding (GR00T's
action encoder, one embodiment). DiT blocks are conditioned on the flow time by adaptive LayerNorm
(shift / scale / zero-initialized gate, as in DiT) and alternate, like GR00T's, between
cross-attention to the backbone's vision-language tokens and self-attention over the sequence.
An action decoder reads the velocity of every action token.
"""

from __future__ import annotations

import torch
from torch import nn

from nexus.model.backbone_features import BackboneFeatures
from nexus.model.layers import MultiHeadAttention, mlp, timestep_embedding


class DiTBlock(nn.Module):
    """adaLN(t) -> attention (cross to VL tokens, or self) -> gated residual; adaLN(t) -> MLP -> gated residual."""

    def __init__(self, width: int, heads: int, cross: bool, kv_dim: int) -> None:
        super().__init__()
        self.cross = cross
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.attn = MultiHeadAttention(width, heads, kv_dim=kv_dim if cross else width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.modulation = nn.Linear(width, 6 * width)
        nn.init.zeros_(self.modulation.weight)  # adaLN-Zero: every block starts as the identity
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, vl: torch.Tensor, vl_mask: torch.Tensor) -> torch.Tensor:
        mod = self.modulation(nn.functional.silu(temb)).unsqueeze(1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, -1)
        h = self.norm1(x) * (1 + scale1) + shift1
        if self.cross:
            h = self.attn(h, vl, vl_mask[:, None, :])
        else:
            h = self.attn(h, h)
        x = x + gate1 * h
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.ff(h)


class GR00TActionHead(nn.Module):
    """Flow-matching DiT over [state, actions] cross-attending to the backbone's last-layer tokens."""

    prefix_layers: tuple[int, ...] = (-1,)

    def __init__(self, feat_dim: int, proprio_dim: int, action_dim: int, hidden_dim: int = 256, chunk: int = 1,
                 depth: int = 4, heads: int = 4,
                 init_log_std: float = -0.5) -> None:
        super().__init__()
        w = hidden_dim
        self.action_dim, self.chunk, self.width = action_dim, chunk, w
        # RL's exploration noise on the last denoising step (TenantPolicy), one std per action of the chunk
        self.log_std = nn.Parameter(torch.full((chunk * action_dim,), float(init_log_std)))
        self.vl_norm = nn.LayerNorm(feat_dim)
        self.state_encoder = mlp(proprio_dim, w, w) if proprio_dim > 0 else None
        # action encoder: W1 a ; [W1 a, emb(t)] -> W2 -> swish -> W3
        self.action_w1 = nn.Linear(action_dim, w)
        self.action_w2 = nn.Linear(2 * w, w)
        self.action_w3 = nn.Linear(w, w)
        self.position = nn.Parameter(torch.randn(chunk + 1, w) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks = nn.ModuleList(DiTBlock(w, heads, cross=i % 2 == 0, kv_dim=feat_dim) for i in range(depth))
        self.final_norm = nn.LayerNorm(w, elementwise_affine=False)
        self.final_modulation = nn.Linear(w, 2 * w)
        nn.init.zeros_(self.final_modulation.weight)
        nn.init.zeros_(self.final_modulation.bias)
        self.decoder = mlp(w, w, action_dim)

    def velocity(self, cond: BackboneFeatures, proprio: torch.Tensor, x: torch.Tensor,
                 tau: torch.Tensor) -> torch.Tensor:
        """Flow velocity [N, chunk, A] at noisy chunk ``x`` [N, chunk, A] and flow times ``tau`` [N]."""
        vl = self.vl_norm(cond.layer(-1))
        vl_mask = cond.mask
        temb_raw = timestep_embedding(tau, self.width).to(x.dtype)
        a = self.action_w1(x)
        a = self.action_w3(nn.functional.silu(self.action_w2(torch.cat([a, temb_raw.unsqueeze(1).expand_as(a)], -1))))
        if self.state_encoder is not None:
            state = self.state_encoder(proprio).unsqueeze(1)
            seq = torch.cat([state, a], 1) + self.position.unsqueeze(0)
        else:
            seq = a + self.position[1:].unsqueeze(0)
        temb = self.time_mlp(temb_raw)
        for block in self.blocks:
            seq = block(seq, temb, vl, vl_mask)
        shift, scale = self.final_modulation(nn.functional.silu(temb)).unsqueeze(1).chunk(2, -1)
        seq = self.final_norm(seq) * (1 + scale) + shift
        return self.decoder(seq[:, -self.chunk:])
