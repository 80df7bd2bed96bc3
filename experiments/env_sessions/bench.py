"""Stable-Baselines3 PPO on the service's simulators vs the same env in-process: env-steps/s, side by side.

Both sides run SB3's PPO (``MultiInputPolicy``, the same settings and seed) on N envs of the same catalog env
(default ``maniskill/pushcube-state``, state observations):

- in-process: ``DummyVecEnv`` of N catalog envs in this process (``nexus.sim.vector.gym_env``: the
  ManiSkill env as a ``gymnasium.Env`` with the catalog's time limit);
- service: ``SB3VecEnv(ServiceVectorEnv(tenant, env, N))`` — one environment session of N envs on a simulator
  worker of a local service (``Nexus.local``), every vector step one HTTP call to the gateway, which forwards
  it to the simulator worker, where it runs on the worker's session thread;
- service_one_worker: the same for a tenant whose ``limits.env_session_workers`` is 1: the session's envs all on
  one simulator worker ("service" spreads a vector session over up to
  ``env_session_workers`` = 2 of the ``--sim-workers`` workers, which step their shares at once);
- service_inline (``--sides``): a tenant whose ``limits.env_session_inline_s`` is ``--inline-s``: a call whose
  previous call took less runs on the worker's event loop (two thread hand-offs fewer per step).

Each measurement is ``model.learn(total_timesteps)`` (collection and PPO's updates: what a user waits for),
its envs built before the clock starts. Rounds interleave the two sides (the order alternates); the figure is
the median over rounds of service / in-process env-steps/s (target >= 0.8). Also the raw vector-step time
of each side without SB3 (``--raw-steps``).

    python experiments/env_sessions/bench.py                        # ~5 min on 2 loaded cores
    python experiments/env_sessions/bench.py --envs 4,8,16 --rounds 3
    python experiments/env_sessions/bench.py --sim-workers 1 --sides in_process,service,service_inline  # as before
    python experiments/env_sessions/bench.py --envs 4,8 --busy     # another tenant's RL rollouts on both workers
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
SIDES = ("in_process", "service", "service_one_worker", "service_inline")
TENANTS = {"service": "sb3", "service_one_worker": "sb3-one-worker", "service_inline": "sb3-inline"}


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
    p.add_argument("--sim-workers", type=int, default=2, help="simulator workers of the service (its default: 2)")
    p.add_argument("--busy", action="store_true",
                   help="another tenant's RL job runs rollouts on the simulator workers throughout (a busy service)")
    p.add_argument("--sides", default="in_process,service,service_one_worker",
                   help=f"comma-separated, of {','.join(SIDES)}")
    p.add_argument("--out", default=str(HERE / "results.json"))
    args = p.parse_args()

    import torch
    from stable_baselines3.common.vec_env import DummyVecEnv

    from nexus.client.api import Nexus
    from nexus.client.sb3 import SB3VecEnv
    from nexus.config import catalog
    from nexus.sim.vector import gym_env
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    entry = catalog.env(args.env)
    sizes = [int(x) for x in args.envs.split(",")]
    sides = [x for x in args.sides.split(",") if x]
    if "in_process" not in sides or not set(sides) <= set(SIDES):
        p.error(f"--sides: in_process and any of {', '.join(SIDES[1:])}")
    rows: list[dict] = []
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="nexus-envbench-") as root, \
            Nexus.local(root, n_sim=args.sim_workers, limits={"max_envs_per_session": max(sizes)},
                        tenant_limits={"sb3-inline": {"env_session_inline_s": args.inline_s},
                                       "sb3-one-worker": {"env_session_workers": 1}}) as nx:
        tenants = {side: nx.create_tenant(TenantSpec(name=TENANTS[side], env=args.env)) for side in sides[1:]}
        service_pids = list(nx.service.names)  # scheduler, gateway, workers (their nannies' trees)
        busy = None
        if args.busy:  # one rollout task per simulator worker at any time, until cancelled
            busy = nx.create_tenant(TenantSpec(name="busy", env=args.env)).rl(
                updates=10_000, episodes_per_batch=4, collectors=args.sim_workers)
            deadline = time.time() + 300
            while busy.progress().done < 1 and time.time() < deadline:  # rollouts and updates under way
                time.sleep(1)
        for n in sizes:
            envs = {"in_process": DummyVecEnv([lambda: gym_env(entry) for _ in range(n)])}
            for side, tenant in tenants.items():
                envs[side] = SB3VecEnv(tenant.vector_env(args.env, num_envs=n, seed=args.seed))
            try:
                for r in range(args.rounds):
                    order = list(envs.items())
                    order = order[r % len(order):] + order[:r % len(order)]  # each side first in turn
                    row: dict = {"envs": n, "round": r}
                    for side, env in order:
                        row[side], row[f"{side}_cpu_ms_per_step"] = learn_rate(env, args, service_pids)
                        row[f"{side}_cpu_ms_per_step"] *= 1000
                    if args.raw_steps:
                        for _, env in order:
                            env.reset()
                        for side, env in order:
                            row[f"{side}_raw"] = raw_rate(lambda a, env=env: env.step(a), n, args.raw_steps)
                    for side in sides[1:]:
                        row[f"ratio_{side}"] = row[side] / row["in_process"]
                        # what the ratio would be where nothing else competes for the cores: CPU per step, both sides
                        row[f"cpu_ratio_{side}"] = row["in_process_cpu_ms_per_step"] / row[f"{side}_cpu_ms_per_step"]
                    rows.append(row)
                    load.append(os.getloadavg())
                    print(f"envs {n} round {r}: " + ", ".join(f"{side} {row[side]:.1f}" for side in sides)
                          + " env-steps/s -> " + ", ".join(f"{row[f'ratio_{side}']:.2f}x" for side in sides[1:]),
                          flush=True)
            finally:
                for env in envs.values():
                    env.close()
        if busy is not None:
            busy.cancel()
        metered = {side: nx.status(tenant=TENANTS[side])["tenants"][0].get("metered_s", {}).get("simulator")
                   for side in sides[1:]}

    summary = []
    for n in sizes:
        mine = [r for r in rows if r["envs"] == n]
        s = {"envs": n, "rounds": len(mine)}
        keys = [k for k in mine[0] if k not in ("envs", "round")]
        for k in keys:
            vals = [r[k] for r in mine if k in r]
            s[k] = statistics.median(vals)
            s[f"{k}_range"] = [min(vals), max(vals)]
        summary.append(s)
    services = sides[1:]
    print()
    print(f"| envs | env-steps/s: {' / '.join(sides)} | "
          + " | ".join(f"{side} / in-process (median, range)" for side in services)
          + f" | CPU ms per env step, all processes: {' / '.join(sides)} | CPU ratio: {' / '.join(services)} |")
    print("|---:|---:|" + "---:|" * len(services) + "---:|---:|")
    for s in summary:
        print(f"| {s['envs']} | {' / '.join(f'{s[side]:.1f}' for side in sides)} | "
              + " | ".join(f"**{s[f'ratio_{side}']:.2f}x** ({s[f'ratio_{side}_range'][0]:.2f}-"
                           f"{s[f'ratio_{side}_range'][1]:.2f})" for side in services)
              + " | " + " / ".join(f"{s[side + '_cpu_ms_per_step']:.2f}" for side in sides) + " | "
              + " / ".join(f"{s[f'cpu_ratio_{side}']:.2f}x" for side in services) + " |")
    out = {"env": args.env, "settings": vars(args), "rows": rows, "summary": summary,
           "metered_simulator_s": metered, "load_average": load,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "time": time.time()}
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
