"""Paper Exp. 2: group batching. Speed-up of one shared-backbone forward for the requests of many tenants
over one forward per tenant, and of the whole training step built on it, measured side by side.

Grid: tenants {2, 4, 6, 8} x local batch {1, 2, 4, 8} x action-module family {GR00T, OFT, π}; GR00T
and OFT tenants share a Qwen3-VL backbone (StarVLA), π tenants a PaliGemma backbone (OpenPI).
Tenants are heterogeneous (LIBERO-like: 2 x 128 px cameras, 8-dim proprio; CALVIN-like: 200 + 84 px
cameras, 15-dim proprio; ManiSkill PickCube rgb: one 64 px camera, 29-dim proprio) with schema-faithful
synthetic samples (``nexus.model.synthetic_tenants``), each with its own DeepSpeed slot.

- forward, grouped: ``VLAFramework.group_features`` on every tenant's requests (one backbone call);
  serial: one call per tenant. Both include tokenization + image patching (the processor) and the
  model forward, not the per-tenant preprocessing (same in both modes).
- train step, grouped: the grouped forward, then each tenant's SFT loss, backward and DeepSpeed step
  on its own rows; serial: per tenant, its own forward then its step (the paper's one-call-per-tenant).
Repetitions alternate grouped and serial (ABBA order) so drift hits both; medians are compared.

    python experiments/group_batching/bench.py                    # CPU, one torch thread (~10 min)
    python experiments/group_batching/bench.py --device cuda      # GPU: bf16, larger backbones, 224 px
    python experiments/group_batching/bench.py --replot experiments/group_batching/results_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
FAMILIES = ("groot", "oft", "pi")
LABEL = {"groot": "GR00T (Qwen3-VL)", "oft": "OFT (Qwen3-VL)", "pi": "π (PaliGemma)"}
BACKBONE = {"groot": "qwen3vl", "oft": "qwen3vl", "pi": "paligemma"}
CHUNK = {"groot": 16, "oft": 8, "pi": 10}  # GR00T N1: 16; OpenVLA-OFT LIBERO: 8; π0.5 LIBERO: 10
PAPER_8X4 = {"groot": 2.21, "oft": 3.24, "pi": 1.71}  # shared-backbone forward speed-up, 8 tenants x batch 4
# backbone size preset, image side, dtype per device (bf16 is 3-4x slower than fp32 on an AVX2 CPU), and the
# action-module width: heads stay a fraction of the backbone, as in the paper's models (the CPU backbone is tiny)
PRESETS = {"cpu": dict(size="small", image_size=64, dtype="float32"),
           "cuda": dict(size="medium", image_size=224, dtype="bfloat16")}
HEAD_WIDTH = {"cpu": 128, "cuda": 512}


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class FamilyBench:
    """One backbone and ``max_tenants`` tenant slots of one family; times grouped vs serial calls."""

    def __init__(self, family: str, device: str, max_tenants: int, hidden_dim: int, size: str | None = None) -> None:
        from nexus.actor.tenant_slot import TenantSlot
        from nexus.model.backbone import BackboneConfig, SharedBackbone
        from nexus.model.framework import VLAFramework
        from nexus.model.preprocessor import TenantPreprocessor
        from nexus.model.synthetic_tenants import SyntheticTenant, tenant_schemas
        from nexus.spec import TenantSpec

        self.family, self.device = family, device
        self.cfg = BackboneConfig(family=BACKBONE[family], device=device, **{**PRESETS[device], **(
            {"size": size} if size else {})})
        self.backbone = SharedBackbone(self.cfg)
        self.framework = VLAFramework(self.backbone)
        schemas = list(tenant_schemas().items())
        self.tenants: list[str] = []
        self.slots, self.data = {}, {}
        for i in range(max_tenants):
            kind, schema = schemas[i % len(schemas)]
            name = f"{kind}-{i}"
            spec = TenantSpec(name=name, env="maniskill/pushcube-state", action_head=family, chunk=CHUNK[family],
                              hidden_dim=hidden_dim, seed=i, lr=1e-4)
            self.slots[name] = TenantSlot(spec, schema, self.backbone.hidden_size)
            self.framework.add_tenant(name, self.slots[name].policy, TenantPreprocessor(schema, self.cfg))
            self.data[name] = SyntheticTenant(schema, chunk=CHUNK[family])
            self.tenants.append(name)

    def requests(self, n_tenants: int, batch: int, seed: int):
        """Every tenant's ``batch`` preprocessed requests (arrival interleaved) and its action targets."""
        import torch

        per, targets = [], {}
        for i, name in enumerate(self.tenants[:n_tenants]):
            obs, actions = self.data[name].batch(batch, (seed, i))
            per.append([(name, self.framework.preprocess(name, o)) for o in obs])
            targets[name] = torch.from_numpy(actions)
        reqs = [r for k in range(batch) for rs in per for r in rs[k:k + 1]]  # round-robin arrival
        return reqs, targets

    def _step(self, name: str, idx: list[int], cond, reqs, targets, seed: int) -> None:
        import numpy as np
        import torch

        from nexus.algorithms.sft import sft_loss

        proprio = torch.from_numpy(np.stack([reqs[i][1].proprio for i in idx]))
        target = targets[name][: len(idx)]
        gen = torch.Generator().manual_seed(seed)
        self.slots[name].train_step(lambda p: sft_loss(p, cond, proprio, target, gen))

    def forward(self, reqs, grouped: bool) -> None:
        if grouped:
            self.framework.group_features(reqs)
        else:
            for name in dict.fromkeys(t for t, _ in reqs):
                self.framework.group_features([r for r in reqs if r[0] == name])
        sync(self.device)

    def train_step(self, reqs, targets, grouped: bool, seed: int) -> None:
        if grouped:
            for name, (idx, cond) in self.framework.group_features(reqs).items():
                self._step(name, idx, cond, reqs, targets, seed)
        else:
            for name in dict.fromkeys(t for t, _ in reqs):
                own = [r for r in reqs if r[0] == name]
                (idx, cond), = self.framework.group_features(own).values()
                self._step(name, idx, cond, own, targets, seed)
        sync(self.device)

    def measure(self, n_tenants: int, batch: int, reps: int) -> dict:
        reqs, targets = self.requests(n_tenants, batch, seed=n_tenants * 100 + batch)
        times: dict[str, list[float]] = {k: [] for k in ("fg", "fs", "sg", "ss")}
        for kind in ("f", "s"):
            run = (lambda g: self.forward(reqs, g)) if kind == "f" else \
                (lambda g: self.train_step(reqs, targets, g, seed=0))
            run(True)  # warm-up (allocator, kernels, lazy inits)
            run(False)
            for r in range(reps):
                order = (True, False) if r % 2 == 0 else (False, True)  # ABBA
                for grouped in order:
                    t0 = time.perf_counter()
                    run(grouped)
                    times[kind + ("g" if grouped else "s")].append(time.perf_counter() - t0)
        calls0 = self.backbone.forward_calls
        self.forward(reqs, True)
        calls_grouped = self.backbone.forward_calls - calls0
        # token slots the text model runs over (real + padding): one left-padded batch vs one per tenant
        slots_grouped = self.token_slots([f for _, f in reqs])
        slots_serial = sum(self.token_slots([f for t, f in reqs if t == name])
                           for name in dict.fromkeys(t for t, _ in reqs))
        med = {k: statistics.median(v) for k, v in times.items()}
        return {"family": self.family, "tenants": n_tenants, "batch": batch, "samples": n_tenants * batch,
                "forward_grouped_s": med["fg"], "forward_serial_s": med["fs"],
                "forward_speedup": med["fs"] / med["fg"],
                "step_grouped_s": med["sg"], "step_serial_s": med["ss"], "step_speedup": med["ss"] / med["sg"],
                "backbone_calls_grouped": calls_grouped, "backbone_calls_serial": n_tenants,
                "token_slots_grouped": slots_grouped, "token_slots_serial": slots_serial,
                "padding_overhead": slots_grouped / slots_serial - 1.0}

    def token_slots(self, feats: list) -> int:
        ids = self.backbone.family.prepare(feats)["input_ids"]
        return int(ids.shape[0] * ids.shape[1])


def print_tables(results: list[dict], tenants: list[int], batches: list[int]) -> None:
    for family in FAMILIES:
        rows = [r for r in results if r["family"] == family]
        if not rows:
            continue
        print(f"\n{LABEL[family]}: speed-up grouped vs one call per tenant — forward / whole train step")
        print("tenants \\ batch " + "".join(f"{b:>16d}" for b in batches))
        for t in tenants:
            cells = []
            for b in batches:
                r = next((x for x in rows if x["tenants"] == t and x["batch"] == b), None)
                cells.append(f"{r['forward_speedup']:6.2f}x /{r['step_speedup']:5.2f}x" if r else "-")
            print(f"{t:>15d} " + "".join(f"{c:>16s}" for c in cells))
    print("\n8 tenants x batch 4 (paper: shared-backbone forward):")
    print(f"{'family':<20s}{'ours forward':>14s}{'ours step':>12s}{'paper forward':>15s}")
    for family in FAMILIES:
        r = next((x for x in results if x["family"] == family and x["tenants"] == 8 and x["batch"] == 4), None)
        if r:
            print(f"{LABEL[family]:<20s}{r['forward_speedup']:>13.2f}x{r['step_speedup']:>11.2f}x"
                  f"{PAPER_8X4[family]:>14.2f}x")


def plot(results: list[dict], tenants: list[int], batches: list[int], device: str, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    paths = []
    for family in FAMILIES:
        rows = [r for r in results if r["family"] == family]
        if not rows:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.3), layout="constrained")
        for ax, key, title in ((axes[0], "forward_speedup", "shared-backbone forward"),
                               (axes[1], "step_speedup", "whole train step")):
            grid = np.full((len(tenants), len(batches)), np.nan)
            for r in rows:
                grid[tenants.index(r["tenants"]), batches.index(r["batch"])] = r[key]
            # diverging around 1x: blue where grouping pays, red where it costs
            norm = TwoSlopeNorm(vmin=min(0.5, np.nanmin(grid)), vcenter=1.0, vmax=max(2.0, np.nanmax(grid)))
            im = ax.imshow(grid, origin="lower", cmap="RdBu", norm=norm)
            for i in range(len(tenants)):
                for j in range(len(batches)):
                    if np.isfinite(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2f}x", ha="center", va="center", color="k", fontsize=9)
            ax.set_xticks(range(len(batches)), batches)
            ax.set_yticks(range(len(tenants)), tenants)
            ax.set_xlabel("local batch per tenant")
            ax.set_ylabel("tenants")
            ax.set_title(title)
            fig.colorbar(im, ax=ax, shrink=0.8)
        fig.suptitle(f"{LABEL[family]}: grouped vs one call per tenant ({device}); paper 8x4: "
                     f"{PAPER_8X4[family]:.2f}x")
        path = out_dir / f"heatmap_{family}_{device}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path.relative_to(HERE.parents[1])))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    ap.add_argument("--tenants", nargs="+", type=int, default=[2, 4, 6, 8])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per mode (medians compared)")
    ap.add_argument("--hidden-dim", type=int, default=None, help="action-module width (default: per device)")
    ap.add_argument("--size", default=None, help="backbone size preset (default: small on cpu, medium on cuda)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: results_<device>.json here)")
    ap.add_argument("--replot", type=Path, default=None, help="only redraw tables and plots from a results JSON")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        res = saved["results"]
        tenants, batches = sorted({r["tenants"] for r in res}), sorted({r["batch"] for r in res})
        print_tables(res, tenants, batches)
        print("\n".join(plot(res, tenants, batches, saved["meta"]["device"], HERE)))
        return

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible")
    if args.device == "cpu":
        torch.set_num_threads(1)
    results: list[dict] = []
    t_start = time.time()
    for family in args.families:
        t0 = time.time()
        bench = FamilyBench(family, args.device, max(args.tenants), args.hidden_dim or HEAD_WIDTH[args.device],
                            args.size)
        params = sum(p.numel() for p in bench.backbone.model.parameters())
        print(f"{LABEL[family]}: backbone {bench.cfg.compat_key()} ({params / 1e6:.1f} M params), "
              f"head {sum(p.numel() for p in next(iter(bench.slots.values())).policy.parameters()) / 1e6:.2f} M, "
              f"chunk {CHUNK[family]}", flush=True)
        for n in args.tenants:
            for b in args.batches:
                r = bench.measure(n, b, args.reps)
                r.update(backbone=bench.cfg.compat_key(), backbone_params=params)
                results.append(r)
                print(f"  {n} tenants x batch {b}: forward {r['forward_serial_s'] * 1e3:7.1f} -> "
                      f"{r['forward_grouped_s'] * 1e3:7.1f} ms ({r['forward_speedup']:.2f}x), step "
                      f"{r['step_serial_s'] * 1e3:7.1f} -> {r['step_grouped_s'] * 1e3:7.1f} ms "
                      f"({r['step_speedup']:.2f}x), padding +{r['padding_overhead']:.0%}", flush=True)
        print(f"  ({time.time() - t0:.0f} s)")
        del bench
    print_tables(results, args.tenants, args.batches)
    plots = plot(results, args.tenants, args.batches, args.device, HERE)
    out = args.out or HERE / f"results_{args.device}.json"
    meta = {"device": args.device, "preset": {**PRESETS[args.device], **({"size": args.size} if args.size else {})},
            "head_width": args.hidden_dim or HEAD_WIDTH[args.device], "chunk": CHUNK, "reps": args.reps,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "wall_s": round(time.time() - t_start, 1),
            "paper_8x4_forward_speedup": PAPER_8X4, "plots": plots,
            "command": "python experiments/group_batching/bench.py " + " ".join(sys.argv[1:])}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {out} and {', '.join(plots)} ({meta['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
