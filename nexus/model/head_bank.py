"""Many tenants' Gaussian OFT heads and critics of one shape, as stacked weights: one batched forward for the
rows of many tenants in an inference group.

On a CPU the ~20 small ops of a tenant's head and critic (a row or two each) cost far more in calls than in
arithmetic: a group of 64 rows over 16 tenants spent most of its time there (``experiments/qos/forward.py``).
Stacked, every tenant's layer is one slice of a ``[S, in, out]`` tensor and the whole group runs as one
``baddbmm`` per layer, over rows padded to ``[S, m]`` (S: the slots from the lowest to the highest of the group's
tenants; m: the most rows any one tenant has in the group).

A slot holds a copy of one policy object's weights. The engine replaces a tenant's policy at each weight sync
(never changes one in place), so a slot is current while it holds that very object (:meth:`HeadBank.holds`).
Same numbers as :meth:`TenantPolicy.act` up to float rounding (batched matmuls sum in another order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nexus.model.layers import normalize_proprio
from nexus.model.oft_head import OFTActionHead
from nexus.model.policy import TenantPolicy
from nexus.model.proprio_norm import standardize


@dataclass(frozen=True)
class HeadShape:
    """What makes two tenants' heads stackable."""

    feat_dim: int
    proprio_dim: int
    hidden: int
    action_dim: int
    chunk: int
    proprio_norm: str  # "tanh" or "running" (per-slot statistics): nexus.model.proprio_norm


def head_shape(policy: TenantPolicy) -> HeadShape | None:
    """The policy's shape if the bank can hold it: an OFT head with a proprio input and a critic."""
    head = policy.head
    if not isinstance(head, OFTActionHead) or policy.value is None or head.proprio_proj is None:
        return None
    return HeadShape(head.feat_proj.in_features, head.proprio_proj.in_features, head.feat_proj.out_features,
                     head.action_dim, head.chunk, policy.proprio_norm.kind)


def _linears(policy: TenantPolicy) -> dict[str, torch.nn.Linear]:
    """The head's and critic's layers by bank name (stored as [in, out] for ``baddbmm``, biases as [1, out])."""
    head, value = policy.head, policy.value.net  # type: ignore[union-attr]  # head_shape checked it
    return {"feat_proj": head.feat_proj, "proprio_proj": head.proprio_proj, "dec0": head.decoder[0],
            "dec1": head.decoder[2], "dec2": head.decoder[4], "val0": value[0], "val1": value[2], "val2": value[4]}


class HeadBank:
    """Stacked weights of the heads of one :class:`HeadShape`, one slot per tenant."""

    def __init__(self, shape: HeadShape, capacity: int = 8) -> None:
        self.shape = shape
        self.slots: dict[str, int] = {}  # tenant -> slot
        self.held: dict[str, TenantPolicy] = {}  # tenant -> the policy object its slot copies
        self._free: list[int] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.biases: dict[str, torch.Tensor] = {}
        self.queries = torch.zeros(0)
        self.log_std = torch.zeros(0)
        self.state_mean = torch.zeros(0)  # "running" banks: each slot's state statistics (else unused zeros)
        self.state_inv_std = torch.zeros(0)
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self.queries.shape[0]

    def _allocate(self, capacity: int) -> None:
        s = self.shape
        dims = {"feat_proj": (s.feat_dim, s.hidden), "proprio_proj": (s.proprio_dim, s.hidden),
                "dec0": (s.hidden, s.hidden), "dec1": (s.hidden, s.hidden), "dec2": (s.hidden, s.action_dim),
                "val0": (s.feat_dim + s.proprio_dim, s.hidden), "val1": (s.hidden, s.hidden), "val2": (s.hidden, 1)}
        old = self.capacity if self.weights else 0
        grown_w = {k: torch.zeros(capacity, i, o) for k, (i, o) in dims.items()}
        grown_b = {k: torch.zeros(capacity, 1, o) for k, (_, o) in dims.items()}
        queries, log_std = torch.zeros(capacity, s.chunk, s.hidden), torch.zeros(capacity, s.chunk * s.action_dim)
        mean, inv_std = torch.zeros(capacity, s.proprio_dim), torch.ones(capacity, s.proprio_dim)
        if old:
            for k in dims:
                grown_w[k][:old], grown_b[k][:old] = self.weights[k], self.biases[k]
            queries[:old], log_std[:old] = self.queries, self.log_std
            mean[:old], inv_std[:old] = self.state_mean, self.state_inv_std
        self.weights, self.biases, self.queries, self.log_std = grown_w, grown_b, queries, log_std
        self.state_mean, self.state_inv_std = mean, inv_std
        self._free = sorted(set(self._free) | set(range(old, capacity)) - set(self.slots.values()))

    def holds(self, tenant: str, policy: TenantPolicy) -> bool:
        return self.held.get(tenant) is policy

    @torch.no_grad()
    def put(self, tenant: str, policy: TenantPolicy) -> None:
        """The tenant's slot (a new one if it has none) now copies ``policy``."""
        if head_shape(policy) != self.shape:
            raise ValueError(f"tenant {tenant!r}: head shape {head_shape(policy)} is not this bank's {self.shape}")
        if tenant not in self.slots:
            if not self._free:
                self._allocate(2 * self.capacity)
            self.slots[tenant] = self._free.pop(0)
        i = self.slots[tenant]
        for name, layer in _linears(policy).items():
            self.weights[name][i].copy_(layer.weight.T)
            self.biases[name][i, 0].copy_(layer.bias)
        self.queries[i].copy_(policy.head.action_queries)
        self.log_std[i].copy_(policy.head.log_std)
        if self.shape.proprio_norm == "running":
            self.state_mean[i].copy_(policy.proprio_norm.mean)
            self.state_inv_std[i].copy_(policy.proprio_norm.inv_std())
        self.held[tenant] = policy

    def drop(self, tenant: str) -> None:
        i = self.slots.pop(tenant, None)
        self.held.pop(tenant, None)
        if i is not None:
            self._free = sorted([*self._free, i])

    def _layer(self, name: str, x: torch.Tensor, span: slice) -> torch.Tensor:
        return torch.baddbmm(self.biases[name][span], x, self.weights[name][span])

    def forward(self, tenants: list[str], pooled: torch.Tensor, proprio: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row r of tenant ``tenants[r]`` -> (Gaussian mean [R, chunk*A], log std [R, chunk*A], value [R])."""
        at = torch.tensor([self.slots[t] for t in tenants])
        lo = int(at.min())
        span = slice(lo, int(at.max()) + 1)  # slots outside the rows' range are not computed (views, no copy)
        slots = at - lo
        used = span.stop - lo
        counts = torch.zeros(used, dtype=torch.long)
        pos = torch.empty_like(slots)
        for r, s in enumerate(slots.tolist()):  # each row's place among its tenant's rows
            pos[r] = counts[s]
            counts[s] += 1
        m = int(counts.max())
        x = pooled.new_zeros(used, m, pooled.shape[1])
        p = pooled.new_zeros(used, m, proprio.shape[1])
        x[slots, pos], p[slots, pos] = pooled, self._normalized(proprio.to(pooled.dtype), at)
        s = self.shape
        ctx = self._layer("feat_proj", x, span) + self._layer("proprio_proj", p, span)  # [S, m, H]
        tokens = (ctx.unsqueeze(2) + self.queries[span].unsqueeze(1)).reshape(used, m * s.chunk, s.hidden)
        h = F.gelu(self._layer("dec0", tokens, span))
        h = F.gelu(self._layer("dec1", h, span))
        mean = self._layer("dec2", h, span).reshape(used, m, s.chunk * s.action_dim)
        v = F.gelu(self._layer("val0", torch.cat([x, p], dim=-1), span))
        v = F.gelu(self._layer("val1", v, span))
        value = self._layer("val2", v, span).squeeze(-1)
        return mean[slots, pos], self.log_std[at], value[slots, pos]

    def _normalized(self, proprio: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """Each row's state as its tenant's policy normalizes it (``TenantPolicy.proprio_norm``)."""
        if self.shape.proprio_norm == "running":
            return standardize(proprio, self.state_mean[at], self.state_inv_std[at])
        return normalize_proprio(proprio)

    def padded_rows(self, tenants: list[str]) -> int:
        """Rows :meth:`forward` would compute for these rows' tenants, padding included."""
        slots = [self.slots[t] for t in tenants]
        return (max(slots) - min(slots) + 1) * max(slots.count(s) for s in set(slots))
