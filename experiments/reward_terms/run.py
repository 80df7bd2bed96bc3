"""A dense-reward and a sparse-reward tenant on one env, side by side in one service: does each learn on its own
reward (``TenantSpec.reward``)?

One ``Nexus.local`` service (2 SIM workers, one actor rank, one inference engine, the gateway), two tenants on
``maniskill/pushcube-state-full`` (fixed 50-step episodes) with the same head, settings and seed, trained at once:

* ``dense``: its own shaping, declared as terms: ``1 - tanh(5 * tcp_to_obj_dist)`` (reach the cube),
  ``1 - tanh(5 * obj_to_goal_dist)`` (the cube near the goal) and ``success`` (the task's success flag);
* ``sparse``: ``success`` only (1 per step while the cube is on the goal).

Neither uses the env's own reward. Every ``--eval-every`` updates each tenant's training job ends and an evaluation
of its new version runs (deterministic episodes on seeds never trained on). The common yardstick is the
evaluation's success rate (each tenant's return is in its own units); the rollouts' per-term rewards come from
the jobs' histories (``reward/<term>``).

    python experiments/reward_terms/run.py                      # 40 updates each, ~25 min on 2 loaded cores
    python experiments/reward_terms/run.py --updates 10 --eval-every 5 --out /tmp/rt.json   # a smoke run
    python experiments/reward_terms/run.py --from-root "$STOPPED_RUN_ROOT"  # an interrupted run

``--from-root`` rebuilds the results of a run stopped early from its service root (the tenants' finished job
records and evaluation reports); the json says which updates it covers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENV = "maniskill/pushcube-state-full"
REWARDS: dict[str, list[dict[str, Any]]] = {
    "dense": [{"term": "tcp_to_obj_dist", "transform": "tanh", "scale": 5.0, "weight": 1.0},
              {"term": "obj_to_goal_dist", "transform": "tanh", "scale": 5.0, "weight": 1.0},
              {"term": "success", "weight": 1.0}],
    "sparse": [{"term": "success", "weight": 1.0}],
}


def rl_job(updates: int, episodes: int) -> dict[str, Any]:
    """configs/demo/push-rl.toml's PPO settings (as experiments/rl_learning), ``updates`` long."""
    return {"kind": "rl", "updates": updates, "episodes_per_batch": episodes, "collectors": 1, "split": 2,
            "ppo": {"gamma": 0.8, "gae_lambda": 0.9, "update_epochs": 8, "minibatch_size": 200, "target_kl": 0.1}}


def batch_row(r: dict[str, Any]) -> dict[str, Any]:
    """An RL batch's history row: its policy version, return, success rate and per-term rewards."""
    return {k: v for k, v in r.items() if k in ("version", "return", "success_rate") or k.startswith("reward/")}


def rollouts(nx, tenant: str) -> list[dict[str, Any]]:
    """Every RL batch the tenant collected: return, success rate and each term's mean per episode."""
    rows = []
    for job in sorted(nx.tenant_log(tenant)["jobs"], key=lambda j: j["t_submit"]):
        if job["kind"] == "rl":
            rows += [batch_row(r) for r in job.get("history", []) if r.get("kind") == "rollout"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--eval-episodes", type=int, default=16)
    ap.add_argument("--episodes", type=int, default=16, help="episodes per update")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=HERE / "reward_terms.json")
    ap.add_argument("--from-root", type=Path, help="rebuild the results from a stopped run's service root")
    args = ap.parse_args()
    if args.from_root is not None:
        # the run's own settings are its jobs' (each tenant's "updates"); --episodes must be the run's
        out = {"env": ENV, "args": {"from_root": str(args.from_root), "episodes": args.episodes},
               "stopped_early": True, **from_root(args.from_root)}
        args.out.write_text(json.dumps(out, indent=1))
        table(out)
        return

    from nexus.client.api import Nexus

    root = Path(tempfile.mkdtemp(prefix="nexus-reward-terms-")) / "service"
    t0 = time.time()
    with Nexus.local(root, n_sim=2) as nx:
        tenants = {name: nx.create_tenant({"name": name, "env": ENV, "action_head": "oft", "hidden_dim": 256,
                                           "lr": 5e-4, "grad_clip": 0.5, "max_inflight": 2,
                                           "proprio_norm": "running", "seed": args.seed, "reward": terms})
                   for name, terms in REWARDS.items()}
        evals = {n: [(0, t.evaluate(episodes=args.eval_episodes))] for n, t in tenants.items()}
        done = dict.fromkeys(tenants, 0)
        t_ready = time.time()
        while min(done.values()) < args.updates:
            n_up = min(args.eval_every, args.updates - min(done.values()))
            jobs = {n: t.submit(rl_job(n_up, args.episodes)) for n, t in tenants.items()}
            for n, job in jobs.items():
                res = job.result()
                done[n] += int(res["updates"])
                evals[n].append((done[n], tenants[n].evaluate(episodes=args.eval_episodes)))
                terms = "  ".join(f"{k.removeprefix('reward/')} {v:.2f}" for k, v in res.items()
                                  if k.startswith("reward/"))
                print(f"{time.time() - t_ready:6.0f} s  {n:6s} update {done[n]:3d}  rollout return "
                      f"{res.get('return', float('nan')):.2f}  success {res.get('success_rate', float('nan')):.2f}"
                      f"  [{terms}]", flush=True)
        results = {n: {"reward": REWARDS[n], "rollouts": rollouts(nx, n),
                       "evals": [{"update": u, **{k: ev.result()[k] for k in ("version", "success_rate",
                                                                              "mean_return", "episodes")}}
                                 for u, ev in evals[n]]} for n in tenants}
    out = {"env": ENV, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "wall_s_training": time.time() - t_ready, "wall_s_total": time.time() - t0, "results": results}
    args.out.write_text(json.dumps(out, indent=1))
    table(out)


def from_root(root: Path) -> dict[str, Any]:
    """The finished jobs of a run's tenants, read from their records under the service root (``jobs/<id>.json``:
    spec, result, history), in submission order."""
    results, t0, t1 = {}, float("inf"), 0.0
    for name in REWARDS:
        jobs = sorted((json.loads(f.read_text()) for f in (root / "tenants" / name / "jobs").glob("*.json")),
                      key=lambda j: j["t_submit"])
        done = [j for j in jobs if j["state"] == "done"]
        t0 = min([t0, *(j["t_start"] for j in done)])
        t1 = max([t1, *(j["t_end"] for j in done)])
        rollouts = [batch_row(r) for j in done if j["kind"] == "rl" for r in j.get("history", [])
                    if r.get("kind") == "rollout"]
        evals = [{"update": j["result"]["version"], **{k: j["result"][k] for k in ("version", "success_rate",
                                                                                 "mean_return", "episodes")}}
                 for j in done if j["kind"] == "eval"]
        results[name] = {"reward": REWARDS[name], "rollouts": rollouts, "evals": evals,
                         "updates": sum(j["result"]["updates"] for j in done if j["kind"] == "rl")}
    return {"wall_s_training": t1 - t0, "results": results}


def table(out: dict[str, Any]) -> None:
    res = out["results"]
    print(f"\n{out['env']}: both tenants at once, {out['args']['episodes']} episodes per update, "
          f"{out['wall_s_training']:.0f} s of training")
    print("| tenant | update | eval success | eval return (own reward) |")
    print("|---|---:|---:|---:|")
    for n, r in res.items():
        for e in r["evals"]:
            print(f"| {n} | {e['update']} | {e['success_rate']:.2f} | {e['mean_return']:.2f} |")
    print("\n| tenant | rollouts, first 5 -> last 5 batches: success | return | per term (mean per episode) |")
    print("|---|---|---|---|")
    for n, r in res.items():
        ro = r["rollouts"]
        head, tail = ro[:5], ro[-5:]

        def mean(rows: list[dict[str, Any]], k: str) -> float:
            return sum(x[k] for x in rows) / max(1, len(rows))

        terms = ", ".join(f"{k.removeprefix('reward/')} {mean(head, k):.2f} -> {mean(tail, k):.2f}"
                          for k in ro[0] if k.startswith("reward/")) if ro else ""
        print(f"| {n} | {mean(head, 'success_rate'):.2f} -> {mean(tail, 'success_rate'):.2f} | "
              f"{mean(head, 'return'):.2f} -> {mean(tail, 'return'):.2f} | {terms} |")


if __name__ == "__main__":
    main()
