"""Serving at QoS: a bounded load harness on loopback against one ``Nexus.local`` service (actor, one
inference engine, two SIM workers, the gateway), through the gateway's HTTP API only.

Phases (each bounded in time and in requests):

* ``predict``: C closed-loop clients (1 / 16 / 64 / 256) spread over T tenants (1 client: 1 tenant,
  otherwise 16), each sending its next predict when the last is answered: predict/s, p50/p95/p99/max,
  errors by status; each answer's ``Server-Timing`` hops (mean and p50 per hop: the latency breakdown); the CPU
  time of each of the service's processes (and the load generator's) per answered predict.
* ``noisy``: open loop: 15 quiet tenants at ``--quiet-rate`` predicts/s each, alone, then with a 16th tenant
  at 10x that rate, in ``--noisy-rounds`` alternating pairs of windows (alone, with, alone, with, ...): each
  window's quiet p50/p99, the median of each case's p99s and their ratio, the noisy tenant's answers and 429s.
* ``ops``: 16 tenants at once, each looping ``forward_backward`` (8 rows) + ``optim_step``: ops/s, p50/p99.
* ``sim``: tenant B's short RL job (2 updates) alone; then tenant A's two 500-episode evaluations, and B's
  same job again while they run (bounded by ``--sim-wait-s``); then A's cancel, timed per call.

The load generator is an asyncio loop with a minimal HTTP/1.1 keep-alive client (one connection per client;
its cost per request is a fraction of httpx's, so the generator takes less of the 2 shared cores).

``--baseline DIR`` measures another checkout of the project (its ``nexus`` package, also in its service's
processes) side by side: both services run at once (each in a child process), and every phase runs on the
baseline, then at once on this checkout, so both see the same load from the rest of the machine:

    git worktree add /tmp/qos-base <commit>        # the code to compare with
    python experiments/qos/bench.py --baseline /tmp/qos-base --out /tmp/qos-ab.json
    python experiments/qos/bench.py --phases predict --clients 1 64 --seconds 5   # a quick look

Writes JSON (``--out``, default ``results.json`` next to this file) and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV = "maniskill/pushcube-state"
HOPS = ("http", "auth", "check", "gateway_queue", "to_engine", "engine_queue", "forward", "reply")


# -- statistics ----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


def ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def summary(lat: list[float]) -> dict[str, float | None]:
    return {"p50_ms": ms(pct(lat, 0.5)), "p95_ms": ms(pct(lat, 0.95)), "p99_ms": ms(pct(lat, 0.99)),
            "max_ms": ms(max(lat) if lat else None)}


def parse_server_timing(value: str) -> dict[str, float]:
    out = {}
    for part in value.split(","):
        name, _, rest = part.strip().partition(";")
        for p in rest.split(";"):
            k, _, v = p.strip().partition("=")
            if k == "dur" and name:
                out[name] = float(v) / 1e3
    return out


# -- a minimal HTTP/1.1 client (keep-alive, Content-Length answers) ---------------------------------
class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                      timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
        reused = self.writer is not None
        try:
            return await self._request(method, path, body, headers, timeout)
        except (ConnectionError, asyncio.IncompleteReadError, IndexError):
            if not reused:
                raise
        # the server closed the idle connection (uvicorn's keep-alive ends after 5 s): once on a new one
        return await self._request(method, path, body, headers, timeout)

    async def _request(self, method: str, path: str, body: bytes, headers: dict[str, str] | None,
                       timeout: float) -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}", f"Content-Length: {len(body)}",
                "Content-Type: application/json", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        try:
            return await asyncio.wait_for(self._answer(), timeout)
        except BaseException:
            self.close()
            raise

    async def _answer(self) -> tuple[int, dict[str, str], bytes]:
        status = int((await self.reader.readline()).split()[1])
        hdrs = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            hdrs[k.strip().lower()] = v.strip()
        body = await self.reader.readexactly(int(hdrs.get("content-length", 0)))
        if hdrs.get("connection", "").lower() == "close":
            self.close()
        return status, hdrs, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Load:
    """Results of one load phase: latencies of answered predicts, statuses, Server-Timing hops."""

    def __init__(self) -> None:
        self.lat: dict[str, list[float]] = {}
        self.status: dict[int, int] = {}
        self.errors = 0  # transport errors (no HTTP answer)
        self.hops: list[dict[str, float]] = []

    def record(self, tenant: str, t0: float, status: int, hdrs: dict[str, str]) -> None:
        self.status[status] = self.status.get(status, 0) + 1
        if status == 200:
            self.lat.setdefault(tenant, []).append(time.perf_counter() - t0)
            if "server-timing" in hdrs:
                self.hops.append(parse_server_timing(hdrs["server-timing"]))

    def all_lat(self, tenants: list[str] | None = None) -> list[float]:
        return [x for t, xs in self.lat.items() if tenants is None or t in tenants for x in xs]

    def breakdown(self, client_lat: list[float]) -> dict[str, dict[str, float | None]]:
        """Mean and p50 per hop; ``client`` = what the client measured minus the server's total."""
        out: dict[str, dict[str, float | None]] = {}
        if not self.hops:
            return out
        for k in (*HOPS, "total"):
            xs = [h.get(k, 0.0) for h in self.hops]
            out[k] = {"mean_ms": ms(sum(xs) / len(xs)), "p50_ms": ms(pct(xs, 0.5))}
        mean_client = sum(client_lat) / len(client_lat)
        out["client"] = {"mean_ms": ms(mean_client - sum(h.get("total", 0.0) for h in self.hops) / len(self.hops)),
                         "p50_ms": None}
        return out


# -- phases ------------------------------------------------------------------------------------------
def predict_body() -> bytes:
    import base64

    import numpy as np

    state = np.linspace(-1, 1, 35).astype(np.float32)
    return json.dumps({"observation": {"state": {"dtype": "float32", "shape": [35],
                                                 "b64": base64.b64encode(state.tobytes()).decode()}}}).encode()


async def closed_loop(host: str, port: int, tokens: dict[str, str], tenants: list[str], clients: int,
                      seconds: float, max_per_client: int = 100_000) -> dict:
    body, load = predict_body(), Load()
    stop = time.monotonic() + seconds

    async def client(i: int) -> None:
        tenant = tenants[i % len(tenants)]
        conn, hdr, n, refused = Conn(host, port), {"Authorization": f"Bearer {tokens[tenant]}"}, 0, 0
        path = f"/v1/tenants/{tenant}/predict"
        rng = random.Random(i)
        while time.monotonic() < stop and n < max_per_client:
            n += 1
            t0 = time.perf_counter()
            try:
                status, h, data = await conn.request("POST", path, body, hdr)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                load.errors += 1
                continue
            load.record(tenant, t0, status, h)
            if status == 429:  # told to back off: as the Python client does (exponential, jittered, from the hint)
                hint = float(json.loads(data or b"{}").get("retry_after_s", 0.1))
                await asyncio.sleep(min(2.0, hint * 2 ** refused) * rng.uniform(0.5, 1.0))
                refused += 1
            else:
                refused = 0
        conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.monotonic() - t0
    lat = load.all_lat()
    return {"clients": clients, "tenants": min(clients, len(tenants)), "seconds": round(wall, 2),
            "predict_per_s": round(len(lat) / wall, 1), **summary(lat), "answered": len(lat),
            "status": {str(k): v for k, v in sorted(load.status.items())}, "transport_errors": load.errors,
            "errors_5xx": sum(v for k, v in load.status.items() if k >= 500),
            "breakdown": load.breakdown(lat) if lat else {}}


async def open_loop(host: str, port: int, tokens: dict[str, str], rates: dict[str, float], seconds: float,
                    max_open: int = 64) -> Load:
    """Each tenant sends predicts at its rate (Poisson arrivals) whatever the answers; at most ``max_open``
    of a tenant's predicts open at once (beyond: counted as status 0, never sent)."""
    body, load = predict_body(), Load()
    rng = random.Random(0)
    stop = time.monotonic() + seconds

    async def one(tenant: str, free: list[Conn]) -> None:
        conn = free.pop() if free else Conn(host, port)
        t0 = time.perf_counter()
        try:
            status, h, _ = await conn.request("POST", f"/v1/tenants/{tenant}/predict", body,
                                              {"Authorization": f"Bearer {tokens[tenant]}"})
            load.record(tenant, t0, status, h)
            free.append(conn)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            load.errors += 1

    async def tenant_loop(tenant: str, rate: float) -> None:
        free: list[Conn] = []
        running: set[asyncio.Task] = set()
        t_next = time.monotonic()
        while time.monotonic() < stop:
            t_next += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, t_next - time.monotonic()))
            if len(running) >= max_open:
                load.status[0] = load.status.get(0, 0) + 1
                continue
            task = asyncio.get_running_loop().create_task(one(tenant, free))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.wait(running)
        for c in free:
            c.close()

    await asyncio.gather(*(tenant_loop(t, r) for t, r in rates.items()))
    return load


def quiet_round(load: Load, quiet: list[str], loud: str | None, engine: dict | None) -> dict:
    """One window's (or the pooled windows') quiet latencies; the noisy tenant's answers when it ran."""
    q = load.all_lat(quiet)
    out = {"quiet_answered": len(q), **{f"quiet_{k}": v for k, v in summary(q).items()},
           "status": {str(k): v for k, v in sorted(load.status.items())}, "transport_errors": load.errors,
           "engine": engine}
    if loud is not None:
        n = load.all_lat([loud])
        out.update(noisy_answered=len(n), noisy_p50_ms=ms(pct(n, 0.5)), noisy_p99_ms=ms(pct(n, 0.99)))
    return out


def median(xs: list[float]) -> float | None:
    s = sorted(x for x in xs if x is not None)
    if not s:
        return None
    m = len(s) // 2
    return s[m] if len(s) % 2 else round((s[m - 1] + s[m]) / 2, 2)


async def noisy(host: str, port: int, tokens: dict[str, str], tenants: list[str], rate: float,
                seconds: float, rounds: int = 1, engine=lambda start: None) -> dict:
    """Open loop: 15 quiet tenants at ``rate``, in ``rounds`` alternating pairs of windows of ``seconds``
    (alone, then with a 16th tenant at 10x; alone, with, ...), so both cases see the same moments of the shared
    box. ``quiet_p99_increase``: the median of the "with" windows' quiet p99 over the median of the "alone"
    ones, minus 1 (with ``rounds=1``: one window each); every window is listed
    (``rounds``), with the pooled percentiles of all windows of a case (``alone``, ``with_noisy``) and each
    pair's own increase."""
    quiet, loud = tenants[:15], tenants[15]
    out: dict = {"quiet_tenants": len(quiet), "quiet_rate_per_s": rate, "noisy_rate_per_s": 10 * rate,
                 "rounds": [], "round_seconds": seconds}
    pooled: dict[str, Load] = {"alone": Load(), "with_noisy": Load()}
    for i in range(rounds):
        for case, rates in (("alone", dict.fromkeys(quiet, rate)),
                            ("with_noisy", {**dict.fromkeys(quiet, rate), loud: 10 * rate})):
            await asyncio.to_thread(engine, True)
            load = await open_loop(host, port, tokens, rates, seconds)
            out["rounds"].append({"round": i, "case": case,
                                  **quiet_round(load, quiet, loud if case == "with_noisy" else None,
                                                await asyncio.to_thread(engine, False))})
            acc = pooled[case]
            for t, xs in load.lat.items():
                acc.lat.setdefault(t, []).extend(xs)
            for k, v in load.status.items():
                acc.status[k] = acc.status.get(k, 0) + v
            acc.errors += load.errors
            acc.hops += load.hops
    for case, load in pooled.items():
        out[case] = quiet_round(load, quiet, loud if case == "with_noisy" else None, None)
        out[case].pop("engine")
        out[case]["breakdown"] = load.breakdown(load.all_lat()) if load.all_lat() else {}
        out[case]["quiet_p99_ms_median_of_rounds"] = median(
            [r["quiet_p99_ms"] for r in out["rounds"] if r["case"] == case])
    a, b = out["alone"]["quiet_p99_ms_median_of_rounds"], out["with_noisy"]["quiet_p99_ms_median_of_rounds"]
    out["quiet_p99_increase"] = round(b / a - 1, 3) if a and b else None
    pa, pb = out["alone"]["quiet_p99_ms"], out["with_noisy"]["quiet_p99_ms"]
    out["quiet_p99_increase_pooled"] = round(pb / pa - 1, 3) if pa and pb else None
    p99s = [r["quiet_p99_ms"] for r in out["rounds"]]
    pairs = zip(p99s[::2], p99s[1::2], strict=True)
    out["quiet_p99_increase_per_round"] = [round(y / x - 1, 3) if x and y else None for x, y in pairs]
    return out


async def ops(host: str, port: int, tokens: dict[str, str], tenants: list[str], seconds: float) -> dict:
    import base64

    import numpy as np

    rng = np.random.default_rng(0)

    def arr(x):
        x = np.ascontiguousarray(x, np.float32)
        return {"dtype": "float32", "shape": list(x.shape), "b64": base64.b64encode(x.tobytes()).decode()}

    body = json.dumps({"batch": {"observations": [{"state": arr(rng.standard_normal(35))} for _ in range(8)],
                                 "actions": arr(rng.uniform(-1, 1, (8, 4)))}, "loss": "sft"}).encode()
    lat: dict[str, list[float]] = {"forward_backward": [], "optim_step": []}
    status: dict[int, int] = {}
    stop = time.monotonic() + seconds

    async def tenant_loop(tenant: str) -> None:
        conn, hdr = Conn(host, port), {"Authorization": f"Bearer {tokens[tenant]}"}
        while time.monotonic() < stop:
            for verb, b in (("forward_backward", body), ("optim_step", b"")):
                t0 = time.perf_counter()
                st, _, _ = await conn.request("POST", f"/v1/tenants/{tenant}/{verb}", b, hdr, timeout=600)
                status[st] = status.get(st, 0) + 1
                if st == 200:
                    lat[verb].append(time.perf_counter() - t0)
        conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(tenant_loop(t) for t in tenants))
    wall = time.monotonic() - t0
    return {"tenants": len(tenants), "seconds": round(wall, 1),
            "steps_per_s": round(len(lat["optim_step"]) / wall, 2),
            **{verb: {"n": len(xs), **summary(xs)} for verb, xs in lat.items()},
            "status": {str(k): v for k, v in sorted(status.items())}}


def sim_fairness(http, tokens: dict[str, str], wait_s: float) -> dict:
    """B's 2-update RL job alone, then while A's two 500-episode evaluations run; A's cancels timed."""
    def call(method: str, path: str, who: str, **kw):
        r = http.request(method, path, headers={"Authorization": f"Bearer {tokens[who]}"}, **kw)
        r.raise_for_status()
        return r.json()

    def run_b(limit: float) -> float | None:
        job = call("POST", "/v1/tenants/simb/jobs", "simb", json={"kind": "rl", "updates": 2})["job"]
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            view = call("GET", f"/v1/jobs/{job}/result", "simb", params={"timeout": 5})
            if view["state"] in ("done", "failed", "cancelled"):
                return round(time.monotonic() - t0, 2) if view["state"] == "done" else None
        call("POST", f"/v1/jobs/{job}/cancel", "simb")
        return None

    out: dict = {"b_alone_s": run_b(wait_s)}
    evals = [call("POST", "/v1/tenants/sima/jobs", "sima", json={"kind": "eval", "episodes": 500})["job"]
             for _ in range(2)]
    time.sleep(3.0)  # A's evaluations hold the simulators
    out["b_with_a_evals_s"] = run_b(wait_s)
    out["b_wait_limit_s"] = wait_s
    progress = [call("GET", f"/v1/jobs/{j}", "sima")["progress"] for j in evals]
    out["a_cancel_s"] = []
    for j in evals:
        t0 = time.monotonic()
        view = call("POST", f"/v1/jobs/{j}/cancel", "sima")
        out["a_cancel_s"].append(round(time.monotonic() - t0, 3))
        out.setdefault("a_state_after_cancel", []).append(view["state"])
    out["a_progress_at_cancel"] = progress
    b, a = out["b_alone_s"], out["b_with_a_evals_s"]
    out["b_slowdown"] = round(a / b, 2) if a and b else None
    return out


def engine_phase(eng, start: bool) -> dict | None:
    """The engine's counters of a phase: reset at its start; at its end its groups, rows, busy time."""
    if start:
        eng.reset_stats().result(60)
        return None
    s = eng.engine_stats().result(60)
    rows, groups = int(s["requests"]), max(1, int(s["groups"]))
    return {"groups": s["groups"], "rows": rows, "busy_s": round(s["busy_s"], 2),
            "rows_per_group": round(rows / groups, 1),
            "busy_ms_per_row": round(1e3 * s["busy_s"] / rows, 2) if rows else None,
            "prefix_cache": s.get("prefix_cache"),  # (none before this cache existed)
            "gc": s.get("gc")}  # the engine worker's collections in the phase (none on code without it)


def gateway_gc(http, token: str) -> dict | None:
    """The gateway's collections and fair-share refusals so far (``GET /v1/admin/qos``; None on code without it)."""
    r = http.get("/v1/admin/qos", headers={"Authorization": f"Bearer {token}"})
    view = r.json() if r.status_code == 200 else {}
    return {**view["gc"], "shed": view.get("shed", 0)} if "gc" in view else None


def gc_delta(before: dict | None, after: dict | None) -> dict | None:
    """Collections per generation over a phase: how many and their total ms (max_ms: since start-up); the
    predicts refused for being over a fair share (``shed``)."""
    if not before or not after:
        return None
    return {"shed": after["shed"] - before["shed"],
            "count": [b - a for a, b in zip(before["count"], after["count"], strict=True)],
            "total_ms": [round(b - a, 2) for a, b in zip(before["total_ms"], after["total_ms"], strict=True)],
            "max_ms_since_start": after["max_ms"], "frozen": after["frozen"], "threshold": after["threshold"]}


def cpu_now(service) -> dict[str, float]:
    """CPU seconds so far of the service's processes by name, and of this process (the load generator)."""
    return {**service.cpu_seconds(), "generator": time.process_time()}


def cpu_per_predict(before: dict[str, float], after: dict[str, float], answered: int) -> dict[str, float]:
    """CPU ms per answered predict of each process kind over a phase (where the 2 cores went)."""
    spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out = {k: round(1e3 * v / max(1, answered), 3) for k, v in sorted(spent.items()) if v > 0.005}
    out["all"] = round(1e3 * sum(spent.values()) / max(1, answered), 3)
    return out


# -- the service (a child process per checkout: its own nexus package, also in its service's processes) --
def serve(args) -> None:
    """Start the service, create the tenants, then run the phases the parent asks for (one JSON line each on
    stdin, one ``RESULT`` line each on stdout) until ``quit``."""
    import httpx

    from nexus.client.api import Nexus
    from nexus.spec import TenantSpec

    tmp = tempfile.TemporaryDirectory(prefix="nexus-qos-")  # the bench's service: nothing in it is kept
    root = Path(tmp.name) / "service"
    names = [f"t{i:02d}" for i in range(16)]
    with tmp, Nexus.local(root, n_sim=2, dashboard_address="127.0.0.1:0", overrides=args.set) as nx:
        url = nx.service.gateway_url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        tokens = {}
        with httpx.Client(base_url=url, timeout=600) as http:
            for i, n in enumerate(names + ["sima", "simb"]):
                r = http.post("/v1/tenants", json=TenantSpec(name=n, env=ENV, seed=i + 1).model_dump())
                r.raise_for_status()
                tokens[n] = r.json()["token"]
            asyncio.run(closed_loop(host, int(port), tokens, names, 16, 2.0))  # warm every tenant's path
            eng = nx.service.engine(0)
            print("READY", flush=True)
            for line in sys.stdin:
                ask = json.loads(line)
                if ask["phase"] == "quit":
                    break
                if ask["phase"] == "predict":
                    c = ask["clients"]
                    engine_phase(eng, True)
                    gc0 = gateway_gc(http, nx.service.operator_token)
                    cpu0 = cpu_now(nx.service)
                    res = asyncio.run(closed_loop(host, int(port), tokens, names[:1] if c == 1 else names, c,
                                                  args.seconds))
                    res["cpu_ms_per_predict"] = cpu_per_predict(cpu0, cpu_now(nx.service), res["answered"])
                    res["engine"] = engine_phase(eng, False)
                    res["gateway_gc"] = gc_delta(gc0, gateway_gc(http, nx.service.operator_token))
                elif ask["phase"] == "noisy":
                    res = asyncio.run(noisy(host, int(port), tokens, names, args.quiet_rate, args.noisy_seconds,
                                            args.noisy_rounds, lambda start: engine_phase(eng, start)))
                elif ask["phase"] == "ops":
                    res = asyncio.run(ops(host, int(port), tokens, names, args.seconds))
                else:
                    res = sim_fairness(http, tokens, args.sim_wait_s)
                print("RESULT " + json.dumps(res), flush=True)


class Child:
    """One checkout's service, driven phase by phase."""

    def __init__(self, label: str, code: str, argv: list[str]) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": code}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--code", code],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read("READY")

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"{self.label}: the child ended (exit {self.proc.wait()})")

    def ask(self, phase: dict) -> dict:
        self.proc.stdin.write(json.dumps(phase) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read("RESULT "))

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"phase": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=300)
        except Exception:
            self.proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", nargs="+", default=["predict", "noisy", "ops", "sim"],
                   choices=["predict", "noisy", "ops", "sim"])
    p.add_argument("--clients", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--seconds", type=float, default=10.0, help="per load phase")
    p.add_argument("--quiet-rate", type=float, default=8.0, help="predicts/s of each quiet tenant (noisy: 10x)")
    p.add_argument("--noisy-rounds", type=int, default=6, help="noisy: alternating pairs of windows (alone, with "
                   "the 10x tenant), each --noisy-seconds; 1 with 10 s: rounds 1-2's single pair")
    p.add_argument("--noisy-seconds", type=float, default=8.0, help="noisy: seconds per window")
    p.add_argument("--sim-wait-s", type=float, default=120.0, help="longest wait for B's RL job")
    p.add_argument("--code", default=None, help="(internal) serve this checkout's service to the parent")
    p.add_argument("--baseline", default=None, help="a checkout of the code before: each phase runs on it, then "
                                                    "on this checkout, one after the other (both services up)")
    p.add_argument("--new-first", action="store_true", help="each phase on this checkout first, then the baseline "
                   "(what one service leaves running after a phase, e.g. tracking writes, lands on the other)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="settings of this checkout's service "
                   "(as `nexus up --set`, e.g. gc.freeze=false)")
    p.add_argument("--baseline-set", nargs="*", default=[], metavar="KEY=VALUE", help="settings of the baseline's "
                   "service (with --baseline . : the same code under other settings)")
    p.add_argument("--out", default=str(HERE / "results.json"), help="JSON results")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.code is not None:
        serve(args)
        return
    argv = ["--seconds", str(args.seconds), "--quiet-rate", str(args.quiet_rate), "--sim-wait-s", str(args.sim_wait_s),
            "--noisy-rounds", str(args.noisy_rounds), "--noisy-seconds", str(args.noisy_seconds)]
    order = (("baseline", args.baseline), ("new", str(REPO)))
    sets = {"baseline": args.baseline_set, "new": args.set}
    children = [Child(label, code, argv + ["--set", *sets[label]])
                for label, code in (order[::-1] if args.new_first else order) if code is not None]
    asks = [{"phase": "predict", "clients": c} for c in args.clients] if "predict" in args.phases else []
    asks += [{"phase": ph} for ph in ("noisy", "ops", "sim") if ph in args.phases]
    runs: dict[str, dict] = {c.label: {"code": args.baseline if c.label == "baseline" else str(REPO),
                                       "set": sets[c.label]} for c in children}
    try:
        for ask in asks:
            for c in children:  # side by side: the same phase on each checkout, back to back
                res = c.ask(ask)
                key = ask["phase"]
                if key == "predict":
                    runs[c.label].setdefault("predict", []).append(res)
                    print(f"  {c.label:>8} predict {res['clients']:>3} clients: {res['predict_per_s']:>7}/s "
                          f"p50 {res['p50_ms']} p99 {res['p99_ms']} status {res['status']}", flush=True)
                elif key == "noisy":
                    runs[c.label][key] = res
                    print(f"  {c.label:>8} noisy: quiet p99 per window {[r['quiet_p99_ms'] for r in res['rounds']]}; "
                          f"medians {res['alone']['quiet_p99_ms_median_of_rounds']} -> "
                          f"{res['with_noisy']['quiet_p99_ms_median_of_rounds']} ms "
                          f"({res['quiet_p99_increase']}), noisy status {res['with_noisy']['status']}", flush=True)
                else:
                    runs[c.label][key] = res
                    print(f"  {c.label:>8} {key}: {json.dumps(res)[:400]}", flush=True)
    finally:
        for c in children:
            c.close()
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "load_avg_at_end": os.getloadavg(), "note": "2 shared cores; other work ran meanwhile"},
           "args": {k: v for k, v in vars(args).items() if k != "code"}, "runs": runs,
           "t": time.strftime("%Y-%m-%d %H:%M:%S")}
    print_tables(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def print_tables(out: dict) -> None:
    for label, r in out["runs"].items():
        print(f"\n### {label}")
        if "predict" in r:
            print("| clients (tenants) | predict/s | p50 ms | p95 ms | p99 ms | max ms | 429 | 5xx + transport |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for x in r["predict"]:
                print(f"| {x['clients']} ({x['tenants']}) | {x['predict_per_s']} | {x['p50_ms']} | {x['p95_ms']} | "
                      f"{x['p99_ms']} | {x['max_ms']} | {x['status'].get('429', 0)} | "
                      f"{x['errors_5xx'] + x['transport_errors']} |")
            rows = [x for x in r["predict"] if x.get("breakdown")]
            if rows:
                print("\n| hop (mean ms) | " + " | ".join(f"{x['clients']} clients" for x in rows) + " |")
                print("|---|" + "---:|" * len(rows))
                for k in (*HOPS, "total", "client"):
                    print(f"| {k} | " + " | ".join(str(x["breakdown"].get(k, {}).get("mean_ms")) for x in rows) + " |")
                kinds = sorted({k for x in rows for k in x.get("cpu_ms_per_predict", {})} - {"all"}) + ["all"]
                print("\n| CPU ms per predict | " + " | ".join(f"{x['clients']} clients" for x in rows) + " |")
                print("|---|" + "---:|" * len(rows))
                for k in kinds:
                    print(f"| {k} | " + " | ".join(str(x.get("cpu_ms_per_predict", {}).get(k)) for x in rows) + " |")
        for key in ("noisy", "ops", "sim"):
            if key in r:
                print(f"\n{key}: {json.dumps(r[key])}")


if __name__ == "__main__":
    main()
