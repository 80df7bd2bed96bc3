"""RL for a flow-matching family through the service: a π-head tenant's PPO on PushCube next to the OFT head's.

One ``Nexus.local`` service; for each seed, two tenants that differ only in ``action_head`` (``pi`` and ``oft``)
run the demo's PPO job (``configs/demo/push-rl.toml``: tenant and job as the demo submits them, 120 annealed
updates of 16 episodes) at the same time, so that the machine's load falls on both alike; each is then scored by a
deterministic evaluation. Beside the first pair, a π-head GRPO tenant runs the same job with ``algorithm = "grpo"``
(groups of 4 episodes reset with one seed), evaluated before and after.

The wall time of a job is from its submission to its result (training only: rollouts and updates, not the
evaluation); when one job of a pair ends first, the other runs on with the machine to itself, which flatters the
slower one's ratio. The π head's RL policy is Flow-Noise with the noise on the last denoising step
(``nexus.model.policy``): the deterministic action is the flow from zero noise, as before.

    nice -n 10 python experiments/flow_rl/flow_rl.py                                # 3 seeds x {pi, oft}, grpo
    nice -n 10 python experiments/flow_rl/flow_rl.py --seeds 1 --grpo-updates 0     # one pair, no GRPO
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEMO = HERE.parents[1] / "configs" / "demo" / "push-rl.toml"


def loadavg() -> float:
    return os.getloadavg()[0]


def rollouts(nx, tenant: str) -> list[dict[str, float]]:
    """The tenant's RL batches so far: (version, return, success rate) of each."""
    log = nx.tenant_log(tenant)
    return [{"version": int(r["version"]), "return": float(r["return"]), "success_rate": float(r["success_rate"])}
            for j in sorted(log["jobs"], key=lambda j: j["t_submit"]) if j["kind"] == "rl"
            for r in j.get("history", []) if r.get("kind") == "rollout"]


def job_of(sub, updates: int, algorithm: str, group_size: int) -> dict[str, Any]:
    """The demo's RL job, ``updates`` long; GRPO takes the PPO section's shared fields and groups of episodes."""
    job = copy.deepcopy(sub.jobs[0]) | {"updates": updates, "algorithm": algorithm}
    if algorithm == "grpo":
        ppo = job.pop("ppo")
        job["grpo"] = {k: ppo[k] for k in ("update_epochs", "minibatch_size", "target_kl", "anneal_lr") if k in ppo} | {
            "group_size": group_size}
    return job


def run_together(nx, sub, runs: list[tuple[str, str, int, int]], args: argparse.Namespace,
                 out: dict[str, Any]) -> None:
    """Tenants (family, algorithm, seed, updates) of the demo's submission, their RL jobs submitted at once (the
    same load on each); each job's wall time from submission to result; then each one's final evaluation."""
    tenants, jobs, rows = {}, {}, {}
    for family, algorithm, seed, _updates in runs:
        name = f"{family}-{algorithm}-s{seed}"
        spec = {**sub.tenant, "name": name, "action_head": family, "seed": seed}
        tenants[name] = nx.create_tenant(spec)
        rows[name] = {"tenant": name, "family": family, "algorithm": algorithm, "seed": seed}
        out[algorithm].append(rows[name])
    for name, t in tenants.items():
        if rows[name]["algorithm"] == "grpo":  # the start, to show GRPO learns (PPO's start: success 0)
            start = t.evaluate(episodes=args.eval_episodes).result()
            rows[name]["start"] = {"success_rate": start["success_rate"], "return": start["mean_return"]}
    t0, load0 = time.time(), loadavg()
    for (_, algorithm, _, updates), (name, t) in zip(runs, tenants.items(), strict=True):
        jobs[name] = t.submit(job_of(sub, updates, algorithm, args.group_size))
    running = dict(jobs)
    while running:
        time.sleep(30)
        for name in list(running):
            rows[name]["rollouts"] = rollouts(nx, name)
            if running[name].progress().finished:
                res = running.pop(name).result()
                rows[name] |= {"wall_s": time.time() - t0, "version": res["version"]}
                print(f"{name:16s} v{res['version']:<4d} trained in {rows[name]['wall_s']:.0f} s", flush=True)
        for name in running:
            rows[name]["load"] = [load0, loadavg()]
        args.out.write_text(json.dumps(out, indent=1))
    evals = {name: t.evaluate(episodes=args.eval_episodes) for name, t in tenants.items()}
    for name, ev in evals.items():
        r, row = ev.result(), rows[name]
        row |= {"success_rate": r["success_rate"], "return": r["mean_return"], "episodes": r["episodes"],
                "load": [load0, loadavg()]}
        returns = [b["return"] for b in row["rollouts"]]
        k = max(1, len(returns) // 10)
        row |= {"rollout_return_first": sum(returns[:k]) / k, "rollout_return_last": sum(returns[-k:]) / k}
        print(f"{name:16s} eval success {row['success_rate']:.2f} return {row['return']:.1f}  rollout return "
              f"{row['rollout_return_first']:.1f} -> {row['rollout_return_last']:.1f}", flush=True)
    args.out.write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--updates", type=int, default=120, help="updates per job (the demo's 120)")
    ap.add_argument("--eval-episodes", type=int, default=50)
    ap.add_argument("--grpo-updates", type=int, default=120, help="the π GRPO tenant's updates, beside the first "
                                                                  "seed's pair (0: none)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "flow_rl.json")
    args = ap.parse_args()

    from nexus.client.api import Nexus
    from nexus.config.service import load_submission

    sub = load_submission([DEMO])
    root = Path(tempfile.mkdtemp(prefix="nexus-flow-rl-")) / "service"
    out: dict[str, Any] = {"env": sub.tenant["env"], "demo": str(DEMO.relative_to(HERE.parents[1])),
                           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "ppo": [], "grpo": []}
    with Nexus.local(root, checkpoint_every=50) as nx:  # the demo's checkpoint interval
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            runs = [("pi", "ppo", seed, args.updates), ("oft", "ppo", seed, args.updates)]
            if i == 0 and args.grpo_updates:
                runs.append(("pi", "grpo", seed, args.grpo_updates))
            run_together(nx, sub, runs, args, out)
    table(out)


def table(out: dict[str, Any]) -> None:
    print(f"\n{out['env']}, the demo's PPO job ({out['args']['updates']} updates), final evaluation "
          f"{out['args']['eval_episodes']} deterministic episodes")
    print("| seed | π success | π return | π wall s | OFT success | OFT return | OFT wall s | wall π / OFT |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    by = {(r["family"], r["seed"]): r for r in out["ppo"]}
    ratios = []
    for seed in sorted({r["seed"] for r in out["ppo"]}):
        pi, oft = by.get(("pi", seed)), by.get(("oft", seed))
        cells = [f"{r['success_rate']:.2f} | {r['return']:.1f} | {r['wall_s']:.0f}" if r else "- | - | -"
                 for r in (pi, oft)]
        ratio = pi["wall_s"] / oft["wall_s"] if pi and oft else None
        if ratio is not None:
            ratios.append(ratio)
        print(f"| {seed} | {cells[0]} | {cells[1]} | {'-' if ratio is None else f'{ratio:.2f}'} |")
    if ratios:
        print(f"wall-time ratio π / OFT: median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-"
              f"{max(ratios):.2f}, {len(ratios)} pairs)")
    for r in out["grpo"]:
        print(f"GRPO π seed {r['seed']}: eval success {r['start']['success_rate']:.2f} -> {r['success_rate']:.2f}, "
              f"return {r['start']['return']:.1f} -> {r['return']:.1f}; rollout return "
              f"{r['rollout_return_first']:.1f} -> {r['rollout_return_last']:.1f} ({r['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
