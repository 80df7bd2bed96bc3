"""One robot's round trip over the gateway's gRPC API vs its HTTP predict, same service, same tenant, same policy.

A tenant with a camera (``maniskill/pickcube-rgb``: 64x64 RGB + state) on one ``Nexus.local`` service with the
gRPC listener on; one robot alternates an ``Act`` round trip on its open stream and an HTTP ``predict`` on a
kept-alive connection, fresh random pixels every call (no cache answers), ``--calls`` of each after
``--warmup``. Reports the medians (and p10/p90) of the client-side round trip, the ratio, and the server's own
forward time from the gRPC replies; writes ``results.json`` here.

    python experiments/robot_grpc/bench.py --calls 200     # ~2 min on 2 cores (service start included)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from nexus.client.api import Nexus
from nexus.client.grpc_robot import RobotClient, grpc_target
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array

HERE = Path(__file__).resolve().parent


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"median_ms": round(float(np.median(a)), 3), "p10_ms": round(float(np.percentile(a, 10)), 3),
            "p90_ms": round(float(np.percentile(a, 90)), 3), "n": len(ms)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--env", default="maniskill/pickcube-rgb")
    p.add_argument("--out", default=str(HERE / "results.json"))
    a = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root, Nexus.local(root, n_sim=1, grpc_port=0) as nx:
        t = nx.create_tenant(TenantSpec(name="robot", env=a.env, seed=1))
        client = RobotClient(grpc_target(nx.service.config.gateway_dir), t.token)
        info = client.info("robot")
        http = httpx.Client(base_url=nx.service.gateway_url, headers={"Authorization": f"Bearer {t.token}"},
                            timeout=60)

        def obs() -> dict:
            return {"state": rng.uniform(-1, 1, info["proprio_dim"]).astype(np.float32),
                    "images": {c["name"]: rng.integers(0, 256, (c["height"], c["width"], 3), dtype=np.uint8)
                               for c in info["cameras"]}}

        g_ms, h_ms, fwd_ms = [], [], []
        with client.session("robot") as s:
            for i in range(a.warmup + a.calls):
                o = obs()
                t0 = time.perf_counter()
                out = s.act(o)
                g = 1e3 * (time.perf_counter() - t0)
                body = {"observation": {"state": encode_array(o["state"]),
                                        "images": {k: encode_array(v) for k, v in o["images"].items()}}}
                t0 = time.perf_counter()
                r = http.post("/v1/tenants/robot/predict", json=body)
                h = 1e3 * (time.perf_counter() - t0)
                r.raise_for_status()
                if i >= a.warmup:
                    g_ms.append(g)
                    h_ms.append(h)
                    fwd_ms.append(out["timing"]["forward_ms"])
        client.close()
        http.close()
    res = {"env": a.env, "cameras": info["cameras"], "grpc_act": stats(g_ms), "http_predict": stats(h_ms),
           "grpc_forward_server": stats(fwd_ms),
           "grpc_over_http": round(float(np.median(g_ms) / np.median(h_ms)), 3),
           "grpc_over_forward": round(float(np.median(g_ms) / np.median(fwd_ms)), 3),
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_1m": round(os.getloadavg()[0], 2)}}
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
