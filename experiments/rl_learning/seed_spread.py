"""Does PPO learn as fast per update through the service as in one process? Seeds side by side.

``--side service``: one local service (``Nexus.local``), one on-policy PushCube tenant per seed (``max_inflight=1``,
one collector, the demo's PPO settings), all trained at once; each job's per-update rollout success is read from
its record (``jobs/<job>.json``). ``--side one_process``: ``ppo_maniskill.py`` once per seed, one after another
(the same task, head and PPO settings, no cluster). ``--side table``: both sides' JSON in ``--dir`` -> the table
(mean rollout success per 15 updates, each seed) and ``seed_spread.json``.

    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side service --seeds 1,2,3
    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side one_process --seeds 1,2,3
    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side table
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = "maniskill/pushcube-state-full"
PPO = {"gamma": 0.8, "gae_lambda": 0.9, "update_epochs": 8, "minibatch_size": 200, "target_kl": 0.1}
WINDOW = 15


def service(seeds: list[int], updates: int, out: Path) -> None:
    import torch

    from nexus.client.api import Nexus
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="nexus-seeds-") as root, Nexus.local(root) as nx:
        jobs = {}
        for s in seeds:
            t = nx.create_tenant(TenantSpec(name=f"s{s}", env=ENV, action_head="oft", lr=5e-4, grad_clip=0.5,
                                            max_inflight=1, seed=s))
            jobs[s] = t.rl(updates=updates, episodes_per_batch=16, collectors=1, ppo=PPO)
        for s, job in jobs.items():
            job.result(timeout=7200)
            record = next((Path(root) / "tenants" / f"s{s}" / "jobs").glob("*.json"))
            history = json.loads(record.read_text())["history"]
            curves[str(s)] = [h["success_rate"] for h in history if h["kind"] == "rollout"]
    out.write_text(json.dumps({"side": "service", "env": ENV, "ppo": PPO, "curves": curves}, indent=1))


def one_process(seeds: list[int], updates: int, out: Path) -> None:
    curves: dict[str, list[float]] = {}
    for s in seeds:
        path = out.with_name(f"one_process_seed{s}.json")
        subprocess.run([sys.executable, str(HERE / "ppo_maniskill.py"), "--env", ENV, "--updates", str(updates),
                        "--eval-every", str(updates), "--eval-episodes", "8", "--seed", str(s), "--out", str(path)],
                       check=True)
        curves[str(s)] = [t["train_success"] for t in json.loads(path.read_text())["train"]]
    out.write_text(json.dumps({"side": "one_process", "env": ENV, "ppo": PPO, "curves": curves}, indent=1))


def table(folder: Path) -> None:
    sides = {p.stem: json.loads(p.read_text()) for p in (folder / "service.json", folder / "one_process.json")}
    rows = []
    for side, data in sides.items():
        for seed, curve in data["curves"].items():
            means = [sum(curve[a:a + WINDOW]) / len(curve[a:a + WINDOW]) for a in range(0, len(curve), WINDOW)]
            rows.append({"side": side, "seed": int(seed), "success_by_window": [round(m, 3) for m in means]})
    print(f"rollout success (sampled), mean per {WINDOW} updates")
    for r in rows:
        print(f"{r['side']:12s} seed {r['seed']}: " + "  ".join(f"{m:.2f}" for m in r["success_by_window"]))
    last = {side: [r["success_by_window"][-1] for r in rows if r["side"] == side] for side in sides}
    summary = {side: sum(v) / len(v) for side, v in last.items()}
    print("last window, mean over seeds: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    (HERE / "seed_spread.json").write_text(json.dumps({"window": WINDOW, "rows": rows,
                                                        "last_window_mean": summary}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("service", "one_process", "table"), required=True)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--dir", type=Path, default=HERE / "seed_spread")
    args = p.parse_args()
    args.dir.mkdir(exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.side == "table":
        table(args.dir)
    elif args.side == "service":
        service(seeds, args.updates, args.dir / "service.json")
    else:
        one_process(seeds, args.updates, args.dir / "one_process.json")


if __name__ == "__main__":
    main()
