"""Export of a tenant's policy version as a self-contained directory (``nexus.export.policy`` format).

Runs on an actor rank (``nexus.actor.tasks.export_version``): the backbone the policy ran on is
resident there. An export reads the version's durable weights from the tenant output dir
(``weights/vNNNNNN.pt``), never the live slot, so any recorded version can be exported at any time,
also while the tenant trains or after the service restarted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nexus.actor.host import ActorHost
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import TrajectoryStore, table_arrays
from nexus.errors import NotFound, SpecError
from nexus.export import policy as policy_format
from nexus.export.policy import action_statistics
from nexus.wire.messages import TenantSetup

EXPORTS = "exports"  # folder of a tenant output dir holding its exported versions (nexus.data.output_dir)


def default_path(output_dir: str | Path, version: int) -> Path:
    """Where a version's export lives inside its tenant's output dir (served as the tenant's files)."""
    return Path(output_dir) / EXPORTS / f"v{version:06d}"


def export_version(actor: ActorHost, setup: TenantSetup, version: int, path: str | None = None) -> dict[str, Any]:
    """Write version ``version`` of the tenant as a policy directory at ``path`` (None:
    ``<output dir>/exports/vNNNNNN/``, written once and reused after).

    Refused with the reason (and nothing written) when the version has no weights, ``path`` exists and is
    not empty, or the weights do not fit the spec.
    """
    if path is None:
        target = default_path(setup.output_dir, version)
        if (target / "manifest.json").is_file():  # already exported (e.g. at the end of a training job)
            return _summary(setup.name, version, target, setup.output_dir)
        path = str(target)
    return _export(actor, setup, version, path)


def _summary(tenant: str, version: int, path: Path, output_dir: str) -> dict[str, Any]:
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


def _export(actor: ActorHost, setup: TenantSetup, version: int, path: str) -> dict[str, Any]:
    spec, schema, output_dir = setup.spec, setup.schema, setup.output_dir
    out = TenantOutputDir(output_dir)
    weights = out.weights_path(version)
    if not weights.is_file():
        raise NotFound(f"tenant {spec.name!r} has no saved weights for version {version} ({weights})")
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if any(k.startswith("lora.") for k in state) != (spec.lora is not None):
        raise SpecError(f"version {version} of tenant {spec.name!r} does not match its spec's lora setting")
    manifest = policy_format.write(
        path, spec=spec, schema=schema, version=version, state_dict=state, backbone=actor.framework.backbone,
        action_stats=_action_stats(actor, setup, out),
        source={"output_dir": str(Path(output_dir).resolve()), "weights": str(weights.resolve()),
                "service_root": str(Path(actor.config.root).resolve())})
    return {"tenant": spec.name, "version": version, "path": str(Path(path).resolve()),
            "relative_path": _relative(path, output_dir), "files": sorted(manifest["files"]) + [policy_format.MANIFEST],
            "backbone_sha256": manifest["backbone"]["weights_sha256"]}


def export_for_tracking(actor: ActorHost, setup: TenantSetup, version: int) -> str | None:
    """The policy directory of ``version`` under ``<output dir>/exports/`` (written once), for the job's
    MLflow model; None when that version has no weights."""
    if not TenantOutputDir(setup.output_dir).weights_path(version).is_file():
        return None
    return export_version(actor, setup, version)["path"]


def _action_stats(actor: ActorHost, setup: TenantSetup, out: TenantOutputDir) -> dict[str, Any] | None:
    """Statistics of the actions the tenant trained on: its SFT dataset's train split, else its recorded
    RL trajectories, else none."""
    spec = setup.spec
    if spec.dataset:
        return action_statistics(actor.dataset(spec.dataset).train()["action"], f"dataset:{spec.dataset}")
    if out.trajectories.is_dir() and any(out.trajectories.iterdir()):
        table = TrajectoryStore(out.trajectories, spec.name, setup.schema).scan()
        if table.num_rows:
            return action_statistics(table_arrays(table)["action"], "trajectories")  # memory-mapped columns
    return None
