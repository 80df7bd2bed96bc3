"""A service root's tenant output dirs as a whole: rediscovery after a restart, the jobs a crashed service
left running, pointers to output dirs outside the root, deletion, evaluation reports.

Worker tasks (named by import path from the scheduler, :mod:`nexus.control.tasks`) that only touch files:
they run on a worker that sees the service root (an actor rank).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from nexus.data.output_dir import TenantOutputDir, atomic_write_bytes, unmark_evaluation
from nexus.wire.messages import job_number


def job_seq(out: TenantOutputDir) -> int:
    """The highest job number found in a tenant's job records and manifest (job ids never repeat)."""
    ids = [r.get("job", "") for r in out.job_records()]
    if out.exists():
        ids += [j.get("job", "") for j in out.read().get("jobs", [])]
    return max([0, *(job_number(i) for i in ids)])


def link_outside_root(tenants_dir: Path, name: str, path: str | Path) -> None:
    """A tenant whose output dir is outside the service root gets a pointer there (rediscovery)."""
    inside = tenants_dir.resolve() / name
    if Path(path).resolve() != inside:
        atomic_write_bytes(tenants_dir / f"{name}.link.json",
                           json.dumps({"tenant": name, "output_dir": str(Path(path).resolve())}).encode())


def discover(root: str) -> list[dict[str, Any]]:
    """Tenants of a service root: ``tenants/<name>/manifest.json`` and pointers to output dirs elsewhere."""
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
        records = out.job_records()
        found.append({"tenant": name, "spec": m["spec"], "output_dir": str(path),
                      "interrupted": [r["job"] for r in records if r.get("state") in ("queued", "running")],
                      # jobs that ended, as recorded: their MLflow runs must say the same (a run a killed service
                      # never closed is closed from its record at the next start)
                      "ended": {r["job"]: [r["state"], r.get("t_end")] for r in records
                                if r.get("state") in ("done", "failed", "cancelled") and "job" in r},
                      "job_seq": job_seq(out), "latest_version": out.highest_version()})
    return found


def mark_interrupted(output_dir: str, reason: str) -> list[str]:
    """Jobs a crashed service left running: their records and the manifest say ``failed``; their unfinished
    evaluations no longer keep a version from retention."""
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


def purge_output(output_dir: str, tenant: str, root: str) -> bool:
    """Delete a deleted tenant's output dir (only a real output dir of that tenant) and its pointer."""
    out = TenantOutputDir(output_dir)
    if out.exists() and out.read().get("tenant") != tenant:
        raise ValueError(f"{output_dir} is not the output dir of tenant {tenant!r}; not deleted")
    if out.path.exists():
        shutil.rmtree(out.path)
    (Path(root) / "tenants" / f"{tenant}.link.json").unlink(missing_ok=True)
    return True


def write_eval_report(output_dir: str, report: dict[str, Any]) -> str:
    """An evaluation's report, ``eval/<job>-vNNNNNN.json`` in the tenant's output dir."""
    path = TenantOutputDir(output_dir).eval_dir / f"{report['job']}-v{report['version']:06d}.json"
    atomic_write_bytes(path, json.dumps(report, indent=2).encode())
    return str(path)
