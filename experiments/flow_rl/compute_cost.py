"""What the π head costs an RL update next to the OFT head, in one process: the head compute only.

Both tenants are the demo's PushCube tenant (``configs/demo/push-rl.toml``: width 256, lr 5e-4) differing only in
``action_head``, on the service's default backbone (tiny Qwen3-VL, frozen, random weights). Per family and repetition:

* **act**: 400 sampled actions of 2 observations each (``VLAFramework.group_act``: one grouped backbone forward,
  then the head), the 800 steps of one update's 16 episodes at the demo's two envs per wave;
* **update**: the demo's PPO update on those 800 rows (8 epochs of minibatches of 200, clipped surrogate + value
  loss, one AdamW step per minibatch, gradient clip 0.5), on backbone features computed once.

Families alternate within each repetition (π, OFT, OFT, π, ...); the figure is the median over repetitions of
π's time over OFT's in the same repetition. The simulator's time (the same for both families, most of a service
update for OFT) is not in it.

    nice -n 10 python experiments/flow_rl/compute_cost.py --reps 5    # -> compute_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEMO = HERE.parents[1] / "configs" / "demo" / "push-rl.toml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=800, help="rows of one update (16 episodes x 50 steps)")
    ap.add_argument("--out", type=Path, default=HERE / "compute_cost.json")
    args = ap.parse_args()

    import numpy as np
    import torch

    from nexus.algorithms.ppo import PPOConfig, ppo_loss
    from nexus.config import catalog
    from nexus.config.service import load_submission
    from nexus.features import Observation
    from nexus.model.backbone import BackboneConfig, SharedBackbone
    from nexus.model.framework import VLAFramework
    from nexus.model.policy import TenantPolicy
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    sub = load_submission([DEMO])
    schema = catalog.env(sub.tenant["env"]).schema
    bcfg = BackboneConfig(size="tiny", image_size=64)
    fw = VLAFramework(SharedBackbone(bcfg))
    rng = np.random.default_rng(0)
    obs = [Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32), instruction=schema.instruction)
           for _ in range(args.steps)]
    cfg = PPOConfig(**sub.jobs[0]["ppo"])
    for family in ("pi", "oft"):
        spec = TenantSpec(**{**sub.tenant, "name": family, "action_head": family})
        policy = TenantPolicy.from_spec(spec, schema, fw.backbone.hidden_size)
        fw.add_tenant(family, policy, TenantPreprocessor(schema, bcfg))

    def act(family: str) -> float:
        t0 = time.perf_counter()
        for i in range(0, args.steps, 2):
            fw.group_act([(family, o) for o in obs[i:i + 2]], deterministic=False)
        return time.perf_counter() - t0

    def update(family: str) -> float:
        policy = fw.policies[family].train()
        feats, proprio = fw.tenant_features(family, obs)
        with torch.no_grad():
            actions, logprob, value = policy.act(feats, proprio)
        adv, ret = torch.randn(args.steps), value + torch.randn(args.steps)
        opt = torch.optim.AdamW(policy.parameters(), lr=float(sub.tenant["lr"]))
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for _ in range(cfg.update_epochs):
            perm = torch.randperm(args.steps, generator=gen)
            for s in range(0, args.steps, cfg.minibatch_size):
                mb = perm[s:s + cfg.minibatch_size]
                loss, _ = ppo_loss(policy, feats[mb], proprio[mb], actions[mb], logprob[mb], adv[mb], ret[mb], cfg)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), float(sub.tenant["grad_clip"]))
                opt.step()
        policy.eval()
        return time.perf_counter() - t0

    reps: list[dict[str, Any]] = []
    for r in range(args.reps):
        order = ("pi", "oft") if r % 2 == 0 else ("oft", "pi")
        row: dict[str, Any] = {"load": os.getloadavg()[0]}
        for family in order:
            row[f"{family}_act_s"] = act(family)
            row[f"{family}_update_s"] = update(family)
        for k in ("act", "update"):
            row[f"ratio_{k}"] = row[f"pi_{k}_s"] / row[f"oft_{k}_s"]
        row["ratio_total"] = (row["pi_act_s"] + row["pi_update_s"]) / (row["oft_act_s"] + row["oft_update_s"])
        reps.append(row)
        print(f"rep {r}: π act {row['pi_act_s']:.1f} s update {row['pi_update_s']:.1f} s | OFT act "
              f"{row['oft_act_s']:.1f} s update {row['oft_update_s']:.1f} s | ratio {row['ratio_total']:.2f} "
              f"(load {row['load']:.1f})", flush=True)
    summary = {k: {"median": statistics.median(x[k] for x in reps), "min": min(x[k] for x in reps),
                   "max": max(x[k] for x in reps)}
               for k in ("pi_act_s", "pi_update_s", "oft_act_s", "oft_update_s", "ratio_act", "ratio_update",
                         "ratio_total")}
    args.out.write_text(json.dumps({"demo": str(DEMO.relative_to(HERE.parents[1])), "steps": args.steps,
                                    "reps": reps, "summary": summary}, indent=1))
    print(f"\n| per update ({args.steps} steps) | π s | OFT s | π / OFT |\n|---|---:|---:|---:|")
    for k in ("act", "update"):
        print(f"| {k} | {summary[f'pi_{k}_s']['median']:.1f} | {summary[f'oft_{k}_s']['median']:.1f} | "
              f"{summary[f'ratio_{k}']['median']:.2f} ({summary[f'ratio_{k}']['min']:.2f}-"
              f"{summary[f'ratio_{k}']['max']:.2f}) |")
    t = summary["ratio_total"]
    print(f"| act + update | | | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) |  {args.reps} repetitions")


if __name__ == "__main__":
    main()
