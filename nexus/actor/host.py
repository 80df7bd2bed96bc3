"""Training Model Service, one actor rank's state (resource ``ACTOR``): the frozen backbone, loaded once per
process, and every tenant's slot (head + value head + adapter in its own DeepSpeed ZeRO engine + version).

Held by the worker's Nexus plugin and passed to the actor tasks (:mod:`nexus.actor.tasks`). With N
ranks (``actor_ranks``) every rank holds every slot, computes its shard of each batch
(:mod:`nexus.algorithms.shards`) and steps with the others; only rank 0 writes weights and manifests and pushes
to inference (:attr:`ActorHost.writes`). Besides
the state, the few things every update needs: backbone features of a batch (the rollout's own features of an
RL batch when they are reusable), and publishing a new version — weights (and a checkpoint when due) made
durable before the version is pushed to the inference engines directly, worker to worker, when something
will read it (lazy sync).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from nexus.actor.process_group import ensure_distributed
from nexus.actor.tenant_slot import TenantSlot
from nexus.algorithms.sft import ActionChunks
from nexus.config import catalog
from nexus.config.service import ServiceConfig
from nexus.data.offline_dataset import OfflineDataset
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import FEATURE_COLUMN, batch_metadata, table_to_observations
from nexus.errors import NotFound, Unavailable
from nexus.features import Observation
from nexus.model.backbone import SharedBackbone
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.framework import VLAFramework
from nexus.model.policy import TenantPolicy
from nexus.wire.engine_client import EngineSet
from nexus.wire.messages import Rendezvous, SyncRule
from nexus.wire.signals import emit


@contextmanager
def metered(tenant: str, what: str, job: str | None = None) -> Iterator[dict[str, Any]]:
    """Charge the actor time of the enclosed work to ``tenant`` (and its job): an ``update`` signal."""
    sig: dict[str, Any] = {"tenant": tenant, "job": job, "what": what, "t0": time.time()}
    try:
        yield sig
    finally:
        sig["t1"] = time.time()
        emit("update", **sig)


class ActorHost:
    def __init__(self, config: ServiceConfig, rank: int = 0, world_size: int = 1, rendezvous: Rendezvous | None = None,
                 local_rank: int = 0, host: str | None = None, listen_fd: int | None = None) -> None:
        """Rank ``rank`` of ``world_size`` (``rendezvous``: where the group meets; None: a world of 1); ``host``:
        this rank's own address (default: the service's host), ``listen_fd``: rank 0's rendezvous socket."""
        torch.set_num_threads(1)
        self.config, self.rank, self.world_size, self.rendezvous = config, rank, world_size, rendezvous
        # before any slot: the process group's sockets stay on this rank's own address
        ensure_distributed(host or config.host, rank, world_size, rendezvous, local_rank, listen_fd)
        self.backbone_cfg = config.backbone
        self.framework = VLAFramework(SharedBackbone(self.backbone_cfg))
        self.slots: dict[str, TenantSlot] = {}
        self.synced: dict[str, int] = {}  # tenant -> the version this actor last pushed to inference (lazy sync)
        self.datasets: dict[str, OfflineDataset] = {}
        self.action_chunks: dict[str, ActionChunks] = {}  # dataset name -> chunked SFT targets
        self.offloaded: dict[str, int] = {}  # tenant -> the version its slot was offloaded at (on disk)
        self.references: dict[str, tuple[int, TenantPolicy]] = {}  # tenant -> a GRPO job's KL reference head

    @property
    def feat_dim(self) -> int:
        return self.framework.backbone.hidden_size

    def slot(self, tenant: str) -> TenantSlot:
        slot = self.slots.get(tenant)
        if slot is None:
            raise Unavailable(f"tenant {tenant!r} has no slot on this actor rank (it restarted?): the control "
                              "plane rebuilds it")
        return slot

    def dataset(self, name: str) -> OfflineDataset:
        if name not in self.datasets:
            self.datasets[name] = OfflineDataset(catalog.dataset(name))
        return self.datasets[name]

    def chunks(self, name: str) -> ActionChunks:
        """A dataset's chunked action targets (each row's following steps), built once over both splits."""
        if name not in self.action_chunks:
            ds = self.dataset(name)
            everything = [ds.train(), ds.heldout()]
            self.action_chunks[name] = ActionChunks(*(np.concatenate([a[k] for a in everything])
                                                      for k in ("episode", "step", "action")))
        return self.action_chunks[name]

    # -- features ---------------------------------------------------------------------------------------
    def features(self, tenant: str, observations: list[Observation]) -> tuple[BackboneFeatures, torch.Tensor]:
        """Frozen-backbone features (one grouped forward; pooled + the prefix layers the tenant's action
        module reads) and proprio tensors for a batch."""
        return self.framework.tenant_features(tenant, observations)

    def batch_features(self, slot: TenantSlot, table, arrays: dict, use_cache: bool = True,
                       rows: np.ndarray | None = None) -> tuple[BackboneFeatures, torch.Tensor, bool]:
        """Backbone features + proprio of a stored RL batch (of its ``rows``; default all) -> (features, proprio,
        from_cache).

        The rollout's own features when the batch carries them, they came from this actor's backbone
        (same compat key), the tenant's head reads pooled features only and it has no LoRA adapter (its
        update backpropagates through the backbone into the adapter, and the adapter moved since the
        rollout); otherwise one forward of the backbone over the batch (what a recompute costs)."""
        key = batch_metadata(table).get("feature_key")
        pre = self.framework.preprocessors.get(slot.name)
        if (use_cache and FEATURE_COLUMN in arrays and pre is not None and key == pre.compat_key
                and not slot.policy.prefix_layers and slot.policy.lora is None):
            pick = slice(None) if rows is None else rows
            pooled = torch.from_numpy(np.array(arrays[FEATURE_COLUMN][pick], np.float32))  # a copy: Arrow is read-only
            return BackboneFeatures(pooled), torch.from_numpy(np.array(arrays["state"][pick], np.float32)), True
        part = table if rows is None else table.take(rows)
        feats, proprio = self.features(slot.name, table_to_observations(part, slot.schema))
        return feats, proprio, False

    def reference(self, slot: TenantSlot, output_dir: str, version: int) -> TenantPolicy:
        """A frozen copy of the tenant's policy at a recorded ``version`` (a GRPO job's KL reference), read once
        from its weights file and kept while the job asks for that version."""
        held = self.references.get(slot.name)
        if held is None or held[0] != version:
            path = TenantOutputDir(output_dir).weights_path(version)
            if not path.exists():
                raise NotFound(f"version {version} of tenant {slot.name!r} has no weights (pruned): it was the KL "
                               "reference of this GRPO job")
            policy = TenantPolicy.from_bytes(path.read_bytes(), slot.spec, slot.schema, self.feat_dim, slot.chunk)
            self.references[slot.name] = held = (version, policy.requires_grad_(False))
        return held[1]

    # -- versions ---------------------------------------------------------------------------------------
    @property
    def writes(self) -> bool:
        """Whether this rank writes the tenants' files and pushes to inference (rank 0 only: the other
        ranks hold the same weights; checkpoints are written by every rank, each its optimizer partition)."""
        return self.rank == 0

    def publish(self, slot: TenantSlot, out: TenantOutputDir, engines: EngineSet, source: str,
                sync: SyncRule | None = None) -> tuple[int, dict[str, float]]:
        """Bump the slot's version and make it durable — every ``checkpoint_every`` versions its checkpoint
        (collective), then its weights written once, both listed in the manifest (retention applied) —
        then push it to inference if the sync rule says so (versions count every optimizer step either way).
        A rank lost during the checkpoint leaves no trace of the version: the re-run makes it again."""
        version = slot.bump_version()
        every = self.config.checkpoint_every
        tag = slot.save_checkpoint(str(out.checkpoints)) if every and version % every == 0 else None
        pushed = {"weight_sync_s": 0.0, "weight_sync_bytes": 0.0}
        if not self.writes:
            return version, pushed
        weights = slot.export_weights()
        digest = out.write_weights(version, weights)
        limits = self.config.limits_for(slot.name)
        out.add_version(version, source, keep=(limits.max_versions_kept, limits.max_checkpoints_kept),
                        checkpoint=tag, sha256=digest)
        if sync is None or sync.should_push(version):
            pushed = self._push(engines, slot, weights)
        return version, pushed

    def sync_weights(self, tenant: str, engines: EngineSet) -> dict[str, Any]:
        """Push the tenant's current head to inference unless it is there already (lazy sync's catch-up,
        e.g. at the end of an SFT job)."""
        with metered(tenant, "sync") as sig:
            slot = self.slots.get(tenant)
            if slot is None or not self.writes or self.synced.get(tenant) == slot.version:
                return {"version": None if slot is None else slot.version, "pushed": False}
            sync = self._push(engines, slot, slot.export_weights())
            sig.update(sync_s=sync["weight_sync_s"], sync_bytes=sync["weight_sync_bytes"], synced=True)
            return {"version": slot.version, "pushed": True, **sync}

    def _push(self, engines: EngineSet, slot: TenantSlot, weights: bytes) -> dict[str, float]:
        t0 = time.perf_counter()
        engines.load_weights(slot.name, slot.version, weights).result()
        self.synced[slot.name] = slot.version
        return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": float(len(weights))}
