"""Reliability benchmark: SIGKILL each role mid-run of two RL tenants, measure what it costs.

One command runs the kill matrix on a real local cluster (2 SIM, 1 ACTOR, 2 INFER workers, two
engines, each tenant on its own engine):

* ``sim``     — the simulator worker running tenant A's rollout
* ``infer``   — the worker hosting tenant A's inference engine
* ``actor``   — the actor worker, while an update runs
* ``service`` — every process of the service at once; a new service starts on the same root,
  rediscovers the tenants, and the interrupted jobs are resubmitted for their remaining updates

Per kill it reports: jobs completed (of 2; for ``service`` the resubmitted ones), the unaffected
tenant B's stall (its longest gap between updates after the kill, minus its median gap before),
the hit tenant A's lost work (updates whose result was lost: published versions the rebuilt slot
does not continue from, plus items interrupted and re-run), and the time to recovery (kill -> the
lost role healthy again, and kill -> A's next new version). Writes ``results.json``.

    .venv/bin/python experiments/reliability/kill_matrix.py [--kills sim,infer,actor,service]
        [--updates 6] [--checkpoint-every 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from nexus.client.api import Nexus  # noqa: E402
from nexus.client.faults import kill_service, kill_worker, wait_for, worker_of_role  # noqa: E402
from nexus.spec import TenantSpec  # noqa: E402

TENANTS = ("ra", "rb")  # ra: the hit tenant, rb: the unaffected one


class Progress:
    """Polls the status every 0.2 s and timestamps every new version of each tenant."""

    def __init__(self, nx: Nexus) -> None:
        self.nx = nx
        self.events: dict[str, list[tuple[float, int]]] = {t: [] for t in TENANTS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                st = self.nx.status()
            except Exception:  # the service is down (the service kill)
                time.sleep(0.2)
                continue
            now = time.time()
            for x in st["tenants"]:
                ev = self.events.get(x["tenant"])
                if ev is not None and (not ev or x["version"] > ev[-1][1]):
                    ev.append((now, x["version"]))
            time.sleep(0.2)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)


def _gaps(events: list[tuple[float, int]], lo: float, hi: float) -> list[float]:
    ts = [t for t, _ in events if lo <= t <= hi]
    return [b - a for a, b in zip(ts, ts[1:], strict=False)]


def _role_back(nx: Nexus, role: str, t_kill: float) -> float | None:
    for tr in nx.status()["service"]["transitions"]:
        if tr["role"] == role and tr["t"] > t_kill and tr["to"] == "healthy":
            return tr["t"] - t_kill
    return None


def _lost_updates(nx: Nexus, tenant: str, t_kill: float) -> int:
    row = {x["tenant"]: x for x in nx.status()["tenants"]}[tenant]
    manifest = json.loads((Path(row["output_dir"]) / "manifest.json").read_text())
    return sum(r["lost_updates"] for r in manifest.get("restores", []) if r["time"] > t_kill)


def _start(root: Path, ck: int) -> Nexus:
    return Nexus.local(root, n_sim=2, n_infer=2, inference_engines=2, checkpoint_every=ck)


def run_kill(nx: Nexus, kind: str, updates: int) -> dict[str, Any]:
    st = nx.status()
    engine_of_a = st["inference"]["routes"]["ra"]
    slot_of_a = next(e["slot"] for e in st["inference"]["engines"] if e["engine"] == engine_of_a)
    hit_role = {"sim": None, "actor": "actor/0", "infer": f"engine/{slot_of_a}"}[kind]
    retried0 = st["service"]["retried_items"]["role_lost"]
    jobs = {t: nx.tenant(t).rl(updates=updates, episodes_per_batch=1, collectors=1) for t in TENANTS}
    with Progress(nx) as prog:
        wait_for(lambda: all(j.info()["progress"].get("updates", 0) >= 2 for j in jobs.values()), 900)
        if kind == "sim":
            def running_a() -> list[str]:
                procs = nx.service.client.processing()
                info = nx.service.client.scheduler_info(n_workers=-1)["workers"]
                return [info[a]["name"] for a, keys in procs.items()
                        if any("nexus-rollout-ra-" in str(k) for k in keys) and a in info]

            name = wait_for(running_a, 300, 0.05)[0]
            hit_role = f"sim/{name}"
        elif kind == "actor":
            wait_for(lambda: nx.status()["actor"]["running"], 300, 0.05)
            name = "actor-0"
        else:
            name = worker_of_role(nx, hit_role)
        v_kill = nx.tenant("ra").version
        t_kill = time.time()
        kill_worker(nx, name)
        results = {}
        for t, j in jobs.items():
            try:
                results[t] = j.result(timeout=900)
            except Exception as e:
                results[t] = {"error": str(e)}
        t_end = time.time()
    wait_for(lambda: all(r["state"] == "healthy" for r in nx.status()["roles"]
                         if not r["role"].startswith("producer/")), 300)
    before = _gaps(prog.events["rb"], 0, t_kill)
    after = _gaps(prog.events["rb"], t_kill - (before and statistics.median(before) or 0), t_end)
    a_next = next((t - t_kill for t, v in prog.events["ra"] if t > t_kill and v > v_kill), None)
    st = nx.status()
    return {"kill": kind, "worker": name, "role": hit_role,
            "jobs_completed": sum("error" not in r for r in results.values()),
            "unaffected_median_gap_s": statistics.median(before) if before else None,
            "unaffected_max_gap_s": max(after) if after else None,
            "unaffected_stall_s": max(0.0, (max(after) if after else 0) - (statistics.median(before) if before else 0)),
            "hit_lost_updates": _lost_updates(nx, "ra", t_kill),
            "redone_items": st["service"]["retried_items"]["role_lost"] - retried0,
            "role_recovery_s": _role_back(nx, hit_role, t_kill), "hit_next_update_s": a_next,
            "results": results}


def run_service_kill(nx: Nexus, root: Path, updates: int, ck: int) -> tuple[Nexus, dict[str, Any]]:
    jobs = {t: nx.tenant(t).rl(updates=updates, episodes_per_batch=1, collectors=1) for t in TENANTS}
    wait_for(lambda: all(j.info()["progress"].get("updates", 0) >= 2 for j in jobs.values()), 900)
    nx.flush()
    done_before = {t: j.info()["progress"].get("updates", 0) for t, j in jobs.items()}
    v_before = {t: nx.tenant(t).version for t in TENANTS}
    t_kill = time.time()
    kill_service(nx.service)
    nx.service.close_client(timeout=5)
    nx2 = _start(root, ck)
    t_ready = time.time()
    st = nx2.status()
    rows = {x["tenant"]: x for x in st["tenants"]}
    v_after = {t: rows[t]["version"] for t in TENANTS}
    jobs2 = {t: nx2.tenant(t).rl(updates=max(1, updates - done_before[t]), episodes_per_batch=1, collectors=1)
             for t in TENANTS}
    with Progress(nx2) as prog:
        results = {}
        for t, j in jobs2.items():
            try:
                results[t] = j.result(timeout=900)
            except Exception as e:
                results[t] = {"error": str(e)}
    a_next = next((t - t_kill for t, v in prog.events["ra"] if v > v_after["ra"]), None)
    b_next = next((t - t_kill for t, v in prog.events["rb"] if v > v_after["rb"]), None)
    return nx2, {"kill": "service", "worker": "all", "role": "scheduler + all workers",
                 "jobs_completed": sum("error" not in r for r in results.values()),
                 "interrupted_jobs_failed": sorted(st["service"]["discovery"].get("interrupted", [])),
                 "rediscovered": sorted(st["service"]["discovery"].get("tenants", [])),
                 "unaffected_median_gap_s": None, "unaffected_max_gap_s": b_next, "unaffected_stall_s": b_next,
                 "hit_lost_updates": _lost_updates(nx2, "ra", t_kill) + max(0, v_before["ra"] - v_after["ra"]),
                 "redone_items": None, "role_recovery_s": t_ready - t_kill, "hit_next_update_s": a_next,
                 "versions": {"before": v_before, "after_restart": v_after}, "results": results}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", default="sim,infer,actor,service")
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--checkpoint-every", type=int, default=1)
    p.add_argument("--root", default=str(HERE / "runs"))
    p.add_argument("--out", default=str(HERE / "results.json"))
    a = p.parse_args()
    root = Path(a.root).resolve() / f"ck{a.checkpoint_every}-{int(time.time())}"
    rows = []
    t0 = time.time()
    nx = _start(root, a.checkpoint_every)
    try:
        for i, t in enumerate(TENANTS):
            nx.create_tenant(TenantSpec(name=t, env="maniskill/pushcube-state", seed=51 + i))
        for kind in a.kills.split(","):
            print(f"-- kill {kind}", flush=True)
            if kind == "service":
                nx, row = run_service_kill(nx, root, a.updates, a.checkpoint_every)
            else:
                row = run_kill(nx, kind, a.updates)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "results"}, default=str), flush=True)
    finally:
        nx.close()
    header = ("kill", "jobs done", "B stall s", "B max gap s", "A lost updates", "redone items", "role back s",
              "A next update s")

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x)

    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:
        lines.append(" | ".join(f(x) for x in (r["kill"], f"{r['jobs_completed']}/2", r["unaffected_stall_s"],
                                                  r["unaffected_max_gap_s"], r["hit_lost_updates"], r["redone_items"],
                                                  r["role_recovery_s"], r["hit_next_update_s"])))
    table = "\n".join(f"| {line} |" for line in lines)
    print(table)
    Path(a.out).write_text(json.dumps({"meta": {"updates": a.updates, "checkpoint_every": a.checkpoint_every,
                                                "wall_s": time.time() - t0, "cmd": " ".join(sys.argv)},
                                       "rows": rows, "table": table}, indent=2, default=str))
    return 0 if all(r["jobs_completed"] == 2 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
