"""A tenant's output directory: reproducible and auditable after the run state is released.

Layout::

    manifest.json        spec, schema, versions, checkpoints, job history
    weights/vNNNNNN.pt   exported head weights of every policy version (inference pins load these)
    checkpoints/         DeepSpeed checkpoints (engine + optimizer state), one tag per saved version
    trajectories/        Arrow IPC batches of rollouts (nexus.data.trajectory_store)
    eval/                eval reports, one JSON per eval job
    exports/vNNNNNN/     exported policy of a finished training job's final version (nexus.policy format)

Written only by workers (never by the scheduler process); every write is atomic (temp + rename).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class TenantOutputDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def trajectories(self) -> Path:
        return self.path / "trajectories"

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"

    def weights_path(self, version: int) -> Path:
        return self.path / "weights" / f"v{version:06d}.pt"

    # -- manifest --------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.exists()

    def read(self) -> dict[str, Any]:
        return json.loads(self.manifest_path.read_text())

    def write(self, manifest: dict[str, Any]) -> None:
        atomic_write_bytes(self.manifest_path, json.dumps(manifest, indent=2, default=str).encode())

    def create(self, spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
        manifest = {"tenant": spec["name"], "spec": spec, "schema": schema, "created": time.time(),
                    "latest_version": 0, "versions": [], "checkpoints": [], "jobs": []}
        self.write(manifest)
        return manifest

    def update(self, **changes: Any) -> dict[str, Any]:
        m = self.read()
        m.update(changes)
        self.write(m)
        return m

    def add_version(self, version: int, source: str) -> None:
        m = self.read()
        m["versions"].append({"version": version, "time": time.time(), "source": source,
                              "weights": str(self.weights_path(version))})
        m["latest_version"] = version
        self.write(m)

    def add_checkpoint(self, version: int, tag: str) -> None:
        m = self.read()
        m["checkpoints"].append({"version": version, "tag": tag, "path": str(self.checkpoints), "time": time.time()})
        self.write(m)

    def add_job(self, record: dict[str, Any]) -> None:
        m = self.read()
        m["jobs"].append(record)
        self.write(m)

    def latest_checkpoint(self) -> dict[str, Any] | None:
        if not self.exists():
            return None
        cks = self.read()["checkpoints"]
        return cks[-1] if cks else None
