"""16 robots of 16 tenants at 10 Hz with 100 ms deadlines (bounded, loopback): the share of replies within the
deadline, over the openpi WebSocket (``openpi-client``, unmodified) and over HTTP ``predict``, phases alternated.

One ``Nexus.local`` service (``backbone.size=small`` by default, one engine, one SIM worker), ``--robots`` tenants on
``maniskill/pickcube-rgb`` (a 64 px camera + 29-float state, chunk 4), each driven by its own robot (a thread with
its own connection). A robot sends an observation with fresh pixels every ``1 / --hz`` s on a fixed schedule (its
phase drawn at random, as robots are not synchronised), each with ``deadline_ms`` (the WebSocket connection's
``?deadline_ms=``, HTTP's body field); a robot whose reply comes after its next tick sends at once (it cannot pipeline:
one request in flight, as openpi's client). A reply is *within* when the robot has it no later than the deadline after
it sent (client clock: packing, loopback and the server). Per phase: the share within, p50 / p99 of the client's
latency, the replies' own timing (queue, forward), the engine's groups (rows per group, why they fired, busy time
over the phase: near 1 means the engine's core is saturated), the box's CPU busy share (``/proc/stat``) and load
average.

    python experiments/robots/fleet.py --seconds 20 --runs 3 --out experiments/robots/results_fleet_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from nexus.client.api import Nexus
from nexus.gateway.openpi import openpi_address
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array

ENV = "maniskill/pickcube-rgb"
TIMING_KEYS = ("gateway_queue_ms", "to_engine_ms", "engine_queue_ms", "forward_ms", "total_ms")


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole box so far (``/proc/stat``)."""
    f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]  # idle + iowait
    return sum(f) - idle, sum(f)


class Robot(threading.Thread):
    """One robot: a fixed-rate loop of observations with a deadline over its own connection for ``seconds``."""

    def __init__(self, i: int, proto: str, host: str, port: int, gateway: str, tenant: str, token: str,
                 hz: float, deadline_ms: float, start_at: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.i, self.proto, self.tenant, self.token = i, proto, tenant, token
        self.period, self.deadline_ms, self.start_at, self.seconds = 1 / hz, deadline_ms, start_at, seconds
        self.rng = np.random.default_rng(1000 + i)
        self.latencies: list[float] = []
        self.timings: list[dict[str, float]] = []
        self.errors: list[str] = []
        if proto == "websocket":
            self.ws = WebsocketClientPolicy(f"ws://{host}:{port}/?deadline_ms={deadline_ms:g}", api_key=token)
        else:
            self.http = httpx.Client(base_url=gateway, timeout=30, headers={"Authorization": f"Bearer {token}"})

    def obs(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
                self.rng.standard_normal(29).astype(np.float32))

    def call(self) -> dict[str, float]:
        img, state = self.obs()
        if self.proto == "websocket":
            out = self.ws.infer({"observation/image": img, "observation/state": state})
            if out["actions"].shape != (4, 4):
                raise AssertionError(f"actions of shape {out['actions'].shape}")
            return out["server_timing"]
        r = self.http.post(f"/v1/tenants/{self.tenant}/predict", json={
            "observation": {"state": encode_array(state), "images": {"base_camera": encode_array(img)}},
            "deadline_ms": self.deadline_ms})
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.text[:200]}")
        return {}

    def run(self) -> None:
        tick = self.start_at
        end = self.start_at + self.seconds
        while tick < end:
            now = time.monotonic()
            if now < tick:
                time.sleep(tick - now)
            t0 = time.monotonic()
            try:
                timing = self.call()
            except Exception as e:  # counted as a miss; the robot goes on
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
                self.latencies.append(float("inf"))
                time.sleep(self.period)
            else:
                self.latencies.append(time.monotonic() - t0)
                self.timings.append(timing)
            tick = max(tick + self.period, time.monotonic())  # one in flight: a late reply shifts the schedule
        if self.proto == "websocket":
            self.ws._ws.close()
        else:
            self.http.close()


def phase(proto: str, host: str, port: int, gateway: str, tenants: list[tuple[str, str]], a, eng,
          seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    start_at = time.monotonic() + 1.0
    robots = [Robot(i, proto, host, port, gateway, name, token, a.hz, a.deadline_ms,
                    start_at + float(rng.uniform(0, 1 / a.hz)), a.seconds) for i, (name, token) in enumerate(tenants)]
    eng.reset_stats().result(60)
    busy0, total0 = cpu_times()
    load0 = os.getloadavg()
    t0 = time.monotonic()
    for r in robots:
        r.start()
    for r in robots:
        r.join()
    wall = time.monotonic() - t0
    busy1, total1 = cpu_times()
    s = eng.engine_stats().result(60)
    lat = np.array([x for r in robots for x in r.latencies])
    ok = lat[np.isfinite(lat)]
    timings = [t for r in robots for t in r.timings]
    groups = max(1, int(s["groups"]))
    return {
        "protocol": proto, "replies": int(lat.size), "errors": sum(len(r.errors) for r in robots),
        "first_errors": [e for r in robots for e in r.errors][:3],
        "within_deadline": round(float(np.mean(lat <= a.deadline_ms / 1e3)), 4),
        "p50_ms": round(1e3 * float(np.percentile(ok, 50)), 1) if ok.size else None,
        "p99_ms": round(1e3 * float(np.percentile(ok, 99)), 1) if ok.size else None,
        "rate_hz": round(lat.size / a.seconds, 1),
        "server_timing_median_ms": {k: round(statistics.median(t.get(k, 0.0) for t in timings), 2)
                                    for k in TIMING_KEYS} if timings else None,
        "engine": {"groups": int(s["groups"]), "rows_per_group": round(int(s["requests"]) / groups, 2),
                   "busy_share": round(float(s["busy_s"]) / wall, 3),
                   "forward_ms_per_group": round(1e3 * float(s["busy_s"]) / groups, 1),
                   "fired": dict(s.get("reasons", {}))},
        "box_cpu_busy_share": round((busy1 - busy0) / max(1.0, total1 - total0), 3),
        "load_average_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--robots", type=int, default=16)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--deadline-ms", type=float, default=100.0)
    p.add_argument("--seconds", type=float, default=20.0, help="per phase")
    p.add_argument("--runs", type=int, default=3, help="WebSocket / HTTP phase pairs, alternated")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "medium"])
    p.add_argument("--set", nargs="*", default=[], help="more service settings, key.path=value")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as root, Nexus.local(root, n_sim=1, overrides=[
            f"backbone.size={a.preset}", *a.set]) as nx:
        tenants = []
        for i in range(a.robots):
            t = nx.create_tenant(TenantSpec(name=f"r{i:02d}", env=ENV, chunk=4, seed=i + 1))
            tenants.append((t.name, t.token))
        host, port = openpi_address(nx.service.config.gateway_dir).removeprefix("ws://").rsplit(":", 1)
        eng = nx.service.engine(0)
        warm = dict(vars(a), seconds=3.0)
        for proto in ("websocket", "http"):  # warm-up: every tenant's head loaded, connections made
            phase(proto, host, int(port), nx.service.gateway_url, tenants, argparse.Namespace(**warm), eng, 0)
        for run in range(a.runs):
            order = ("websocket", "http") if run % 2 == 0 else ("http", "websocket")
            for proto in order:
                r = phase(proto, host, int(port), nx.service.gateway_url, tenants, a, eng, 1 + run)
                r["run"] = run + 1
                runs.append(r)
                print(json.dumps(r), flush=True)
    summary: dict[str, Any] = {}
    for proto in ("websocket", "http"):
        mine = [r for r in runs if r["protocol"] == proto]
        summary[proto] = {k: [r[k] for r in mine] for k in ("within_deadline", "p50_ms", "p99_ms")}
        summary[proto]["median_within_deadline"] = statistics.median(summary[proto]["within_deadline"])
    print(f"\n{'run':>3} {'protocol':>9} {'within':>7} {'p50 ms':>7} {'p99 ms':>7} {'rows/grp':>8} {'eng busy':>8} "
          f"{'box cpu':>7} {'load 1m':>11}")
    for r in runs:
        print(f"{r['run']:>3} {r['protocol']:>9} {r['within_deadline']:>7.3f} {r['p50_ms']!s:>7} {r['p99_ms']!s:>7} "
              f"{r['engine']['rows_per_group']:>8} {r['engine']['busy_share']:>8} {r['box_cpu_busy_share']:>7} "
              f"{r['load_average_1m'][0]:>5}-{r['load_average_1m'][1]:<5}")
    result = {"setup": {"env": ENV, "preset": a.preset, "robots": a.robots, "hz": a.hz, "deadline_ms": a.deadline_ms,
                        "seconds_per_phase": a.seconds, "runs": a.runs, "cpus": os.cpu_count(), "set": a.set},
              "summary": summary, "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
