"""A tenant's slot on an actor rank, built from its durable state.

Durability rules (the control plane relies on them):

* A version's weights are written once (``TenantOutputDir.write_weights``) *before* the version is
  pushed to inference or listed in the manifest, and with ``checkpoint_every = k`` every k-th version
  is also a DeepSpeed checkpoint (params + optimizer state) saved before it is published
  (:meth:`~nexus.actor.host.ActorHost.publish`).
* A slot rebuilt after a crash loads its latest checkpoint, and its version counter continues past
  the highest version ever written, so no version number is used twice and no published weights file
  is rewritten. Updates after the checkpoint (at most ``k - 1`` with ``checkpoint_every = k``) are the
  work lost; the rebuild records them in the manifest (``restores``).

A slot that would not fit the actor's memory is refused before anything is built: the actor must never hit
its memory limit (Dask would restart it and every tenant would lose its slot).
"""

from __future__ import annotations

import ctypes
import gc
import time

import psutil
import torch
from distributed import get_worker

from nexus.actor.host import ActorHost
from nexus.actor.process_group import agreed_error, gather_objects, portable
from nexus.actor.tenant_slot import TenantSlot
from nexus.config.paths import confine, private_mkdir
from nexus.data.output_dir import TenantOutputDir
from nexus.data.tenant_dirs import job_seq, link_outside_root
from nexus.errors import Forbidden, LimitExceeded
from nexus.export.policy import initial_state
from nexus.features import TenantSchema
from nexus.model.backbone import SharedBackbone
from nexus.model.policy import TenantPolicy
from nexus.model.preprocessor import TenantPreprocessor
from nexus.spec import TenantSpec
from nexus.wire.messages import SlotInfo, TenantSetup

# Actor bytes per trainable parameter of a slot at its peak: fp32 weights, gradients, Adam's two moments,
# ZeRO's gradient buffers, and the transient copies of a weight export (state_dict clone + torch.save
# bytes): 7 x 4 bytes (ZeRO's fp32 master is a view of the weights: nexus.actor.zero_memory).
ACTOR_BYTES_PER_PARAM = 28


def build_slot(actor: ActorHost, setup: TenantSetup) -> SlotInfo:
    """Allocate (or keep) a tenant's slot on this rank from its durable state (a new tenant starts at 0).

    With N ranks every rank reads the tenant's state and the ranks compare outcomes before anything is
    written or built (a refusal on one rank is the refusal of all); only rank 0 writes the tenant's files,
    after every rank has read them; building the slot's engine and loading its checkpoint are collective."""
    name, spec, schema = setup.name, setup.spec, setup.schema
    out = TenantOutputDir(setup.output_dir)
    error, state, existed = None, None, out.path.exists()
    try:
        state = _read_state(actor, setup, out)
    except Exception as e:
        error = e
    failed = agreed_error(error, gather_objects(portable(error)))
    if failed is not None:
        if actor.writes and not existed and out.path.is_dir() and not any(out.path.iterdir()):
            out.path.rmdir()  # a refused tenant (or init_from) leaves nothing behind
        raise failed
    assert state is not None
    ck, init, published = state
    current = actor.slots.get(name)
    if actor.writes and not out.exists():
        out.create(spec.model_dump(), schema.to_dict())
    if current is not None and current.version >= published:  # this process still holds it
        return SlotInfo(name, current.version, True, current.version, published, job_seq(out))
    # a LoRA tenant's adapter is part of its policy: the slot's engine trains it, its weights files carry it
    bb = actor.framework.backbone
    slot = TenantSlot(spec, schema, actor.feat_dim, grad_clip=spec.grad_clip, lora_shapes=bb.lora_shapes(spec.lora),
                      init_state=init)
    ck_version = None
    if ck is not None:
        slot.load_checkpoint(str(out.checkpoints), ck["tag"])
        ck_version = slot.version
    slot.version = max(slot.version, published)  # numbering continues past everything ever written
    if current is not None:  # replaced by the rebuilt one
        current.close()
    actor.slots[name] = slot
    actor.framework.add_tenant(name, slot.policy, TenantPreprocessor(schema, actor.backbone_cfg))
    actor.synced[name] = slot.version  # the engine pool registers the tenant at this version
    if actor.writes:
        _record_build(actor, slot, out, ck_version, published)
    return SlotInfo(name, slot.version, ck is not None, ck_version, published, job_seq(out))


def _read_state(actor: ActorHost, setup: TenantSetup, out: TenantOutputDir
                ) -> tuple[dict | None, dict[str, torch.Tensor] | None, int]:
    """What a slot is built from -> (latest checkpoint, initial weights, highest version published), the
    checks first (before the manifest: a refused ``init_from`` leaves no tenant behind)."""
    spec, schema = setup.spec, setup.schema
    if setup.name not in actor.slots:  # first: a refused tenant leaves nothing behind
        check_actor_budget(actor, spec, schema)
    check_output_dir(actor, spec, out)
    ck = out.latest_checkpoint()
    init = None if ck is not None else _initial_state(spec, schema, actor.framework.backbone, out)
    return ck, init, out.highest_version()


def _record_build(actor: ActorHost, slot: TenantSlot, out: TenantOutputDir, ck_version: int | None,
                  published: int) -> None:
    """Rank 0: a new tenant's version 0, the updates a rebuild lost, the tenant's link under the root."""
    if not out.weights_path(slot.version).exists():  # a new tenant: its version 0
        out.write_weights(slot.version, slot.export_weights())
        out.add_version(slot.version, "init")
    if published > (ck_version or 0):  # published versions newer than the checkpoint: their updates are lost
        m = out.read()
        lost = published - (ck_version or 0)
        m.setdefault("restores", []).append({"time": time.time(), "checkpoint_version": ck_version,
                                             "published_version": published, "lost_updates": lost})
        out.write(m)
    link_outside_root(actor.config.tenants_dir, slot.name, out.path)


def drop_slot(actor: ActorHost, tenant: str) -> None:
    slot = actor.slots.pop(tenant, None)
    if slot is not None:
        slot.close()
    actor.synced.pop(tenant, None)
    actor.framework.remove_tenant(tenant)


def release_memory() -> None:
    """Give dropped slots' memory back: their engines hold reference cycles, and glibc keeps freed pages
    in its arenas unless asked to trim them."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _initial_state(spec: TenantSpec, schema: TenantSchema, backbone: SharedBackbone, out: TenantOutputDir):
    """The weights a slot without a checkpoint starts from: the tenant's own version 0 when it was written
    (a rebuilt slot; its v0 may have come from ``init_from``, whose dir need not exist any more), else the
    exported policy ``init_from`` (a new tenant; checked against this backbone before anything is written),
    else None (fresh, seeded weights)."""
    v0 = out.weights_path(0)
    if v0.is_file():
        return torch.load(v0, map_location="cpu", weights_only=True)
    if spec.init_from:
        return initial_state(spec.init_from, spec, schema, backbone)
    return None


def slot_bytes(spec: TenantSpec, schema: TenantSchema, feat_dim: int,
               lora_shapes: dict[str, tuple[int, int]] | None = None) -> int:
    """Actor memory a tenant's slot would take (head, value head and LoRA adapter), counted on torch's
    meta device (nothing is allocated)."""
    with torch.device("meta"):
        policy = TenantPolicy.from_spec(spec, schema, feat_dim, lora_shapes=lora_shapes)
    return ACTOR_BYTES_PER_PARAM * sum(p.numel() for p in policy.parameters())


def check_actor_budget(actor: ActorHost, spec: TenantSpec, schema: TenantSchema) -> None:
    """Refuse a slot that would not fit, before building it."""
    limits = actor.config.limits_for(spec.name)
    need = slot_bytes(spec, schema, actor.feat_dim, actor.framework.backbone.lora_shapes(spec.lora))
    if need > limits.max_head_bytes:
        raise LimitExceeded(f"hidden_dim={spec.hidden_dim} ({spec.action_head}): the slot needs "
                            f"~{need / 2**20:.0f} MiB of actor memory, over the limit "
                            f"max_head_bytes={limits.max_head_bytes / 2**20:.0f} MiB")
    try:
        memory_limit = get_worker().memory_manager.memory_limit
    except (ValueError, AttributeError):  # not on a Dask worker (unit tests)
        return
    if not memory_limit:
        return
    free = limits.actor_memory_fraction * memory_limit - psutil.Process().memory_info().rss
    if need > free:
        raise LimitExceeded(f"hidden_dim={spec.hidden_dim} ({spec.action_head}): the slot needs "
                            f"~{need / 2**20:.0f} MiB of actor memory but the actor has "
                            f"{max(free, 0) / 2**20:.0f} MiB left of its budget "
                            f"(actor_memory_fraction={limits.actor_memory_fraction} of {memory_limit / 2**30:.1f} GiB)")


def check_output_dir(actor: ActorHost, spec: TenantSpec, out: TenantOutputDir) -> None:
    """The dir lies inside the service's base with no symlink on the way, and is not another tenant's."""
    base = actor.config.output_base or str(actor.config.tenants_dir)
    private_mkdir(base)
    confine(out.path, base)
    if out.exists():
        owner = out.read().get("tenant")
        if owner != spec.name:
            raise Forbidden(f"output dir of tenant {spec.name!r} refused: it holds tenant {owner!r}'s manifest")
    private_mkdir(out.path)
