"""PPO with GAE, CleanRL style (ppo_continuous_action.py), on a tenant's Gaussian policy.

In reading order: the hyper-parameters (:class:`PPOConfig`, what an ``RLJob`` carries), advantage
estimation over collected trajectories (:func:`compute_gae`), the clipped surrogate loss on one
minibatch (:func:`ppo_loss`) and one update over a stored batch (:func:`update`: epochs of shuffled
minibatches, each an optimizer step of the tenant's own engine, stopped early past ``target_kl``).

torch is imported inside the functions: the control plane validates jobs against ``PPOConfig`` and the
scheduler process never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from pydantic import Field

from nexus.algorithms.lr_schedule import AnnealedLR
from nexus.algorithms.shards import owned_in, shard

if TYPE_CHECKING:
    import torch

    from nexus.algorithms.learner import GaussianPolicy, Learner
    from nexus.model.backbone_features import BackboneFeatures

    Array = TypeVar("Array", np.ndarray, torch.Tensor)
else:
    Array = TypeVar("Array")


class PPOConfig(AnnealedLR):
    """PPO with GAE on the Gaussian action head (CleanRL names); ``anneal_lr`` from :class:`AnnealedLR`."""

    gamma: float = Field(0.95, gt=0, le=1)
    gae_lambda: float = Field(0.9, ge=0, le=1)
    clip_coef: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    ent_coef: float = Field(0.0, ge=0)
    update_epochs: int = Field(4, ge=1)
    minibatch_size: int = Field(64, ge=1)
    norm_adv: bool = True
    target_kl: float | None = Field(None, gt=0, description="end an update's epochs once approx KL exceeds it")


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
    as_torch = hasattr(rewards, "detach")  # a torch tensor (without importing torch for numpy callers)

    def np64(x: Array | float) -> np.ndarray:
        if hasattr(x, "detach"):
            x = x.detach().cpu().numpy()  # type: ignore[union-attr]
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
        import torch

        dev = rewards.device  # type: ignore[union-attr]
        return (torch.as_tensor(adv, dtype=torch.float32, device=dev),  # type: ignore[return-value]
                torch.as_tensor(ret, dtype=torch.float32, device=dev))
    return adv.astype(np.float32), ret.astype(np.float32)  # type: ignore[return-value]


def ppo_loss(policy: GaussianPolicy, feats: BackboneFeatures | torch.Tensor, proprio: torch.Tensor,
             actions: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
             cfg: PPOConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate PPO loss on one minibatch -> (loss, stats).

    ``actions`` are the unclipped samples the behaviour policy drew, ``old_logprob`` their
    log-probabilities at collection time. stats: pg_loss, v_loss, entropy, approx_kl, clipfrac.
    """
    import torch

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


def normalized_advantages(advantages: torch.Tensor, cfg: PPOConfig) -> tuple[torch.Tensor, PPOConfig]:
    """A minibatch's advantages normalized as :func:`ppo_loss` would (``cfg.norm_adv``), and the config that
    leaves them as they are: the ranks of the actor group normalize over the whole minibatch, then cut it."""
    if cfg.norm_adv and advantages.numel() > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    return advantages, cfg.model_copy(update={"norm_adv": False})


def update(learner: Learner, feats: BackboneFeatures, proprio: torch.Tensor, arrays: Mapping[str, Any],
           cfg: PPOConfig) -> dict[str, float]:
    """One PPO update on a batch of whole episodes (``arrays``: the stored columns reward, value, action,
    logprob, terminated, truncated; ``feats``/``proprio``: the backbone features and states of the steps this
    rank owns, ``nexus.algorithms.shards.shard(rows, rank, world_size)``; all of them on one rank).

    Returns the stats averaged over minibatches, with ``batch_steps`` and ``epochs`` run. The minibatch
    order is a pure function of the tenant's seed and version, so a retried update is identical; every rank
    draws the same order and computes its own rows of each minibatch."""
    import torch

    dones = np.logical_or(arrays["terminated"], arrays["truncated"]).astype(np.float32)
    # a time-limit end bootstraps from the last stored value: the observation after it is not recorded
    truncated_only = arrays["truncated"] & ~arrays["terminated"]
    boot = np.where(truncated_only, arrays["value"], 0.0).astype(np.float32)
    adv, ret = compute_gae(arrays["reward"], arrays["value"], dones, 0.0, cfg.gamma, cfg.gae_lambda,
                           bootstrap_values=boot)
    adv, ret = torch.as_tensor(adv, dtype=torch.float32), torch.as_tensor(ret, dtype=torch.float32)
    actions = torch.as_tensor(np.array(arrays["action"]))  # a copy: the Arrow buffers are read-only
    old_logprob = torch.as_tensor(np.array(arrays["logprob"]))
    n = len(actions)
    own = shard(n, learner.rank, learner.world_size).rows  # the rows feats/proprio hold
    gen = torch.Generator().manual_seed(learner.spec.seed + learner.version)
    sums: dict[str, float] = {}
    count = epochs = 0
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.minibatch_size):
            mb = perm[start:start + cfg.minibatch_size]
            mb_adv, mb_cfg = normalized_advantages(adv[mb], cfg)
            norm = adv.clone()
            norm[mb] = mb_adv  # over the whole minibatch, whichever rank computes a row
            local, share = owned_in(mb.numpy(), learner.rank, learner.world_size)
            rows = torch.as_tensor(own[local])  # this rank's rows of the minibatch (rows of the batch)
            cut = torch.as_tensor(local)  # ... and of feats/proprio
            stats = learner.train_step(lambda policy, rows=rows, cut=cut, mb_cfg=mb_cfg, norm=norm: ppo_loss(
                policy, feats[cut], proprio[cut], actions[rows], old_logprob[rows], norm[rows], ret[rows], mb_cfg),
                share)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
        epochs += 1
        if cfg.target_kl is not None and stats["approx_kl"] > cfg.target_kl:
            break  # the policy moved far enough from the one that collected the batch (CleanRL's rule)
    return {k: v / max(count, 1) for k, v in sums.items()} | {"batch_steps": float(n), "epochs": float(epochs)}
