"""Tasks of the actor ranks (resource ``ACTOR``), each given the rank's :class:`ActorHost`: a tenant's slot
built, rebuilt and dropped; one training-queue item run; a job finished; a version exported.

An update is one function per kind of work, each handing its batch to its algorithm (:data:`UPDATES`:
SFT → ``nexus.algorithms.sft``, RL → ``nexus.algorithms.ppo`` or ``nexus.algorithms.grpo``); then the new
version is published (:meth:`ActorHost.publish`). Low-level ops (:mod:`nexus.actor.ops`) make a version
only when they save weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from distributed import get_worker

from nexus.actor import export, ops
from nexus.actor.host import ActorHost, metered
from nexus.actor.slot_rebuild import rebuild_each
from nexus.actor.slots import build_slot, drop_slot, release_memory
from nexus.actor.tenant_slot import TenantSlot
from nexus.algorithms import grpo, ppo, sft
from nexus.algorithms.shards import Shard, shard
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import read_batch, table_arrays
from nexus.wire.engine_client import EngineSet
from nexus.wire.messages import (
    EngineEndpoint,
    GRPOWork,
    OpWork,
    RLWork,
    SFTWork,
    SlotInfo,
    TenantSetup,
    UpdateRequest,
    UpdateResult,
    Work,
)

logger = logging.getLogger("nexus.actor")


# -- slots ------------------------------------------------------------------------------------------------
def init_tenant(actor: ActorHost, setup: TenantSetup) -> SlotInfo:
    """Allocate a tenant's slot on this rank from its durable state (a new tenant starts at 0)."""
    with metered(setup.name, "init"):
        return build_slot(actor, setup)


def rebuild_slots(actor: ActorHost, setups: list[TenantSetup], offloaded: list[str] = ()) -> dict[str, Any]:
    """A restarted actor rank: rebuild every tenant's slot (a tenant that fails does not stop the others);
    the ``offloaded`` tenants' slots stay on disk until their next item."""
    actor.offloaded.update(dict.fromkeys(offloaded, 0))
    return rebuild_each(setups, lambda s: init_tenant(actor, s))


def drop_tenant(actor: ActorHost, tenant: str) -> bool:
    drop_slot(actor, tenant)
    actor.offloaded.pop(tenant, None)
    actor.references.pop(tenant, None)
    return True


def offload_slots(actor: ActorHost, setups: list[TenantSetup]) -> dict[str, Any]:
    """Idle tenants' slots to disk: each slot's current version gets its checkpoint if it has none yet (a
    collective: every rank runs this task in the same order), then the rank frees the slot. A slot with
    gradients waiting for an ``optim_step`` stays (they are in no checkpoint)."""
    done, kept = [], {}
    for setup in setups:
        slot = actor.slots.get(setup.name)
        if slot is None:
            continue
        if slot.pending_backward:
            kept[setup.name] = "gradients wait for an optim_step"
            continue
        out = TenantOutputDir(setup.output_dir)
        if slot.checkpoint_version != slot.version:  # the slot's own state: the same on every rank
            tag = slot.save_checkpoint(str(out.checkpoints))
            if actor.writes:
                out.add_checkpoint(slot.version, tag)
                limits = actor.config.limits_for(setup.name)
                out.prune(limits.max_versions_kept, limits.max_checkpoints_kept)
        actor.offloaded[setup.name] = slot.version
        drop_slot(actor, setup.name)
        done.append(setup.name)
    release_memory()
    return {"offloaded": done, "kept": kept}


def slot_for(actor: ActorHost, setup: TenantSetup) -> TenantSlot:
    """The tenant's slot on this rank, restored from its checkpoint when it was offloaded."""
    if setup.name not in actor.slots and setup.name in actor.offloaded:
        build_slot(actor, setup)
        actor.offloaded.pop(setup.name, None)
    return actor.slot(setup.name)


# -- updates ----------------------------------------------------------------------------------------------
def update_sft(actor: ActorHost, slot: TenantSlot, work: SFTWork) -> dict[str, float]:
    """One SFT step on a batch of the tenant's dataset (chunked targets: each row's following actions); this
    rank computes its shard of the batch (``nexus.algorithms.shards``)."""
    ds = actor.dataset(work.dataset)

    def targets(rows: dict) -> torch.Tensor:
        if slot.chunk == 1:
            return torch.as_tensor(rows["action"])
        return torch.as_tensor(actor.chunks(work.dataset).targets(rows["episode"], rows["step"], slot.chunk))

    batch = ds.sample_batch(work.batch_size, work.step, slot.spec.seed)
    part = shard(len(batch["episode"]), slot.rank, slot.world_size)
    mine = _rows(batch, part)
    feats, proprio = actor.features(slot.name, ds.observations(mine))
    metrics = sft.update(slot, feats, proprio, targets(mine), work.step, part)
    observe_states(slot, batch)
    if work.eval_heldout:
        held = ds.heldout()
        part = shard(len(held["episode"]), slot.rank, slot.world_size)
        rows = _rows(held, part)
        hf, hp = actor.features(slot.name, ds.observations(rows))
        mse = {"heldout_action_mse": sft.action_mse(slot.policy, hf, hp, targets(rows))}
        metrics |= slot.combine(mse, part.share)
    return metrics


def _rows(batch: dict, part: Shard) -> dict:
    return batch if part.share == 1.0 else {k: v[part.rows] for k, v in batch.items()}


def update_rl(actor: ActorHost, slot: TenantSlot, work: RLWork) -> dict[str, float]:
    """One RL update on a stored trajectory batch (the rollout's backbone features when reusable); this rank
    computes the backbone features of the rows it owns (``nexus.algorithms.shards``)."""
    table = read_batch(work.batch)
    arrays = table_arrays(table)
    own = None if slot.world_size == 1 else shard(table.num_rows, slot.rank, slot.world_size).rows
    feats, proprio, cached = actor.batch_features(slot, table, arrays, work.use_cached_features, own)
    with slot.lr_scaled(work.lr_scale):
        metrics = ppo.update(slot, feats, proprio, arrays, work.config) | {"cached_features": float(cached)}
    observe_states(slot, arrays)
    return metrics


def observe_states(slot: TenantSlot, arrays: dict) -> None:
    """After an SFT step or RL update: the tenant's proprio normalization folds in the whole batch's states (every
    rank the same rows: the ranks keep identical statistics); the next version acts and trains with them."""
    if "state" in arrays:
        slot.policy.proprio_norm.observe(arrays["state"])


def update_grpo(actor: ActorHost, slot: TenantSlot, work: GRPOWork, output_dir: str) -> dict[str, float]:
    """One GRPO update on a stored batch of whole groups; with ``kl_coef`` > 0 the reference head (the version
    the job started from) scores this rank's steps first."""
    table = read_batch(work.batch)
    arrays = table_arrays(table)
    own = None if slot.world_size == 1 else shard(table.num_rows, slot.rank, slot.world_size).rows
    feats, proprio, cached = actor.batch_features(slot, table, arrays, work.use_cached_features, own)
    ref_logprob = None
    if work.ref_version is not None and work.config.kl_coef > 0:
        ref = actor.reference(slot, output_dir, work.ref_version)
        mine = slice(None) if own is None else own
        with torch.no_grad():
            ref_logprob, _, _ = ref.evaluate(feats, proprio, torch.as_tensor(np.array(arrays["action"][mine])))
    with slot.lr_scaled(work.lr_scale):
        metrics = grpo.update(slot, feats, proprio, arrays, work.config, ref_logprob)
    observe_states(slot, arrays)
    return metrics | {"cached_features": float(cached)}


# one update per kind of work: (actor, slot, work, the tenant's output dir) -> metrics
UPDATES: dict[type, Callable[[ActorHost, TenantSlot, Any, str], dict[str, float]]] = {
    SFTWork: lambda actor, slot, work, _: update_sft(actor, slot, work),
    RLWork: lambda actor, slot, work, _: update_rl(actor, slot, work),
    GRPOWork: update_grpo,
}


def run_update(actor: ActorHost, req: UpdateRequest, data: Any = None) -> UpdateResult:
    """One training-queue item on this rank; a new version goes to every engine in ``req.engines``."""
    return update(actor, req, EngineSet(get_worker(), req.engines), data)


def update(actor: ActorHost, req: UpdateRequest, engines: EngineSet, data: Any = None) -> UpdateResult:
    """:func:`run_update` with the engines to push to (an ``EngineSet``)."""
    slot = slot_for(actor, req.tenant)
    out = TenantOutputDir(req.tenant.output_dir)
    work: Work = req.work
    kind = "op" if isinstance(work, OpWork) else "rl" if isinstance(work, RLWork | GRPOWork) else "sft"
    with metered(slot.name, kind, req.job) as sig:
        outputs = None
        if isinstance(work, OpWork):
            version, metrics, outputs = ops.run_op(actor, slot, work, data, out, engines)
            sync: dict[str, float] = {}
        else:
            metrics = UPDATES[type(work)](actor, slot, work, req.tenant.output_dir)
            version, sync = actor.publish(slot, out, engines, f"{kind}:{req.item_id}", req.sync)
        sig.update(sync_s=sync.get("weight_sync_s", 0.0), sync_bytes=sync.get("weight_sync_bytes", 0.0),
                   synced=bool(sync.get("weight_sync_bytes")))
    metrics = {k: float(v) for k, v in {**metrics, **sync, "update_s": sig["t1"] - sig["t0"]}.items()}
    return UpdateResult(version=int(version), metrics=metrics, pushed_to=tuple(engines.pushed_to),
                        push_errors=tuple(engines.errors), outputs=outputs)


# -- jobs and exports -----------------------------------------------------------------------------------
def finish_job(actor: ActorHost, tenant: str, output_dir: str, record: dict, checkpoint: bool,
               version: int | None = None, engines: tuple[EngineEndpoint, ...] = ()) -> dict[str, Any]:
    """At a job's end: checkpoint (training jobs, unless this version has one), record the job (its metric
    history goes to ``jobs/<job>.json``), and push the last version to ``engines`` if lazy sync held it
    back. The artifacts are the manifest and the weights of ``version`` (the version the job evaluated or
    produced; default: the slot's current one) and, for a finished training job, its exported policy."""
    with metered(tenant, "checkpoint"):
        out = TenantOutputDir(output_dir)
        slot = actor.slots.get(tenant)
        if checkpoint and slot is not None:
            # decided from the slot's own state, the same on every rank (the save is collective)
            if slot.checkpoint_version != slot.version:
                tag = slot.save_checkpoint(str(out.checkpoints))
                if actor.writes:
                    out.add_checkpoint(slot.version, tag)
                    limits = actor.config.limits_for(tenant)
                    out.prune(limits.max_versions_kept, limits.max_checkpoints_kept)
        if not actor.writes:
            return {"artifacts": []}
        if checkpoint and slot is not None:
            record["checkpoint"] = out.latest_checkpoint()["tag"]
        if record.get("history") is None:
            out.write_job(record)  # add_job writes the record file itself when there is a history
        out.add_job(record)
        artifacts = [str(out.manifest_path)]
        if version is None and slot is not None:
            version = slot.version
        if version is not None and out.weights_path(version).exists():
            artifacts.append(str(out.weights_path(version)))
        if slot is not None and checkpoint and record.get("state") == "done":  # the job's MLflow model
            artifacts += _export_for_tracking(actor, slot, output_dir)
    res: dict[str, Any] = {"artifacts": artifacts}
    if engines:
        res["sync"] = actor.sync_weights(tenant, EngineSet(get_worker(), engines))
    return res


def _export_for_tracking(actor: ActorHost, slot: TenantSlot, output_dir: str) -> list[str]:
    setup = TenantSetup(slot.name, slot.spec, slot.schema, output_dir, slot.version)
    try:
        path = export.export_for_tracking(actor, setup, slot.version)
    except Exception:  # the job stays recorded; only its MLflow model is missing
        logger.exception("could not export %s v%d", slot.name, slot.version)
        return []
    return [path] if path else []


def export_version(actor: ActorHost, setup: TenantSetup, version: int, path: str | None = None) -> dict[str, Any]:
    """Write a recorded version as a policy directory (only rank 0 writes; ``nexus.actor.export``)."""
    return export.export_version(actor, setup, version, path) if actor.rank == 0 else {}
