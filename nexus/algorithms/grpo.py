"""GRPO (group relative policy optimization) on a tenant's Gaussian policy, CleanRL style.

No critic: a batch holds *groups* of rollouts that start from the same state (episodes reset with the same
seed), and each rollout is scored against its own group. In reading order: the hyper-parameters
(:class:`GRPOConfig`, what an ``RLJob(algorithm="grpo")`` carries as ``grpo``), the group-relative advantages
(:func:`group_advantages` for one score per rollout — DeepSeekMath's *outcome* supervision — and
:func:`process_advantages` for per-step rewards — its *process* supervision: every step reward normalized over
the group, then summed from each step on), the loss on one minibatch (:func:`grpo_loss`: PPO's clipped
surrogate with those advantages plus an optional KL penalty to a reference policy, the k3 estimator) and one
update over a stored batch (:func:`update`: epochs of shuffled minibatches, each an optimizer step of the
tenant's own engine, stopped early past ``target_kl``).

torch is imported inside the functions: the control plane validates jobs against ``GRPOConfig`` and the
scheduler process never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

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


class GRPOConfig(AnnealedLR):
    """GRPO's hyper-parameters. The loss reads ``clip_coef``, ``kl_coef``, ``ent_coef``; a job's update also
    the group, advantage, epoch and ``anneal_lr`` fields (the low-level ``forward_backward(loss="grpo")`` takes
    advantages the client computed, e.g. with :func:`group_advantages`)."""

    clip_coef: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL penalty to the reference policy (a job's "
                                                  "reference: the version it started from)")
    ent_coef: float = Field(0.0, ge=0)
    eps: float = Field(1e-6, gt=0, description="std floor of a group (all-equal scores give zero advantages)")
    group_size: int = Field(4, ge=2, le=256, description="rollouts per group, reset with the same seed "
                                                         "(a job's episodes_per_batch is a multiple of it)")
    advantage: Literal["outcome", "process"] = Field(
        "process", description="outcome: each episode's return standardized in its group; process: each step's "
                               "reward standardized over its group's steps, summed from the step on (dense rewards)")
    gamma: float = Field(1.0, gt=0, le=1, description="discount of the process reward-to-go")
    update_epochs: int = Field(4, ge=1)
    minibatch_size: int = Field(64, ge=1)
    target_kl: float | None = Field(None, gt=0, description="end an update's epochs once approx KL exceeds it")


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


def process_advantages(rewards: np.ndarray, episodes: np.ndarray, groups: np.ndarray, gamma: float = 1.0,
                       eps: float = 1e-6) -> np.ndarray:
    """Per-step advantages of process supervision (DeepSeekMath §4.1.3), rows ordered by time within an episode:
    each reward standardized over all steps of its group, then its (discounted) sum from the step to the
    episode's end."""
    r = np.asarray(rewards, np.float64)
    norm = np.zeros_like(r)
    for key in np.unique(groups):
        m = groups == key
        norm[m] = (r[m] - r[m].mean()) / (r[m].std() + eps)
    adv = np.zeros_like(r)
    for ep in np.unique(episodes):
        (idx,) = np.nonzero(episodes == ep)
        running = 0.0
        for i in idx[::-1]:
            running = norm[i] + gamma * running
            adv[i] = running
    return adv.astype(np.float32)


def batch_advantages(arrays: Mapping[str, Any], cfg: GRPOConfig) -> np.ndarray:
    """Advantages [N] of a stored batch of whole episodes (columns episode, reward): episode ``e`` belongs to
    group ``e // group_size`` (the rollouts of a group were reset with one seed)."""
    episodes = np.asarray(arrays["episode"], np.int64)
    groups = episodes // cfg.group_size
    if cfg.advantage == "process":
        return process_advantages(arrays["reward"], episodes, groups, cfg.gamma, cfg.eps)
    ids, inverse = np.unique(episodes, return_inverse=True)
    returns = np.bincount(inverse, weights=np.asarray(arrays["reward"], np.float64))
    per_episode = group_advantages(returns, ids // cfg.group_size, cfg.eps)
    return per_episode[inverse]


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


def update(learner: Learner, feats: BackboneFeatures, proprio: torch.Tensor, arrays: Mapping[str, Any],
           cfg: GRPOConfig, ref_logprob: torch.Tensor | None = None) -> dict[str, float]:
    """One GRPO update on a batch of whole episodes in groups (``arrays``: the stored columns episode, reward,
    action, logprob; ``feats``/``proprio``: the backbone features and states of the steps this rank owns,
    ``nexus.algorithms.shards.shard(rows, rank, world_size)``; ``ref_logprob``: the reference policy's
    log-probabilities of this rank's steps, when ``kl_coef`` > 0).

    Returns the stats averaged over minibatches, with ``batch_steps``, ``epochs`` and the group score spread
    (``group_return_std``: 0 means no group had a winner to learn from). As in PPO's update, the minibatch order
    is a pure function of the tenant's seed and version, and every rank draws the same order."""
    import torch

    adv = torch.as_tensor(batch_advantages(arrays, cfg), dtype=torch.float32)
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
            local, share = owned_in(mb.numpy(), learner.rank, learner.world_size)
            rows = torch.as_tensor(own[local])  # this rank's rows of the minibatch (rows of the batch)
            cut = torch.as_tensor(local)  # ... and of feats/proprio
            ref = None if ref_logprob is None else ref_logprob[cut]
            stats = learner.train_step(lambda policy, rows=rows, cut=cut, ref=ref: grpo_loss(
                policy, feats[cut], proprio[cut], actions[rows], old_logprob[rows], adv[rows], cfg, ref), share)
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
        epochs += 1
        if cfg.target_kl is not None and stats["approx_kl"] > cfg.target_kl:
            break  # the policy moved far enough from the one that collected the batch
    out = {k: v / max(count, 1) for k, v in sums.items()}
    return out | {"batch_steps": float(n), "epochs": float(epochs), "group_return_std": _group_spread(arrays, cfg)}


def _group_spread(arrays: Mapping[str, Any], cfg: GRPOConfig) -> float:
    """Mean within-group standard deviation of the episodes' returns."""
    episodes = np.asarray(arrays["episode"], np.int64)
    ids, inverse = np.unique(episodes, return_inverse=True)
    returns = np.bincount(inverse, weights=np.asarray(arrays["reward"], np.float64))
    groups = ids // cfg.group_size
    return float(np.mean([returns[groups == g].std() for g in np.unique(groups)]))
