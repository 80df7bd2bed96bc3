"""An inference engine's weights: the frozen backbone, every tenant's live head and the versions pinned by
running evaluations.

Touched by the engine's model thread only (methods without ``async``), except the pin counts, which the
engine keeps on its event loop. The backbone is built at the first registration.
"""

from __future__ import annotations

import torch

from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir
from nexus.deploy.gc_tuning import refreeze
from nexus.engine.head_versions import HeadVersions
from nexus.features import TenantSchema
from nexus.model.backbone import SharedBackbone
from nexus.model.framework import VLAFramework
from nexus.model.head_bank import HeadBank, HeadShape, head_shape
from nexus.model.policy import TenantPolicy
from nexus.model.prefix_cache import PrefixCache
from nexus.model.preprocessor import TenantPreprocessor
from nexus.spec import TenantSpec


class TenantHeads(HeadVersions[TenantPolicy]):
    def __init__(self, config: ServiceConfig) -> None:
        super().__init__()
        self.config = config
        self._framework: VLAFramework | None = None
        self.banks: dict[HeadShape, HeadBank] = {}  # live heads stacked by shape (caches.head_bank_tenants)
        self._banked: dict[str, HeadBank] = {}  # tenant -> the bank with its slot (no shape to work out per group)

    @property
    def framework(self) -> VLAFramework:
        if self._framework is None:
            torch.set_num_threads(1)
            self.framework = VLAFramework(SharedBackbone(self.config.backbone))
            refreeze()  # the backbone lives as long as the engine: out of the collector's sight (gc.freeze)
        return self._framework  # type: ignore[return-value]  # set just above

    @framework.setter
    def framework(self, framework: VLAFramework) -> None:  # tests and benchmarks bring their own backbones
        """The engine's framework, with its prefix cache: the policies it serves are replaced at each weight
        sync, never changed in place (what makes the cache's keys by adapter object sound)."""
        mb = self.config.caches.prefix_cache_mb
        framework.prefix_cache = PrefixCache(int(mb * 2**20)) if mb > 0 else None
        self._framework = framework

    def policy_from_bytes(self, tenant: str, weights: bytes) -> TenantPolicy:
        spec, schema = self.specs[tenant]
        bb = self.framework.backbone
        return TenantPolicy.from_bytes(weights, spec, schema, bb.hidden_size, lora_shapes=bb.lora_shapes(spec.lora))

    # -- model thread -------------------------------------------------------------------------------
    def register(self, spec: TenantSpec, schema: TenantSchema, version: int, weights: bytes) -> None:
        self.specs[spec.name] = (spec, schema)
        policy = self.policy_from_bytes(spec.name, weights)
        pre = TenantPreprocessor(schema, self.framework.backbone.cfg)
        self.framework.add_tenant(spec.name, policy, pre)
        self.live[spec.name] = (version, policy)
        self._bank(spec.name, policy)
        self.feature_keys[spec.name] = pre.compat_key

    def load(self, tenant: str, version: int, weights: bytes) -> None:
        """The tenant's live head becomes ``version``."""
        policy = self.policy_from_bytes(tenant, weights)
        self.live[tenant] = (version, policy)
        self._bank(tenant, policy)
        self.framework.policies[tenant] = policy

    def unregister(self, tenant: str) -> None:
        """Forget a deleted tenant (its live head and pinned versions)."""
        self.forget(tenant)
        for bank in self.banks.values():
            bank.drop(tenant)
        self._banked.pop(tenant, None)
        self.framework.remove_tenant(tenant)

    def load_pinned(self, tenant: str, version: int, output_dir: str) -> TenantPolicy:
        """``version``'s head: the live one if it is that version, else read from the tenant's output dir."""
        live_version, live = self.live[tenant]
        if live_version == version:
            return live
        return self.policy_from_bytes(tenant, TenantOutputDir(output_dir).weights_path(version).read_bytes())

    def _bank(self, tenant: str, policy: TenantPolicy) -> None:
        """The tenant's live head into the bank of its shape, while that bank has room (else its rows run its
        head alone)."""
        shape = head_shape(policy)
        for other, bank in self.banks.items():
            if other != shape:
                bank.drop(tenant)
        self._banked.pop(tenant, None)
        limit = self.config.caches.head_bank_tenants
        if shape is None or limit == 0:
            return
        bank = self.banks.setdefault(shape, HeadBank(shape))
        if tenant in bank.slots or len(bank.slots) < limit:
            bank.put(tenant, policy)
            self._banked[tenant] = bank

    def bank_of(self, tenant: str, policy: TenantPolicy) -> HeadBank | None:
        """The bank whose slot holds this very policy of the tenant (its live head), if any."""
        bank = self._banked.get(tenant)
        return bank if bank is not None and bank.holds(tenant, policy) else None

    def policy_of(self, tenant: str, version: int | None) -> TenantPolicy:
        live_version, live = self.live[tenant]
        return live if version is None or version == live_version else self.pinned[(tenant, version)][0]

    def prefix_cache_stats(self, reset: bool = False) -> dict[str, int]:
        """The prefix cache's counters (empty before the backbone is built or with the cache off); ``reset``:
        then from zero."""
        cache = self._framework.prefix_cache if self._framework is not None else None
        if cache is None:
            return {}
        stats = cache.stats()
        if reset:
            cache.reset_counters()
        return stats
