"""Export of a tenant's policy version as a self-contained directory (``nexus.policy`` format).

Worker-side tasks (resource ``ACTOR``: the backbone the policy ran on is resident there), named by import
path from the scheduler. An export reads the version's durable weights from the tenant output dir
(``weights/vNNNNNN.pt``), never the live slot, so any recorded version can be exported at any time,
also while the tenant trains or after the service restarted.

Module-level imports stay light (the scheduler imports this module to name its functions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nexus.errors import NotFound, SpecError

EXPORTS = "exports"  # folder of a tenant output dir holding its exported versions (nexus.data.output_dir)


def default_path(output_dir: str | Path, version: int) -> Path:
    """Where a version's export lives inside its tenant's output dir (served as the tenant's files)."""
    return Path(output_dir) / EXPORTS / f"v{version:06d}"


def export_version(spec: dict[str, Any], schema: dict[str, Any], output_dir: str, version: int,
                   path: str | None = None, rank: int = 0) -> dict[str, Any]:
    """Write version ``version`` of the tenant (its output dir ``output_dir``) as a policy directory at ``path``
    (None: ``<output dir>/exports/vNNNNNN/``, written once and reused after).

    Refused with the reason (and nothing written) when the version has no weights, ``path`` exists and is
    not empty, or the weights do not fit the spec. Only actor rank 0 writes (``rank``: the caller's rank).
    """
    if rank != 0:
        return {}
    if path is None:
        target = default_path(output_dir, version)
        if (target / "manifest.json").is_file():  # already exported (e.g. at the end of a training job)
            return _summary(spec["name"], version, target, output_dir)
        path = str(target)
    return _export(spec, schema, output_dir, version, path)


def _summary(tenant: str, version: int, path: Path, output_dir: str) -> dict[str, Any]:
    from nexus import policy as policy_format

    m = policy_format.read_manifest(path)
    return {"tenant": tenant, "version": version, "path": str(path.resolve()),
            "relative_path": _relative(path, output_dir), "files": sorted(m["files"]) + [policy_format.MANIFEST],
            "backbone_sha256": m["backbone"]["weights_sha256"]}


def _relative(path: str | Path, output_dir: str) -> str | None:
    """``path`` relative to the tenant's output dir (the gateway's files route), None when outside it."""
    try:
        return str(Path(path).resolve().relative_to(Path(output_dir).resolve()))
    except ValueError:
        return None


def _export(spec: dict[str, Any], schema: dict[str, Any], output_dir: str, version: int, path: str) -> dict[str, Any]:
    import torch

    from nexus import policy as policy_format
    from nexus.control.validation import schema_from_dict
    from nexus.data.output_dir import TenantOutputDir
    from nexus.services import training
    from nexus.spec import TenantSpec

    spec_, schema_ = TenantSpec.model_validate(spec), schema_from_dict(schema)
    out = TenantOutputDir(output_dir)
    weights = out.weights_path(version)
    if not weights.is_file():
        raise NotFound(f"tenant {spec_.name!r} has no saved weights for version {version} ({weights})")
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if any(k.startswith("lora.") for k in state) != (spec_.lora is not None):
        raise SpecError(f"version {version} of tenant {spec_.name!r} does not match its spec's lora setting")
    svc = training.service()
    manifest = policy_format.write(
        path, spec=spec_, schema=schema_, version=version, state_dict=state, backbone=svc.framework.backbone,
        action_stats=_action_stats(svc, spec_, schema_, out),
        source={"output_dir": str(Path(output_dir).resolve()), "weights": str(weights.resolve()),
                "service_root": str(Path(svc.config.root).resolve())})
    return {"tenant": spec_.name, "version": version, "path": str(Path(path).resolve()),
            "relative_path": _relative(path, output_dir), "files": sorted(manifest["files"]) + [policy_format.MANIFEST],
            "backbone_sha256": manifest["backbone"]["weights_sha256"]}


def export_for_tracking(spec: dict[str, Any], schema: dict[str, Any], output_dir: str, version: int) -> str | None:
    """The policy directory of ``version`` under ``<output dir>/exports/`` (written once), for the job's
    MLflow model; None when that version has no weights."""
    from nexus.data.output_dir import TenantOutputDir

    if not TenantOutputDir(output_dir).weights_path(version).is_file():
        return None
    return export_version(spec, schema, output_dir, version)["path"]


def _action_stats(svc: Any, spec: Any, schema: Any, out: Any) -> dict[str, Any] | None:
    """Statistics of the actions the tenant trained on: its SFT dataset's train split, else its recorded
    RL trajectories, else none."""
    from nexus.policy import action_statistics

    if spec.dataset:
        return action_statistics(svc.dataset(spec.dataset).train()["action"], f"dataset:{spec.dataset}")
    if out.trajectories.is_dir() and any(out.trajectories.iterdir()):
        from nexus.data.trajectory_store import TrajectoryStore, table_arrays

        table = TrajectoryStore(out.trajectories, spec.name, schema).scan()
        if table.num_rows:
            return action_statistics(table_arrays(table)["action"], "trajectories")  # memory-mapped columns
    return None
