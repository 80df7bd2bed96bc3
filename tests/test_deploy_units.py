"""The separate-host commands without a cluster: what each prepares on the shared root (config, certificates,
lock), the TLS rule off loopback, the role → resource mapping, and command lines that Dask's own CLI parsers
accept (with the plugin's --nexus-config preload argument); the retirement of a simulator that left for good;
the gateway's HTTPS certificate verified by a real TLS client; `nexus down` refusing another host's service."""

from __future__ import annotations

import http.server
import json
import os
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import click
import pytest

from nexus.config.service import HealthSettings, ServiceConfig
from nexus.control.health.manager import HealthManager, RoleState
from nexus.deploy import hosts as deploy
from nexus.deploy.local import RootLock
from nexus.deploy.processes import ROLE_RESOURCES
from nexus.deploy.tls import ensure_certificates, server_certificate
from nexus.errors import Conflict, SpecError

REPO = Path(__file__).resolve().parents[1]


def _service(root: Path, tls: bool, scheduler: str = "tcp://10.9.0.1:8786", **fields) -> ServiceConfig:
    """A root as `nexus scheduler` leaves it (service.json, scheduler.json, certificates with TLS)."""
    config = ServiceConfig(root=str(root), host=deploy.address_host(scheduler), tls=tls, **fields)
    root.mkdir(parents=True, exist_ok=True)
    if tls:
        ensure_certificates(config.tls_dir)
    config.save(root / "service.json")
    (root / "scheduler.json").write_text(json.dumps({"address": scheduler}))
    return config


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# -- scheduler -------------------------------------------------------------------------------------------
def test_scheduler_off_loopback_turns_tls_on_writes_the_root_and_holds_its_lock(tmp_path):
    root = tmp_path / "root"
    launch, lock = deploy.plan_scheduler(ServiceConfig(root=str(root), host="10.9.0.1"), port=0)
    try:
        saved = ServiceConfig.load(root / "service.json")
        assert saved.tls and saved.host == "10.9.0.1"
        for f in ("ca.pem", "ca.key", "service.pem", "service.key"):
            assert stat.S_IMODE(os.stat(root / "tls" / f).st_mode) == 0o600
        a = launch.args
        assert a[0] == "distributed.cli.dask_scheduler" and _arg(a, "--protocol") == "tls"
        assert _arg(a, "--host") == "10.9.0.1" and _arg(a, "--dashboard-address") == "10.9.0.1:8787"
        assert _arg(a, "--nexus-config") == str(root / "service.json")
        assert lock.fileno() in launch.keep_fds  # the lock goes with the exec'd scheduler
        with pytest.raises(Conflict, match="in use by a running service"):
            deploy.plan_scheduler(ServiceConfig(root=str(root), host="10.9.0.1"))
    finally:
        lock.release()
    # loopback: no TLS unless asked; explicitly off a non-loopback host: off, with a warning
    launch, lock = deploy.plan_scheduler(ServiceConfig(root=str(tmp_path / "lo"), host="127.0.0.1"))
    lock.release()
    assert "--protocol" not in launch.args and not ServiceConfig.load(tmp_path / "lo" / "service.json").tls
    launch, lock = deploy.plan_scheduler(ServiceConfig(root=str(tmp_path / "off"), host="10.9.0.1"), tls=False)
    lock.release()
    assert not ServiceConfig.load(tmp_path / "off" / "service.json").tls


def test_command_lines_are_what_dasks_own_cli_parses(tmp_path):
    """The scheduler's preload argument reaches the plugin's click command; a worker's flags are dask worker's."""
    from distributed.cli import dask_scheduler, dask_worker

    from nexus.control.plugin import dask_setup

    launch, lock = deploy.plan_scheduler(ServiceConfig(root=str(tmp_path / "root"), host="10.9.0.1"), port=0)
    lock.release()
    ctx = dask_scheduler.main.make_context("scheduler", launch.args[1:])
    assert ctx.params["preload"] == ("nexus.control.plugin",)
    assert ctx.params["preload_argv"] == ("--nexus-config", str(tmp_path / "root" / "service.json"))
    assert dask_setup.make_context("dask_setup", list(ctx.params["preload_argv"])).params == {
        "config_path": str(tmp_path / "root" / "service.json")}
    with pytest.raises(click.UsageError):
        dask_scheduler.main.make_context("scheduler", [*launch.args[1:], "--nexus-confg", "x"])
    (tmp_path / "root" / "scheduler.json").write_text(json.dumps({"address": "tls://10.9.0.1:8786"}))
    for role in ROLE_RESOURCES:
        w = deploy.plan_worker(tmp_path / "root", role, host="10.9.0.2", name=f"{role}-x", wait_s=1)
        wp = dask_worker.main.make_context("worker", w.args[1:]).params
        assert wp["resources"] == f"{ROLE_RESOURCES[role]}=1" and wp["preload"] == ("nexus.worker.plugin",)
        assert wp["host"] == "10.9.0.2" and wp["tls_ca_file"] == str(tmp_path / "root" / "tls" / "ca.pem")


# -- workers and the gateway -------------------------------------------------------------------------------
def test_worker_follows_the_root_and_refuses_an_insecure_join(tmp_path):
    root = tmp_path / "plain"
    _service(root, tls=False, actor_ranks=2)
    with pytest.raises(SpecError, match="without TLS.*--no-tls"):
        deploy.plan_worker(root, "sim", host="10.9.0.2", wait_s=1)
    w = deploy.plan_worker(root, "sim", host="10.9.0.2", no_tls=True, scratch=tmp_path / "scratch", wait_s=1)
    assert _arg(w.args, "--local-directory") == str(tmp_path / "scratch") == w.env["TMPDIR"]
    assert w.env["DASK_DISTRIBUTED__WORKER__DAEMON"] == "False" and w.env["OMP_NUM_THREADS"] == "1"
    assert _arg(w.args, "--scheduler-file") == str(root / "scheduler.json")
    a = deploy.plan_worker(root, "actor", host="10.9.0.3", rank=1, no_tls=True, wait_s=1)
    assert _arg(a.args, "--name") == "actor-1" and "DASK_DISTRIBUTED__WORKER__DAEMON" not in a.env
    with pytest.raises(SpecError, match="ranks 0..1"):
        deploy.plan_worker(root, "actor", rank=2, no_tls=True, wait_s=1)
    with pytest.raises(SpecError, match="--rank is for actor"):
        deploy.plan_worker(root, "infer", rank=0, no_tls=True, wait_s=1)
    with pytest.raises(SpecError, match="unknown role"):
        deploy.plan_worker(root, "gpu", wait_s=1)
    secure = tmp_path / "secure"
    _service(secure, tls=True)
    with pytest.raises(SpecError, match="uses TLS"):
        deploy.plan_worker(secure, "sim", host="10.9.0.2", no_tls=True, wait_s=1)
    with pytest.raises(Exception, match="no scheduler in"):
        deploy.plan_worker(tmp_path / "empty", "sim", wait_s=0.2)


def test_default_address_is_the_route_to_the_scheduler(tmp_path):
    _service(tmp_path / "root", tls=False, scheduler="tcp://127.0.0.1:8786")
    w = deploy.plan_worker(tmp_path / "root", "infer", wait_s=1)
    assert _arg(w.args, "--host") == "127.0.0.1" and _arg(w.args, "--dashboard-address") == "127.0.0.1:0"
    assert deploy.address_host("tls://[::1]:8786") == "::1" and deploy.facing_address("127.0.0.1") == "127.0.0.1"


def test_gateway_serves_https_off_loopback_with_a_certificate_a_tls_client_verifies(tmp_path):
    root = tmp_path / "root"
    config = _service(root, tls=True)
    g = deploy.plan_gateway(root, host="10.9.0.4", port=8000, advertise="gw.example", wait_s=1)
    cert, key = Path(_arg(g.args, "--certfile")), Path(_arg(g.args, "--keyfile"))
    assert _arg(g.args, "--advertise") == "gw.example" and _arg(g.args, "--port") == "8000"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert "--certfile" not in deploy.plan_gateway(root, host="127.0.0.1", wait_s=1).args  # loopback: HTTP

    # a real TLS handshake: a server with a certificate issued for 127.0.0.1, a client trusting only the CA
    cert, key = server_certificate(config.tls_dir, "probe", ("127.0.0.1",))
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        import httpx

        url = f"https://127.0.0.1:{server.server_address[1]}/"
        trusting = ssl.create_default_context(cafile=str(root / "tls" / "ca.pem"))
        assert httpx.get(url, verify=trusting, timeout=10).status_code in (200, 404)
        with pytest.raises(httpx.ConnectError):  # the system's trust store does not know the service CA
            httpx.get(url, timeout=10)
    finally:
        server.shutdown()
        server.server_close()


# -- health: workers that leave ----------------------------------------------------------------------------
def test_a_simulator_that_left_for_good_is_retired_while_others_serve():
    now = [1000.0]
    h = HealthManager(HealthSettings(), lambda: now[0])
    for name, address in (("sim/a", "tcp://a"), ("sim/b", "tcp://b")):
        h.register(name, "simulator", address, name[4:])
        h.ready(name, address, name[4:])
    h.worker_lost("tcp://a")
    now[0] += 30
    assert h.retire_departed("simulator", 60) == [] and h.state("sim/a") == RoleState.FAILED
    now[0] += 31
    assert h.retire_departed("simulator", 60) == ["sim/a"] and h.get("sim/a") is None
    assert h.history[-1]["to"] == "retired" and "left the cluster" in h.history[-1]["reason"]
    h.worker_lost("tcp://b")  # the last simulator stays failed: the service has none left
    now[0] += 120
    assert h.retire_departed("simulator", 60) == [] and h.state("sim/b") == RoleState.FAILED


# -- nexus down on shared storage --------------------------------------------------------------------------
def test_down_refuses_a_service_that_runs_on_another_host(tmp_path):
    lock = RootLock(tmp_path)
    lock.acquire()
    try:
        lock.record(host="another-host")
        r = subprocess.run([sys.executable, "-m", "nexus.client.cli", "down", "--root", str(tmp_path)],
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 3 and "runs on host another-host" in r.stderr, r.stderr
    finally:
        lock.release()
