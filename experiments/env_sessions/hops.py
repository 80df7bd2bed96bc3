"""Where a vector step of an environment session spends its time, hop by hop (the few-envs case of issue 22).

One local service (``Nexus.local(n_sim=1)``), one session of N envs of ``--env``; per round, ``--steps`` vector
steps with zero actions, each way:

- **client**: ``ServiceVectorEnv.step`` as a user calls it (HTTP to the gateway, gateway -> simulator worker);
- **direct**: the same step sent from this process's Dask client straight to the simulator worker
  (``nexus.sim_client.call_sim``): no HTTP, no gateway;
- **session**: the simulator seconds the worker metered to the session over each of those loops (its
  ``SessionTable.call``: the envs' steps, autoresets and observation stacking, without messaging);
- **back-to-back**: N envs of the same catalog entry (``EnvPool`` lockstep, as a session has) stepped in a loop
  inside the simulator worker's process (``Client.run``), and in this process, with and without a pause of
  ``--pause-ms`` between steps (the idle time a request/response service has between two steps).

Prints a table (ms per vector step, median over rounds) and writes JSON.

    PYTHONPATH=$PWD .venv/bin/python experiments/env_sessions/hops.py --envs 4 --rounds 3   # ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def lockstep_loop(env: str, n: int, steps: int, pause_s: float = 0.0) -> float:
    """Seconds per vector step of N lockstep envs of ``env`` built here, stepped back to back (``pause_s``
    slept between steps, not timed); an autoreset every 40 steps like a session's episodes."""
    import numpy as np

    from nexus import catalog
    from nexus.services.sim_host import EnvPool

    entry = catalog.env(env)
    (group,) = EnvPool().checkout(entry, [n], "lockstep")
    actions = np.zeros((n, entry.schema.action_dim), np.float32)
    group.reset_some({i: i for i in range(n)})
    busy = 0.0
    for k in range(steps):
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter()
        group.step(actions)
        if k % 40 == 39:
            group.reset_some({i: None for i in range(n)})
        busy += time.perf_counter() - t0
    group.close()
    return busy / steps


def session_busy(dask_worker, session: str) -> float | None:
    """The simulator seconds a session has been metered so far on this worker (None: not here)."""
    from nexus.services.worker_plugin import PLUGIN_NAME

    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    s = plugin.sim.sessions.sessions.get(session) if plugin is not None else None
    return None if s is None else s.busy_s + s.busy_total_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="maniskill/pushcube-state")
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--steps", type=int, default=200, help="vector steps per loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pause-ms", type=float, default=4.0, help="the pause between back-to-back steps' paused variant")
    p.add_argument("--out", default=str(HERE / "hops.json"))
    args = p.parse_args()

    import numpy as np
    import torch

    from nexus.client.api import Nexus
    from nexus.sim_client import call_sim
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    n = args.envs
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="nexus-envhops-") as root, Nexus.local(root, n_sim=1) as nx:
        tenant = nx.create_tenant(TenantSpec(name="hops", env=args.env))
        venv = tenant.vector_env(args.env, num_envs=n, seed=0)
        sid = venv.session.id
        (row,) = nx.service.client.sync(nx.service.client.scheduler.nexus_env_sessions, tenant="hops", session=sid)
        sim = row["address"]
        actions = np.zeros((n, venv.single_action_space.shape[0]), np.float32)

        def metered() -> float:
            return nx.service.client.run(session_busy, session=sid, workers=[sim])[sim]

        async def direct_loop() -> float:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                await call_sim(nx.service.client, sim, "step", plain=True, session=sid, tenant="hops",
                               actions=actions.tobytes(), shape=list(actions.shape))
            return (time.perf_counter() - t0) / args.steps

        try:
            for r in range(args.rounds):
                out: dict = {"round": r}
                venv.reset()
                b0, t0 = metered(), time.perf_counter()
                for _ in range(args.steps):
                    venv.step(actions)
                out["client"] = (time.perf_counter() - t0) / args.steps
                b1 = metered()
                out["client_session"] = (b1 - b0) / args.steps
                out["direct"] = nx.service.client.sync(direct_loop)
                out["direct_session"] = (metered() - b1) / args.steps
                out["worker_back_to_back"] = nx.service.client.run(lockstep_loop, args.env, n, args.steps,
                                                           workers=[sim])[sim]
                out["here_back_to_back"] = lockstep_loop(args.env, n, args.steps)
                out["here_paused"] = lockstep_loop(args.env, n, args.steps, args.pause_ms / 1000)
                rows.append(out)
                print(f"round {r}: " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in out.items() if k != "round"),
                      flush=True)
        finally:
            venv.close()

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    labels = [("client", "a step as the client sees it (HTTP -> gateway -> simulator worker)"),
              ("client_session", "  of which the session's own call on the worker (metered)"),
              ("direct", "a step sent straight to the worker over Dask (no HTTP, no gateway)"),
              ("direct_session", "  of which the session's own call on the worker (metered)"),
              ("worker_back_to_back", "the same envs stepped back to back in the worker's process"),
              ("here_back_to_back", "the same envs stepped back to back in this process"),
              ("here_paused", f"in this process, {args.pause_ms:g} ms slept between steps (not timed)")]
    print(f"\n| {n} envs of {args.env}, ms per vector step (median of {args.rounds}) | ms |\n|---|---:|")
    for k, label in labels:
        print(f"| {label} | {1e3 * med[k]:.2f} |")
    doc = {"settings": vars(args), "rows": rows, "median_s": med, "load_average": os.getloadavg(),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "time": time.time()}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
