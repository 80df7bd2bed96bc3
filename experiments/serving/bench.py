"""Serving as a VLA serves: camera observations with fresh pixels, through the gateway's HTTP API, against the
same exported policy in one process (one torch thread, as the engines have).

One ``Nexus.local`` service per checkout (a child process each), backbone preset ``small`` (``--preset
medium``), 16 tenants on ``maniskill/pickcube-rgb`` (64 px camera + 29-float state), version-0 heads (no
training: the comparison is the same policy on both sides). Observations: ``--record`` steps of the real
ManiSkill env (random actions, recorded once into ``--obs``); every request gets fresh pixels (a per-request
counter written into 8 pixels of the camera image, plus the pool index), so no prefix cache answers; the engine's
prefix-cache hits are reported. A held-out probe (an observation outside the pool) checks that the gateway and the
in-process policy answer the same action.

Phases, alternated in each child (both sides see the same moments of the shared machine):

* ``single``: one client, blocks of ``--block`` predicts through the gateway, then as many ``predict_action`` calls
  in process, alternated until ``--single`` of each: p50 of each and their ratio (the service's overhead).
* ``group``: 16 tenants x ``--clients-per-tenant`` closed-loop clients through the gateway for ``--seconds``
  (predicts/s, p50/p99, errors, Server-Timing hops, the engine's groups and prefix cache, CPU per predict of the
  service's processes and of the load generator), then the in-process policy for ``--seconds`` on batches of the
  engine's group size (``predict_actions``; the bound batching sets on this hardware), then one at a time; the ratio
  gateway / in-process batched.
* ``image``: the CPU of each step of the image path, one observation at a time (client body, gateway parse and
  check, payload to the engine, the engine's check, preprocessing, the whole ``predict_action``).
* ``cached``: the cached state-only case, named as such: 16 tenants on ``maniskill/pushcube-state``, one fixed
  35-float observation (the engine's prefix cache answers the backbone), 1 client and 16 x 4 clients.

``--runs`` repeats the phases (median of the runs' ratios; each run printed). The results file has a section per
preset (a run of one preset replaces its own section only; ``--section`` names another). ``--baseline DIR`` runs
every phase on another checkout too, back to back with this one (before/after):

    python experiments/serving/bench.py --runs 3                      # small; writes results.json
    python experiments/serving/bench.py --runs 3 --preset medium --out /tmp/medium.json
    python experiments/serving/bench.py --baseline /tmp/serving-base --runs 1 --out /tmp/ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV, STATE_ENV = "maniskill/pickcube-rgb", "maniskill/pushcube-state"
CAMERA = "base_camera"


def _qos():
    """experiments/qos/bench.py's load generator and statistics (a file, not a package)."""
    spec = importlib.util.spec_from_file_location("qos_bench", HERE.parent / "qos" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


qos = _qos()
Conn, Load, pct, ms, summary = qos.Conn, qos.Load, qos.pct, qos.ms, qos.summary


# -- observations -----------------------------------------------------------------------------------------------
def record(path: Path, steps: int) -> None:
    """``steps`` observations of the real env (random actions, 50-step episodes), saved once."""
    import numpy as np

    from nexus.config import catalog
    from nexus.sim.vector import make_single

    env = make_single(catalog.env(ENV))
    rng = np.random.default_rng(0)
    states, images = [], []
    ep = 0
    while len(states) < steps:
        o = env.reset(seed=ep)
        for _ in range(50):
            states.append(o.state.copy())
            images.append(o.images[CAMERA].copy())
            o = env.step(rng.uniform(-1, 1, 4).astype(np.float32)).obs
        ep += 1
    env.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, state=np.stack(states[:steps]), image=np.stack(images[:steps]))


class Observations:
    """The recorded pool (all but the last: the held-out probe), each request's pixels fresh."""

    def __init__(self, path: str, instruction: str) -> None:
        import numpy as np

        d = np.load(path)
        self.state, self.image = d["state"][:-1], d["image"][:-1]
        self.probe = {"state": d["state"][-1], "images": {CAMERA: d["image"][-1]}, "instruction": instruction}
        self.instruction, self.i = instruction, 0

    def fresh(self) -> dict:
        """The next pool observation with this request's counter in its first 8 pixel bytes (never seen before)."""
        import numpy as np

        self.i += 1
        k = self.i % len(self.state)
        img = self.image[k].copy()
        img.reshape(-1)[:8] = np.frombuffer(np.int64(self.i).tobytes(), np.uint8)
        return {"state": self.state[k], "images": {CAMERA: img}, "instruction": self.instruction}

    @staticmethod
    def body(obs: dict) -> bytes:
        def enc(a) -> dict:
            return {"dtype": a.dtype.name, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}

        return json.dumps({"observation": {"state": enc(obs["state"]),
                                           "images": {c: enc(v) for c, v in obs["images"].items()},
                                           "instruction": obs["instruction"]}}).encode()


# -- phases (in a child: its service and the in-process policy) -----------------------------------------------------
def cpu_now(service) -> dict[str, float]:
    return {**service.cpu_seconds(), "generator": time.process_time()}


def single(host, port, token, tenant, policy, obs: Observations, n: int, block: int, service) -> dict:
    """Alternated blocks: ``block`` gateway predicts of one client, then ``block`` in-process ``predict_action``.
    CPU: the service's processes and the load generator over the gateway blocks, this thread's over the in-process
    calls (per predict: what a lone predict costs, whatever the machine's load does to the wall times)."""
    gw, local = [], []
    hops = Load()
    conn, hdr, path = Conn(host, port), {"Authorization": f"Bearer {token}"}, f"/v1/tenants/{tenant}/predict"
    loop = asyncio.new_event_loop()
    errors, cpu_gw, cpu_local = 0, {}, 0.0
    try:
        while len(gw) < n:
            c0 = cpu_now(service)
            for _ in range(block):
                body = obs.body(obs.fresh())
                t0 = time.perf_counter()
                status, h, _ = loop.run_until_complete(conn.request("POST", path, body, hdr))
                if status != 200:
                    errors += 1
                    continue
                gw.append(time.perf_counter() - t0)
                hops.record(tenant, t0, status, h)
            c1 = cpu_now(service)
            for k in c1:
                cpu_gw[k] = cpu_gw.get(k, 0.0) + c1[k] - c0.get(k, 0.0)
            for _ in range(block):
                o = obs.fresh()
                c = time.thread_time()
                t0 = time.perf_counter()
                policy.predict_action(o)
                local.append(time.perf_counter() - t0)
                cpu_local += time.thread_time() - c
    finally:
        conn.close()
        loop.close()
    g, p = pct(gw, 0.5), pct(local, 0.5)
    cpu = qos.cpu_per_predict({}, cpu_gw, len(gw))
    cpu_in = round(1e3 * cpu_local / max(1, len(local)), 3)
    return {"n": len(gw), "errors": errors, "gateway": summary(gw), "in_process": summary(local),
            "ratio_p50": round(g / p, 3), "breakdown": hops.breakdown(gw),
            "cpu_ms_per_predict": cpu, "in_process_cpu_ms_per_predict": cpu_in,
            "cpu_ratio": round(cpu["all"] / cpu_in, 3) if cpu_in else None}


def in_process(policy, obs: Observations, batch: int, seconds: float) -> dict:
    """``predict_actions`` on batches of ``batch`` fresh observations for ``seconds``: observations per second."""
    rows, lat, cpu = 0, [], 0.0
    t_end = time.perf_counter() + seconds
    t_start = time.perf_counter()
    while time.perf_counter() < t_end:
        os_ = [obs.fresh() for _ in range(batch)]
        c = time.thread_time()
        t0 = time.perf_counter()
        if batch == 1:
            policy.predict_action(os_[0])
        else:
            policy.predict_actions(os_)
        lat.append(time.perf_counter() - t0)
        cpu += time.thread_time() - c
        rows += batch
    wall = time.perf_counter() - t_start
    return {"batch": batch, "per_s": round(rows / wall, 1), "call_p50_ms": ms(pct(lat, 0.5)), "calls": len(lat),
            "cpu_ms_per_row": round(1e3 * cpu / max(1, rows), 3)}


def image_path(policy, obs: Observations, schema, n: int = 300) -> dict:
    """CPU ms (this thread) of each step an image predict's observation takes on its way, one observation at a
    time: the client's JSON body, the gateway's parse and check, the pickled payload to the engine and back, the
    engine's own check, the preprocessing (resize, normalization) and the whole in-process ``predict_action``."""
    from nexus.engine.request_check import check_request
    from nexus.gateway.state import PredictBody
    from nexus.wire.engine_client import pack, unpack
    from nexus.wire.inputs import check_observation

    o = obs.fresh()
    raw = obs.body(o)
    body = PredictBody.model_validate_json(raw)
    checked = check_observation(body.observation, schema)
    payload = pack({"args": [[[policy.tenant, checked, None, True, "r", None, 1]]], "kwargs": {}})
    steps = {"client_body_json_b64": lambda: obs.body(obs.fresh()),
             "gateway_parse_body": lambda: PredictBody.model_validate_json(raw),
             "gateway_check_observation": lambda: check_observation(body.observation, schema),
             "to_engine_pack": lambda: pack({"args": [[[policy.tenant, checked, None, True, "r", None, 1]]],
                                             "kwargs": {}}),
             "engine_unpack": lambda: unpack(payload),
             "engine_check_request": lambda: check_request(checked, schema, policy.tenant),
             "preprocess": lambda: policy.framework.preprocess(policy.tenant, checked),
             "predict_action": lambda: policy.predict_action(o)}
    out: dict = {"body_bytes": len(raw)}
    for name, fn in steps.items():
        k = n if name != "predict_action" else max(1, n // 10)
        fn()
        c = time.thread_time()
        for _ in range(k):
            fn()
        out[name] = round(1e3 * (time.thread_time() - c) / k, 4)
    return out


async def closed_loop(host, port, tokens: dict[str, str], tenants: list[str], clients: int, seconds: float,
                      make_body, timeout: float = 600.0) -> dict:
    load = Load()
    stop = time.monotonic() + seconds

    async def client(i: int) -> None:
        tenant = tenants[i % len(tenants)]
        conn, hdr = Conn(host, port), {"Authorization": f"Bearer {tokens[tenant]}"}
        path = f"/v1/tenants/{tenant}/predict"
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            try:
                status, h, _ = await conn.request("POST", path, make_body(), hdr, timeout)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                load.errors += 1
                continue
            load.record(tenant, t0, status, h)
            if status == 429:
                await asyncio.sleep(0.05)
        conn.close()

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.monotonic() - t0
    lat = load.all_lat()
    return {"clients": clients, "tenants": min(clients, len(tenants)), "seconds": round(wall, 2),
            "predict_per_s": round(len(lat) / wall, 1), **summary(lat), "answered": len(lat),
            "status": {str(k): v for k, v in sorted(load.status.items())}, "transport_errors": load.errors,
            "errors": load.errors + sum(v for k, v in load.status.items() if k != 200),
            "breakdown": load.breakdown(lat) if lat else {}}


def gateway_load(nx, eng, host, port, tokens, tenants, clients, seconds, make_body) -> dict:
    qos.engine_phase(eng, True)
    cpu0 = cpu_now(nx.service)
    res = asyncio.run(closed_loop(host, port, tokens, tenants, clients, seconds, make_body))
    res["cpu_ms_per_predict"] = qos.cpu_per_predict(cpu0, cpu_now(nx.service), res["answered"])
    res["engine"] = qos.engine_phase(eng, False)
    return res


def serve(args) -> None:
    """Start the service, create the tenants, export and load t00's policy, then run the phases the parent asks
    for (one JSON line each on stdin, one ``RESULT`` line each on stdout) until ``quit``."""
    import httpx
    import numpy as np
    import torch

    from nexus.client.api import Nexus
    from nexus.config import catalog
    from nexus.config.service import ServiceConfig
    from nexus.export import policy as exported

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory(prefix="nexus-serving-")
    root = Path(tmp.name) / "service"
    names = [f"t{i:02d}" for i in range(16)]
    sets = [f"backbone.size={args.preset}", *args.set]
    with tmp, Nexus.local(root, n_sim=1, dashboard_address="127.0.0.1:0", overrides=sets) as nx:
        url = nx.service.gateway_url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        port = int(port)
        group = ServiceConfig(root=str(root)).infer_max_batch if args.group is None else args.group
        tokens: dict[str, str] = {}
        obs = Observations(args.obs, catalog.env(ENV).schema.instruction)
        with httpx.Client(base_url=url, timeout=600) as http:
            def create(names_: list[str], env: str) -> None:
                for i, n in enumerate(names_):
                    r = http.post("/v1/tenants", json={"name": n, "env": env, "seed": i + 1})
                    r.raise_for_status()
                    tokens[n] = r.json()["token"]

            create(names, ENV)
            r = http.post(f"/v1/tenants/{names[0]}/export", json={},
                          headers={"Authorization": f"Bearer {tokens[names[0]]}"})
            r.raise_for_status()
            exports = sorted((root / "tenants" / names[0] / "exports").glob("v*"))
            policy = exported.load(exports[-1])
            asyncio.run(closed_loop(host, port, tokens, names, 16, 3.0, lambda: obs.body(obs.fresh())))  # warm
            for _ in range(3):
                policy.predict_actions([obs.fresh() for _ in range(group)])
            eng = nx.service.engine(0)
            # the held-out probe: the same action from the gateway and from the exported policy
            r = http.post(f"/v1/tenants/{names[0]}/predict", content=obs.body(obs.probe),
                          headers={"Authorization": f"Bearer {tokens[names[0]]}",
                                   "Content-Type": "application/json"})
            r.raise_for_status()
            a_gw = np.asarray(r.json()["action"], np.float32)
            a_local = np.asarray(policy.predict_action(obs.probe)["action"], np.float32)
            probe = {"gateway_action": a_gw.round(5).tolist(), "in_process_action": a_local.round(5).tolist(),
                     "max_abs_diff": float(np.abs(a_gw - a_local).max())}
            print("READY " + json.dumps({"group": group, "probe": probe, "export": exports[-1].name}), flush=True)
            for line in sys.stdin:
                ask = json.loads(line)
                if ask["phase"] == "quit":
                    break
                if ask["phase"] == "single":
                    qos.engine_phase(eng, True)
                    res = single(host, port, tokens[names[0]], names[0], policy, obs, args.single, args.block,
                                 nx.service)
                    res["engine"] = qos.engine_phase(eng, False)
                elif ask["phase"] == "group":
                    res = {"gateway": gateway_load(nx, eng, host, port, tokens, names, 16 * args.clients_per_tenant,
                                                   args.seconds, lambda: obs.body(obs.fresh())),
                           "in_process_batched": in_process(policy, obs, group, args.seconds),
                           "in_process_one": in_process(policy, obs, 1, args.seconds)}
                    res["ratio_batched"] = round(res["gateway"]["predict_per_s"]
                                                 / res["in_process_batched"]["per_s"], 3)
                    formed = round(res["gateway"]["engine"]["rows_per_group"])
                    if formed > group:  # the gateway gathers up to qos.gather_max_requests into one group
                        res["in_process_formed"] = in_process(policy, obs, formed, args.seconds)
                        res["ratio_formed"] = round(res["gateway"]["predict_per_s"]
                                                    / res["in_process_formed"]["per_s"], 3)
                    res["ratio_one"] = round(res["gateway"]["predict_per_s"] / res["in_process_one"]["per_s"], 3)
                elif ask["phase"] == "image":
                    res = image_path(policy, obs, catalog.env(ENV).schema)
                else:  # cached, state-only
                    state_names = [f"s{i:02d}" for i in range(16)]
                    if state_names[0] not in tokens:
                        create(state_names, STATE_ENV)
                    fixed = qos.predict_body()
                    res = {"case": "cached state-only (pushcube-state, one fixed observation)"}
                    for c in (1, 16 * args.clients_per_tenant):
                        res[f"clients_{c}"] = gateway_load(nx, eng, host, port, tokens, state_names, c,
                                                           args.seconds, lambda body=fixed: body)
                print("RESULT " + json.dumps(res), flush=True)


class Child:
    """One checkout's service, driven phase by phase."""

    def __init__(self, label: str, code: str, argv: list[str]) -> None:
        self.label = label
        env = {**os.environ, "PYTHONPATH": code}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--code", code],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = json.loads(self._read("READY "))

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


def show(label: str, phase: str, res: dict) -> None:
    if phase == "single":
        print(f"  {label:>8} single: gateway p50 {res['gateway']['p50_ms']} ms, in-process p50 "
              f"{res['in_process']['p50_ms']} ms, ratio {res['ratio_p50']} (n={res['n']}, errors {res['errors']}, "
              f"cache hits {res['engine']['prefix_cache']['hits']}); CPU ms/predict {res['cpu_ms_per_predict']} vs "
              f"in-process {res['in_process_cpu_ms_per_predict']}", flush=True)
    elif phase == "group":
        g = res["gateway"]
        print(f"  {label:>8} group: gateway {g['predict_per_s']}/s p50 {g['p50_ms']} p99 {g['p99_ms']} errors "
              f"{g['errors']} rows/group {g['engine']['rows_per_group']}; in-process batched "
              f"{res['in_process_batched']['per_s']}/s, one {res['in_process_one']['per_s']}/s; ratio "
              f"{res['ratio_batched']} (formed-size bound: {res.get('in_process_formed', {}).get('per_s')}/s, ratio "
              f"{res.get('ratio_formed')}; cache hits {g['engine']['prefix_cache']['hits']}); CPU ms/predict "
              f"{g['cpu_ms_per_predict']} vs in-process batched {res['in_process_batched']['cpu_ms_per_row']}",
              flush=True)
    elif phase == "image":
        print(f"  {label:>8} image path, CPU ms per observation: {json.dumps(res)}", flush=True)
    else:
        print(f"  {label:>8} cached: " + ", ".join(f"{k}: {v['predict_per_s']}/s p50 {v['p50_ms']}" for k, v in
                                                   res.items() if k.startswith("clients")), flush=True)


def medians(runs: list[dict]) -> dict:
    out: dict = {}
    single_ = [r["single"] for r in runs if "single" in r]
    group = [r["group"] for r in runs if "group" in r]
    if single_:
        out["single"] = {"gateway_p50_ms": statistics.median(r["gateway"]["p50_ms"] for r in single_),
                         "in_process_p50_ms": statistics.median(r["in_process"]["p50_ms"] for r in single_),
                         "ratio_p50": statistics.median(r["ratio_p50"] for r in single_),
                         "each_run_ratio": [r["ratio_p50"] for r in single_]}
    if group:
        out["group"] = {"gateway_per_s": statistics.median(r["gateway"]["predict_per_s"] for r in group),
                        "gateway_p50_ms": statistics.median(r["gateway"]["p50_ms"] for r in group),
                        "gateway_p99_ms": statistics.median(r["gateway"]["p99_ms"] for r in group),
                        "errors": sum(r["gateway"]["errors"] for r in group),
                        "in_process_batched_per_s": statistics.median(r["in_process_batched"]["per_s"] for r in group),
                        "in_process_one_per_s": statistics.median(r["in_process_one"]["per_s"] for r in group),
                        "ratio_batched": statistics.median(r["ratio_batched"] for r in group),
                        "each_run_ratio": [r["ratio_batched"] for r in group]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=["small", "medium"], help="backbone size")
    p.add_argument("--phases", nargs="+", default=["single", "group", "cached", "image"],
                   choices=["single", "group", "cached", "image"])
    p.add_argument("--runs", type=int, default=3, help="repeats of the phases (cached: once)")
    p.add_argument("--single", type=int, default=200, help="single: predicts of each side")
    p.add_argument("--block", type=int, default=10, help="single: predicts per side before switching")
    p.add_argument("--seconds", type=float, default=15.0, help="group / cached: seconds per load phase")
    p.add_argument("--clients-per-tenant", type=int, default=4)
    p.add_argument("--group", type=int, default=None, help="in-process batch (default: infer_max_batch)")
    p.add_argument("--obs", default=str(Path(tempfile.gettempdir()) / "nexus-serving-obs.npz"),
                   help="recorded observations (recorded here when missing)")
    p.add_argument("--record", type=int, default=200, help="observations to record (the last is the probe)")
    p.add_argument("--baseline", default=None, help="another checkout: every phase on it too, back to back")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="settings of this checkout's service")
    p.add_argument("--baseline-set", nargs="*", default=[], metavar="KEY=VALUE", help="the baseline's settings")
    p.add_argument("--code", default=None, help="(internal) serve this checkout's service to the parent")
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument("--section", default=None, help="the results file's section to write (default: the preset)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.code is not None:
        serve(args)
        return
    if not Path(args.obs).exists():
        t0 = time.monotonic()
        record(Path(args.obs), args.record)
        print(f"recorded {args.record} observations of {ENV} in {time.monotonic() - t0:.0f} s", flush=True)
    argv = ["--preset", args.preset, "--single", str(args.single), "--block", str(args.block),
            "--seconds", str(args.seconds), "--clients-per-tenant", str(args.clients_per_tenant), "--obs", args.obs,
            *(["--group", str(args.group)] if args.group else [])]
    sets = {"baseline": args.baseline_set, "new": args.set}
    codes = {"baseline": args.baseline, "new": str(REPO)}
    children = [Child(label, code, argv + ["--set", *sets[label]]) for label, code in codes.items() if code]
    runs: dict[str, dict] = {c.label: {"code": codes[c.label], "set": sets[c.label], **c.ready, "runs": []}
                             for c in children}
    load_avg = []
    try:
        for i in range(args.runs):
            for c in children:
                runs[c.label]["runs"].append({})
            for phase in [ph for ph in ("single", "group") if ph in args.phases]:
                for c in children:
                    res = c.ask({"phase": phase})
                    runs[c.label]["runs"][i][phase] = res
                    show(f"{c.label}#{i}", phase, res)
            load_avg.append(os.getloadavg())
        for phase in [ph for ph in ("cached", "image") if ph in args.phases]:
            for c in children:
                runs[c.label][phase] = res = c.ask({"phase": phase})
                show(c.label, phase, res)
    finally:
        for c in children:
            c.close()
    for r in runs.values():
        r["median"] = medians(r["runs"])
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_per_run": load_avg,
                       "note": "2 shared cores; other work ran meanwhile: side-by-side ratios are what count"},
           "args": {k: v for k, v in vars(args).items() if k != "code"}, "results": runs,
           "t": time.strftime("%Y-%m-%d %H:%M:%S")}
    for label, r in runs.items():
        print(f"\n### {label} ({args.preset}) medians of {args.runs} runs: {json.dumps(r['median'])}")
        print(f"probe: {json.dumps(r['probe'])}")
    if args.out:  # one file, a section per preset: a run of one preset keeps the other's
        path = Path(args.out)
        whole = json.loads(path.read_text()) if path.exists() else {}
        whole = whole if isinstance(whole, dict) and "results" not in whole else {}
        whole[args.section or args.preset] = out
        path.write_text(json.dumps(whole, indent=1))


if __name__ == "__main__":
    main()
