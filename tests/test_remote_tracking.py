"""A remote MLflow tracking server works the same as the default local store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from nexus.client.api import Nexus
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("mlflow server did not start") from None
            time.sleep(1)
    yield url
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


def test_jobs_tracked_on_a_remote_server(tmp_path, mlflow_server, capsys):
    from mlflow.tracking import MlflowClient
    from rich.console import Console

    with Nexus.local(tmp_path / "svc", n_sim=1, tracking_uri=mlflow_server, experiment="remote-exp") as nx:
        t = nx.create_tenant(TenantSpec(name="remote", dataset="pickcube-scripted", seed=31))
        job = t.sft(steps=3, batch_size=16)
        res = job.follow(console=Console(width=120, force_terminal=False))
        assert res["version"] == 3
        nx.flush()
    assert f"{job.id} (steps)" in capsys.readouterr().out  # the progress bar was drawn
    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("remote-exp")
    runs = client.search_runs([exp.experiment_id])
    assert [r.data.tags["nexus.job"] for r in runs] == [job.id]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["name"] == "remote"
    assert run.data.metrics["system/metered_actor_s"] > 0 and "train/loss" in run.data.metrics
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3]  # steps are policy versions
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"manifest.json", "result.json", "plots", "weights"} <= artifacts
