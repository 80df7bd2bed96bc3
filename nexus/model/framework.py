"""The VLA framework of the architecture diagram: resident frozen backbones, per-tenant preprocessors and
per-tenant policies. Requests of many tenants share backbone forwards (group batching); each tenant's
rows then go through that tenant's own action module only.

Grouping follows :func:`nexus.model.backbone.compatible`: requests with equal compat keys form one
forward; every other group (another image size, another backbone) runs as its own forward in the same
call. One forward computes the union of what its tenants' action modules read (pooled features, prefix
layers); each tenant gets back exactly its own rows and layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nexus.features import Observation, VLAFeature
from nexus.model.backbone import SharedBackbone
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor

TenantRows = tuple[list[int], BackboneFeatures]  # request indices of one tenant, its features in that order


class VLAFramework:
    """Shared backbones + tenant preprocessors + tenant policies (latest versions by default).

    ``backbone`` is the first (default) backbone; more can be resident (``add_backbone``), e.g. a
    Qwen3-VL for OFT / GR00T tenants next to a PaliGemma for π tenants.
    """

    def __init__(self, backbone: SharedBackbone, *more: SharedBackbone) -> None:
        self.backbone = backbone
        self.backbones: list[SharedBackbone] = [backbone]
        for bb in more:
            self.add_backbone(bb)
        self.policies: dict[str, TenantPolicy] = {}
        self.preprocessors: dict[str, TenantPreprocessor] = {}

    @property
    def tenants(self) -> list[str]:
        return sorted(self.policies)

    def add_backbone(self, backbone: SharedBackbone) -> None:
        if any(b.cfg.model_key() == backbone.cfg.model_key() for b in self.backbones):
            raise ValueError(f"a backbone for {backbone.cfg.model_key()!r} is already resident")
        self.backbones.append(backbone)

    def backbone_for(self, compat_key: str) -> SharedBackbone:
        for bb in self.backbones:
            if bb.accepts(compat_key):
                return bb
        raise ValueError(f"no resident backbone runs {compat_key!r} (resident: "
                         f"{[b.cfg.model_key() for b in self.backbones]})")

    def add_tenant(self, tenant: str, policy: TenantPolicy, preprocessor: TenantPreprocessor) -> None:
        """Register (or replace) a tenant; its preprocessor must target a resident backbone."""
        try:
            bb = self.backbone_for(preprocessor.compat_key)
        except ValueError:
            raise ValueError(f"tenant {tenant!r}: preprocessor targets {preprocessor.compat_key!r}, "
                             f"this framework's backbones are "
                             f"{[b.compat_key for b in self.backbones]}") from None
        bb.normalize_layers(policy.prefix_layers)  # fails now, not at the first request, if out of range
        self.policies[tenant] = policy.eval()
        self.preprocessors[tenant] = preprocessor

    def remove_tenant(self, tenant: str) -> None:
        self.policies.pop(tenant, None)
        self.preprocessors.pop(tenant, None)

    def preprocess(self, tenant: str, obs: Observation) -> VLAFeature:
        try:
            pre = self.preprocessors[tenant]
        except KeyError:
            raise KeyError(f"unknown tenant {tenant!r} (registered: {self.tenants})") from None
        return pre(obs)

    def _layers(self, tenant: str, policies: dict[str, TenantPolicy] | None) -> tuple[int, ...]:
        policy = (policies or {}).get(tenant)
        if policy is None:
            policy = self.policies.get(tenant)
        return policy.prefix_layers if policy is not None else ()

    def group_features(self, requests: list[tuple[str, VLAFeature]],
                       policies: dict[str, TenantPolicy] | None = None) -> dict[str, TenantRows]:
        """Backbone features per tenant: ``{tenant: (request indices, BackboneFeatures)}``.

        One backbone forward per compatible group (first-seen order); each forward computes the prefix
        layers its tenants' policies read (``policies`` overrides registered ones, e.g. a pinned version).
        """
        groups: dict[str, list[int]] = {}
        for i, (_, feat) in enumerate(requests):
            groups.setdefault(feat.compat_key, []).append(i)
        parts: dict[str, list[tuple[list[int], BackboneFeatures]]] = {}
        for key, idx in groups.items():
            bb = self.backbone_for(key)
            tenants = list(dict.fromkeys(requests[i][0] for i in idx))
            wanted = {t: bb.normalize_layers(self._layers(t, policies)) for t in tenants}
            union = sorted({layer for layers in wanted.values() for layer in layers})
            encoded = bb.encode_prefix([requests[i][1] for i in idx], layers=union)
            for t in tenants:
                rows = [r for r, i in enumerate(idx) if requests[i][0] == t]
                parts.setdefault(t, []).append(([idx[r] for r in rows], encoded[rows].with_layers(wanted[t])))
        out: dict[str, TenantRows] = {}
        for t, chunks in parts.items():
            if len(chunks) == 1:
                out[t] = chunks[0]
                continue
            order = [i for ids, _ in chunks for i in ids]  # a tenant split over groups: restore request order
            merged = BackboneFeatures.cat([f for _, f in chunks])
            perm = sorted(range(len(order)), key=order.__getitem__)
            out[t] = ([order[p] for p in perm], merged[perm])
        return out

    def group_encode(self, requests: list[tuple[str, VLAFeature]]) -> list[torch.Tensor]:
        """Pooled feature row [hidden] per request, in request order (one forward per compatible group)."""
        rows: list[torch.Tensor | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, (_, feat) in enumerate(requests):
            groups.setdefault(feat.compat_key, []).append(i)
        for key, idx in groups.items():
            encoded = self.backbone_for(key).encode([requests[i][1] for i in idx])
            for r, i in enumerate(idx):
                rows[i] = encoded[r]
        return rows  # type: ignore[return-value]  # every slot is filled above

    def tenant_features(self, tenant: str, observations: list[Observation]) -> tuple[BackboneFeatures, torch.Tensor]:
        """One tenant's batch: backbone features (its layers) and proprio [N, P]."""
        feats = self.preprocessors[tenant].batch(observations)
        (_, out), = self.group_features([(tenant, f) for f in feats]).values()
        return out, torch.from_numpy(np.stack([f.proprio for f in feats]))

    def group_act(self, requests: list[tuple[str, Observation]], deterministic: bool,
                  policies: dict[str, TenantPolicy] | None = None,
                  return_features: bool = False) -> list[dict[str, Any]]:
        """Actions for a group of tenants' observations: one backbone forward per compatible group,
        then each tenant's head on its own rows.

        ``policies`` overrides a tenant's registered policy (e.g. a version pinned by an evaluation).
        Each result: ``action`` float32 [A] clipped to [-1, 1] for the environment, ``raw_action`` the
        unclipped sample (store this one for PPO: ``logprob`` is its exact log-probability),
        ``logprob``, ``value`` (floats) and, if asked, ``feature`` float32 [hidden] (pooled).
        """
        feats = [self.preprocess(t, obs) for t, obs in requests]
        per_tenant = self.group_features([(t, f) for (t, _), f in zip(requests, feats, strict=True)], policies)
        results: list[dict[str, Any]] = [{} for _ in requests]
        for tenant, (idx, cond) in per_tenant.items():
            policy = (policies or {}).get(tenant)
            if policy is None:
                policy = self.policies[tenant]
            proprio = torch.from_numpy(np.stack([feats[i].proprio for i in idx]))
            action, logprob, value = policy.act(cond, proprio, deterministic=deterministic)
            raw = action.float().cpu().numpy()
            logprob_np, value_np = logprob.float().cpu().numpy(), value.float().cpu().numpy()
            for r, i in enumerate(idx):
                results[i] = {"action": np.clip(raw[r], -1.0, 1.0), "raw_action": raw[r],
                              "logprob": float(logprob_np[r]), "value": float(value_np[r])}
                if return_features:
                    results[i]["feature"] = cond.pooled[r].float().cpu().numpy()
        return results
