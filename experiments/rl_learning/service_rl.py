"""PPO and GRPO as jobs of one service, side by side: learning curves of two PushCube tenants.

One ``Nexus.local`` service (scheduler, SIM workers, one actor rank, one inference engine, the gateway) and two
tenants created through the Python API with the same task, head and seed: ``ppo`` trains with
``RLJob(algorithm="ppo")`` (GAE with the value head), ``grpo`` with ``RLJob(algorithm="grpo")`` (no critic:
groups of episodes reset with one seed, each scored within its group). Both run at the same time, so they share
the machine's load. Every ``--eval-every`` updates each tenant's training job ends and an evaluation of its new
version (deterministic episodes on seeds never used for training) runs while its next training job continues.

Settings are those of ``ppo_maniskill.py`` (16 episodes per update, OFT head width 256, lr 5e-4, gradient clip
0.5, 8 epochs of minibatches of 200, target KL 0.1; PPO gamma 0.8, lambda 0.9), fixed 50-step episodes
(``maniskill/pushcube-state-full``). GRPO: groups of ``--group-size`` episodes, process supervision (every step
reward standardized over its group, summed from the step on).

    python experiments/rl_learning/run.py service                       # 40 updates each, ~15 min on 2 cores
    python experiments/rl_learning/run.py service --updates 20 --algorithms grpo
    python experiments/rl_learning/run.py service --algorithms ppo-c1,ppo-c2 --out /tmp/collectors.json  # 1 vs 2 sims
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENV = "maniskill/pushcube-state-full"


def variant(name: str, args: argparse.Namespace) -> tuple[str, int]:
    """A tenant's name -> (algorithm, collectors): "ppo" or "grpo", with "-c<N>" for N collectors (e.g. ppo-c1)."""
    algorithm, _, c = name.partition("-c")
    return algorithm, int(c) if c else args.collectors


def job_spec(name: str, updates: int, args: argparse.Namespace) -> dict[str, Any]:
    algorithm, collectors = variant(name, args)
    common = {"update_epochs": 8, "minibatch_size": 200, "target_kl": 0.1}
    job: dict[str, Any] = {"kind": "rl", "algorithm": algorithm, "updates": updates,
                           "episodes_per_batch": args.episodes, "collectors": collectors}
    if algorithm == "ppo":
        job["ppo"] = {"gamma": 0.8, "gae_lambda": 0.9, **common}
    else:
        job["grpo"] = {"group_size": args.group_size, "advantage": args.advantage, "kl_coef": args.kl_coef, **common}
    return job


def rollout_rows(nx, tenant: str) -> list[dict[str, Any]]:
    """Every RL batch the tenant's jobs collected: (update index, policy version, return, success)."""
    log = nx.tenant_log(tenant)
    rows = []
    for job in sorted(log["jobs"], key=lambda j: j["t_submit"]):
        if job["kind"] != "rl":
            continue
        rows += [{"version": int(r["version"]), "return": float(r["return"]), "success_rate": float(r["success_rate"])}
                 for r in job.get("history", []) if r.get("kind") == "rollout"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithms", default="ppo,grpo", help="tenants: ppo / grpo, '-c<N>' for N collectors (ppo-c1)")
    ap.add_argument("--updates", type=int, default=40, help="updates per tenant")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-episodes", type=int, default=16)
    ap.add_argument("--episodes", type=int, default=16, help="episodes per update")
    ap.add_argument("--collectors", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--advantage", default="process", choices=("process", "outcome"))
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--n-sim", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE / "service_rl.json")
    args = ap.parse_args()

    from nexus.client.api import Nexus
    from nexus.spec import TenantSpec

    algorithms = args.algorithms.split(",")
    root = Path(tempfile.mkdtemp(prefix="nexus-service-rl-")) / "service"
    t0 = time.time()
    with Nexus.local(root, n_sim=args.n_sim) as nx:
        tenants = {a: nx.create_tenant(TenantSpec(name=a, env=ENV, action_head="oft", hidden_dim=256, lr=5e-4,
                                                  grad_clip=0.5, max_inflight=2, seed=args.seed))
                   for a in algorithms}
        evals: dict[str, list] = {a: [(0, tenants[a].evaluate(episodes=args.eval_episodes))] for a in algorithms}
        chunks: dict[str, list] = {a: [] for a in algorithms}
        t_ready = time.time()
        done = dict.fromkeys(algorithms, 0)
        while min(done.values()) < args.updates:
            chunk = {a: min(args.eval_every, args.updates - done[a]) for a in algorithms}
            jobs = {a: tenants[a].submit(job_spec(a, chunk[a], args)) for a in algorithms if chunk[a] > 0}
            for a, job in jobs.items():
                res = job.result()
                done[a] += int(res["updates"])
                evals[a].append((done[a], tenants[a].evaluate(episodes=args.eval_episodes)))
                print(f"{time.time() - t_ready:7.0f} s  {a:5s} update {done[a]:4d}  v{res['version']}  "
                      f"rollout return {res.get('return', float('nan')):.2f}  "
                      f"success {res.get('success_rate', float('nan')):.2f}", flush=True)
                chunks[a].append({"updates": done[a], "t_s": time.time() - t_ready, "version": res["version"]})
            write(args, snapshot(nx, algorithms, evals, chunks, wait=False), t0, t_ready)  # partial, in case
        out = write(args, snapshot(nx, algorithms, evals, chunks, wait=True), t0, t_ready)
    table(out)
    plot(out, args.out.with_suffix(".png"))


def snapshot(nx, algorithms: list[str], evals: dict[str, list], chunks: dict[str, list], wait: bool
             ) -> dict[str, Any]:
    """Each tenant's evaluations (those finished, or all with ``wait``), rollout batches and job chunks."""
    results: dict[str, Any] = {}
    for a in algorithms:
        rows = []
        for update, ev in evals[a]:
            if not wait and not ev.progress().finished:
                continue
            r = ev.result()
            rows.append({"update": update, "version": r["version"], "success_rate": r["success_rate"],
                         "return": r["mean_return"], "episodes": r["episodes"]})
        results[a] = {"evals": rows, "rollouts": rollout_rows(nx, a), "chunks": chunks[a]}
    return results


def write(args: argparse.Namespace, results: dict[str, Any], t0: float, t_ready: float) -> dict[str, Any]:
    out = {"env": ENV, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "wall_s_training": time.time() - t_ready, "wall_s_total": time.time() - t0, "machine": platform.node(),
           "cpu": platform.processor() or platform.machine(), "results": results}
    args.out.write_text(json.dumps(out, indent=1))
    return out


def table(out: dict[str, Any]) -> None:
    algorithms = list(out["results"])
    print(f"\n{out['env']}, {out['args']['episodes']} episodes per update, both tenants at once "
          f"({out['wall_s_training']:.0f} s)")
    print("| update | " + " | ".join(f"{a} eval success | {a} eval return" for a in algorithms) + " |")
    print("|---:|" + "---:|---:|" * len(algorithms))
    rows = max(len(out["results"][a]["evals"]) for a in algorithms)
    for i in range(rows):
        cells = []
        upd = None
        for a in algorithms:
            ev = out["results"][a]["evals"]
            if i < len(ev):
                upd = ev[i]["update"]
                cells += [f"{ev[i]['success_rate']:.2f}", f"{ev[i]['return']:.1f}"]
            else:
                cells += ["", ""]
        print(f"| {upd} | " + " | ".join(cells) + " |")


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for a, res in out["results"].items():
        ev = res["evals"]
        ax1.plot([e["update"] for e in ev], [e["success_rate"] for e in ev], marker="o", label=a.upper())
        ro = res["rollouts"]
        ax2.plot(range(1, len(ro) + 1), [r["return"] for r in ro], alpha=0.8, label=a.upper())
    ax1.set(xlabel="update", ylabel="eval success rate (deterministic)", ylim=(-0.02, 1.02),
            title="evaluation of each version")
    ax2.set(xlabel="RL batch (16 episodes)", ylabel="rollout return (sampled actions)", title="training batches")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    names = " vs ".join(a.upper() for a in out["results"])
    fig.suptitle(f"{names} as service jobs, {out['env']} (at once, one service)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
