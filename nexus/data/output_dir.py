"""A tenant's output directory: reproducible and auditable after the run state is released.

Layout::

    manifest.json        spec, schema, versions (with the sha256 of their weights), checkpoints, job history
    weights/vNNNNNN.pt   exported head weights of every policy version (inference pins load these);
                         written once: a published version's file never changes
    checkpoints/         DeepSpeed checkpoints (engine + optimizer state), one tag per saved version
    trajectories/        Arrow IPC batches of rollouts (nexus.data.trajectory_store)
    eval/                eval reports, one JSON per eval job
    jobs/<job>.json      one record per job: "running" from its start, its final state at its end
    exports/vNNNNNN/     exported policy of a version (nexus.policy format): a finished training job's final
                         version, or one written on request (nexus_export without a path)

Written only by workers (never by the scheduler process); every write is atomic (temp + rename), files
are 0600 and dirs 0700 (``nexus.paths``). Old versions' weights and old checkpoints beyond the tenant's
quota (``ServiceLimits.max_versions_kept`` / ``max_checkpoints_kept``) are pruned, and the manifest says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from nexus.paths import FILE_MODE, private_mkdir, private_write_bytes


def atomic_write_bytes(path: Path, data: bytes) -> None:
    private_write_bytes(path, data)


def write_once(path: Path, data: bytes) -> bool:
    """Create ``path`` (0600) with ``data`` atomically, never replacing an existing file.

    Returns False when the file already holds exactly ``data`` (a retried write); raises
    ``FileExistsError`` when it holds anything else."""
    private_mkdir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.link(tmp, path)  # fails if the name exists: no reader ever sees a replaced version
        return True
    except FileExistsError:
        if path.read_bytes() == data:
            return False
        raise FileExistsError(f"{path} exists with other contents; a published version is never rewritten") from None
    finally:
        tmp.unlink(missing_ok=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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

    @property
    def jobs_dir(self) -> Path:
        return self.path / "jobs"

    def weights_path(self, version: int) -> Path:
        return self.path / "weights" / f"v{version:06d}.pt"

    def write_weights(self, version: int, data: bytes) -> str:
        """Write a version's weights once; returns their sha256."""
        write_once(self.weights_path(version), data)
        return sha256(data)

    def weight_versions(self) -> list[int]:
        """Versions that have a weights file (published, or written just before a crash)."""
        d = self.path / "weights"
        if not d.exists():
            return []
        return sorted(int(p.stem[1:]) for p in d.glob("v*.pt") if p.stem[1:].isdigit())

    def highest_version(self) -> int:
        """The highest version this tenant ever wrote or published: the next one must be above it."""
        listed = [v["version"] for v in self.read()["versions"]] if self.exists() else []
        return max([0, *listed, *self.weight_versions()])

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

    def add_version(self, version: int, source: str, **extra: Any) -> None:
        """List a published version (once: listing it again is a no-op)."""
        m = self.read()
        if any(v["version"] == version for v in m["versions"]):
            return
        path = self.weights_path(version)
        digest = extra.pop("sha256", None) or (sha256(path.read_bytes()) if path.exists() else None)
        m["versions"].append({"version": version, "time": time.time(), "source": source, "weights": str(path),
                              "sha256": digest, **extra})
        m["latest_version"] = max(version, m.get("latest_version", 0))
        self.write(m)

    def add_checkpoint(self, version: int, tag: str) -> None:
        m = self.read()
        if any(c["tag"] == tag and not c.get("pruned") for c in m["checkpoints"]):
            return
        m["checkpoints"].append({"version": version, "tag": tag, "path": str(self.checkpoints), "time": time.time()})
        self.write(m)

    def add_job(self, record: dict[str, Any]) -> None:
        """Append a finished job to the manifest (replacing an earlier record of the same job)."""
        m = self.read()
        m["jobs"] = [j for j in m["jobs"] if j.get("job") != record.get("job")] + [record]
        self.write(m)

    def prune(self, versions_kept: int, checkpoints_kept: int) -> dict[str, list[int]]:
        """Delete the weights of all but the newest ``versions_kept`` versions and all but the newest
        ``checkpoints_kept`` DeepSpeed checkpoints; the manifest keeps their records, marked pruned."""
        m = self.read()
        gone: dict[str, list[int]] = {"weights": [], "checkpoints": []}
        live = [v for v in m["versions"] if not v.get("pruned")]
        for v in live[:max(0, len(live) - versions_kept)]:
            Path(v["weights"]).unlink(missing_ok=True)
            v["pruned"] = True
            gone["weights"].append(v["version"])
        cks = [c for c in m["checkpoints"] if not c.get("pruned")]
        for c in cks[:max(0, len(cks) - checkpoints_kept)]:
            tag_dir = self.checkpoints / c["tag"].rsplit("/", 1)[-1]
            if tag_dir.is_dir() and not tag_dir.is_symlink():
                shutil.rmtree(tag_dir)
            c["pruned"] = True
            gone["checkpoints"].append(c["version"])
        if gone["weights"] or gone["checkpoints"]:
            self.write(m)
        return gone

    def latest_checkpoint(self) -> dict[str, Any] | None:
        if not self.exists():
            return None
        cks = [c for c in self.read()["checkpoints"] if not c.get("pruned")]
        return cks[-1] if cks else None

    # -- job records ----------------------------------------------------------------------------
    def write_job(self, record: dict[str, Any]) -> None:
        atomic_write_bytes(self.jobs_dir / f"{record['job']}.json", json.dumps(record, indent=2, default=str).encode())

    def job_records(self) -> list[dict[str, Any]]:
        if not self.jobs_dir.exists():
            return []
        out = []
        for p in sorted(self.jobs_dir.glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out
