"""Worker tasks for a tenant's slot lifecycle and durable state: build, rebuild, update, finish, drop,
rediscover; and the rollout producer wrapper.

Durability rules (the control plane relies on them):

* A version's weights are written once (``TenantOutputDir.write_weights``) *before* the version is
  pushed to inference or listed in the manifest, and with ``checkpoint_every = k`` every k-th version
  is also a DeepSpeed checkpoint (params + optimizer state) saved before it is published.
* A slot rebuilt after a crash loads its latest checkpoint, and its version counter continues past
  the highest version ever written, so no version number is used twice and no published weights file
  is rewritten. Updates after the checkpoint (at most ``k - 1`` with ``checkpoint_every = k``) are the
  work lost; the rebuild records them in the manifest (``restores``).

Module-level imports stay light: the scheduler names these tasks by import path only.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from nexus.messages import RolloutRequest, SlotInfo, TenantSetup, UpdateRequest, UpdateResult


def _state():
    from nexus.services.worker_plugin import state

    return state()


# -- durable versions (called by nexus.services.training._publish_version) ----------------------------
def make_durable(svc, slot, out, version: int, weights: bytes, source: str) -> dict[str, list[int]]:
    """Write a new version's weights once and, when due, its checkpoint, then list both in the manifest
    (one write, retention applied in it). Returns what retention pruned."""
    digest = out.write_weights(version, weights)
    every = svc.config.checkpoint_every
    tag = slot.save_checkpoint(str(out.checkpoints)) if every and version % every == 0 else None
    limits = svc.config.limits_for(slot.spec.name)
    return out.add_version(version, source, keep=(limits.max_versions_kept, limits.max_checkpoints_kept),
                           checkpoint=tag, sha256=digest)


# -- slots ------------------------------------------------------------------------------------------------
def init_tenant(setup: TenantSetup) -> SlotInfo:
    """Allocate a tenant's slot on this actor rank from its durable state (a new tenant starts at 0)."""
    from nexus.services.training import _metered

    with _metered(setup.name, "init"):
        return _build_slot(setup)


def rebuild_slots(setups: list[TenantSetup]) -> dict[str, Any]:
    """A restarted actor rank: rebuild every tenant's slot (a tenant that fails does not stop the others)."""
    slots, errors = [], {}
    for s in setups:
        try:
            slots.append(init_tenant(s))
        except Exception as e:
            errors[s.name] = f"{type(e).__name__}: {e}"
    return {"slots": slots, "errors": errors}


def _job_seq(out) -> int:
    from nexus.messages import job_number

    ids = [r.get("job", "") for r in out.job_records()]
    if out.exists():
        ids += [j.get("job", "") for j in out.read().get("jobs", [])]
    return max([0, *(job_number(i) for i in ids)])


def _build_slot(setup: TenantSetup) -> SlotInfo:
    from nexus.control.validation import schema_from_dict
    from nexus.data.output_dir import TenantOutputDir
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.services.tenant_slot import TenantSlot
    from nexus.services.training import check_actor_budget, check_output_dir
    from nexus.spec import TenantSpec

    svc = _state().training()
    name = setup.name
    spec, schema = TenantSpec.model_validate(setup.spec), schema_from_dict(setup.schema)
    out = TenantOutputDir(setup.output_dir)
    if name not in svc.slots:  # first: a refused tenant leaves nothing behind
        check_actor_budget(svc, spec, schema)
    existed = out.path.exists()
    check_output_dir(svc, spec, out)
    bb = svc.framework.backbone
    ck = out.latest_checkpoint()
    current = svc.slots.get(name)
    try:  # before the manifest: a refused init_from leaves no tenant behind
        init = None if ck is not None else _initial_state(spec, schema, bb, out)
    except BaseException:
        if not existed and not any(out.path.iterdir()):
            out.path.rmdir()
        raise
    if not out.exists():
        out.create(setup.spec, setup.schema)
    published = out.highest_version()
    if current is not None and current.version >= published:  # this process still holds it
        return SlotInfo(name, current.version, True, current.version, published, _job_seq(out))
    # a LoRA tenant's adapter is part of its policy: the slot's engine trains it, its weights files carry it
    slot = TenantSlot(spec, schema, svc.feat_dim, grad_clip=spec.grad_clip, lora_shapes=bb.lora_shapes(spec.lora),
                      init_state=init)
    ck_version = None
    if ck is not None:
        slot.load_checkpoint(str(out.checkpoints), ck["tag"])
        ck_version = slot.version
    slot.version = max(slot.version, published)  # numbering continues past everything ever written
    svc.slots[name] = slot
    svc.framework.add_tenant(name, slot.policy, TenantPreprocessor(schema, svc.backbone_cfg))
    if not out.weights_path(slot.version).exists():  # a new tenant: its version 0
        out.write_weights(slot.version, slot.export_weights())
        out.add_version(slot.version, "init")
    if published > (ck_version or 0):  # published versions newer than the checkpoint: their updates are lost
        m = out.read()
        lost = published - (ck_version or 0)
        m.setdefault("restores", []).append({"time": time.time(), "checkpoint_version": ck_version,
                                             "published_version": published, "lost_updates": lost})
        out.write(m)
    svc.synced[name] = slot.version  # the engine pool registers the tenant at this version
    _link_outside_root(svc.config, name, out.path)
    return SlotInfo(name, slot.version, ck is not None, ck_version, published, _job_seq(out))


def _initial_state(spec, schema, backbone, out):
    """The weights a slot without a checkpoint starts from: the tenant's own version 0 when it was written
    (a rebuilt slot; its v0 may have come from ``init_from``, whose dir need not exist any more), else the
    exported policy ``init_from`` (a new tenant; checked against this backbone before anything is written),
    else None (fresh, seeded weights)."""
    import torch

    from nexus.policy import initial_state

    v0 = out.weights_path(0)
    if v0.is_file():
        return torch.load(v0, map_location="cpu", weights_only=True)
    if spec.init_from:
        return initial_state(spec.init_from, spec, schema, backbone)
    return None


def _link_outside_root(config, name: str, path: Path) -> None:
    """A tenant whose output dir is outside the service root gets a pointer there (rediscovery)."""
    import json

    from nexus.data.output_dir import atomic_write_bytes

    inside = config.tenants_dir.resolve() / name
    if Path(path).resolve() != inside:
        atomic_write_bytes(config.tenants_dir / f"{name}.link.json",
                           json.dumps({"tenant": name, "output_dir": str(Path(path).resolve())}).encode())


def drop_tenant(tenant: str) -> bool:
    svc = _state().training()
    svc.slots.pop(tenant, None)
    svc.framework.remove_tenant(tenant)
    return True


def purge_output(output_dir: str, tenant: str, root: str) -> bool:
    """Delete a deleted tenant's output dir (only a real output dir of that tenant) and its pointer."""
    from nexus.data.output_dir import TenantOutputDir

    out = TenantOutputDir(output_dir)
    if out.exists() and out.read().get("tenant") != tenant:
        raise ValueError(f"{output_dir} is not the output dir of tenant {tenant!r}; not deleted")
    if out.path.exists():
        shutil.rmtree(out.path)
    (Path(root) / "tenants" / f"{tenant}.link.json").unlink(missing_ok=True)
    return True


# -- updates and jobs ---------------------------------------------------------------------------------------
def run_update(req: UpdateRequest, data: Any = None) -> UpdateResult:
    """One training-queue item on this rank; the new version goes to every engine in ``req.engines``."""
    from distributed import get_worker

    from nexus.services import training
    from nexus.services.engine_client import EngineSet

    item = dict(req.item)
    if data is not None:
        item["payload"] = {**item["payload"], "data": data}
    engines = EngineSet(get_worker(), req.engines)
    res = training.run_item(item, req.tenant.spec, req.tenant.schema, req.tenant.output_dir, engines)
    return UpdateResult(version=int(res["version"]), metrics={k: float(v) for k, v in res["metrics"].items()},
                        pushed_to=tuple(engines.pushed_to), push_errors=tuple(engines.errors))


def finish_job(tenant: str, output_dir: str, record: dict, checkpoint: bool,
               version: int | None = None, engines: tuple = ()) -> dict[str, Any]:
    """At a job's end: checkpoint (training jobs, unless this version has one), record the job (its metric
    history goes to ``jobs/<job>.json``), and push the last version to ``engines`` if lazy sync held it
    back. The artifacts are the manifest and the weights of ``version`` (the version the job evaluated or
    produced; default: the slot's current one) and, for a finished training job, its exported policy."""
    from nexus.services.training import _metered

    with _metered(tenant, "checkpoint"):
        from nexus.data.output_dir import TenantOutputDir

        out = TenantOutputDir(output_dir)
        slot = _state().training().slots.get(tenant)
        if checkpoint and slot is not None:
            ck = out.latest_checkpoint()
            if ck is None or ck["version"] != slot.version:
                tag = slot.save_checkpoint(str(out.checkpoints))
                out.add_checkpoint(slot.version, tag)
                limits = _state().training().config.limits_for(tenant)
                out.prune(limits.max_versions_kept, limits.max_checkpoints_kept)
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
            artifacts += _export_for_tracking(tenant, slot, output_dir)
    res: dict[str, Any] = {"artifacts": artifacts}
    if engines:
        from distributed import get_worker

        from nexus.services.engine_client import EngineSet
        from nexus.services.training import sync_weights

        res["sync"] = sync_weights(tenant, EngineSet(get_worker(), engines))
    return res


def _export_for_tracking(tenant: str, slot, output_dir: str) -> list[str]:
    import logging
    from dataclasses import asdict

    from nexus.services.export import export_for_tracking

    try:
        path = export_for_tracking(slot.spec.model_dump(), asdict(slot.schema), output_dir, slot.version)
    except Exception:  # the job stays recorded; only its MLflow model is missing
        logging.getLogger("nexus.actor").exception("could not export %s v%d", tenant, slot.version)
        return []
    return [path] if path else []


# -- a restarted service ----------------------------------------------------------------------------------
def discover(root: str) -> list[dict[str, Any]]:
    """Tenants of a service root: ``tenants/<name>/manifest.json`` and pointers to output dirs elsewhere."""
    import json

    from nexus.data.output_dir import TenantOutputDir

    tenants_dir = Path(root) / "tenants"
    dirs: dict[str, Path] = {}
    if tenants_dir.exists():
        for p in sorted(tenants_dir.iterdir()):
            if p.is_dir() and (p / "manifest.json").exists():
                dirs.setdefault(p.name, p)
            elif p.name.endswith(".link.json"):
                try:
                    link = json.loads(p.read_text())
                    dirs[link["tenant"]] = Path(link["output_dir"])
                except (OSError, ValueError, KeyError):
                    continue
    found = []
    for name, path in sorted(dirs.items()):
        out = TenantOutputDir(path)
        if not out.exists():
            continue
        m = out.read()
        found.append({"tenant": name, "spec": m["spec"], "output_dir": str(path),
                      "interrupted": [r["job"] for r in out.job_records() if r.get("state") in ("queued", "running")],
                      "job_seq": _job_seq(out), "latest_version": out.highest_version()})
    return found


def mark_interrupted(output_dir: str, reason: str) -> list[str]:
    """Jobs a crashed service left running: their records and the manifest say ``failed``; their unfinished
    evaluations no longer keep a version from retention."""
    from nexus.data.output_dir import TenantOutputDir, unmark_evaluation

    unmark_evaluation(output_dir)
    out = TenantOutputDir(output_dir)
    marked = []
    for r in out.job_records():
        if r.get("state") in ("queued", "running"):
            r.update(state="failed", error=reason, t_end=time.time())
            out.write_job(r)
            out.add_job(r)
            marked.append(r["job"])
    return marked


# -- rollout producers -----------------------------------------------------------------------------------------
def _producer_settings(req: RolloutRequest) -> dict[str, Any] | None:
    """A LoRA tenant's update recomputes its features through the adapter: its rollouts store none."""
    if req.datapath is None or not req.tenant.spec.get("lora"):
        return req.datapath
    return {**req.datapath, "cache_features": False}


def run_rollout(req: RolloutRequest) -> dict[str, Any]:
    """A rollout producer: the tenant's episodes, each action from its (re-routable) inference engine."""
    from distributed import get_worker

    from nexus.services import rollout
    from nexus.services.engine_client import EngineClient

    kind = "rollout" if req.version is None else "eval"
    with _state().producer(f"{req.job}:{req.offset}", req.job or "", req.tenant.name, kind) as progress:
        routes = {req.tenant.name: req.route} if req.route is not None else None
        engine = EngineClient(get_worker(), routes=routes, on_answer=progress.tick)
        return rollout.collect(req.tenant.name, req.env, req.tenant.output_dir, req.tenant.schema, req.episodes,
                               req.seed, req.offset, req.deterministic, req.version, engine, req.job,
                               _producer_settings(req))
