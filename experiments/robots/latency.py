"""One robot's call, three ways, on one service (bounded): the tenant's exported policy's ``predict_action`` in this
process (one torch thread, as the engines run), the HTTP ``predict`` and openpi-client's ``infer`` over the
WebSocket endpoint. Camera observations with fresh pixels every call (no cache answers), the three interleaved
call by call so the box's load hits them alike; medians and the ratios to the in-process call.

    python experiments/robots/latency.py --calls 40 --out experiments/robots/results_latency_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from openpi_client.websocket_client_policy import WebsocketClientPolicy

import nexus.export.policy
from nexus.client.api import Nexus
from nexus.features import Observation
from nexus.gateway.openpi import openpi_address
from nexus.spec import TenantSpec
from nexus.wire.inputs import encode_array

ENV = "maniskill/pickcube-rgb"  # one 64 px camera + 29-dim state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--chunk", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root, Nexus.local(root, n_sim=1) as nx:
        t = nx.create_tenant(TenantSpec(name="robot", env=ENV, chunk=a.chunk, seed=1))
        export = t.export(None, Path(root) / "export")
        local = nexus.export.policy.load(export["local_path"])
        host, port = openpi_address(nx.service.config.gateway_dir).removeprefix("ws://").rsplit(":", 1)
        robot = WebsocketClientPolicy(host, int(port), api_key=t.token)
        http = httpx.Client(base_url=nx.service.gateway_url, timeout=60,
                            headers={"Authorization": f"Bearer {t.token}"})
        times: dict[str, list[float]] = {"in_process": [], "http": [], "websocket": []}
        server: list[dict[str, float]] = []  # the WebSocket replies' server_timing
        for i in range(a.calls + 3):  # the first 3: warm-up, not counted
            img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            state = rng.standard_normal(29).astype(np.float32)
            t0 = time.perf_counter()
            local.predict_action(Observation(state=state, images={"base_camera": img}))
            t1 = time.perf_counter()
            r = http.post("/v1/tenants/robot/predict", json={"observation": {
                "state": encode_array(state), "images": {"base_camera": encode_array(img)}}})
            t2 = time.perf_counter()
            out = robot.infer({"observation/image": img, "observation/state": state})
            t3 = time.perf_counter()
            assert r.status_code == 200 and out["actions"].shape == (a.chunk, 4)
            if i >= 3:
                times["in_process"].append(t1 - t0)
                times["http"].append(t2 - t1)
                times["websocket"].append(t3 - t2)
                server.append(out["server_timing"])
        robot._ws.close()
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    result = {"env": ENV, "chunk": a.chunk, "calls": a.calls, "median_ms": {k: round(v, 2) for k, v in med.items()},
              "ratio_to_in_process": {k: round(med[k] / med["in_process"], 3) for k in ("http", "websocket")},
              "websocket_server_timing_median_ms": {
                  k: round(statistics.median(t.get(k, 0.0) for t in server), 2)
                  for k in ("decode_ms", "gateway_queue_ms", "to_engine_ms", "engine_queue_ms", "forward_ms",
                            "total_ms")}}
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
