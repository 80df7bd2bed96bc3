"""A thousand tenants on one backbone: memory per tenant, decision latency, gateway latency, predict throughput.

One ``Nexus.local`` service (actor, one inference engine, one SIM worker, gateway). Tenants are created through
the gateway's HTTP API (operator token) in steps up to each count of ``--tenants``; at each step:

* memory: the actor's and the inference worker's RSS growth per tenant added past the first count (the first
  tenant pays one-off costs: the engine builds its backbone, DeepSpeed its first engine), with every slot
  resident (the growth per tenant created at this count: the earlier ones are offloaded), after one training
  step of ``--trained`` of the new tenants (their optimizer state; resident + this = an active tenant), and
  after every idle slot was offloaded to disk (``nexus_offload``; the actor's growth per tenant over the
  resident first count); each RSS read after a gc + ``malloc_trim`` in that worker (the
  trained one also before it: what glibc kept of the steps' freed buffers); next to the memory one backbone per
  tenant would take (the paper's alternative: a model per tenant);
* the plugin's decision latency per queue operation, timed inside the plugin (``status()["decisions"]``:
  reserve / put / pop / done / pump / route, p50 and p99 over the step's operations);
* gateway latency: create (each tenant of the step), status (``GET /v1/status``, the default page) and
  its size, the monitoring view's size;
* predict throughput: 64 clients, each predicting for its own tenant, for ``--predict-s`` seconds.

    python experiments/scale/bench.py                          # 1, 64, 256, 1024 tenants; ~25 min on 2 cores
    python experiments/scale/bench.py --tenants 1 64 --predict-s 5   # a quick look
    python experiments/scale/real_shapes.py                     # real-shape backbones counted on the meta device
    python experiments/scale/bench.py slot-memory               # one actor slot's memory by component
                                                                # (slot_memory.py, in one process; its own --help)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ENV = "maniskill/pushcube-state"
MIB = 2**20


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def rss(nx, resource: str, trim: bool = True) -> float:
    """RSS (MiB) of the worker process holding ``resource``; ``trim``: after a garbage collection and glibc's
    ``malloc_trim`` there (``nexus.actor.slots.release_memory``), so that what the process holds is measured,
    not the freed pages of transient buffers glibc keeps in its arenas until it is asked."""
    import psutil

    from nexus.actor.slots import release_memory

    pids = nx.service.client.run(os.getpid)
    workers = nx.service.client.scheduler_info()["workers"]
    addr = next(a for a, w in workers.items() if resource in w["resources"])
    if trim:
        nx.service.client.run(release_memory, workers=[addr])
    return psutil.Process(pids[addr]).memory_info().rss / MIB


def backbone_mib(cfg) -> float:
    """Memory of one backbone's weights (what a model per tenant would cost each tenant)."""
    import torch

    from nexus.model.backbone import SharedBackbone

    torch.set_num_threads(1)
    bb = SharedBackbone(cfg.backbone)
    return sum(p.numel() * p.element_size() for p in bb.model.parameters()) / MIB


def observation() -> dict:
    import numpy as np

    from nexus.wire.inputs import encode_array

    return {"state": encode_array(np.linspace(-1, 1, 35).astype(np.float32))}


async def predict_load(url: str, tokens: dict[str, str], names: list[str], seconds: float) -> dict[str, float]:
    """``len(names)`` clients in one asyncio loop, each predicting for its own tenant as fast as answered."""
    import httpx

    lat: list[float] = []
    errors = rejected = 0  # rejected: 429s past a tenant's predict budget (back-pressure, not failures)
    stop = time.monotonic() + seconds
    body = {"observation": observation()}

    async def client(http, name: str) -> None:
        nonlocal errors, rejected
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            r = await http.post(f"/v1/tenants/{name}/predict", json=body,
                                headers={"Authorization": f"Bearer {tokens[name]}"})
            if r.status_code == 200:
                lat.append(time.perf_counter() - t0)
            elif r.status_code == 429:
                rejected += 1
                await asyncio.sleep(float(r.json().get("retry_after_s", 0.05)))  # the gateway's finer hint
            else:
                errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=len(names))) as http:
        t0 = time.monotonic()
        await asyncio.gather(*(client(http, n) for n in names))
        wall = time.monotonic() - t0
    return {"clients": len(names), "predict_per_s": len(lat) / wall, "p50_ms": 1e3 * pct(lat, 0.5),
            "p99_ms": 1e3 * pct(lat, 0.99), "errors": errors, "rejected_429": rejected}


def train_one_step(nx, names: list[str]) -> None:
    """One low-level SFT step on each of ``names`` (their optimizer state now exists)."""
    import numpy as np

    from nexus.features import Observation

    rng = np.random.default_rng(0)
    batch = {"observations": [Observation(state=rng.standard_normal(35).astype(np.float32)) for _ in range(8)],
             "actions": rng.uniform(-1, 1, (8, 4)).astype(np.float32)}
    for n in names:
        t = nx.tenant(n)
        t.forward_backward(batch).result(600)
        t.optim_step().result(600)
        t.save_weights().result(600)


def step(nx, http, op: dict, tokens: dict, target: int, args) -> dict:
    from nexus.spec import TenantSpec

    creates = []
    start = rss(nx, "ACTOR")  # every earlier tenant offloaded but the one restored at the end of the last step
    before = len(tokens)
    for i in range(len(tokens), target):
        spec = TenantSpec(name=f"s{i:04d}", env=ENV, seed=i % 500, hidden_dim=args.hidden_dim).model_dump()
        t0 = time.perf_counter()
        r = http.post("/v1/tenants", json=spec, headers=op)
        creates.append(time.perf_counter() - t0)
        r.raise_for_status()
        tokens[spec["name"]] = r.json()["token"]
    names = sorted(tokens)
    row: dict = {"tenants": target, "create_p50_ms": 1e3 * pct(creates, 0.5), "create_p99_ms": 1e3 * pct(creates, 0.99),
                 "create_max_ms": 1e3 * max(creates) if creates else float("nan")}
    time.sleep(2)
    row["actor_rss_start_mib"], row["created"] = start, target - before
    row["actor_rss_resident_mib"], row["infer_rss_mib"] = rss(nx, "ACTOR"), rss(nx, "INFER")
    trained = sorted(tokens)[before:][-args.trained:]  # tenants created in this step: resident, never stepped
    train_one_step(nx, trained)
    row["actor_rss_trained_untrimmed_mib"] = rss(nx, "ACTOR", trim=False)  # + the steps' freed buffers glibc kept
    row["actor_rss_trained_mib"] = rss(nx, "ACTOR")
    row["trained"] = len(trained)
    row["decisions"] = nx.service.internal("nexus_status", limit=1)["decisions"]
    lat, size = [], 0
    for _ in range(args.status_calls):
        t0 = time.perf_counter()
        r = http.get("/v1/status", headers=op)
        lat.append(time.perf_counter() - t0)
        size = len(r.content)
    row |= {"status_p50_ms": 1e3 * pct(lat, 0.5), "status_p99_ms": 1e3 * pct(lat, 0.99), "status_kib": size / 1024,
            "monitoring_kib": len(http.get("/v1/admin/monitoring", headers=op).content) / 1024}
    clients = names[:args.clients] if len(names) >= args.clients else (names * args.clients)[:args.clients]
    row["predict"] = asyncio.run(predict_load(nx.service.gateway_url, tokens, clients, args.predict_s))
    off = nx.service.internal("nexus_offload", idle_s=0.0)
    time.sleep(2)
    row["offloaded"] = off["offloaded"]
    row["actor_rss_offloaded_mib"] = rss(nx, "ACTOR")
    t0 = time.perf_counter()
    train_one_step(nx, names[:1])  # its slot comes back from disk
    row["restore_and_step_s"] = time.perf_counter() - t0
    return row


def main() -> None:
    if sys.argv[1:2] == ["slot-memory"]:  # the component microbenchmark (helper module slot_memory.py)
        sys.path.insert(0, str(HERE))
        import slot_memory

        sys.argv = [str(HERE / "slot_memory.py"), *sys.argv[2:]]  # its variants rerun that file in fresh processes
        slot_memory.main()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="bench.py slot-memory [--help]: one actor slot's memory by component")
    ap.add_argument("--tenants", type=int, nargs="+", default=[1, 64, 256, 1024])
    ap.add_argument("--hidden-dim", type=int, default=256, help="every tenant's head width (the default spec's)")
    ap.add_argument("--trained", type=int, default=16, help="tenants given one optimizer step at each count")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--predict-s", type=float, default=15.0)
    ap.add_argument("--status-calls", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    import httpx

    from nexus.client.api import Nexus

    backbone = {"device": args.device, **({"dtype": "bfloat16"} if args.device == "cuda" else {})}
    root = Path(tempfile.mkdtemp(prefix="nexus-scale-")) / "service"
    t_all = time.time()
    with Nexus.local(root, n_sim=1, backbone=backbone, offload_idle_s=0.0,
                     limits={"max_tenants": max(args.tenants), "max_queued_ops": 64}) as nx:
        cfg = nx.service.config
        base = {"actor_rss_mib": rss(nx, "ACTOR"), "infer_rss_mib": rss(nx, "INFER"),
                "backbone_mib": backbone_mib(cfg)}
        print(f"no tenant: actor {base['actor_rss_mib']:.0f} MiB, inference {base['infer_rss_mib']:.0f} MiB; "
              f"one backbone's weights {base['backbone_mib']:.1f} MiB", flush=True)
        op = {"Authorization": f"Bearer {nx.service.operator_token}"}
        tokens: dict[str, str] = {}
        rows = []
        with httpx.Client(base_url=nx.service.gateway_url, timeout=600) as http:
            first: dict | None = None
            for n in sorted(args.tenants):
                row = step(nx, http, op, tokens, n, args)
                first = first or row  # the first tenant pays one-off costs (the engine's backbone, DeepSpeed's
                # first engine): its count gives no per-tenant memory
                # a tenant's first step adds its optimizer state: the growth per trained tenant
                extra = row["actor_rss_trained_mib"] - row["actor_rss_resident_mib"]
                row["actor_trained_extra_per_tenant_mib"] = extra / max(row["trained"], 1)
                row["actor_trained_extra_per_tenant_untrimmed_mib"] = (
                    row["actor_rss_trained_untrimmed_mib"] - row["actor_rss_resident_mib"]) / max(row["trained"], 1)
                for k, b in (("actor_rss_offloaded_mib", "actor_rss_resident_mib"), ("infer_rss_mib", "infer_rss_mib")):
                    added = n - first["tenants"]
                    row[k.replace("_mib", "_per_tenant_mib")] = (row[k] - first[b]) / added if added else float("nan")
                # resident: the growth per tenant created in this step (the earlier ones are offloaded)
                row["actor_rss_resident_per_tenant_mib"] = float("nan") if row is first else (
                    (row["actor_rss_resident_mib"] - row["actor_rss_start_mib"]) / row["created"])
                # an active tenant: its slot resident and its optimizer state there (after a step)
                row["actor_active_per_tenant_mib"] = (row["actor_rss_resident_per_tenant_mib"]
                                                      + row["actor_trained_extra_per_tenant_mib"])
                row["backbone_per_tenant_mib"] = base["backbone_mib"] * n
                rows.append(row)
                d = row["decisions"]
                print(f"{n:5d} tenants  actor/tenant resident {row['actor_rss_resident_per_tenant_mib']:.2f} MiB, "
                      f"active {row['actor_active_per_tenant_mib']:.2f} MiB, after offload "
                      f"{row['actor_rss_offloaded_per_tenant_mib']:.2f} MiB; inference/tenant "
                      f"{row['infer_rss_per_tenant_mib']:.2f} MiB; decision p99 "
                      f"{max((v['p99_us'] for v in d.values()), default=0):.0f} us; status p50 "
                      f"{row['status_p50_ms']:.0f} ms {row['status_kib']:.0f} KiB; predict "
                      f"{row['predict']['predict_per_s']:.0f}/s  ({time.time() - t_all:.0f} s)", flush=True)
    print(f"\n{'tenants':>8s} {'actor MiB/t':>12s} {'trained':>8s} {'active':>7s} {'offloaded':>10s} "
          f"{'infer MiB/t':>12s} "
          f"{'backbones MiB':>14s} {'pop p99 us':>11s} {'pump p99 us':>12s} {'route p99 us':>13s} "
          f"{'create p50/p99 ms':>18s} {'status p50/p99 ms':>18s} {'status KiB':>11s} {'predict/s':>10s}")
    for r in rows:
        d = r["decisions"]

        def p99(op: str, d=d) -> str:
            return f"{d[op]['p99_us']:.0f}" if op in d else "-"

        print(f"{r['tenants']:8d} {r['actor_rss_resident_per_tenant_mib']:12.2f} "
              f"{r['actor_trained_extra_per_tenant_mib']:8.2f} {r['actor_active_per_tenant_mib']:7.2f} "
              f"{r['actor_rss_offloaded_per_tenant_mib']:10.2f} "
              f"{r['infer_rss_per_tenant_mib']:12.2f} {r['backbone_per_tenant_mib']:14.1f} {p99('pop'):>11s} "
              f"{p99('pump'):>12s} {p99('route'):>13s} {r['create_p50_ms']:8.0f}/{r['create_p99_ms']:<9.0f} "
              f"{r['status_p50_ms']:8.0f}/{r['status_p99_ms']:<9.0f} {r['status_kib']:11.1f} "
              f"{r['predict']['predict_per_s']:10.0f}")
    kept = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    Path(args.out).write_text(json.dumps({
        **{k: v for k, v in kept.items() if k == "real_shapes"},  # real_shapes.py's section
        "meta": {**vars(args), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "command": "python experiments/scale/bench.py " + " ".join(sys.argv[1:]),
                 "wall_s": time.time() - t_all}, "base": base, "rows": rows,
        "decision_p99_us_max": max(max((v["p99_us"] for v in r["decisions"].values()), default=0) for r in rows),
        "median_status_ms": statistics.median(r["status_p50_ms"] for r in rows)}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
