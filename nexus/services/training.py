"""Training Model Service: the actor group's worker side (tasks with resource ``ACTOR``).

The frozen backbone is loaded once per actor process; each tenant holds a slot (head + value head
+ its own DeepSpeed ZeRO engine + version). An update activates one slot, trains it, exports the
new head, bumps the version, makes it durable and pushes the weights to the inference engines
directly (worker to worker, never through the scheduler) when something will use them
(:func:`should_push`: lazy sync). A PPO update reads the backbone features its rollout stored with
the batch instead of running the frozen backbone again (when they come from the same backbone).
The process's service lives in its Nexus worker plugin (``nexus.services.worker_plugin``); slot
lifecycle tasks are in ``nexus.services.recovery``.

Module-level imports stay light (no torch at import).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

from nexus.signals import emit


class TrainingModelService:
    """Process-wide state of one actor worker: the backbone and the tenant slots."""

    def __init__(self, config=None) -> None:
        """``config``: a ``ServiceConfig`` (default: the service's, from ``ServiceConfig.load()``)."""
        import torch

        from nexus.config import ServiceConfig
        from nexus.model.backbone import BackboneConfig, SharedBackbone
        from nexus.model.framework import VLAFramework
        from nexus.services.tenant_slot import ensure_distributed

        torch.set_num_threads(1)
        self.config = config if config is not None else ServiceConfig.load()
        ensure_distributed(self.config.host)  # before any slot: the rendezvous stays on the service's host
        self.backbone_cfg = BackboneConfig(**self.config.backbone.model_dump())
        self.framework = VLAFramework(SharedBackbone(self.backbone_cfg))
        self.slots: dict[str, Any] = {}  # tenant -> TenantSlot
        self.synced: dict[str, int] = {}  # tenant -> the version this actor last pushed to inference (lazy sync)
        self.datasets: dict[str, Any] = {}  # name -> OfflineDataset
        self.action_chunks: dict[str, Any] = {}  # dataset name -> ActionChunks (chunked SFT targets)

    @property
    def feat_dim(self) -> int:
        return self.framework.backbone.hidden_size

    def dataset(self, name: str):
        from nexus import catalog
        from nexus.data.offline_dataset import OfflineDataset

        if name not in self.datasets:
            self.datasets[name] = OfflineDataset(catalog.dataset(name))
        return self.datasets[name]

    def features(self, tenant: str, observations: list) -> tuple[Any, Any]:
        """Frozen-backbone features (one grouped forward; pooled + the prefix layers the tenant's action
        module reads, as ``BackboneFeatures``) and proprio tensors for a batch."""
        return self.framework.tenant_features(tenant, observations)


def service() -> TrainingModelService:
    """This process's training model service (held by its worker plugin)."""
    from nexus.services.worker_plugin import state

    return state().training()


# Actor bytes per trainable parameter of a slot: fp32 weights, gradients, Adam's two moments, ZeRO's
# flat fp32 partition and gradient buffers, and the transient copies of a weight export (state_dict
# clone + torch.save bytes): 8 x 4 bytes.
ACTOR_BYTES_PER_PARAM = 32


def slot_bytes(spec, schema, feat_dim: int, lora_shapes: dict[str, tuple[int, int]] | None = None) -> int:
    """Actor memory a tenant's slot would take (head, value head and LoRA adapter), counted on torch's
    meta device (nothing is allocated)."""
    import torch

    from nexus.model.policy import TenantPolicy

    with torch.device("meta"):
        policy = TenantPolicy.from_spec(spec, schema, feat_dim, lora_shapes=lora_shapes)
    return ACTOR_BYTES_PER_PARAM * sum(p.numel() for p in policy.parameters())


def check_actor_budget(svc: TrainingModelService, spec, schema) -> None:
    """Refuse a slot that would not fit, before building it: the actor must never hit its memory limit
    (Dask would restart it and every tenant would lose its slot)."""
    from nexus.errors import LimitExceeded

    limits = svc.config.limits_for(spec.name)
    need = slot_bytes(spec, schema, svc.feat_dim, svc.framework.backbone.lora_shapes(spec.lora))
    if need > limits.max_head_bytes:
        raise LimitExceeded(f"hidden_dim={spec.hidden_dim} ({spec.action_head}): the slot needs "
                            f"~{need / 2**20:.0f} MiB of actor memory, over the limit "
                            f"max_head_bytes={limits.max_head_bytes / 2**20:.0f} MiB")
    try:
        from distributed import get_worker

        memory_limit = get_worker().memory_manager.memory_limit
    except (ValueError, AttributeError):  # not on a Dask worker (unit tests)
        return
    if not memory_limit:
        return
    import psutil

    free = limits.actor_memory_fraction * memory_limit - psutil.Process().memory_info().rss
    if need > free:
        raise LimitExceeded(f"hidden_dim={spec.hidden_dim} ({spec.action_head}): the slot needs "
                            f"~{need / 2**20:.0f} MiB of actor memory but the actor has "
                            f"{max(free, 0) / 2**20:.0f} MiB left of its budget "
                            f"(actor_memory_fraction={limits.actor_memory_fraction} of {memory_limit / 2**30:.1f} GiB)")


def check_output_dir(svc: TrainingModelService, spec, out) -> None:
    """The dir lies inside the service's base with no symlink on the way, and is not another tenant's."""
    from nexus.errors import Forbidden
    from nexus.paths import confine, private_mkdir

    base = svc.config.output_base or str(svc.config.tenants_dir)
    private_mkdir(base)
    confine(out.path, base)
    if out.exists():
        owner = out.read().get("tenant")
        if owner != spec.name:
            raise Forbidden(f"output dir of tenant {spec.name!r} refused: it holds tenant {owner!r}'s manifest")
    private_mkdir(out.path)


def slot_states() -> dict[str, dict[str, int]]:
    """Operator view of this actor's slots: version and pending backward passes per tenant (tests, audits)."""
    from nexus.services.worker_plugin import state

    svc = state().training_built
    slots = svc.slots if svc is not None else {}
    return {t: {"version": s.version, "pending_backward": s._pending_backward} for t, s in slots.items()}


def _push_weights(engine, tenant: str, version: int, weights: bytes) -> dict[str, float]:
    t0 = time.perf_counter()
    engine.load_weights(tenant, version, weights).result()
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": float(len(weights))}


def should_push(version: int, sync: dict | None) -> bool:
    """The lazy weight-sync rule: push a new version to inference when something will use it.

    ``sync`` (from the control plane; None = eager): ``policy`` "eager" (every version) or "lazy";
    ``live_consumers`` — something reads the tenant's live head now (an RL job's rollouts);
    ``every`` — also every N versions (0: never). Pinned evaluations load their version from the
    tenant's output dir, so they never need a push; the job's end pushes the last version."""
    if sync is None or sync.get("policy", "eager") == "eager":
        return True
    every = int(sync.get("every", 0))
    return bool(sync.get("live_consumers")) or (every > 0 and version % every == 0)


def _publish_version(svc: TrainingModelService, tenant: str, out, engine, source: str,
                     sync: dict | None = None) -> tuple[int, dict]:
    """Bump the slot's version, make it durable, record it in the manifest; push it to inference if
    :func:`should_push` says so (versions count every optimizer step either way)."""
    from nexus.services.recovery import make_durable

    slot = svc.slots[tenant]
    version = slot.bump_version()
    weights = slot.export_weights()
    make_durable(svc, slot, out, version, weights, source)  # weights (+ checkpoint when due), listed, first
    pushed = {"weight_sync_s": 0.0, "weight_sync_bytes": 0.0}
    if should_push(version, sync):
        pushed = _push_weights(engine, tenant, version, weights)
        svc.synced[tenant] = version
    return version, pushed


def sync_weights(tenant: str, engine) -> dict[str, Any]:
    """Push the tenant's current head to inference unless it is there already (lazy sync's catch-up,
    e.g. at the end of an SFT job)."""
    with _metered(tenant, "sync") as sig:
        svc = service()
        slot = svc.slots.get(tenant)
        if slot is None or svc.synced.get(tenant) == slot.version:
            return {"version": None if slot is None else slot.version, "pushed": False}
        sync = _push_weights(engine, tenant, slot.version, slot.export_weights())
        svc.synced[tenant] = slot.version
        sig.update(sync_s=sync["weight_sync_s"], sync_bytes=sync["weight_sync_bytes"], synced=True)
        return {"version": slot.version, "pushed": True, **sync}


def run_item(item: dict, spec: dict, schema: dict, output_dir: str, engine) -> dict[str, Any]:
    """Run one training-queue item on its tenant's slot (RL batch, SFT batch or low-level op)."""
    from nexus.data.output_dir import TenantOutputDir

    svc = service()
    tenant = item["tenant"]
    if tenant not in svc.slots:
        raise RuntimeError(f"tenant {tenant!r} has no slot on this actor (was the worker restarted?)")
    out = TenantOutputDir(output_dir)
    with _metered(tenant, item["kind"], item["payload"].get("job")) as sig:
        kind = item["kind"]
        sync_rule = item["payload"].get("sync")  # datapath: lazy weight sync, rule from the control plane
        if kind == "rl":
            metrics = _ppo_update(svc, tenant, item["payload"])
            version, sync = _publish_version(svc, tenant, out, engine, f"rl:{item['item_id']}", sync_rule)
        elif kind == "sft":
            metrics = _sft_update(svc, tenant, item["payload"])
            version, sync = _publish_version(svc, tenant, out, engine, f"sft:{item['item_id']}", sync_rule)
        else:
            res = _run_op(svc, tenant, item["payload"], out, engine)
            version, metrics, sync = res["version"], res["metrics"], {}
        sig.update(sync_s=sync.get("weight_sync_s", 0.0), sync_bytes=sync.get("weight_sync_bytes", 0.0),
                   synced=bool(sync.get("weight_sync_bytes")))
    return {"version": version, "metrics": {**metrics, **sync, "update_s": sig["t1"] - sig["t0"]}}


@contextmanager
def _metered(tenant: str, what: str, job: str | None = None):
    """Charge the actor time of the enclosed work to ``tenant`` (and its job): a monitoring signal."""
    sig: dict[str, Any] = {"tenant": tenant, "job": job, "what": what, "t0": time.time()}
    try:
        yield sig
    finally:
        sig["t1"] = time.time()
        emit("update", **sig)


def _sft_update(svc: TrainingModelService, tenant: str, payload: dict) -> dict[str, float]:
    import numpy as np
    import torch

    from nexus.algorithms.sft import ActionChunks, sft_loss

    slot = svc.slots[tenant]
    name = payload["dataset"]
    ds = svc.dataset(name)
    batch = ds.sample_batch(payload["batch_size"], payload["step"], slot.spec.seed)
    feats, proprio = svc.features(tenant, ds.observations(batch))

    def targets(rows: dict) -> Any:
        if slot.chunk == 1:
            return torch.as_tensor(rows["action"])
        if name not in svc.action_chunks:  # chunked targets need each row's following steps
            everything = [ds.train(), ds.heldout()]
            svc.action_chunks[name] = ActionChunks(*(np.concatenate([a[k] for a in everything])
                                                     for k in ("episode", "step", "action")))
        return torch.as_tensor(svc.action_chunks[name].targets(rows["episode"], rows["step"], slot.chunk))

    actions = targets(batch)
    # flow-matching noise and times: a pure function of (tenant seed, step), so a retried item is identical
    gen = torch.Generator().manual_seed(slot.spec.seed * 1_000_003 + int(payload["step"]))
    stats = slot.train_step(lambda policy: sft_loss(policy, feats, proprio, actions, gen))
    metrics = {"loss": float(stats["loss"])}
    if payload.get("eval_heldout"):
        held = ds.heldout()
        hf, hp = svc.features(tenant, ds.observations(held))
        with torch.no_grad():  # flow families: the deterministic action (flow from zero noise)
            err = (slot.policy.mean_action(hf, hp) - targets(held)).pow(2).mean()
        metrics["heldout_action_mse"] = float(err)
    return metrics


def _ppo_update(svc: TrainingModelService, tenant: str, payload: dict) -> dict[str, float]:
    import numpy as np
    import torch

    from nexus.algorithms.ppo import compute_gae, ppo_loss
    from nexus.data.trajectory_store import BatchRef, read_ipc, table_arrays
    from nexus.spec import PPOConfig

    slot = svc.slots[tenant]
    cfg = PPOConfig(**payload["ppo"])
    ref = BatchRef.from_dict(payload["batch"])
    table = read_ipc(ref.path)
    arrays = table_arrays(table)
    feats, proprio, cached = batch_features(svc, tenant, table, arrays, payload.get("use_cached_features", True))
    dones = np.logical_or(arrays["terminated"], arrays["truncated"]).astype(np.float32)
    # batches hold whole episodes; a time-limit end bootstraps from the last stored value, since the
    # observation after the last step is not recorded
    truncated_only = arrays["truncated"] & ~arrays["terminated"]
    boot = np.where(truncated_only, arrays["value"], 0.0).astype(np.float32)
    adv, ret = compute_gae(arrays["reward"], arrays["value"], dones, 0.0, cfg.gamma, cfg.gae_lambda,
                           bootstrap_values=boot)
    adv, ret = torch.as_tensor(adv, dtype=torch.float32), torch.as_tensor(ret, dtype=torch.float32)
    actions = torch.as_tensor(np.array(arrays["action"]))  # a copy: the Arrow buffers are read-only
    old_logprob = torch.as_tensor(np.array(arrays["logprob"]))
    n = len(actions)
    gen = torch.Generator().manual_seed(slot.spec.seed + slot.version)
    sums: dict[str, float] = {}
    count = 0
    epochs = 0
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, cfg.minibatch_size):
            mb = perm[start:start + cfg.minibatch_size]
            stats = slot.train_step(lambda policy, mb=mb: ppo_loss(
                policy, feats[mb], proprio[mb], actions[mb], old_logprob[mb], adv[mb], ret[mb], cfg))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            count += 1
        epochs += 1
        if cfg.target_kl is not None and stats["approx_kl"] > cfg.target_kl:
            break  # the policy moved far enough from the one that collected the batch (CleanRL's rule)
    return {k: v / max(count, 1) for k, v in sums.items()} | {"batch_steps": float(n), "epochs": float(epochs),
                                                               "cached_features": float(cached)}


def batch_features(svc: TrainingModelService, tenant: str, table, arrays: dict, use_cache: bool = True):
    """Backbone features + proprio of a stored RL batch -> (BackboneFeatures, proprio, from_cache).

    The rollout's own features when the batch carries them, they came from this actor's backbone
    (same compat key), the tenant's head reads pooled features only and it has no LoRA adapter (its
    update backpropagates through the backbone into the adapter, and the adapter moved since the
    rollout); otherwise one forward of the backbone over the batch (what a recompute costs)."""
    import numpy as np
    import torch

    from nexus.data.trajectory_store import FEATURE_COLUMN, batch_metadata, table_to_observations
    from nexus.model.backbone_features import BackboneFeatures

    slot = svc.slots[tenant]
    key = batch_metadata(table).get("feature_key")
    pre = svc.framework.preprocessors.get(tenant)
    if (use_cache and FEATURE_COLUMN in arrays and pre is not None and key == pre.compat_key
            and not slot.policy.prefix_layers and slot.policy.lora is None):
        pooled = torch.from_numpy(np.array(arrays[FEATURE_COLUMN], np.float32))  # a copy: Arrow buffers are read-only
        return BackboneFeatures(pooled), torch.from_numpy(np.array(arrays["state"], np.float32)), True
    feats, proprio = svc.features(tenant, table_to_observations(table, slot.schema))
    return feats, proprio, False


def _run_op(svc: TrainingModelService, tenant: str, payload: dict, out, engine) -> dict[str, Any]:
    """Tinker-style verbs: each datum is self-contained (observations + actions [+ PPO fields]).

    The batch is checked (``nexus.inputs.check_batch``) before it touches the slot: a bad batch is a
    SpecError and the slot's gradients and version stay as they were."""
    import torch

    from nexus.algorithms.ppo import ppo_loss
    from nexus.algorithms.sft import sft_loss
    from nexus.errors import Conflict
    from nexus.inputs import check_batch
    from nexus.spec import PPOConfig

    slot = svc.slots[tenant]
    op = payload["op"]

    def finite(loss_fn):  # refuse before backward: gradients of a NaN loss would poison the slot
        def run(policy):
            loss, stats = loss_fn(policy)
            if not bool(torch.isfinite(loss)):
                from nexus.errors import SpecError

                raise SpecError(f"batch: the {payload['loss']} loss is {float(loss)} on this batch; nothing was "
                                "accumulated")
            return loss, stats
        return run

    if op == "forward_backward":
        limits = svc.config.limits_for(tenant)
        data = check_batch(payload["data"], slot.schema, payload["loss"], chunk=slot.chunk,
                           gaussian=slot.policy.gaussian, max_rows=limits.max_batch_rows,
                           max_instruction_chars=limits.max_instruction_chars)
        feats, proprio = svc.features(tenant, data["observations"])
        actions = torch.as_tensor(data["actions"])
        if payload["loss"] == "sft":
            stats = slot.forward_backward(finite(lambda p: sft_loss(p, feats, proprio, actions)))
        elif payload["loss"] == "grpo":  # advantages: group-relative (nexus.algorithms.grpo.group_advantages)
            from nexus.algorithms.grpo import GRPOConfig, grpo_loss

            gcfg = GRPOConfig(**data.get("grpo", {}))
            t = {k: torch.as_tensor(data[k]) for k in ("logprobs", "advantages")}
            ref = data.get("ref_logprobs")
            ref_t = None if ref is None else torch.as_tensor(ref)
            stats = slot.forward_backward(finite(lambda p: grpo_loss(p, feats, proprio, actions, t["logprobs"],
                                                                     t["advantages"], gcfg, ref_t)))
        else:
            cfg = PPOConfig(**data.get("ppo", {}))
            t = {k: torch.as_tensor(data[k]) for k in ("logprobs", "advantages", "returns")}
            stats = slot.forward_backward(finite(lambda p: ppo_loss(p, feats, proprio, actions, t["logprobs"],
                                                                    t["advantages"], t["returns"], cfg)))
        return {"version": slot.version, "metrics": {k: float(v) for k, v in stats.items()}}
    if op == "optim_step":
        if slot._pending_backward == 0:
            raise Conflict(f"tenant {tenant!r}: optim_step without a forward_backward since the last step")
        return {"version": slot.version, "metrics": {k: float(v) for k, v in slot.optim_step().items()}}
    version, sync = _publish_version(svc, tenant, out, engine, "save_weights")  # explicit: always pushed
    return {"version": version, "metrics": sync}
