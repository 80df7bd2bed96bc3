"""How many SFT steps does the demo's SFT tenant need before its evaluation shows real success?

Trains one action-module family on ``datasets/pickcube-scripted`` in one process through the actor's own
update function (``nexus.actor.tasks.update_sft``, as ``experiments/rl_learning/sft_families.py``
does) and, at each checkpoint step, runs deterministic closed-loop episodes of ``maniskill/pickcube-state``
(the demo's eval env, terminate-on-success as in the catalog). Prints a table (steps, SFT wall time,
held-out action MSE, success) and writes JSON next to this file. Used to choose the demo's head and budget.

    python experiments/demo_budget/sft_budget.py --family pi --backbone paligemma
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "rl_learning"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="pi", choices=("oft", "groot", "pi"))
    ap.add_argument("--backbone", default="paligemma", choices=("qwen3vl", "paligemma"))
    ap.add_argument("--checkpoints", type=int, nargs="+", default=[200, 400, 700, 1000, 1500])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--hidden-dim", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--env-episodes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dataset", default="pickcube-scripted")
    ap.add_argument("--out", default=str(HERE / "results.json"), help="the results file; this run is added under "
                    "its configuration's key")
    args = ap.parse_args()

    import tempfile

    import torch
    from sft_families import rollout

    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import update_sft
    from nexus.actor.tenant_slot import TenantSlot
    from nexus.config.service import ServiceConfig
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.spec import TenantSpec
    from nexus.wire.messages import SFTWork

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="nexus-sft-budget-"))
    cfg = ServiceConfig(root=str(work), backbone={"family": args.backbone, "size": "tiny"})
    svc = ActorHost(cfg)
    ds = svc.dataset(args.dataset)
    name = f"sft-{args.family}"
    spec = TenantSpec(name=name, dataset=args.dataset, action_head=args.family, chunk=args.chunk,
                      hidden_dim=args.hidden_dim, lr=args.lr, seed=args.seed)
    slot = svc.slots[name] = TenantSlot(spec, ds.schema, svc.feat_dim, grad_clip=spec.grad_clip)
    svc.framework.add_tenant(name, slot.policy, TenantPreprocessor(ds.schema, svc.backbone_cfg))
    rows, train_s, t_all = [], 0.0, time.time()
    step = 0
    for ck in sorted(args.checkpoints):
        t0 = time.time()
        m = {}
        while step < ck:
            m = update_sft(svc, slot, SFTWork(args.dataset, step, args.batch, eval_heldout=step == ck - 1))
            step += 1
        train_s += time.time() - t0
        t0 = time.time()
        env = rollout(svc, name, argparse.Namespace(dataset=args.dataset, env_episodes=args.env_episodes))
        rows.append({"steps": step, "train_s": round(train_s, 1), "loss": m["loss"],
                     "heldout_action_mse": m["heldout_action_mse"], "success_rate": env["success_rate"],
                     "mean_return": env["mean_return"], "eval_s": round(time.time() - t0, 1)})
        r = rows[-1]
        print(f"steps {r['steps']:5d}  train {r['train_s']:6.1f} s  loss {r['loss']:.4f}  held-out MSE "
              f"{r['heldout_action_mse']:.4f}  success {r['success_rate']:.2f} ({args.env_episodes} episodes, "
              f"eval {r['eval_s']:.0f} s)", flush=True)
    # one results file: each configuration's run under its own key (a rerun of a configuration replaces it)
    out = Path(args.out)
    runs = json.loads(out.read_text())["runs"] if out.exists() else {}
    runs[f"{args.family}_{args.backbone}_b{args.batch}_seed{args.seed}"] = {
        "meta": {**{k: v for k, v in vars(args).items() if k != "out"}, "wall_s": round(time.time() - t_all, 1),
                 "command": "python experiments/demo_budget/sft_budget.py " + " ".join(sys.argv[1:])},
        "rows": rows}
    out.write_text(json.dumps({"runs": dict(sorted(runs.items()))}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
