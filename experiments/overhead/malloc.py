"""CPU that Dask's worker environment costs: ``MALLOC_TRIM_THRESHOLD_=65536``, which Dask's nanny sets for
every worker process it spawns (``distributed.nanny.pre-spawn-environ``), vs glibc's own adaptive
thresholds (the service unsets it: ``nexus.config.service.DASK_DEFAULTS``), side by side in one run.

Two workloads of the service's workers, each in a fresh process per setting and round, run in a
thread as a Dask worker runs its tasks:

- ``train``: forward + backward + Adam steps of a small transformer (the actor's and the engine's kind
  of work: tensors above 128 KiB allocated and freed at every step);
- ``render``: a producer of 4 ManiSkill PickCube rgb envs (``maniskill/pickcube-rgb``) stepped in
  lockstep, each step rendering a camera frame (the simulator worker's heaviest tenant).

User and system CPU seconds and minor page faults per workload (``getrusage``), settings alternating over
the rounds.

    python experiments/overhead/bench.py malloc          # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {"dask nanny (65536)": "65536", "service (unset)": None}


def child(workload: str, steps: int) -> None:
    """One workload in a thread of this process; prints its rusage as JSON."""
    import resource
    import threading
    import time

    import torch

    torch.set_num_threads(1)
    out: dict[str, float] = {}

    def train() -> None:
        layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 2)
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        x = torch.randn(32, 64, 256)
        for _ in range(steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    def render_setup():
        import numpy as np

        from nexus.config import catalog
        from nexus.sim.environment import make_env

        entry = catalog.env("maniskill/pickcube-rgb")
        envs = [make_env(entry, seed=j, num_envs=1) for j in range(4)]
        rng = np.random.default_rng(0)

        def loop(n: int) -> None:
            for i in range(n):
                for j, env in enumerate(envs):
                    r = env.step(rng.uniform(-1, 1, entry.schema.action_dim).astype(np.float32))
                    if r.terminated or r.truncated:
                        env.reset(seed=100 * i + j)
        loop(3)  # outside the measured window: first frames
        return lambda: loop(steps)

    def run() -> None:
        fn = train if workload == "train" else render_setup()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fn()
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out.update(user_s=r1.ru_utime - r0.ru_utime, sys_s=r1.ru_stime - r0.ru_stime,
                   minor_faults=float(r1.ru_minflt - r0.ru_minflt), wall_s=t1 - t0)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    print(json.dumps(out))


def measure(workload: str, value: str | None, steps: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TRIM_THRESHOLD_"}
    if value is not None:
        env["MALLOC_TRIM_THRESHOLD_"] = value
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, __file__, "--child", workload, "--steps", str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    return m | {"cpu_s": m["user_s"] + m["sys_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=25)
    ap.add_argument("--render-steps", type=int, default=40, help="lockstep steps of the 4 rgb envs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results.json"))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps)
        return
    steps = {"train": args.train_steps, "render": args.render_steps}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {w: {s: [] for s in SETTINGS} for w in steps}
    for r in range(args.rounds):
        for w, n in steps.items():
            for s in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
                runs[w][s].append(measure(w, SETTINGS[s], n))
                m = runs[w][s][-1]
                print(f"round {r} {w:6s} {s:20s} user {m['user_s']:6.2f} s  sys {m['sys_s']:6.2f} s  "
                      f"faults {m['minor_faults']:10.0f}  load {os.getloadavg()[0]:.1f}", flush=True)
    keys = ["user_s", "sys_s", "cpu_s", "minor_faults", "wall_s"]
    med = {w: {s: {k: statistics.median(x[k] for x in rs) for k in keys} for s, rs in by.items()}
           for w, by in runs.items()}
    print(f"\nmedian of {args.rounds} rounds, {os.cpu_count()} cores (train: {args.train_steps} steps; render: "
          f"{args.render_steps} lockstep steps of 4 rgb envs)")
    print(f"{'workload':8s} {'setting':20s} {'user s':>8s} {'sys s':>8s} {'CPU s':>8s} {'minor faults':>13s}")
    ratios = {}
    for w, by in med.items():
        for s, m in by.items():
            print(f"{w:8s} {s:20s} {m['user_s']:8.2f} {m['sys_s']:8.2f} {m['cpu_s']:8.2f} {m['minor_faults']:13.0f}")
        a, b = (by[s]["cpu_s"] for s in SETTINGS)
        ratios[w] = a / max(b, 1e-9)
        print(f"{w:8s} CPU with Dask's setting / without: {ratios[w]:.2f}x")
    out = Path(args.out)  # one results file for the folder: this script's section of it
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["malloc"] = {
        "meta": {**{k: v for k, v in vars(args).items() if k not in ("child", "steps")}, "settings": SETTINGS,
                 "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "command": "python experiments/overhead/bench.py malloc " + " ".join(sys.argv[1:])},
        "median": med, "cpu_ratio": ratios, "runs": runs}
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
