"""GRPO (group relative policy optimization) on a tenant's Gaussian policy.

No critic: several rollouts from the same start (a "group", e.g. episodes reset with the same seed)
are scored, and each rollout's advantage is its return standardized within its group. The policy loss
is PPO's clipped surrogate with those advantages, plus an optional KL penalty towards a reference
policy's log-probabilities (the k3 estimator, as in DeepSeekMath's GRPO).

torch is imported inside the functions: requests are checked against ``GRPOConfig`` where torch is not
loaded (the gateway, ``nexus.inputs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

    from nexus.algorithms.learner import GaussianPolicy
    from nexus.model.backbone_features import BackboneFeatures

    Array = TypeVar("Array", np.ndarray, torch.Tensor)
else:
    Array = TypeVar("Array")


class GRPOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    clip_coef: float = 0.2
    kl_coef: float = 0.0  # weight of the KL penalty to the reference policy (needs ref_logprob)
    ent_coef: float = 0.0
    eps: float = 1e-6  # std floor of a group (all-equal returns give zero advantages)


def group_advantages(returns: Array, groups: Array, eps: float = 1e-6) -> Array:
    """Return standardized within each group: (R - mean_group) / (std_group + eps); same type as ``returns``."""
    as_torch = hasattr(returns, "detach")  # a torch tensor
    r = np.asarray(returns.detach().cpu() if as_torch else returns, dtype=np.float64)  # type: ignore[union-attr]
    g = np.asarray(groups.detach().cpu() if hasattr(groups, "detach") else groups)  # type: ignore[union-attr]
    if r.shape != g.shape or r.ndim != 1:
        raise ValueError(f"returns and groups must be 1-D of one length, got {r.shape} and {g.shape}")
    adv = np.zeros_like(r)
    for key in np.unique(g):
        m = g == key
        adv[m] = (r[m] - r[m].mean()) / (r[m].std() + eps)
    if as_torch:
        import torch

        return torch.as_tensor(adv, dtype=torch.float32, device=returns.device)  # type: ignore[return-value]
    return adv.astype(np.float32)  # type: ignore[return-value]


def grpo_loss(policy: GaussianPolicy, feats: BackboneFeatures | torch.Tensor, proprio: torch.Tensor,
              actions: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, cfg: GRPOConfig,
              ref_logprob: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with group-relative advantages (+ KL to a reference) -> (loss, stats).

    stats: pg_loss, kl_ref, entropy, approx_kl, clipfrac.
    """
    import torch

    newlogprob, entropy, _ = policy.evaluate(feats, proprio, actions)
    dev = newlogprob.device
    old_logprob, advantages = (torch.as_tensor(x).to(dev, torch.float32) for x in (old_logprob, advantages))
    logratio = newlogprob - old_logprob
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()
    pg_loss = torch.max(-advantages * ratio,
                        -advantages * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)).mean()
    kl = newlogprob.new_zeros(())
    if ref_logprob is not None and cfg.kl_coef > 0:
        log_ref_ratio = torch.as_tensor(ref_logprob).to(dev, torch.float32) - newlogprob
        kl = (log_ref_ratio.exp() - log_ref_ratio - 1).mean()  # k3: unbiased, always >= 0
    loss = pg_loss + cfg.kl_coef * kl - cfg.ent_coef * entropy.mean()
    stats = {"pg_loss": pg_loss.item(), "kl_ref": kl.item(), "entropy": entropy.mean().item(),
             "approx_kl": approx_kl.item(), "clipfrac": clipfrac.item()}
    return loss, stats
