"""Steps per second of every catalog env (state and camera, per simulator), as the service runs them.

Each env is built with ``nexus.sim.environment.make_env`` (catalog settings, schema check), reset,
then stepped with uniform random actions in [-1, 1] (episodes reset at their end, as a rollout does).
Env creation and the first reset are timed separately. Envs with ``num_envs > 1`` report both vector
steps/s and env-steps/s. Prints a table and writes JSON (absolute CPU figures: compare within one run).

    python experiments/env_throughput/measure.py                      # every catalog env
    python experiments/env_throughput/measure.py --envs robosuite/lift-rgb --camera-steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np


def measure(name: str, steps: int, device: str) -> dict:
    from nexus.config import catalog
    from nexus.sim.environment import make_env

    entry = catalog.env(name)
    t0 = time.perf_counter()
    env = make_env(entry, seed=0, device=device)
    make_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    low, high = env.action_bounds
    n = getattr(env, "num_envs", 1)
    resets, t, seed = 0, [0] * n, 1
    t0 = time.perf_counter()
    for _ in range(steps):
        act = rng.uniform(low, high, (n, len(low))).astype(np.float32)
        if n == 1:
            res = [env.step(act[0])]
        else:
            res = env.step(act)
        ended = {}
        for i, r in enumerate(res):
            t[i] += 1
            if r.terminated or r.truncated or t[i] >= entry.max_episode_steps:
                ended[i], t[i], seed = seed, 0, seed + 1
        if ended:
            resets += len(ended)
            if n == 1:
                env.reset(seed=ended[0])
            else:
                env.reset_some(ended)
    dt = time.perf_counter() - t0
    env.close()
    cams = ", ".join(f"{c.name} {c.height}x{c.width}" for c in entry.schema.cameras) or "-"
    return {"env": name, "simulator": entry.simulator, "task": entry.env_id, "obs_mode": entry.obs_mode,
            "cameras": cams, "control_mode": entry.control_mode, "num_envs": n, "steps": steps,
            "make_s": round(make_s, 2), "steps_per_s": round(steps / dt, 2),
            "env_steps_per_s": round(steps * n / dt, 2), "resets": resets}


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", nargs="*", default=None, help="catalog names (default: all)")
    p.add_argument("--state-steps", type=int, default=300)
    p.add_argument("--camera-steps", type=int, default=40)
    p.add_argument("--device", default="auto", help="auto (GPU simulation when CUDA is present) | cpu | cuda")
    p.add_argument("--out", type=Path, default=here / "results.json")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from nexus.config import catalog

    names = args.envs or sorted(catalog.envs())
    rows = []
    for name in names:
        entry = catalog.env(name)
        steps = args.camera_steps if entry.schema.cameras else args.state_steps
        rows.append(measure(name, steps, args.device))
        r = rows[-1]
        print(f"  measured {name}: {r['steps_per_s']:.1f} steps/s", file=sys.stderr, flush=True)
    header = (f"{'env':<30} {'sim':<9} {'obs':<5} {'cameras':<44} {'n':>2} {'make s':>7} {'steps/s':>8} "
              f"{'env-steps/s':>11}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['env']:<30} {r['simulator']:<9} {r['obs_mode']:<5} {r['cameras']:<44} {r['num_envs']:>2} "
              f"{r['make_s']:>7.1f} {r['steps_per_s']:>8.1f} {r['env_steps_per_s']:>11.1f}")
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": args.device,
            "cuda": torch.cuda.is_available(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # vector envs start processes (forkserver): keep the guard
    sys.exit(main())
