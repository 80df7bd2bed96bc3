"""Training Model Service: the actor group's worker side (tasks with resource ``ACTOR``).

The frozen backbone is loaded once per actor process; each tenant holds a slot (head + value head
+ its own DeepSpeed ZeRO engine + version). An update activates one slot, trains it, exports the
new head, bumps the version and pushes the weights to the inference engine directly
(worker to worker, never through the scheduler).

Module-level imports stay light: the scheduler imports this module to name its task functions.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any

from nexus.signals import emit

_lock = threading.Lock()
_service: TrainingModelService | None = None


class TrainingModelService:
    """Process-wide state of one actor worker: the backbone and the tenant slots."""

    def __init__(self) -> None:
        import torch

        from nexus.config import ServiceConfig
        from nexus.model.backbone import BackboneConfig, SharedBackbone
        from nexus.model.framework import VLAFramework

        torch.set_num_threads(1)
        self.config = ServiceConfig.load()
        self.backbone_cfg = BackboneConfig(**self.config.backbone.model_dump())
        self.framework = VLAFramework(SharedBackbone(self.backbone_cfg))
        self.slots: dict[str, Any] = {}  # tenant -> TenantSlot
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
    global _service
    with _lock:
        if _service is None:
            _service = TrainingModelService()
        return _service


def _push_weights(engine, tenant: str, version: int, weights: bytes) -> dict[str, float]:
    t0 = time.perf_counter()
    engine.load_weights(tenant, version, weights).result()
    return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": float(len(weights))}


def _publish_version(svc: TrainingModelService, tenant: str, out, engine, source: str) -> tuple[int, dict]:
    """Bump the slot's version, save its head, push it to inference, record it in the manifest."""
    from nexus.data.output_dir import atomic_write_bytes

    slot = svc.slots[tenant]
    version = slot.bump_version()
    weights = slot.export_weights()
    atomic_write_bytes(out.weights_path(version), weights)
    sync = _push_weights(engine, tenant, version, weights)
    out.add_version(version, source, keep_last=svc.config.retention.keep_last)  # + retention (ux)
    return version, sync


def init_tenant(spec: dict, schema: dict, output_dir: str, engine) -> dict[str, Any]:
    """Allocate a tenant's slot; a tenant re-created from its output dir resumes its last checkpoint."""
    with _metered(spec["name"], "init"):
        return _init_tenant(spec, schema, output_dir, engine)


def _init_tenant(spec: dict, schema: dict, output_dir: str, engine) -> dict[str, Any]:
    from nexus.control.validation import schema_from_dict
    from nexus.data.output_dir import TenantOutputDir, atomic_write_bytes
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.services.tenant_slot import TenantSlot
    from nexus.spec import TenantSpec

    svc = service()
    spec_, schema_ = TenantSpec.model_validate(spec), schema_from_dict(schema)
    out = TenantOutputDir(output_dir)
    slot = TenantSlot(spec_, schema_, svc.feat_dim, grad_clip=spec_.grad_clip)
    restored = False
    ck = out.latest_checkpoint()
    if ck is not None:
        slot.load_checkpoint(str(out.checkpoints), ck["tag"])
        restored = True
    elif not out.exists():
        out.create(spec, schema)
    svc.slots[spec_.name] = slot
    svc.framework.add_tenant(spec_.name, slot.policy, TenantPreprocessor(schema_, svc.backbone_cfg))
    weights = slot.export_weights()
    if not out.weights_path(slot.version).exists():
        atomic_write_bytes(out.weights_path(slot.version), weights)
        out.add_version(slot.version, "init")
    engine.register_tenant(spec, schema, slot.version, weights).result()
    return {"version": slot.version, "restored": restored}


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
        if kind == "rl":
            metrics = _ppo_update(svc, tenant, item["payload"])
            version, sync = _publish_version(svc, tenant, out, engine, f"rl:{item['item_id']}")
        elif kind == "sft":
            metrics = _sft_update(svc, tenant, item["payload"])
            version, sync = _publish_version(svc, tenant, out, engine, f"sft:{item['item_id']}")
        else:
            res = _run_op(svc, tenant, item["payload"], out, engine)
            version, metrics, sync = res["version"], res["metrics"], {}
        sig.update(sync_s=sync.get("weight_sync_s", 0.0), sync_bytes=sync.get("weight_sync_bytes", 0.0))
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
    from nexus.data.trajectory_store import BatchRef, read_ipc, table_arrays, table_to_observations
    from nexus.spec import PPOConfig

    slot = svc.slots[tenant]
    cfg = PPOConfig(**payload["ppo"])
    ref = BatchRef.from_dict(payload["batch"])
    table = read_ipc(ref.path)
    arrays = table_arrays(table)
    feats, proprio = svc.features(tenant, table_to_observations(table, slot.schema))
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
    return {k: v / max(count, 1) for k, v in sums.items()} | {"batch_steps": float(n), "epochs": float(epochs)}


def _run_op(svc: TrainingModelService, tenant: str, payload: dict, out, engine) -> dict[str, Any]:
    """Tinker-style verbs: each datum is self-contained (observations + actions [+ PPO fields])."""
    import torch

    from nexus.algorithms.ppo import ppo_loss
    from nexus.algorithms.sft import sft_loss
    from nexus.features import Observation
    from nexus.spec import PPOConfig

    slot = svc.slots[tenant]
    op = payload["op"]
    if op == "forward_backward":
        data = payload["data"]
        obs = [o if isinstance(o, Observation) else Observation(**o) for o in data["observations"]]
        feats, proprio = svc.features(tenant, obs)
        actions = torch.as_tensor(data["actions"], dtype=torch.float32)
        if payload["loss"] == "sft":
            stats = slot.forward_backward(lambda p: sft_loss(p, feats, proprio, actions))
        elif payload["loss"] == "grpo":  # advantages: group-relative (nexus.algorithms.grpo.group_advantages)
            from nexus.algorithms.grpo import GRPOConfig, grpo_loss

            gcfg = GRPOConfig(**data.get("grpo", {}))
            t = {k: torch.as_tensor(data[k], dtype=torch.float32) for k in ("logprobs", "advantages")}
            ref = data.get("ref_logprobs")
            ref_t = None if ref is None else torch.as_tensor(ref, dtype=torch.float32)
            stats = slot.forward_backward(lambda p: grpo_loss(p, feats, proprio, actions, t["logprobs"],
                                                              t["advantages"], gcfg, ref_t))
        else:
            cfg = PPOConfig(**data.get("ppo", {}))
            t = {k: torch.as_tensor(data[k], dtype=torch.float32) for k in ("logprobs", "advantages", "returns")}
            stats = slot.forward_backward(lambda p: ppo_loss(p, feats, proprio, actions, t["logprobs"],
                                                             t["advantages"], t["returns"], cfg))
        return {"version": slot.version, "metrics": {k: float(v) for k, v in stats.items()}}
    if op == "optim_step":
        return {"version": slot.version, "metrics": {k: float(v) for k, v in slot.optim_step().items()}}
    version, sync = _publish_version(svc, tenant, out, engine, "save_weights")
    return {"version": version, "metrics": sync}


def finish_job(tenant: str, output_dir: str, record: dict, checkpoint: bool,
               version: int | None = None) -> dict[str, Any]:
    """Save a DeepSpeed checkpoint after a training job and append the job to the manifest; the artifacts
    are the manifest and the weights of ``version`` (the version the job evaluated or produced; default:
    the slot's current one)."""
    with _metered(tenant, "checkpoint"):
        return _finish_job(tenant, output_dir, record, checkpoint, version)


def _finish_job(tenant: str, output_dir: str, record: dict, checkpoint: bool,
                version: int | None = None) -> dict[str, Any]:
    from nexus.data.output_dir import TenantOutputDir

    svc = service()
    out = TenantOutputDir(output_dir)
    slot = svc.slots.get(tenant)
    if checkpoint and slot is not None:
        tag = slot.save_checkpoint(str(out.checkpoints))
        out.add_checkpoint(slot.version, tag)
        record["checkpoint"] = tag
    out.add_job(record)
    artifacts = [str(out.manifest_path)]
    if version is None and slot is not None:
        version = slot.version
    if version is not None and out.weights_path(version).exists():
        artifacts.append(str(out.weights_path(version)))
    return {"artifacts": artifacts}
