"""π-style action expert (OpenPI's π0): flow matching with attention into the VLM prefix.

The suffix is [state token, action tokens]: the proprio state is projected into one token (π0's
``state_proj``), each noisy action is projected and fused with the flow-time embedding by a small MLP
(π0's ``action_time_mlp``). Layer l of the expert attends, in ONE softmax, over the prefix and the
suffix, as π0's action expert does over the shared KV of each PaliGemma layer: its keys / values for
the prefix come from the backbone's hidden states of the matching layer (the last ``depth`` layers,
projected by the expert's own K/V weights, since the shared backbone is frozen), and π0's
block-causal mask applies — the prefix is visible to all, the state token sees the prefix and
itself, action tokens see everything (prefix, state, all actions). Gemma-style blocks: RMSNorm,
GeGLU MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nexus.model.backbone_features import BackboneFeatures
from nexus.model.layers import MultiHeadAttention, timestep_embedding


class PiExpertLayer(nn.Module):
    def __init__(self, width: int, heads: int, prefix_dim: int) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(width)
        self.prefix_norm = nn.RMSNorm(prefix_dim)
        self.attn = MultiHeadAttention(width, heads)
        self.prefix_k = nn.Linear(prefix_dim, width)
        self.prefix_v = nn.Linear(prefix_dim, width)
        self.post_norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, 4 * width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, prefix: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N, S, W] suffix; prefix [N, T, D] hidden states; mask [N, S, T + S] (True = attend)."""
        a = self.attn
        h = self.input_norm(x)
        p = self.prefix_norm(prefix)
        k = torch.cat([a.split(self.prefix_k(p)), a.split(a.k(h))], dim=2)
        v = torch.cat([a.split(self.prefix_v(p)), a.split(a.v(h))], dim=2)
        x = x + a.attend(a.split(a.q(h)), k, v, mask)
        h = self.post_norm(x)
        return x + self.down(F.gelu(self.gate(h), approximate="tanh") * self.up(h))


class PiActionExpert(nn.Module):
    """Flow-matching action expert attending layer-wise to the backbone's prefix; takes the proprio state."""

    def __init__(self, feat_dim: int, proprio_dim: int, action_dim: int, hidden_dim: int = 256, chunk: int = 1,
                 depth: int = 2, heads: int = 4,
                 init_log_std: float = -0.5) -> None:
        super().__init__()
        w = hidden_dim
        self.action_dim, self.chunk, self.width = action_dim, chunk, w
        # RL's exploration noise on the last denoising step (TenantPolicy), one std per action of the chunk
        self.log_std = nn.Parameter(torch.full((chunk * action_dim,), float(init_log_std)))
        self.prefix_layers: tuple[int, ...] = tuple(range(-depth, 0))  # layer l <-> backbone layer -(depth-l)
        self.state_proj = nn.Linear(proprio_dim, w) if proprio_dim > 0 else None
        self.action_in_proj = nn.Linear(action_dim, w)
        self.action_time_mlp_in = nn.Linear(2 * w, w)
        self.action_time_mlp_out = nn.Linear(w, w)
        self.position = nn.Parameter(torch.randn(chunk + 1, w) * 0.02)  # the expert has no RoPE
        self.layers = nn.ModuleList(PiExpertLayer(w, heads, feat_dim) for _ in range(depth))
        self.final_norm = nn.RMSNorm(w)
        self.action_out_proj = nn.Linear(w, action_dim)

    def _suffix_mask(self, prefix_mask: torch.Tensor, n_suffix: int, has_state: bool) -> torch.Tensor:
        """[N, S, T + S]: prefix padding hidden; the state token does not see the action tokens."""
        n = prefix_mask.shape[0]
        suffix = torch.ones(n_suffix, n_suffix, dtype=torch.bool, device=prefix_mask.device)
        if has_state:
            suffix[0, 1:] = False
        prefix = prefix_mask[:, None, :].expand(n, n_suffix, prefix_mask.shape[1])
        return torch.cat([prefix, suffix.unsqueeze(0).expand(n, -1, -1)], dim=2)

    def velocity(self, cond: BackboneFeatures, proprio: torch.Tensor, x: torch.Tensor,
                 tau: torch.Tensor) -> torch.Tensor:
        """Flow velocity [N, chunk, A] at noisy chunk ``x`` [N, chunk, A] and flow times ``tau`` [N]."""
        temb = timestep_embedding(tau, self.width).to(x.dtype).unsqueeze(1).expand(-1, self.chunk, -1)
        a = self.action_in_proj(x)
        a = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, temb], -1))))
        has_state = self.state_proj is not None
        if has_state:
            state = self.state_proj(proprio).unsqueeze(1)  # type: ignore[misc]
            seq = torch.cat([state, a], 1) + self.position.unsqueeze(0)
        else:
            seq = a + self.position[1:].unsqueeze(0)
        mask = self._suffix_mask(cond.mask, seq.shape[1], has_state)  # type: ignore[arg-type]
        for layer, index in zip(self.layers, self.prefix_layers, strict=True):
            seq = layer(seq, cond.layer(index), mask)
        return self.action_out_proj(self.final_norm(seq[:, -self.chunk:]))
