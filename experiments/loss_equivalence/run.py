"""Paper Exp. 2, second half: does group batching change any tenant's learning?

Four π-style tenants on one PaliGemma backbone — two LIBERO-like, two CALVIN-like (schema-faithful
synthetic samples, ``nexus.model.synthetic_tenants``) — are trained twice from the same seeds for N SFT
steps: once **grouped** (each step, one backbone forward for all four tenants' batches, split per tenant)
and once **serial** (each tenant its own backbone forward). Everything else is identical: the data of
step k (seeded by tenant and k), the flow-matching noise and times (a generator seeded by tenant and k),
each tenant's own DeepSpeed ZeRO-2 engine and AdamW state. The only difference is which other samples
share the backbone forward, i.e. padding and batch shape, i.e. float rounding.

Prints per-tenant start / end losses and the maximum relative loss difference, writes JSON and one plot
with the loss curves overlaid (grouped solid, serial dashed) and the relative difference per step.

    python experiments/loss_equivalence/run.py                 # CPU, one torch thread, 150 steps (~3 min)
    python experiments/loss_equivalence/run.py --device cuda --size medium --image-size 224
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
TENANTS = (("libero-a", "libero", 0), ("libero-b", "libero", 1), ("calvin-a", "calvin", 2), ("calvin-b", "calvin", 3))


def build(args):
    """Backbone + two identical sets of slots (grouped, serial), each with its framework registration."""
    from nexus.actor.tenant_slot import TenantSlot
    from nexus.model.backbone import BackboneConfig, SharedBackbone
    from nexus.model.framework import VLAFramework
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.model.synthetic_tenants import CALVIN_LIKE, LIBERO_LIKE, SyntheticTenant
    from nexus.spec import TenantSpec

    cfg = BackboneConfig(family="paligemma", size=args.size, image_size=args.image_size, dtype=args.dtype,
                         device=args.device)
    backbone = SharedBackbone(cfg)
    schemas = {"libero": LIBERO_LIKE, "calvin": CALVIN_LIKE}
    frameworks, slots, data = {}, {}, {}
    for mode in ("grouped", "serial"):
        frameworks[mode] = VLAFramework(backbone)
        slots[mode] = {}
        for name, kind, seed in TENANTS:
            spec = TenantSpec(name=name, env="maniskill/pushcube-state", action_head="pi", chunk=args.chunk,
                              hidden_dim=args.hidden_dim, lr=args.lr, seed=seed)
            slots[mode][name] = TenantSlot(spec, schemas[kind], backbone.hidden_size)
            frameworks[mode].add_tenant(name, slots[mode][name].policy, TenantPreprocessor(schemas[kind], cfg))
            data[name] = SyntheticTenant(schemas[kind], chunk=args.chunk)
    return backbone, frameworks, slots, data


def step_batch(fw, data, step: int, batch: int):
    """Step ``step``'s requests of every tenant (interleaved arrival) and their action chunks."""
    import torch

    per, targets = [], {}
    for name, _, seed in TENANTS:
        obs, actions = data[name].batch(batch, (seed, step))
        per.append([(name, fw.preprocess(name, o)) for o in obs])
        targets[name] = torch.from_numpy(actions)
    return [r for k in range(batch) for rs in per for r in rs[k:k + 1]], targets


def train_step(slot, seed: int, step: int, cond, reqs, idx, target) -> float:
    import numpy as np
    import torch

    from nexus.algorithms.sft import sft_loss

    proprio = torch.from_numpy(np.stack([reqs[i][1].proprio for i in idx]))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)  # same noise/times in both modes
    return slot.train_step(lambda p: sft_loss(p, cond, proprio, target, gen))["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=8, help="local batch per tenant")
    ap.add_argument("--chunk", type=int, default=10, help="action chunk (π0.5 on LIBERO: 10)")
    ap.add_argument("--hidden-dim", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--size", default="small", help="PaliGemma size preset")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()

    import numpy as np
    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    t0 = time.time()
    backbone, fws, slots, data = build(args)
    names = [n for n, _, _ in TENANTS]
    losses = {mode: {n: [] for n in names} for mode in ("grouped", "serial")}
    calls = {}
    for step in range(args.steps):
        reqs, targets = step_batch(fws["grouped"], data, step, args.batch)
        before = backbone.forward_calls
        for name, (idx, cond) in fws["grouped"].group_features(reqs).items():
            seed = dict((n, s) for n, _, s in TENANTS)[name]
            losses["grouped"][name].append(train_step(slots["grouped"][name], seed, step, cond, reqs, idx,
                                                      targets[name]))
        calls["grouped"] = backbone.forward_calls - before
        before = backbone.forward_calls
        for name, _, seed in TENANTS:
            own = [r for r in reqs if r[0] == name]
            (idx, cond), = fws["serial"].group_features(own).values()
            losses["serial"][name].append(train_step(slots["serial"][name], seed, step, cond, own, idx,
                                                     targets[name]))
        calls["serial"] = backbone.forward_calls - before
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  " + "  ".join(f"{n} {losses['grouped'][n][-1]:.4f}/{losses['serial'][n][-1]:.4f}"
                                                   for n in names), flush=True)

    g = np.array([losses["grouped"][n] for n in names])
    s = np.array([losses["serial"][n] for n in names])
    rel = np.abs(g - s) / np.maximum(np.abs(s), 1e-12)
    param_diff = {n: max(float((a - b).detach().abs().max()) for a, b in zip(slots["grouped"][n].policy.parameters(),
                                                                      slots["serial"][n].policy.parameters(),
                                                                      strict=True)) for n in names}
    summary = {n: {"loss_start": float(s[i, 0]), "loss_end_mean10": float(s[i, -10:].mean()),
                   "max_rel_diff": float(rel[i].max()), "max_abs_param_diff": param_diff[n]}
               for i, n in enumerate(names)}
    print(f"\n{'tenant':<10s}{'loss start':>12s}{'loss end (mean 10)':>20s}{'max rel diff':>14s}{'max |Δθ|':>12s}")
    for n, v in summary.items():
        print(f"{n:<10s}{v['loss_start']:>12.4f}{v['loss_end_mean10']:>20.4f}{v['max_rel_diff']:>14.2e}"
              f"{v['max_abs_param_diff']:>12.2e}")
    print(f"\nbackbone forwards per step: grouped {calls['grouped']}, serial {calls['serial']}")
    print(f"maximum relative loss difference grouped vs serial over {args.steps} steps x 4 tenants: "
          f"{rel.max():.2e} (first step: {rel[:, 0].max():.2e})")

    plot_path = HERE / f"loss_curves_{args.device}.png"
    plot(names, g, s, rel, plot_path)
    out = HERE / f"results_{args.device}.json"
    out.write_text(json.dumps({
        "meta": {**vars(args), "backbone": backbone.compat_key, "torch": torch.__version__,
                 "python": platform.python_version(), "torch_threads": torch.get_num_threads(),
                 "wall_s": round(time.time() - t0, 1), "plot": plot_path.name,
                 "command": "python experiments/loss_equivalence/run.py " + " ".join(sys.argv[1:])},
        "max_rel_diff": float(rel.max()), "max_rel_diff_first_step": float(rel[:, 0].max()),
        "summary": summary, "losses": {m: {n: v for n, v in d.items()} for m, d in losses.items()}}, indent=1))
    print(f"wrote {out} and {plot_path} ({time.time() - t0:.0f} s)")


def plot(names, grouped, serial, rel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    steps = range(grouped.shape[1])
    import numpy as np

    exact = float((rel == 0).mean())
    for i, n in enumerate(names):
        top.plot(steps, grouped[i], color=colours[i], lw=1.2, label=f"{n} grouped (line)")
        top.plot(steps, serial[i], color=colours[i], ls="none", marker="o", ms=4, mfc="none", markevery=3,
                 label=f"{n} serial (circles)")
        nonzero = np.where(rel[i] > 0, rel[i], np.nan)  # exact equality has no place on a log axis
        bottom.semilogy(steps, nonzero, color=colours[i], ls="none", marker=".", ms=4, label=n)
    top.set_ylabel("flow-matching SFT loss")
    top.set_yscale("log")
    top.set_title("4 π-style tenants (2 LIBERO-like, 2 CALVIN-like): grouped vs serial, same seeds")
    top.legend(ncol=2, fontsize=8)
    bottom.set_ylabel("|grouped − serial| / serial")
    bottom.set_xlabel("SFT step")
    bottom.set_title(f"max relative difference {rel.max():.1e}; bit-identical at {exact:.0%} of the points "
                     "(not drawn)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
