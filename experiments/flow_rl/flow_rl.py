"""RL for a flow-matching family through the service: a π-head tenant's PPO on PushCube next to the OFT head's.

One ``Nexus.local`` service; for each seed, two tenants that differ only in ``action_head`` (``pi`` and ``oft``)
run the demo's PPO job (``configs/demo/push-rl.toml``: tenant and job as the demo submits them, 120 annealed
updates of 16 episodes), one after the other, the order alternating from seed to seed so that a drift of the
machine's load falls on both families alike; each is then scored by a deterministic evaluation. Optionally a
π-head GRPO tenant runs the same job with ``algorithm = "grpo"`` (groups of 4 episodes reset with one seed) and is
evaluated before and after.

The wall time of a job is from its submission to its result (training only: rollouts and updates, not the
evaluation). The π head's RL policy is Flow-Noise with the noise on the last denoising step
(``nexus.model.policy``): the deterministic action is the flow from zero noise, as before.

    nice -n 10 python experiments/flow_rl/flow_rl.py                                # 3 seeds x {pi, oft}, grpo
    nice -n 10 python experiments/flow_rl/flow_rl.py --seeds 1 --grpo-updates 0     # one pair
"""

from __future__ import annotations

import argparse
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


def rollout_returns(nx, tenant: str) -> list[float]:
    log = nx.tenant_log(tenant)
    return [float(r["return"]) for j in sorted(log["jobs"], key=lambda j: j["t_submit"]) if j["kind"] == "rl"
            for r in j.get("history", []) if r.get("kind") == "rollout"]


def train_and_evaluate(nx, sub, family: str, seed: int, args: argparse.Namespace, algorithm: str = "ppo",
                       evaluate_start: bool = False) -> dict[str, Any]:
    """One tenant of the demo's submission with ``family`` and ``seed``: its RL job's wall time, its evaluations."""
    name = f"{family}-{algorithm}-s{seed}"
    spec = sub.tenant.model_copy(update={"name": name, "action_head": family, "seed": seed})
    job = sub.jobs[0].model_dump(exclude_unset=False) | {"updates": args.updates, "algorithm": algorithm}
    if algorithm == "grpo":  # the PPO section's shared fields, GRPO's groups
        ppo = job.pop("ppo")
        job["grpo"] = {k: ppo[k] for k in ("update_epochs", "minibatch_size", "target_kl", "anneal_lr")} | {
            "group_size": args.group_size}
    t = nx.create_tenant(spec)
    row: dict[str, Any] = {"tenant": name, "family": family, "algorithm": algorithm, "seed": seed}
    if evaluate_start:
        start = t.evaluate(episodes=args.eval_episodes).result()
        row["start"] = {"success_rate": start["success_rate"], "return": start["mean_return"]}
    load0, t0 = loadavg(), time.time()
    res = t.submit(job).result()
    row["wall_s"] = time.time() - t0
    row["load"] = [load0, loadavg()]
    ev = t.evaluate(episodes=args.eval_episodes).result()
    returns = rollout_returns(nx, name)
    k = max(1, len(returns) // 10)
    row |= {"version": res["version"], "success_rate": ev["success_rate"], "return": ev["mean_return"],
            "episodes": ev["episodes"], "rollout_return_first": sum(returns[:k]) / k,
            "rollout_return_last": sum(returns[-k:]) / k}
    print(f"{name:16s} v{row['version']:<4d} wall {row['wall_s']:7.0f} s  eval success {row['success_rate']:.2f} "
          f"return {row['return']:.1f}  rollout return {row['rollout_return_first']:.1f} -> "
          f"{row['rollout_return_last']:.1f}  load {row['load'][0]:.1f}/{row['load'][1]:.1f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--updates", type=int, default=120, help="updates per job (the demo's 120)")
    ap.add_argument("--eval-episodes", type=int, default=50)
    ap.add_argument("--grpo-updates", type=int, default=120, help="the π GRPO tenant's updates (0: none)")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--out", type=Path, default=HERE / "flow_rl.json")
    args = ap.parse_args()

    from nexus.client.api import Nexus
    from nexus.config.service import load_submission

    sub = load_submission([DEMO])
    root = Path(tempfile.mkdtemp(prefix="nexus-flow-rl-")) / "service"
    out: dict[str, Any] = {"env": sub.tenant.env, "demo": str(DEMO.relative_to(HERE.parents[1])),
                           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "ppo": [], "grpo": []}
    with Nexus.local(root, checkpoint_every=50) as nx:  # the demo's checkpoint interval
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for family in ("pi", "oft") if i % 2 == 0 else ("oft", "pi"):
                out["ppo"].append(train_and_evaluate(nx, sub, family, seed, args))
                args.out.write_text(json.dumps(out, indent=1))
        if args.grpo_updates:
            grpo_args = argparse.Namespace(**{**vars(args), "updates": args.grpo_updates})
            out["grpo"].append(train_and_evaluate(nx, sub, "pi", int(args.seeds.split(",")[0]), grpo_args, "grpo",
                                                  evaluate_start=True))
            args.out.write_text(json.dumps(out, indent=1))
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
