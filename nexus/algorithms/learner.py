"""What the algorithms train: one tenant's slot (the actor's ``TenantSlot``) and its Gaussian policy, as
protocols (the algorithms import no service or policy class: the control plane imports their configs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from nexus.model.backbone_features import BackboneFeatures


class GaussianPolicy(Protocol):
    """A policy with exact action log-probabilities (``nexus.model.policy.TenantPolicy``, every family)."""

    def evaluate(self, feats: BackboneFeatures | torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log-probability of ``actions``, entropy, value) per row."""
        ...


# a loss on the tenant's policy: policy -> (loss, stats)
LossFn = Callable[[Any], tuple["torch.Tensor", dict[str, Any]]]


class Seeded(Protocol):
    seed: int


class Learner(Protocol):
    """A tenant's slot on one rank of the actor group: its spec (seeds), version, chunk, policy and optimizer
    (one DeepSpeed engine over the group's ``world_size`` ranks)."""

    spec: Seeded
    version: int
    chunk: int
    policy: Any
    rank: int
    world_size: int

    def train_step(self, loss_fn: LossFn, share: float = 1.0) -> dict[str, float]:
        """Backpropagate ``loss_fn(policy)`` on this rank's ``share`` of a batch (``nexus.algorithms.shards``)
        and apply one optimizer step (every rank together) -> the batch's stats."""
        ...
