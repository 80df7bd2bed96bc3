"""Supervised fine-tuning on demonstrations: one loss per action-module family, and the update.

- Gaussian (OFT) heads regress their mean action onto the demonstrated one (MSE).
- Flow-matching (GR00T / π) experts regress the flow velocity at a noisy interpolation between
  Gaussian noise and the demonstrated action chunk (rectified flow, ``nexus.model.flow_matching``).

Noise and flow times come from ``generator`` when given, so a step is a pure function of the policy,
the batch and the generator's seed (grouped and serial training give the same loss); :func:`update`
seeds it from the tenant's seed and the step, so a retried step is identical.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from nexus.algorithms.learner import Learner
from nexus.algorithms.shards import Shard
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.flow_matching import interpolate, noise_like, sample_tau
from nexus.model.policy import TenantPolicy


def sft_loss(policy: TenantPolicy, feats: BackboneFeatures | torch.Tensor, proprio: torch.Tensor,
             actions: torch.Tensor, generator: torch.Generator | None = None,
             draws: FlowDraws | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The family's SFT loss on demonstrated actions [N, chunk*action_dim] -> (loss, stats).

    stats: ``mse`` (Gaussian mean vs action) or ``flow_mse`` (velocity error); the value head is unused.
    ``draws``: the flow family's noise and times, drawn beforehand (else from ``generator``).
    """
    if policy.gaussian:
        pred = policy.mean_action(feats, proprio)
        loss = F.mse_loss(pred, torch.as_tensor(actions).to(pred.device, pred.dtype))
        return loss, {"mse": loss.item()}
    return flow_matching_loss(policy, feats, proprio, actions, generator, draws)


FlowDraws = tuple[torch.Tensor, torch.Tensor]  # (noise [N, chunk, A], tau [N]) of a flow-matching step


def flow_draws(policy: TenantPolicy, rows: int, generator: torch.Generator | None = None) -> FlowDraws:
    """Noise and flow times of a batch of ``rows`` rows, in the order :func:`flow_matching_loss` draws them."""
    noise = noise_like(torch.empty(rows, policy.chunk, policy.action_dim), generator)
    return noise, sample_tau(rows, policy.cfg.flow, generator)


def flow_matching_loss(policy: TenantPolicy, feats: BackboneFeatures | torch.Tensor, proprio: torch.Tensor,
                       actions: torch.Tensor, generator: torch.Generator | None = None,
                       draws: FlowDraws | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """MSE between the predicted and the true velocity ``A - eps`` at ``x_tau``, tau ~ the family's schedule."""
    p = next(policy.parameters())
    target = torch.as_tensor(actions).to(p.device, p.dtype).reshape(-1, policy.chunk, policy.action_dim)
    if draws is None:
        noise = noise_like(target, generator)
        tau = sample_tau(target.shape[0], policy.cfg.flow, generator, device=p.device)
    else:
        noise, tau = draws[0].to(p.device, p.dtype), draws[1].to(p.device)
    x_tau, velocity = interpolate(target, noise, tau)
    loss = F.mse_loss(policy.velocity(feats, proprio, x_tau, tau), velocity)
    return loss, {"flow_mse": loss.item()}


def update(learner: Learner, feats: BackboneFeatures, proprio: torch.Tensor, actions: torch.Tensor,
           step: int, shard: Shard | None = None) -> dict[str, float]:
    """One SFT step (one optimizer step of the tenant's engine) on demonstrated ``actions`` -> {"loss"}.

    ``shard``: which rows of the step's batch ``feats``/``proprio``/``actions`` are (this rank's; default:
    the whole batch)."""
    shard = shard or Shard.whole(len(actions))
    # flow-matching noise and times: a pure function of (tenant seed, step), so a retried item is identical;
    # drawn for the whole batch and cut, so every group size trains on the same draws
    gen = torch.Generator().manual_seed(learner.spec.seed * 1_000_003 + int(step))
    draws = None
    if not learner.policy.gaussian:
        idx = torch.as_tensor(shard.rows)
        noise, tau = flow_draws(learner.policy, shard.total, gen)
        draws = (noise[idx], tau[idx])
    stats = learner.train_step(lambda policy: sft_loss(policy, feats, proprio, actions, gen, draws), shard.share)
    return {"loss": float(stats["loss"])}


def action_mse(policy: TenantPolicy, feats: BackboneFeatures, proprio: torch.Tensor, actions: torch.Tensor) -> float:
    """Mean squared error of the policy's deterministic action (flow families: the flow from zero noise)."""
    with torch.no_grad():
        return float((policy.mean_action(feats, proprio) - actions).pow(2).mean())


class ActionChunks:
    """Chunked targets from per-step actions: the ``chunk`` actions from a row's step on, in its episode.

    Built once over every row the episodes have (e.g. a dataset's train + held-out split). Past an
    episode's last step the last action repeats (the usual padding of chunked imitation).
    """

    def __init__(self, episode: np.ndarray, step: np.ndarray, action: np.ndarray) -> None:
        self._row = {(int(e), int(s)): i for i, (e, s) in enumerate(zip(episode, step, strict=True))}
        self._last: dict[int, int] = {}
        for e, s in zip(episode, step, strict=True):
            self._last[int(e)] = max(self._last.get(int(e), -1), int(s))
        self._action = np.asarray(action, np.float32)

    def targets(self, episode: np.ndarray, step: np.ndarray, chunk: int) -> np.ndarray:
        """[N, chunk * action_dim] for rows given by their (episode, step)."""
        out = np.empty((len(episode), chunk, self._action.shape[1]), dtype=np.float32)
        for r, (e, s) in enumerate(zip(episode, step, strict=True)):
            e, s = int(e), int(s)
            for k in range(chunk):
                out[r, k] = self._action[self._row[(e, min(s + k, self._last[e]))]]
        return out.reshape(len(episode), -1)
