"""The `nexus` CLI's failure paths, as a user meets them: one line on stderr, a stated exit status, no hang,
no traceback (without --debug). Real processes, real sockets, real files; no service needed."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nexus.data.output_dir import TenantOutputDir
from nexus.deploy.local import RootLock, lock_holder

REPO = Path(__file__).resolve().parents[1]


def nexus(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "nexus.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def one_line_error(r: subprocess.CompletedProcess, status: int, *needles: str) -> None:
    assert r.returncode == status, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # one line, no traceback
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def http_port():
    """A port that answers HTTP, not Dask (like the dashboard's): connecting must not hang."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers: a request waits on it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def test_no_service_at_root(tmp_path):
    r = nexus("status", "--root", str(tmp_path))
    one_line_error(r, 3, "is `nexus up` running?", str(tmp_path / "gateway"))


def test_a_stale_gateway_file_on_a_free_root_is_no_service(tmp_path):
    # a service that died left root/gateway/gateway.json behind; its root lock is free
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "gateway.json").write_text('{"url": "http://127.0.0.1:9"}')
    (tmp_path / "gateway" / "operator.token").write_text("op-x")
    (tmp_path / "service.lock").write_text("")
    r = nexus("list", "--root", str(tmp_path), "--timeout", "2")
    one_line_error(r, 3, "no running gateway recorded in", "is `nexus up` running?")


def test_dead_gateway_url_fails_within_the_stated_timeout():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = nexus("status", "--address", f"http://127.0.0.1:{port}", "--token", "x", "--timeout", "2")
    one_line_error(r, 3, "within 2 s", f"--address http://127.0.0.1:{port}")


def test_an_http_port_that_is_not_a_gateway_is_refused(http_port):
    r = nexus("list", "--address", f"http://127.0.0.1:{http_port}", "--token", "x", "--timeout", "5")
    one_line_error(r, 3, "is not a JoyNexus gateway", f"--address http://127.0.0.1:{http_port}")


def test_a_dask_address_is_refused_with_the_gateway_hint(http_port):
    # the CLI speaks the HTTP API only: the scheduler's address is the service's own, never a client's door
    r = nexus("list", "--address", f"tcp://127.0.0.1:{http_port}", "--timeout", "2")
    one_line_error(r, 1, "give the gateway URL", f"tcp://127.0.0.1:{http_port}")


def test_a_silent_port_fails_within_the_stated_timeout_and_debug_shows_the_traceback(silent_port):
    # (a hang would end in subprocess.TimeoutExpired: the dashboard port once hung the CLI past 400 s)
    r = nexus("status", "--address", f"http://127.0.0.1:{silent_port}", "--token", "x", "--timeout", "2", timeout=60)
    one_line_error(r, 3, f"http://127.0.0.1:{silent_port} within 2 s")
    debug = nexus("--debug", "status", "--address", f"http://127.0.0.1:{silent_port}", "--token", "x", "--timeout",
                  "1", timeout=30)
    assert debug.returncode != 0 and "Traceback" in debug.stderr  # --debug shows it


def _wait_until_connecting(pid: int, port: int, timeout_s: float = 60.0) -> None:
    import psutil

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp")):
            return
        time.sleep(0.1)
    raise AssertionError(f"the CLI (pid {pid}) opened no connection to port {port} within {timeout_s:g} s")


def test_ctrl_c_is_one_line(silent_port):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # as from a terminal: a runner started in the background (`make test &`, some CI) ignores SIGINT and its
    # children inherit that, so the CLI's process gets Python's handler back before the CLI runs
    as_terminal = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "sys.argv[0] = 'nexus'; runpy.run_module('nexus.client.cli', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", as_terminal, "status", "--address",
                             f"http://127.0.0.1:{silent_port}", "--token", "x", "--timeout", "60"],
                            stderr=subprocess.PIPE, text=True, env=env)
    _wait_until_connecting(proc.pid, silent_port)  # imported and waiting on the connection (a cold import is slow)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["nexus status: interrupted"]


def test_unknown_tenant_without_service(tmp_path):
    r = nexus("logs", "nobody", "--root", str(tmp_path), "--timeout", "1")
    one_line_error(r, 1, "unknown tenant 'nobody'", "no manifest")
    r = nexus("report", "nobody", "--root", str(tmp_path), "--timeout", "1", "--out", str(tmp_path / "r"))
    one_line_error(r, 1, "unknown tenant 'nobody'")


def _stored_tenant(root: Path, rows: int = 400) -> None:
    out = TenantOutputDir(root / "tenants" / "old")
    out.create({"name": "old"}, {})
    out.add_job({"job": "old-sft-1", "kind": "sft", "state": "done", "t_submit": 1.0, "t_end": 9.0, "error": None,
                 "history": [{"kind": "train", "step": i, "loss": 1 / i} for i in range(1, rows)]})


def test_logs_from_the_manifest_and_into_a_closed_pipe(tmp_path):
    _stored_tenant(tmp_path)
    r = nexus("logs", "old", "--root", str(tmp_path), "--timeout", "1")
    assert r.returncode == 0, r.stderr
    assert "old-sft-1" in r.stdout and "[from the manifest]" in r.stdout and "-- train (399 rows)" in r.stdout
    assert "service not reachable" in r.stderr
    # `nexus logs | head`: the reader leaves early; no BrokenPipeError
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = f"{sys.executable} -m nexus.client.cli logs old --root {tmp_path} --timeout 1 | head -n 2"
    piped = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, env=env,
                           timeout=60)
    assert len(piped.stdout.splitlines()) == 2
    assert "BrokenPipe" not in piped.stderr and "Traceback" not in piped.stderr, piped.stderr


def test_a_second_service_on_a_locked_root_refuses_and_keeps_the_first_ones_files(tmp_path):
    lock = RootLock(tmp_path)
    lock.acquire()  # what a running `nexus up` holds
    try:
        lock.record(address="tcp://127.0.0.1:1234")
        (tmp_path / "scheduler.json").write_text('{"address": "tcp://127.0.0.1:1234"}')
        assert lock_holder(tmp_path) == {"pid": os.getpid(), "address": "tcp://127.0.0.1:1234"}
        r = nexus("up", "--root", str(tmp_path))
        one_line_error(r, 1, "in use by a running service", f"pid {os.getpid()}", "nexus down")
        assert (tmp_path / "scheduler.json").read_text() == '{"address": "tcp://127.0.0.1:1234"}'
        assert not (tmp_path / "logs").exists()  # nothing of the second service was started
    finally:
        lock.release()
    assert lock_holder(tmp_path) is None


def test_down_without_a_service(tmp_path):
    one_line_error(nexus("down", "--root", str(tmp_path)), 1, "no running service")


@pytest.mark.parametrize("text, needle", [("root = \n", "invalid TOML"),
                                          ("infer_max_batch = 0\n", "infer_max_batch")])
def test_bad_config_files_are_one_line(tmp_path, text, needle):
    (tmp_path / "bad.toml").write_text(text)
    one_line_error(nexus("up", "--config", str(tmp_path / "bad.toml"), "--root", str(tmp_path)), 1, needle)
    assert not (tmp_path / "service.lock").exists()  # refused before anything started
    one_line_error(nexus("submit", str(tmp_path / "bad.toml"), "--root", str(tmp_path)), 1)
    one_line_error(nexus("up", "--set", "nonsense", "--root", str(tmp_path)), 1, "expected key=value")
