"""Launch from files on a real service: `nexus up --config` in its own process, `nexus submit` of tenant and
job files, `list`, `logs`, the root lock against a second `nexus up`, and `nexus down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nexus.client.api import Nexus
from nexus.config.validation import validate_tenant
from nexus.errors import Conflict
from nexus.gateway.auth import read_gateway_url, read_operator_token

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]


def nexus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nexus.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """`nexus up --config configs/service.toml` with overrides, as a user runs it."""
    root = tmp_path_factory.mktemp("launched")
    log = open(root.parent / f"{root.name}-up.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "nexus.client.cli", "up", "--config",
                             str(REPO / "configs" / "service.toml"), "--root", str(root), "--dashboard",
                             "127.0.0.1:0", "--set", "cluster.sim_workers=1", "--set", "limits.max_versions_kept=3",
                             "--set", "infer_max_batch=4"],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 240
    while "JoyNexus service up" not in Path(log.name).read_text():
        assert proc.poll() is None and time.time() < deadline, Path(log.name).read_text()
        time.sleep(0.5)
    yield root, proc, Path(log.name)
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)


def test_up_prints_where_everything_is(service):
    root, _, log = service
    text = log.read_text()
    for needle in ("root:", str(root), "dashboard:", "Nexus page:", "/nexus", "MLflow:", f"sqlite:///{root}"):
        assert needle in text, text
    cfg = json.loads((root / "service.json").read_text())  # what every worker reads
    # retention is the limit max_versions_kept (one retention mechanism)
    assert cfg["limits"]["max_versions_kept"] == 3 and cfg["infer_max_batch"] == 4
    assert cfg["cluster"]["sim_workers"] == 1
    for needle in ("gateway:", "operator token:", str(root / "gateway" / "operator.token")):
        assert needle in text, text


@pytest.fixture(scope="module")
def filed(service, tmp_path_factory):
    """Tenant "filed" and its SFT job from files by `nexus submit --follow`, then an evaluation job file through
    the API: what the tests below read (each of them runs alone too)."""
    root, _, _ = service
    files = tmp_path_factory.mktemp("files")
    (files / "tenant.toml").write_text('name = "filed"\ndataset = "pickcube-scripted"\n'
                                       'env = "maniskill/pickcube-state"\nseed = 4\n')
    (files / "job.toml").write_text('kind = "sft"\nsteps = 3\nbatch_size = 8\n')
    r = nexus("submit", str(files / "tenant.toml"), str(files / "job.toml"), "--set", "tenant.lr=0.002",
              "--set", "job.steps=6", "--root", str(root), "--follow")
    assert r.returncode == 0, r.stderr
    gateway = root / "gateway"  # as the CLI does: the gateway, as the operator
    with Nexus(read_gateway_url(gateway), token=read_operator_token(gateway)) as nx:
        version = nx.tenant("filed").info["version"]  # before the evaluation (which makes no version)
        # a job file for an existing tenant, through the API
        ev = nx.tenant("filed").submit(REPO / "configs" / "jobs" / "eval.toml", overrides=["job.episodes=1"])
        evaluated = ev.result(timeout=300)
    return {"submit": r, "version": version, "eval": evaluated}


def test_submit_files_gives_the_same_tenant_as_the_api(service, filed, tmp_path):
    root, _, _ = service
    assert "submitted filed-sft-" in filed["submit"].stdout
    gateway = root / "gateway"  # as the CLI does: the gateway, as the operator
    with Nexus(read_gateway_url(gateway), token=read_operator_token(gateway)) as nx:
        t = nx.tenant("filed")
        spec, _ = validate_tenant({"name": "filed", "dataset": "pickcube-scripted", "env": "maniskill/pickcube-state",
                                   "seed": 4, "lr": 0.002})
        assert filed["version"] == 6 == t.info["version"]
        # the API with the same content is the same tenant (an existing tenant with another spec is refused)
        assert nx.create_tenant(spec.model_dump()).name == "filed"
        with pytest.raises(Conflict, match="exists with another spec"):  # the gateway: 409
            nx.create_tenant(spec.model_copy(update={"lr": 0.1}).model_dump())
        # the evaluation job file (through the API, in the fixture)
        assert filed["eval"]["episodes"] == 1 and filed["eval"]["version"] == 6
        # retention (max_versions_kept=3): the newest 3, the initial and the evaluated (6)
        weights = sorted(int(p.stem[1:]) for p in (root / "tenants" / "filed" / "weights").glob("v*.pt"))
        assert weights == [0, 4, 5, 6]
    # a bad file is refused with the service's words before anything is sent
    (tmp_path / "bad.toml").write_text('name = "filed2"\nenv = "maniskill/no-such-task"\n')
    r = nexus("submit", str(tmp_path / "bad.toml"), "--root", str(root))
    assert r.returncode == 1 and "unknown env" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_list_and_logs(service, filed):
    root, _, _ = service
    r = nexus("list", "--root", str(root))
    assert r.returncode == 0 and "filed-sft-" in r.stdout and "6/6 steps" in r.stdout, r.stdout
    r = nexus("logs", "filed", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert "-- train (6 rows)" in r.stdout and "-- eval (1 rows)" in r.stdout
    r = nexus("logs", "nobody", "--root", str(root))
    assert r.returncode == 1 and "unknown tenant 'nobody'" in r.stderr and "Traceback" not in r.stderr


def test_second_up_refused_then_down_stops_the_first(service):
    root, proc, _ = service
    before = (root / "scheduler.json").read_text()
    r = nexus("up", "--root", str(root))
    assert r.returncode == 1 and "in use by a running service" in r.stderr, r.stderr
    assert (root / "scheduler.json").read_text() == before  # the first service stays visible
    r = nexus("down", "--root", str(root))
    assert r.returncode == 0 and "stopped the service" in r.stdout, r.stderr
    assert proc.wait(timeout=60) == 0
    r = nexus("status", "--root", str(root))
    assert r.returncode == 3 and "is `nexus up` running?" in r.stderr
