"""SFT is real for every action-module family: held-out action error on recorded ManiSkill demonstrations.

Each family (OFT, GR00T, π) is trained on ``datasets/pickcube-scripted`` (scripted PickCube expert,
state observations, 4-dim end-effector actions; ``nexus.data.offline_dataset.OfflineDataset`` with its
episode-level held-out split) through the actor's own update function, in one process:
``nexus.actor.tasks.update_sft`` on an ``ActorHost`` whose backbone is the family's
(Qwen3-VL for OFT / GR00T, PaliGemma for π), with the tenant's DeepSpeed slot. Targets are action chunks
(``--chunk`` steps, padded with the episode's last action). Held-out error is the MSE of the
deterministic action chunk (Gaussian mean; flow integrated from zero noise) against the demonstrations.
After training each policy also runs ``--env-episodes`` deterministic episodes in the simulator
(first action of each chunk), as a sanity check of closed-loop behaviour.

    python experiments/rl_learning/run.py sft                   # ~4 min on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
FAMILIES = ("oft", "groot", "pi")
BACKBONE = {"oft": "qwen3vl", "groot": "qwen3vl", "pi": "paligemma"}
LABEL = {"oft": "OFT", "groot": "GR00T", "pi": "π"}


def train_family(family: str, args) -> dict:
    import numpy as np
    import torch

    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import update_sft
    from nexus.actor.tenant_slot import TenantSlot
    from nexus.config.service import ServiceConfig
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.spec import TenantSpec
    from nexus.wire.messages import SFTWork

    work = Path(tempfile.mkdtemp(prefix=f"nexus-sft-{family}-"))
    cfg = ServiceConfig(root=str(work), backbone={"family": BACKBONE[family], "size": "tiny"})
    svc = ActorHost(cfg)
    ds = svc.dataset(args.dataset)
    name = f"sft-{family}"
    spec = TenantSpec(name=name, dataset=args.dataset, action_head=family, chunk=args.chunk, hidden_dim=args.hidden_dim,
                      lr=args.lr, seed=args.seed)
    slot = svc.slots[name] = TenantSlot(spec, ds.schema, svc.feat_dim, grad_clip=spec.grad_clip)
    svc.framework.add_tenant(name, slot.policy, TenantPreprocessor(ds.schema, svc.backbone_cfg))

    def heldout_mse() -> float:  # before any step (later points come from update_sft's own evaluation)
        from nexus.algorithms.sft import ActionChunks

        held = ds.heldout()
        everything = [ds.train(), held]
        chunks = ActionChunks(*(np.concatenate([a[k] for a in everything]) for k in ("episode", "step", "action")))
        feats, proprio = svc.features(name, ds.observations(held))
        with torch.no_grad():
            pred = slot.policy.mean_action(feats, proprio)
        return float((pred - torch.as_tensor(chunks.targets(held["episode"], held["step"], args.chunk))).pow(2).mean())

    t0 = time.time()
    curve = [{"step": 0, "heldout_action_mse": heldout_mse(), "loss": float("nan"), "time_s": 0.0}]
    for step in range(args.steps):
        evaluate = (step + 1) % args.eval_every == 0
        m = update_sft(svc, slot, SFTWork(args.dataset, step, args.batch, eval_heldout=evaluate))
        if evaluate:
            curve.append({"step": step + 1, "heldout_action_mse": m["heldout_action_mse"], "loss": m["loss"],
                          "time_s": time.time() - t0})
            print(f"  {LABEL[family]:6s} step {step + 1:4d}  loss {m['loss']:.4f}  held-out action MSE "
                  f"{m['heldout_action_mse']:.4f}", flush=True)
    train_s = time.time() - t0
    env_eval = rollout(svc, name, args) if args.env_episodes else None
    return {"family": family, "backbone": svc.backbone_cfg.compat_key(),
            "head_params": sum(p.numel() for p in slot.policy.parameters()), "curve": curve,
            "start": curve[0]["heldout_action_mse"], "end": curve[-1]["heldout_action_mse"], "train_s": train_s,
            "env_eval": env_eval}


def rollout(svc, name: str, args) -> dict:
    """Deterministic episodes in the dataset's env: the first action of each predicted chunk is executed."""
    from nexus.config import catalog
    from nexus.sim.environment import PolicyOutput, collect_episodes, episode_stats, make_env

    entry = catalog.env(catalog.dataset(args.dataset).env)
    env = make_env(entry, seed=0, num_envs=min(4, args.env_episodes))

    class Policy:
        def batch(self, observations: list) -> list:
            outs = svc.framework.group_act([(name, o) for o in observations], deterministic=True)
            return [PolicyOutput(action=o["raw_action"][:entry.schema.action_dim]) for o in outs]

        def __call__(self, obs):
            return self.batch([obs])[0]

    try:
        stats = episode_stats(collect_episodes(env, Policy(), args.env_episodes, seed=500_000, tenant=name))
    finally:
        env.close()
    return {"success_rate": stats["success_rate"], "mean_return": stats["mean_return"], "episodes": stats["episodes"]}


def baselines(args) -> dict:
    """Held-out MSE of trivial predictors: all zeros, and the train split's mean action chunk."""
    import numpy as np

    from nexus.algorithms.sft import ActionChunks
    from nexus.config import catalog
    from nexus.data.offline_dataset import OfflineDataset

    ds = OfflineDataset(catalog.dataset(args.dataset))
    train, held = ds.train(), ds.heldout()
    chunks = ActionChunks(*(np.concatenate([train[k], held[k]]) for k in ("episode", "step", "action")))
    target = chunks.targets(held["episode"], held["step"], args.chunk)
    mean = chunks.targets(train["episode"], train["step"], args.chunk).mean(0)
    return {"zeros": float((target ** 2).mean()), "train_mean": float(((target - mean) ** 2).mean()),
            "heldout_rows": len(held["step"]), "train_rows": len(train["step"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="pickcube-scripted")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--hidden-dim", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--env-episodes", type=int, default=20, help="0: skip the closed-loop check")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    base = baselines(args)
    print(f"{args.dataset}: {base['train_rows']} train / {base['heldout_rows']} held-out rows; held-out MSE of "
          f"zeros {base['zeros']:.4f}, of the train mean chunk {base['train_mean']:.4f}", flush=True)
    results = [train_family(f, args) for f in args.families]
    print(f"\n{'family':<8s}{'backbone':<26s}{'held-out MSE start':>20s}{'end':>10s}{'ratio':>8s}"
          f"{'env success':>13s}")
    for r in results:
        env = f"{r['env_eval']['success_rate']:.2f}" if r["env_eval"] else "-"
        print(f"{LABEL[r['family']]:<8s}{r['backbone']:<26s}{r['start']:>20.4f}{r['end']:>10.4f}"
              f"{r['end'] / r['start']:>8.3f}{env:>13s}")
    print(f"(baselines: zeros {base['zeros']:.4f}, train mean {base['train_mean']:.4f}; {time.time() - t0:.0f} s)")
    plot_path = HERE / "sft_families.png"
    plot(results, base, plot_path)
    out = HERE / "in_process.json"  # this experiment's in-process results, one section per script
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc["sft_families"] = {"meta": {**vars(args), "wall_s": round(time.time() - t0, 1), "torch": torch.__version__,
                                    "python": platform.python_version(), "plot": plot_path.name,
                                    "command": "python experiments/rl_learning/run.py sft " + " ".join(sys.argv[1:])},
                           "baselines": base, "results": results}
    out.write_text(json.dumps(doc, indent=1, default=float))
    print(f"wrote {out} and {plot_path}")


def plot(results: list[dict], base: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in results:
        ax.plot([c["step"] for c in r["curve"]], [c["heldout_action_mse"] for c in r["curve"]], "o-", ms=3,
                label=f"{LABEL[r['family']]} ({r['backbone'].split(':')[0]})")
    ax.axhline(base["zeros"], color="grey", ls=":", label="predict zeros")
    ax.axhline(base["train_mean"], color="black", ls="--", lw=0.8, label="predict the train mean")
    ax.set_yscale("log")
    ax.set_xlabel("SFT step (batch 64)")
    ax.set_ylabel("held-out action-chunk MSE")
    ax.set_title("SFT on pickcube-scripted, every action-module family")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
