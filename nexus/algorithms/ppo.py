"""PPO with GAE, CleanRL style (ppo_continuous_action.py), on a tenant's Gaussian policy.

Only the two pure pieces live here: advantage estimation over collected trajectories and the clipped
surrogate loss on one minibatch. Looping over epochs/minibatches and the optimizer step belong to the
caller (the tenant slot owns the optimizer).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from nexus.model.backbone_features import BackboneFeatures
from nexus.model.policy import TenantPolicy
from nexus.spec import PPOConfig

Array = TypeVar("Array", np.ndarray, torch.Tensor)


def compute_gae(rewards: Array, values: Array, dones: Array, last_values: Array | float, gamma: float,
                gae_lambda: float, bootstrap_values: Array | None = None) -> tuple[Array, Array]:
    """Generalized advantage estimation -> (advantages, returns), same type/shape as ``rewards``.

    Convention (differs from CleanRL, whose ``dones`` flags the *next* observation):

    - ``rewards``, ``values``, ``dones``: shape [T] or [T, E], ordered by time. Several episodes may be
      concatenated along T (and/or E independent streams laid side by side).
    - ``dones[t] = 1``: the episode ended at step t (terminated OR truncated): value from step t+1 is
      never bootstrapped into step t, and the advantage recursion restarts there.
    - ``last_values`` (scalar or [E]): V of the observation after the last step T-1; used only where
      ``dones[T-1] = 0``, i.e. the rollout was cut in the middle of an episode.
    - ``bootstrap_values`` (optional, like ``rewards``): for a step that ended by *truncation* (time
      limit), V(final observation) of that episode; 0 for terminations and elsewhere. Where
      ``dones[t] = 1`` the TD target becomes ``r_t + gamma * bootstrap_values[t]``. Omitted: every end
      is treated as a termination.

    ``returns = advantages + values`` (the critic's regression target).
    """
    as_torch = isinstance(rewards, torch.Tensor)

    def np64(x: Array | float) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().numpy()
        return np.asarray(x, dtype=np.float64)

    r, v, d = np64(rewards), np64(values), np64(dones)
    if not (r.shape == v.shape == d.shape) or r.ndim not in (1, 2):
        raise ValueError(f"rewards/values/dones must share a [T] or [T, E] shape, got {r.shape}, "
                         f"{v.shape}, {d.shape}")
    boot = np.zeros_like(r) if bootstrap_values is None else np64(bootstrap_values)
    next_value = np.broadcast_to(np64(last_values), r.shape[1:])

    adv = np.zeros_like(r)
    running = np.zeros(r.shape[1:])
    for t in reversed(range(r.shape[0])):
        if t < r.shape[0] - 1:
            next_value = v[t + 1]
        not_done = 1.0 - d[t]
        target_next = not_done * next_value + d[t] * boot[t]
        delta = r[t] + gamma * target_next - v[t]
        running = delta + gamma * gae_lambda * not_done * running
        adv[t] = running
    ret = adv + v

    if as_torch:
        dev = rewards.device  # type: ignore[union-attr]
        return (torch.as_tensor(adv, dtype=torch.float32, device=dev),  # type: ignore[return-value]
                torch.as_tensor(ret, dtype=torch.float32, device=dev))
    return adv.astype(np.float32), ret.astype(np.float32)  # type: ignore[return-value]


def ppo_loss(policy: TenantPolicy, feats: BackboneFeatures | torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor,
             old_logprob: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
             cfg: PPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate PPO loss on one minibatch -> (loss, stats).

    ``actions`` are the unclipped samples the behaviour policy drew, ``old_logprob`` their
    log-probabilities at collection time. stats: pg_loss, v_loss, entropy, approx_kl, clipfrac.
    """
    newlogprob, entropy, newvalue = policy.evaluate(feats, proprio, actions)
    dev = newlogprob.device
    old_logprob, advantages, returns = (torch.as_tensor(x).to(dev, torch.float32)
                                        for x in (old_logprob, advantages, returns))

    logratio = newlogprob - old_logprob
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()  # http://joschu.net/blog/kl-approx.html
        clipfrac = ((ratio - 1.0).abs() > cfg.clip_coef).float().mean()

    if cfg.norm_adv and advantages.numel() > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - cfg.clip_coef, 1 + cfg.clip_coef)
    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

    v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - cfg.ent_coef * entropy_loss + cfg.vf_coef * v_loss

    stats = {"pg_loss": pg_loss.item(), "v_loss": v_loss.item(), "entropy": entropy_loss.item(),
             "approx_kl": approx_kl.item(), "clipfrac": clipfrac.item()}
    return loss, stats
