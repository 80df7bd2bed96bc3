"""Separate hosts, same engine: the scheduler, the gateway and workers by role started as separate processes,
each in a session of its own (no launcher parents them), exactly as on separate hosts sharing one service root.

An SFT and an RL tenant run; the RL tenant's simulator worker is killed mid-job (its whole process group, as
a host lost) and another joins later: it takes the rollouts, both jobs finish, the lost worker's role fails and
is retired once it stays away. Loopback variant (always), and a variant in network namespaces of their own with
private addresses joined by a bridge (TLS on by default there: Dask over mutual TLS, the gateway over HTTPS
verified with the root's CA), where this machine lets the test make them. Every listener binds only the address
its host was given. On loopback an INFER worker added later joins the engine pool through scale-inference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nexus.client.api import Nexus
from nexus.client.faults import wait_for
from nexus.gateway.auth import read_gateway_url, read_operator_token
from nexus.spec import TenantSpec
from tests.hosts import REPO, Host, Namespaces, Processes

pytestmark = pytest.mark.cluster

RL_UPDATES, SFT_STEPS = 5, 4
# a SIM worker gone this long (never restarted by its nanny) is retired while others serve
SCHEDULER_SETTINGS = ["--set", "health.fail_after_s=30", "--set", "cluster.memory_limit=4GiB"]


def _roles(nx: Nexus) -> dict[str, dict]:
    return {r["role"]: r for r in nx.status()["roles"]}


def _sim_spans(nx: Nexus, tenant: str) -> list[dict]:
    spans = nx.monitoring(since=0.0)["spans"]
    return [s for s in spans if s["service"] == "simulator" and s["tenant"] == tenant]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nexus.client.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def _run_deployment(hosts: dict[str, Host], root: Path, logs: Path, join_infer: bool) -> None:
    a, b, c, d = hosts["a"], hosts["b"], hosts["c"], hosts["d"]
    p = Processes(logs)
    r = ["--root", str(root)]
    try:
        p.nexus("scheduler", a, "scheduler", *r, "--host", a.address, "--port", "0", "--dashboard",
                f"{a.address}:0", *SCHEDULER_SETTINGS)
        p.nexus("gateway", a, "gateway", *r, "--host", a.address)
        p.nexus("actor", b, "worker", "--role", "actor", "--rank", "0", *r, "--host", b.address,
                "--scratch", str(root.parent / "scratch-b"))
        p.nexus("infer-0", b, "worker", "--role", "infer", "--name", "infer-0", *r, "--host", b.address)
        p.nexus("sim-c", c, "worker", "--role", "sim", "--name", "sim-c", *r, "--host", c.address,
                "--scratch", str(root.parent / "scratch-c"))

        def gateway_up() -> str | None:
            dead = {n: rc for n, rc in p.alive().items() if rc is not None}
            assert not dead, f"exited: {dead}\n" + "\n".join(p.log(n)[-3000:] for n in dead)
            return read_gateway_url(root / "gateway")

        url = wait_for(gateway_up, 240, 0.5, "the gateway serving")
        tls = json.loads((root / "service.json").read_text())["tls"]
        assert tls == (a.address != "127.0.0.1"), "TLS is on by default off loopback, off on it"
        assert url.startswith("https://" if tls else "http://")
        nx = Nexus(url, token=read_operator_token(root / "gateway"), ca=root / "tls" / "ca.pem" if tls else None)
        try:
            wait_for(lambda: len(nx.status()["workers"]) >= 3, 240, 0.5, "three workers joined")
            nx.wait_ready(timeout=300)
            rl = nx.create_tenant(TenantSpec(name="hosts-rl", env="maniskill/pushcube-state", hidden_dim=64, seed=5))
            sft = nx.create_tenant(TenantSpec(name="hosts-sft", dataset="pickcube-scripted", action_dim=4,
                                              hidden_dim=64, seed=6))
            rl_job = rl.rl(updates=RL_UPDATES, episodes_per_batch=1, collectors=1)
            sft_job = sft.sft(steps=SFT_STEPS, batch_size=16)

            wait_for(lambda: _sim_spans(nx, "hosts-rl"), 300, 0.2, "a first rollout on sim-c")
            at_kill = rl_job.progress()
            address = {"sim-c": _roles(nx)["sim/sim-c"]["address"]}  # spans name workers by address
            p.kill("sim-c")  # nanny and worker at once: the host is gone, nothing restarts it
            lost = wait_for(lambda: _roles(nx)["sim/sim-c"]["state"] == "failed" and _roles(nx)["sim/sim-c"],
                            120, 0.2, "the lost simulator seen as failed")
            assert lost["reason"] == "worker lost"
            p.nexus("sim-d", d, "worker", "--role", "sim", "--name", "sim-d", *r)  # --host: the route's own

            results = {"rl": rl_job.result(timeout=600), "sft": sft_job.result(timeout=600)}
            assert results["rl"]["updates"] == RL_UPDATES and results["rl"]["version"] == RL_UPDATES
            assert results["sft"]["version"] == SFT_STEPS
            assert at_kill.done < RL_UPDATES, "the RL job had finished before the kill"
            address["sim-d"] = _roles(nx)["sim/sim-d"]["address"]
            assert set(address.values()) <= {s["worker"] for s in _sim_spans(nx, "hosts-rl")}, \
                "the simulator that joined later took the job's remaining rollouts"

            if join_infer:
                p.nexus("infer-1", b, "worker", "--role", "infer", "--name", "infer-1", *r, "--host", b.address)
                wait_for(lambda: "infer-1" in {w["name"] for w in nx.status()["workers"]}, 240, 0.5,
                         "infer-1 joined")
                view = nx.scale_inference(2)
                assert {(e["worker"], e["state"]) for e in view["engines"]} == {("infer-0", "serving"),
                                                                                ("infer-1", "serving")}

            bound = p.listening()
            assert bound and {n for n, _, _ in bound} >= {"scheduler", "gateway", "actor", "infer-0", "sim-d"}
            stray = [x for x in bound if x[1] != x[2]]
            assert not stray, f"listeners on addresses their host was not given: {stray}"

            # the departed simulator is retired once it stays away; the service is whole again
            wait_for(lambda: nx.status()["service"]["state"] == "ok", 120, 1.0, "the service back to ok")
            st = nx.status()
            assert "sim/sim-c" not in {x["role"] for x in st["roles"]}
            assert any(t["role"] == "sim/sim-c" and t["to"] == "retired" for t in st["service"]["transitions"])
        finally:
            nx.close()
        # the operator's commands work from the root alone (an https gateway verified with the root's CA)
        status = _cli("status", *r, "--json")
        assert status.returncode == 0, status.stderr
        assert {w["name"] for w in json.loads(status.stdout)["workers"]} >= {"actor-0", "infer-0", "sim-d"}
        down = _cli("down", *r)
        assert down.returncode == 0, down.stderr
        assert p.procs["scheduler"][0].wait(timeout=30) == 0, "`nexus down` stops the scheduler it names"
    except BaseException:
        for name in p.alive():
            print(f"--- {name} (last lines) ---\n{p.log(name)[-2000:]}")
        raise
    finally:
        p.stop_all()


def test_separate_processes_on_loopback(tmp_path):
    hosts = {n: Host(n, "127.0.0.1") for n in "abcd"}
    _run_deployment(hosts, tmp_path / "root", tmp_path, join_infer=True)


def test_separate_hosts_in_network_namespaces(tmp_path):
    why = Namespaces.unavailable()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here ({why}); the loopback variant covers the rest")
    with Namespaces(list("abcd")) as ns:
        _run_deployment(ns.hosts, tmp_path / "root", tmp_path, join_infer=False)
