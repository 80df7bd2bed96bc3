"""SIGKILL of the whole service mid-job, then a new service on the same root: tenants rediscovered,
no version re-used, published weights intact, the interrupted job and its MLflow run marked failed,
job ids unique across the restart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nexus.client.api import Nexus
from nexus.client.faults import kill_service, wait_for
from nexus.config.service import ServiceConfig
from nexus.spec import TenantSpec
from nexus.wire.messages import job_number

pytestmark = pytest.mark.cluster


def _hashes(manifest: dict) -> dict[int, str]:
    return {v["version"]: hashlib.sha256(Path(v["weights"]).read_bytes()).hexdigest() for v in manifest["versions"]}


def test_service_killed_mid_job_is_rediscovered_by_the_next(tmp_path):
    root = tmp_path / "svc"
    nx = Nexus.local(root, n_sim=1)
    try:
        t = nx.create_tenant(TenantSpec(name="crash", env="maniskill/pushcube-state", seed=41))
        out = Path(t.info["output_dir"])
        job = t.rl(updates=40, episodes_per_batch=1, collectors=1)
        wait_for(lambda: job.info()["progress"].get("updates", 0) >= 2, 600, what="two updates")
        nx.flush()  # the MLflow run exists
        kill_service(nx.service)
    finally:
        nx.service.close_client(timeout=5)
        nx.service.stop()
    manifest = json.loads((out / "manifest.json").read_text())
    published = _hashes(manifest)
    top = max(published)
    assert json.loads((out / "jobs" / f"{job.id}.json").read_text())["state"] == "running"

    with Nexus.local(root, n_sim=1) as nx2:
        st = nx2.status()
        assert st["service"]["discovery"]["state"] == "done"
        assert job.id in st["service"]["discovery"]["interrupted"]
        row = {x["tenant"]: x for x in st["tenants"]}["crash"]
        assert row["version"] >= top and row["restored"]
        record = json.loads((out / "jobs" / f"{job.id}.json").read_text())
        assert record["state"] == "failed" and "stopped" in record["error"]
        assert [j["state"] for j in json.loads((out / "manifest.json").read_text())["jobs"]] == ["failed"]
        t2 = nx2.tenant("crash")
        job2 = t2.rl(updates=2, episodes_per_batch=1, collectors=1)
        assert job_number(job2.id) > job_number(job.id), "job ids never repeat across restarts"
        res = job2.result(timeout=600)
        assert res["version"] == row["version"] + 2
        nx2.flush()
        cfg = ServiceConfig(**st["config"])
    manifest = json.loads((out / "manifest.json").read_text())
    versions = [v["version"] for v in manifest["versions"]]
    assert versions == sorted(set(versions)) and max(versions) == res["version"]
    after = _hashes(manifest)
    assert all(after[v] == h for v, h in published.items()), "a published version's weights changed"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg.resolved_tracking_uri())
    exp = client.get_experiment_by_name(cfg.resolved_experiment())
    runs = {r.data.tags["nexus.job"]: r for r in client.search_runs([exp.experiment_id])}
    assert runs[job.id].info.status == "FAILED"
    assert runs[job2.id].info.status == "FINISHED"
