"""The VLA framework of the architecture diagram: one shared frozen backbone, per-tenant preprocessors
and per-tenant policies. Requests of many tenants share backbone forwards (group batching); each
tenant's rows then go through that tenant's own head only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nexus.features import Observation, VLAFeature
from nexus.model.action_head import TenantPolicy
from nexus.model.backbone import SharedBackbone
from nexus.model.preprocessor import TenantPreprocessor


class VLAFramework:
    """Shared backbone + tenant preprocessors + tenant policies (latest versions by default)."""

    def __init__(self, backbone: SharedBackbone) -> None:
        self.backbone = backbone
        self.policies: dict[str, TenantPolicy] = {}
        self.preprocessors: dict[str, TenantPreprocessor] = {}

    @property
    def tenants(self) -> list[str]:
        return sorted(self.policies)

    def add_tenant(self, tenant: str, policy: TenantPolicy, preprocessor: TenantPreprocessor) -> None:
        """Register (or replace) a tenant; its preprocessor must target this backbone's model."""
        if not self.backbone.accepts(preprocessor.compat_key):
            raise ValueError(f"tenant {tenant!r}: preprocessor targets {preprocessor.compat_key!r}, "
                             f"this framework's backbone is {self.backbone.compat_key!r}")
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

    def group_encode(self, requests: list[tuple[str, VLAFeature]]) -> list[torch.Tensor]:
        """Feature row [hidden] per request, in request order.

        Requests are grouped by compat key (first-seen order); each group is ONE backbone forward.
        Incompatible groups (e.g. tenants at different image sizes) run one after another in this call.
        """
        groups: dict[str, list[int]] = {}
        for i, (_, feat) in enumerate(requests):
            groups.setdefault(feat.compat_key, []).append(i)
        rows: list[torch.Tensor | None] = [None] * len(requests)
        for idx in groups.values():
            encoded = self.backbone.encode([requests[i][1] for i in idx])
            for r, i in enumerate(idx):
                rows[i] = encoded[r]
        return rows  # type: ignore[return-value]  # every slot is filled above

    def group_act(self, requests: list[tuple[str, Observation]], deterministic: bool,
                  policies: dict[str, TenantPolicy] | None = None,
                  return_features: bool = False) -> list[dict[str, Any]]:
        """Actions for a group of tenants' observations: one backbone forward per compatible group,
        then each tenant's head on its own rows.

        ``policies`` overrides a tenant's registered policy (e.g. a version pinned by an evaluation).
        Each result: ``action`` float32 [A] clipped to [-1, 1] for the environment, ``raw_action`` the
        unclipped sample (store this one for PPO: ``logprob`` is its exact log-probability),
        ``logprob``, ``value`` (floats) and, if asked, ``feature`` float32 [hidden].
        """
        feats = [self.preprocess(t, obs) for t, obs in requests]
        rows = self.group_encode([(t, f) for (t, _), f in zip(requests, feats, strict=True)])
        by_tenant: dict[str, list[int]] = {}
        for i, (tenant, _) in enumerate(requests):
            by_tenant.setdefault(tenant, []).append(i)

        results: list[dict[str, Any]] = [{} for _ in requests]
        for tenant, idx in by_tenant.items():
            policy = (policies or {}).get(tenant)
            if policy is None:
                policy = self.policies[tenant]
            feat = torch.stack([rows[i] for i in idx])
            proprio = torch.from_numpy(np.stack([feats[i].proprio for i in idx]))
            action, logprob, value = policy.act(feat, proprio, deterministic=deterministic)
            raw = action.float().cpu().numpy()
            logprob_np, value_np = logprob.float().cpu().numpy(), value.float().cpu().numpy()
            for r, i in enumerate(idx):
                results[i] = {"action": np.clip(raw[r], -1.0, 1.0), "raw_action": raw[r],
                              "logprob": float(logprob_np[r]), "value": float(value_np[r])}
                if return_features:
                    results[i]["feature"] = feat[r].float().cpu().numpy()
        return results
