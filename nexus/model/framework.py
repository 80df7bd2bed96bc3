"""The VLA framework of the architecture diagram: resident frozen backbones, per-tenant preprocessors and
per-tenant policies. Requests of many tenants share backbone forwards (group batching); each tenant's
rows then go through that tenant's own action module only.

Grouping follows :func:`nexus.model.backbone.compatible`: requests with equal compat keys form one
forward; every other group (another image size, another backbone) runs as its own forward in the same
call. One forward computes the union of what its tenants' action modules read (pooled features, prefix
layers); each tenant gets back exactly its own rows and layers. Tenants' LoRA adapters ride along inside
the shared forward, each applied to its own rows only (``nexus.model.lora``); with ``grad=True`` the
forward is differentiable, so one grouped forward can also train several tenants' adapters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nexus.features import Observation, VLAFeature
from nexus.model.backbone import SharedBackbone
from nexus.model.backbone_features import BackboneFeatures, DeferredFeatures
from nexus.model.policy import TenantPolicy
from nexus.model.prefix_cache import PrefixCache
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
        # an inference engine's (its policies are replaced, never changed in place); never a training process's
        self.prefix_cache: PrefixCache | None = None

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

    def _policy(self, tenant: str, policies: dict[str, TenantPolicy] | None) -> TenantPolicy | None:
        policy = (policies or {}).get(tenant)
        return policy if policy is not None else self.policies.get(tenant)

    def _layers(self, tenant: str, policies: dict[str, TenantPolicy] | None) -> tuple[int, ...]:
        policy = self._policy(tenant, policies)
        return policy.prefix_layers if policy is not None else ()

    def group_features(self, requests: list[tuple[str, VLAFeature]],
                       policies: dict[str, TenantPolicy] | None = None,
                       row_policies: list[TenantPolicy | None] | None = None,
                       grad: bool = False) -> dict[str, TenantRows]:
        """Backbone features per tenant: ``{tenant: (request indices, BackboneFeatures)}``.

        One backbone forward per compatible group (first-seen order); each forward computes the prefix
        layers its tenants' policies read (``policies`` overrides registered ones, e.g. a pinned version)
        and runs each row through its policy's LoRA adapter, if it has one. ``row_policies`` (one per
        request, None: the tenant's) names the policy of each row when a tenant's rows use different
        versions (an evaluation's pinned adapter next to the live one). ``grad`` keeps the autograd graph
        from the adapters to the features (a LoRA tenant's training step).
        """
        if row_policies is not None and len(row_policies) != len(requests):
            raise ValueError(f"{len(row_policies)} row policies for {len(requests)} requests")
        row_pol = [(row_policies[i] if row_policies is not None else None) or self._policy(t, policies)
                   for i, (t, _) in enumerate(requests)]
        groups: dict[str, list[int]] = {}
        for i, (_, feat) in enumerate(requests):
            groups.setdefault(feat.compat_key, []).append(i)
        parts: dict[str, list[tuple[list[int], BackboneFeatures]]] = {}
        for key, idx in groups.items():
            bb = self.backbone_for(key)
            tenants = list(dict.fromkeys(requests[i][0] for i in idx))
            wanted = {t: bb.normalize_layers(self._layers(t, policies)) for t in tenants}
            union = sorted({layer for layers in wanted.values() for layer in layers})
            adapters = [getattr(row_pol[i], "lora", None) for i in idx]
            encoded = bb.encode_prefix([requests[i][1] for i in idx], layers=union,
                                       adapters=adapters if any(a is not None for a in adapters) else None,
                                       grad=grad, cache=self.prefix_cache)
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

    def tenant_features(self, tenant: str, observations: list[Observation]
                        ) -> tuple[BackboneFeatures | DeferredFeatures, torch.Tensor]:
        """One tenant's batch: backbone features (its layers) and proprio [N, P].

        A tenant with a LoRA adapter gets :class:`AdaptedFeatures`: computed when its policy reads them,
        through the adapter's current weights and with autograd when grad mode is on (its training step
        backpropagates through the frozen backbone into the adapter). Others get frozen features now.
        """
        feats = self.preprocessors[tenant].batch(observations)
        proprio = torch.from_numpy(np.stack([f.proprio for f in feats]))
        policy = self.policies.get(tenant)
        if policy is not None and policy.lora is not None:
            return AdaptedFeatures(self, tenant, feats), proprio
        (_, out), = self.group_features([(tenant, f) for f in feats]).values()
        return out, proprio

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


class AdaptedFeatures(DeferredFeatures):
    """A LoRA tenant's batch, encoded when its policy reads it (``TenantPolicy`` calls :meth:`compute`).

    Each computation is a fresh backbone forward through the reading policy's adapter: features follow
    the adapter as it trains, and with grad mode on they carry the graph back to it.
    """

    def __init__(self, framework: VLAFramework, tenant: str, features: list[VLAFeature]) -> None:
        self.framework, self.tenant, self.features = framework, tenant, features

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, rows: Any) -> AdaptedFeatures:
        if isinstance(rows, int):
            rows = [rows]
        if isinstance(rows, slice):
            idx = list(range(len(self.features)))[rows]
        else:
            t = torch.as_tensor(rows).reshape(-1)
            idx = (t.nonzero().reshape(-1) if t.dtype == torch.bool else t).tolist()
        return AdaptedFeatures(self.framework, self.tenant, [self.features[int(i)] for i in idx])

    def compute(self, policy: TenantPolicy) -> BackboneFeatures:
        reqs = [(self.tenant, f) for f in self.features]
        (_, out), = self.framework.group_features(reqs, policies={self.tenant: policy},
                                                  grad=torch.is_grad_enabled()).values()
        return out
