"""Does PPO learn as fast per update through the service as in one process? Seeds side by side.

``--side service``: one local service (``Nexus.local``), one on-policy PushCube tenant per seed (``max_inflight=1``,
one collector, the demo's PPO settings), all trained at once; each job's per-update rollout success is read from
its record (``jobs/<job>.json``). ``--side one_process``: ``ppo_maniskill.py`` once per seed, one after another
(the same task, head and PPO settings, no cluster). ``--side table``: both sides' JSON in ``--dir`` -> the table
(mean rollout success per 15 updates, each seed) and ``seed_spread.json``.

    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side service --seeds 1,2,3
    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side one_process --seeds 1,2,3
    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side table

PPO's learning-rate annealing, 120 updates, a final deterministic evaluation of 50 episodes per seed:

    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side service --updates 120 \
        --final-eval 50 --tag _const120
    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side service --updates 120 \
        --final-eval 50 --anneal-lr --tag _anneal120
    PYTHONPATH=$PWD .venv/bin/python experiments/rl_learning/seed_spread.py --side table \
        --compare service_const120,service_anneal120 --out anneal_lr.json

The same, annealed from twice the demo's learning rate (``--lr 1e-3 --tag _anneal120_lr1e-3``), and with the state
standardized by running statistics (``--proprio-norm running --tag _anneal120_running``; ``--compare
service_anneal120,service_anneal120_running --out proprio_norm.json``).
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


def service(seeds: list[int], updates: int, out: Path, ppo: dict, final_eval: int, lr: float = 5e-4,
            proprio_norm: str = "tanh") -> None:
    import torch

    from nexus.client.api import Nexus
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    curves: dict[str, list[float]] = {}
    finals: dict[str, float] = {}
    tenants = {}
    with tempfile.TemporaryDirectory(prefix="nexus-seeds-") as root, Nexus.local(root) as nx:
        jobs = {}
        for s in seeds:
            t = nx.create_tenant(TenantSpec(name=f"s{s}", env=ENV, action_head="oft", lr=lr, grad_clip=0.5,
                                            max_inflight=1, seed=s, proprio_norm=proprio_norm))
            jobs[s] = t.rl(updates=updates, episodes_per_batch=16, collectors=1, ppo=ppo)
            tenants[s] = t
        for s, job in jobs.items():
            job.result(timeout=7200)
            record = next((Path(root) / "tenants" / f"s{s}" / "jobs").glob("*.json"))
            history = json.loads(record.read_text())["history"]
            curves[str(s)] = [h["success_rate"] for h in history if h["kind"] == "rollout"]
            if final_eval:  # deterministic episodes of the last version, as the demo's final evaluation
                finals[str(s)] = tenants[s].evaluate(episodes=final_eval).result(timeout=3600)["success_rate"]
    out.write_text(json.dumps({"side": "service", "env": ENV, "ppo": ppo, "lr": lr, "proprio_norm": proprio_norm,
                               "curves": curves, "final_eval_episodes": final_eval, "final_eval_success": finals},
                              indent=1))


def one_process(seeds: list[int], updates: int, out: Path) -> None:
    curves: dict[str, list[float]] = {}
    for s in seeds:
        path = out.with_name(f"one_process_seed{s}.json")
        subprocess.run([sys.executable, str(HERE / "ppo_maniskill.py"), "--env", ENV, "--updates", str(updates),
                        "--eval-every", str(updates), "--eval-episodes", "8", "--seed", str(s), "--out", str(path)],
                       check=True)
        curves[str(s)] = [t["train_success"] for t in json.loads(path.read_text())["train"]]
    out.write_text(json.dumps({"side": "one_process", "env": ENV, "ppo": PPO, "curves": curves}, indent=1))


def table(folder: Path, names: list[str], out: Path) -> None:
    sides = {n: json.loads((folder / f"{n}.json").read_text()) for n in names}
    rows = []
    for side, data in sides.items():
        for seed, curve in data["curves"].items():
            means = [sum(curve[a:a + WINDOW]) / len(curve[a:a + WINDOW]) for a in range(0, len(curve), WINDOW)]
            rows.append({"side": side, "seed": int(seed), "success_by_window": [round(m, 3) for m in means],
                         "final_eval_success": data.get("final_eval_success", {}).get(seed)})
    print(f"rollout success (sampled), mean per {WINDOW} updates; final deterministic eval where run")
    for r in rows:
        final = "" if r["final_eval_success"] is None else f"  | final eval {r['final_eval_success']:.2f}"
        print(f"{r['side']:18s} seed {r['seed']}: " + "  ".join(f"{m:.2f}" for m in r["success_by_window"]) + final)
    last = {side: [r["success_by_window"][-1] for r in rows if r["side"] == side] for side in sides}
    summary = {side: sum(v) / len(v) for side, v in last.items()}
    print("last window, mean over seeds: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    out.write_text(json.dumps({"window": WINDOW, "rows": rows, "last_window_mean": summary}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("service", "one_process", "table"), required=True)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--dir", type=Path, default=HERE / "seed_spread")
    p.add_argument("--anneal-lr", action="store_true", help="service side: PPO's learning-rate annealing on")
    p.add_argument("--lr", type=float, default=5e-4, help="service side: the tenants' learning rate (the demo's)")
    p.add_argument("--final-eval", type=int, default=0, help="service side: deterministic episodes of the last "
                                                               "version per seed (0: none)")
    p.add_argument("--proprio-norm", choices=("tanh", "running"), default="tanh",
                   help="service side: how the tenants' heads read the state (TenantSpec.proprio_norm)")
    p.add_argument("--tag", default="", help="service side: written to service<tag>.json")
    p.add_argument("--compare", default="service,one_process", help="table: the JSON files (stems) in --dir")
    p.add_argument("--out", default="seed_spread.json", help="table: written next to this script")
    args = p.parse_args()
    args.dir.mkdir(exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.side == "table":
        table(args.dir, args.compare.split(","), HERE / args.out)
    elif args.side == "service":
        service(seeds, args.updates, args.dir / f"service{args.tag}.json", PPO | {"anneal_lr": args.anneal_lr},
                args.final_eval, args.lr, args.proprio_norm)
    else:
        one_process(seeds, args.updates, args.dir / "one_process.json")


if __name__ == "__main__":
    main()
