"""The versions of each tenant's head an inference engine holds: the live one and the pinned ones.

The bookkeeping and lookups the real heads (:class:`~nexus.engine.tenant_heads.TenantHeads`, with policies)
and heads without weights (a model of the devices) share; no torch here.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from nexus.features import TenantSchema
from nexus.spec import TenantSpec

P = TypeVar("P")  # what a version holds: a policy, or None (heads without weights)


class HeadVersions(Generic[P]):
    def __init__(self) -> None:
        self.specs: dict[str, tuple[TenantSpec, TenantSchema]] = {}
        self.live: dict[str, tuple[int, P]] = {}  # tenant -> (version, policy)
        self.pinned: dict[tuple[str, int], list] = {}  # (tenant, version) -> [policy, refcount]
        self.feature_keys: dict[str, str] = {}  # tenant -> compat key of the forward its rows run in

    def forget(self, tenant: str) -> None:
        """Drop a deleted tenant's spec, live head and pinned versions."""
        self.specs.pop(tenant, None)
        self.live.pop(tenant, None)
        for key in [k for k in self.pinned if k[0] == tenant]:
            del self.pinned[key]

    # -- lookups (any thread) -----------------------------------------------------------------------
    def live_version(self, tenant: str) -> int | None:
        entry = self.live.get(tenant)
        return None if entry is None else entry[0]

    def serves(self, tenant: str, version: int | None) -> bool:
        """The tenant is registered and ``version`` (None: the live one) is live or pinned."""
        if tenant not in self.live:
            return False
        return version is None or (tenant, version) in self.pinned or self.live[tenant][0] == version

    def versions(self) -> dict[str, object]:
        return {"live": {t: v for t, (v, _) in self.live.items()},
                "pinned": sorted(f"{t}@{v}" for t, v in self.pinned)}
