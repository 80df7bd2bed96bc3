"""The learning-rate schedule an RL job's updates share, whatever the algorithm (PPO, GRPO).

A config that inherits :class:`AnnealedLR` carries ``anneal_lr``; the job's flow asks ``lr_scale`` for each
update's share of the tenant's learning rate and the actor steps that update at it (``TenantSlot.lr_scaled``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AnnealedLR(BaseModel):
    # NaN / inf are refused in every float field of an algorithm's config (a NaN coefficient would poison a slot)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    anneal_lr: bool = Field(False, description="CleanRL's schedule: update i of a job's n runs at the tenant's "
                                               "learning rate x (1 - i / n), so the last versions move little")

    def lr_scale(self, index: int, updates: int) -> float:
        """The share of the tenant's learning rate that update ``index`` (0-based) of a job of ``updates`` runs
        at."""
        return 1.0 - min(index, updates - 1) / max(updates, 1) if self.anneal_lr else 1.0
