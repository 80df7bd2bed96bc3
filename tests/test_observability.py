"""Signals, the /nexus page, /metrics, MLflow and metering on a real local cluster during a real run."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.client.cli import main as cli
from nexus.data.output_dir import TenantOutputDir
from nexus.features import Observation, TenantSchema
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two tenants train and one evaluates at once; then every view of the service is checked."""
    root = tmp_path_factory.mktemp("observed")
    with Nexus.local(root, n_sim=2) as nx:
        rl = nx.create_tenant(TenantSpec(name="obs-rl", env="maniskill/pushcube-state", seed=21))
        sft = nx.create_tenant(TenantSpec(name="obs-sft", dataset="pickcube-scripted",
                                          env="maniskill/pickcube-state", seed=22))
        jobs = [rl.rl(updates=3, episodes_per_batch=1, collectors=2), sft.sft(steps=20, batch_size=32),
                sft.evaluate(episodes=2)]
        results = [j.result(timeout=600) for j in jobs]
        # whether the RL's and the eval's requests happened to share a forward depends on timing (T = 5 ms);
        # the page's legend must explain the shared colour, so make sure one such forward exists
        assert _shared_forward(nx, [rl.info["output_dir"], sft.info["output_dir"]], ["obs-rl", "obs-sft"])
        nx.flush()
        yield nx, jobs, results


def _shared_forward(nx: Nexus, output_dirs: list[str], tenants: list[str], tries: int = 20) -> bool:
    """Both tenants' producers ask at once, until one forward answered both (at most ``tries`` rounds)."""
    engine = nx.service.engine()
    obs = []
    for d in output_dirs:
        schema = TenantSchema.from_dict(json.loads(TenantOutputDir(d).manifest_path.read_text())["schema"])
        obs.append(Observation(state=np.zeros(schema.proprio_dim, np.float32), instruction=schema.instruction))
    for t in tenants:  # an open producer that is not waiting holds a group back for up to T
        engine.open_producer(f"probe-{t}", t).result(timeout=30)
    try:
        for _ in range(tries):
            futures = [engine.predict_batch(t, [o], None, True, None, f"probe-{t}")
                       for t, o in zip(tenants, obs, strict=True)]
            if all(f.result(timeout=60)["group_rows"] == len(tenants) for f in futures):
                return True
    finally:
        for t in tenants:
            engine.close_producer(f"probe-{t}").result(timeout=30)
    return False


def _get(nx: Nexus, path: str) -> bytes:
    return urllib.request.urlopen(nx.service.dashboard_link.replace("/status", path), timeout=60).read()


def test_signals_reach_the_page_data_source(run):
    nx, jobs, _ = run
    view = nx.monitoring()
    assert {t["tenant"] for t in view["status"]["tenants"]} == {"obs-rl", "obs-sft"}
    assert view["signals"].get("update", 0) >= 3 + 20  # one per update, plus init/checkpoint
    assert view["signals"].get("rollout", 0) >= 3 and view["signals"].get("inference", 0) >= 1
    services = {s["service"] for s in view["spans"]}
    assert services == {"actor", "inference", "simulator"}
    assert view["group_sizes"] and min(view["group_sizes"]) >= 1
    assert view["samples"] and "training_depth" in view["samples"][-1]
    assert view["weight_sync"]["obs-rl"]["count"] == 3 and view["weight_sync"]["obs-rl"]["bytes"] > 0


def test_metering_sums_match_measured_busy_time(run):
    nx, jobs, _ = run
    view = nx.monitoring()
    metering = view["metering"]
    stream = nx.service.client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.get_task_stream())

    def dask_busy(prefixes: tuple[str, ...]) -> float:
        return sum(ss["stop"] - ss["start"] for t in stream if str(t["key"]).startswith(prefixes)
                   for ss in t["startstops"] if ss["action"] == "compute")

    actor = sum(m["actor"] for m in metering.values())
    sim = sum(m["simulator"] for m in metering.values())
    assert actor == pytest.approx(dask_busy(("nexus-update-", "nexus-init-", "nexus-finish-")), rel=0.05)
    assert sim == pytest.approx(dask_busy(("nexus-rollout-", "nexus-eval-obs")), rel=0.05)
    engine = nx.service.engine().engine_stats().result()
    assert sum(m["inference"] for m in metering.values()) == pytest.approx(engine["busy_s"], rel=0.05)
    uses = {"rl": ("actor", "inference", "simulator"), "sft": ("actor",), "eval": ("inference", "simulator")}
    for j in jobs:  # every job is metered on exactly the services it used
        info = nx.job(j.id).info()
        used = {s for s, v in info["metered_s"].items() if v > 0}
        assert used == set(uses[info["kind"]]), (info["kind"], info["metered_s"])


def test_nexus_page_metrics_and_state_answer(run):
    nx, _, _ = run
    page = _get(nx, "/nexus").decode()
    assert "bokeh" in page.lower()
    assert '<a href="nexus">Nexus</a>' in _get(nx, "/status").decode()  # the navigation links the page
    metrics = _get(nx, "/metrics").decode()
    assert 'nexus_metered_device_seconds_total{service="actor",tenant="obs-rl"}' in metrics
    assert 'nexus_tenant_version{tenant="obs-sft"} 20.0' in metrics
    state = json.loads(_get(nx, "/nexus/api/state"))
    assert {t["tenant"] for t in state["tenants"]} == {"obs-rl", "obs-sft"}


def test_cli_status_logs_and_report(run, tmp_path, capsys):
    nx, _, _ = run
    root = nx.service.config.root
    assert cli(["status", "--root", root]) == 0
    out = capsys.readouterr().out
    assert "obs-rl" in out and "actor s" in out
    assert cli(["logs", "obs-sft", "--root", root]) == 0
    out = capsys.readouterr().out
    assert "-- train (20 rows)" in out and "-- eval (1 rows)" in out and "loss" in out
    assert cli(["report", "obs-rl", "--root", root, "--out", str(tmp_path)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["obs-rl-curves.png", "obs-rl-utilization.png"]
    assert all((tmp_path / p).stat().st_size > 5000 for p in pngs)


def test_nexus_page_renders_live_tenants_in_headless_chromium(run):
    from nexus.control.monitoring.dashboard import GROUPED_LABEL
    from tests.browser import screenshot_when

    nx, jobs, _ = run
    assert shutil.which("chromium"), "Debian's chromium is missing: `make test` installs it"
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "nexus-page.png"
    # the page shows the jobs table (every job id, with progress) and the timeline's legend as text
    expected = ["obs-rl", "obs-sft", "Jobs", "Health", "Legend", *(j.id for j in jobs), "20/20 steps"]
    text = screenshot_when(nx.service.dashboard_link.replace("/status", "/nexus"), expected, shot)
    assert GROUPED_LABEL in text  # the shared-forward colour is explained (a forward served both tenants)
    for name in ("sim-0", "sim-1", "actor-0", "infer-0"):  # health rows by worker name, not address
        assert name in text
    assert "Workers" in text and "Status" in text  # the dashboard's navigation bar
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
