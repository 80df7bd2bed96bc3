"""Stable-Baselines3 PPO on the service's simulators vs the same env in-process: env-steps/s, side by side.

Both sides run SB3's PPO (``MultiInputPolicy``, the same settings and seed) on N envs of the same catalog env
(default ``maniskill/pushcube-state``, state observations):

- in-process: ``DummyVecEnv`` of N catalog envs in this process (``nexus.simulators.vector.gym_env``: the
  ManiSkill env as a ``gymnasium.Env`` with the catalog's time limit);
- service: ``SB3VecEnv(ServiceVectorEnv(tenant, env, N))`` — one environment session of N envs on a simulator
  worker of a local service (``Nexus.local``), every vector step one HTTP call to the gateway, which forwards
  it to the simulator worker, where it runs on the worker's session thread;
- service_inline: the same for a tenant whose ``limits.env_session_inline_s`` is ``--inline-s``: a call whose
  previous call took less runs on the worker's event loop (two thread hand-offs fewer per step).

Each measurement is ``model.learn(total_timesteps)`` (collection and PPO's updates: what a user waits for),
its envs built before the clock starts. Rounds interleave the two sides (the order alternates); the figure is
the median over rounds of service / in-process env-steps/s (target >= 0.8). Also the raw vector-step time
of each side without SB3 (``--raw-steps``).

    python experiments/env_sessions/bench.py                        # ~5 min on 2 loaded cores
    python experiments/env_sessions/bench.py --envs 4,8,16 --rounds 3
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


def ppo(env, args):
    from stable_baselines3 import PPO
    from stable_baselines3.common.logger import Logger

    model = PPO("MultiInputPolicy", env, n_steps=args.n_steps, batch_size=args.batch_size, n_epochs=args.epochs,
                seed=args.seed, device="cpu", verbose=0)
    model.set_logger(Logger(None, []))  # SB3's default makes a folder in /tmp per learn()
    return model


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) of these processes and all their descendants (Dask nannies' workers)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def learn_rate(env, args, service_pids: list[int]) -> tuple[float, float]:
    """env-steps/s of ``model.learn`` on ``env`` (model built before the clock starts), and the CPU seconds per
    env step of this process plus the service's processes."""
    model = ppo(env, args)
    c0, t0 = time.process_time() + tree_cpu(service_pids), time.perf_counter()
    model.learn(total_timesteps=args.timesteps)
    wall, cpu = time.perf_counter() - t0, time.process_time() + tree_cpu(service_pids) - c0
    return model.num_timesteps / wall, cpu / model.num_timesteps


def raw_rate(step, n: int, steps: int) -> float:
    """env-steps/s of bare vector steps with zero actions (no learner)."""
    import numpy as np

    actions = np.zeros((n, 4), np.float32)
    step(actions)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(actions)
    return n * steps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="maniskill/pushcube-state")
    p.add_argument("--envs", default="8", help="comma-separated numbers of envs (one comparison each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timesteps", type=int, default=2048, help="env steps per measurement")
    p.add_argument("--n-steps", type=int, default=64, help="PPO n_steps per env")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--raw-steps", type=int, default=50, help="bare vector steps per raw measurement (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inline-s", type=float, default=0.05, help="env_session_inline_s of the service_inline side")
    p.add_argument("--out", default=str(HERE / "results.json"))
    args = p.parse_args()

    import torch
    from stable_baselines3.common.vec_env import DummyVecEnv

    from nexus import catalog
    from nexus.client.api import Nexus
    from nexus.client.sb3 import SB3VecEnv
    from nexus.simulators.vector import gym_env
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    entry = catalog.env(args.env)
    sizes = [int(x) for x in args.envs.split(",")]
    rows: list[dict] = []
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="nexus-envbench-") as root, \
            Nexus.local(root, n_sim=1, limits={"max_envs_per_session": max(sizes)},
                        tenant_limits={"sb3-inline": {"env_session_inline_s": args.inline_s}}) as nx:
        tenant = nx.create_tenant(TenantSpec(name="sb3", env=args.env))
        tenant_inline = nx.create_tenant(TenantSpec(name="sb3-inline", env=args.env))
        service_pids = list(nx.service.names)  # scheduler, gateway, workers (their nannies' trees)
        for n in sizes:
            local = DummyVecEnv([lambda: gym_env(entry) for _ in range(n)])
            remote = SB3VecEnv(tenant.vector_env(args.env, num_envs=n, seed=args.seed))
            inline = SB3VecEnv(tenant_inline.vector_env(args.env, num_envs=n, seed=args.seed))
            try:
                for r in range(args.rounds):
                    order = [("in_process", local), ("service", remote), ("service_inline", inline)]
                    order = order[r % 3:] + order[:r % 3]  # each side first once in 3 rounds
                    row: dict = {"envs": n, "round": r}
                    for side, env in order:
                        row[side], row[f"{side}_cpu_ms_per_step"] = learn_rate(env, args, service_pids)
                        row[f"{side}_cpu_ms_per_step"] *= 1000
                    # what the ratio would be where nothing else competes for the cores: CPU per step, both sides
                    row["cpu_ratio"] = row["in_process_cpu_ms_per_step"] / row["service_cpu_ms_per_step"]
                    row["cpu_ratio_inline"] = (row["in_process_cpu_ms_per_step"]
                                               / row["service_inline_cpu_ms_per_step"])
                    if args.raw_steps:
                        for _, env in order:
                            env.reset()
                        for side, env in order:
                            row[f"{side}_raw"] = raw_rate(lambda a, env=env: env.step(a), n, args.raw_steps)
                    row["ratio"] = row["service"] / row["in_process"]
                    row["ratio_inline"] = row["service_inline"] / row["in_process"]
                    rows.append(row)
                    load.append(os.getloadavg())
                    print(f"envs {n} round {r}: in-process {row['in_process']:.1f}, service {row['service']:.1f}, "
                          f"inline {row['service_inline']:.1f} env-steps/s -> {row['ratio']:.2f}x, "
                          f"{row['ratio_inline']:.2f}x", flush=True)
            finally:
                local.close()
                remote.close()
                inline.close()
        metered = {t: nx.status(tenant=t)["tenants"][0].get("metered_s", {}).get("simulator")
                   for t in ("sb3", "sb3-inline")}

    summary = []
    for n in sizes:
        mine = [r for r in rows if r["envs"] == n]
        s = {"envs": n, "rounds": len(mine)}
        for k in ("in_process", "service", "service_inline", "ratio", "ratio_inline", "in_process_raw",
                  "service_raw", "service_inline_raw", "in_process_cpu_ms_per_step", "service_cpu_ms_per_step",
                  "service_inline_cpu_ms_per_step", "cpu_ratio", "cpu_ratio_inline"):
            vals = [r[k] for r in mine if k in r]
            if vals:
                s[k] = statistics.median(vals)
                s[f"{k}_range"] = [min(vals), max(vals)]
        summary.append(s)
    print()
    print("| envs | env-steps/s: in-process / service / service inline | service / in-process (median, range) "
          "| inline / in-process | raw vector steps: in-process / service / inline | CPU ms per env step, all "
          "processes: in-process / service / inline | CPU ratio: service / inline |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s in summary:
        raw = (f"{s['in_process_raw']:.0f} / {s['service_raw']:.0f} / {s['service_inline_raw']:.0f}"
               if "service_raw" in s else "-")
        print(f"| {s['envs']} | {s['in_process']:.1f} / {s['service']:.1f} / {s['service_inline']:.1f} | "
              f"**{s['ratio']:.2f}x** ({s['ratio_range'][0]:.2f}-{s['ratio_range'][1]:.2f}) | "
              f"**{s['ratio_inline']:.2f}x** ({s['ratio_inline_range'][0]:.2f}-{s['ratio_inline_range'][1]:.2f}) | "
              f"{raw} | {s['in_process_cpu_ms_per_step']:.2f} / {s['service_cpu_ms_per_step']:.2f} / "
              f"{s['service_inline_cpu_ms_per_step']:.2f} | {s['cpu_ratio']:.2f}x / {s['cpu_ratio_inline']:.2f}x |")
    out = {"env": args.env, "settings": vars(args), "rows": rows, "summary": summary,
           "metered_simulator_s": metered, "load_average": load,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "time": time.time()}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
