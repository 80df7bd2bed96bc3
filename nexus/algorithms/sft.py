"""Supervised fine-tuning on demonstrations: regress the head's mean action onto the demonstrated one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nexus.model.action_head import TenantPolicy


def sft_loss(policy: TenantPolicy, feats: torch.Tensor, proprio: torch.Tensor,
             actions: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """MSE between the Gaussian mean and the demonstrated actions [N, A] (the value head is unused)."""
    pred = policy.mean_action(feats, proprio)
    loss = F.mse_loss(pred, torch.as_tensor(actions).to(pred.device, pred.dtype))
    return loss, {"mse": loss.item()}
