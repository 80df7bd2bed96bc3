"""Tenant LoRA adapters on the shared backbone: what a mixed-adapter grouped forward buys, what an adapter
costs per tenant slot, and what it gains in SFT — heads only vs LoRA rank 8 / 16, measured in one run.

Throughput (tenants {1, 4, 8}, each with its own DeepSpeed ZeRO-2 slot; heterogeneous schemas —
LIBERO-like, CALVIN-like, ManiSkill PickCube rgb — with schema-faithful synthetic samples, ``--batch``
observations per tenant):

- inference, grouped: ``VLAFramework.group_act`` over every tenant's requests: one backbone forward,
  each row under its tenant's adapter (S-LoRA / Punica style: the base matmuls shared, each adapter's
  low-rank product on its own rows), each tenant's head on its rows; serial: one call per tenant.
- training step, grouped: ``nexus.actor.tenant_slot.grouped_forward_backward`` (one grouped forward
  and one backbone backward for all tenants' adapters, each tenant's loss and gradients through its own
  engine) + each slot's optimizer step; serial: per tenant, its own forward (through its adapter, with
  autograd for LoRA) and step. Heads-only tenants train on frozen (no-grad) features in both modes.
- grouped and serial alternate in ABBA order; medians of ``--reps``; ratios are serial / grouped.

Memory per tenant slot: parameters (head + value head, adapter) and AdamW state (the ZeRO fp32 master
partition + both moments), counted from the engine's own tensors; on cuda also the allocated GPU memory
per slot created, measured.

SFT held-out error: ``--sft-dataset`` (default ``robosuite-lift-scripted``: LIBERO-schema Panda Lift with
agent-view + wrist cameras, so the backbone's features matter) through the actor's own update function
(``nexus.actor.tasks.update_sft``), heads only vs LoRA at each rank, same seed and batches;
held-out action MSE of the deterministic action on the dataset's episode-level held-out split.

    python experiments/lora/bench.py                  # CPU, one torch thread
    python experiments/lora/bench.py --device cuda    # GPU: bf16 backbone, medium preset, 224 px
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
PRESETS = {"cpu": dict(size="small", image_size=64, dtype="float32"),
           "cuda": dict(size="medium", image_size=224, dtype="bfloat16")}
HEAD_WIDTH = {"cpu": 128, "cuda": 512}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHUNK = 8  # OpenVLA-OFT's LIBERO chunk


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def lora_of(rank: int, targets: tuple[str, ...]):
    from nexus.spec import LoraConfig

    return None if rank == 0 else LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=targets)


def label(rank: int) -> str:
    return "heads only" if rank == 0 else f"LoRA r{rank}"


class Setup:
    """``n`` tenant slots of one configuration (heads only or LoRA of one rank) on one shared backbone."""

    def __init__(self, backbone, n: int, rank: int, args) -> None:
        import torch

        from nexus.actor.tenant_slot import TenantSlot
        from nexus.model.framework import VLAFramework
        from nexus.model.preprocessor import TenantPreprocessor
        from nexus.model.synthetic_tenants import SyntheticTenant, tenant_schemas
        from nexus.spec import TenantSpec

        self.device, self.framework, self.slots, self.data = args.device, VLAFramework(backbone), [], {}
        schemas = list(tenant_schemas().items())
        lora = lora_of(rank, tuple(args.targets))
        for i in range(n):
            kind, schema = schemas[i % len(schemas)]
            name = f"{kind}-{i}"
            spec = TenantSpec(name=name, env="maniskill/pushcube-state", chunk=CHUNK, hidden_dim=args.hidden_dim,
                              seed=i, lr=1e-4, lora=lora)
            # (a fresh adapter's B is zero; its matmuls cost the same as a trained one's)
            slot = TenantSlot(spec, schema, backbone.hidden_size, lora_shapes=backbone.lora_shapes(lora))
            self.framework.add_tenant(name, slot.policy, TenantPreprocessor(schema, backbone.cfg))
            self.slots.append(slot)
            obs, actions = SyntheticTenant(schema, chunk=CHUNK).batch(args.batch, 7 * i + 1)
            self.data[name] = (obs, torch.from_numpy(actions))

    def infer_grouped(self) -> None:
        self.framework.group_act([(s.name, o) for s in self.slots for o in self.data[s.name][0]], deterministic=True)
        sync(self.device)

    def infer_serial(self) -> None:
        for s in self.slots:
            self.framework.group_act([(s.name, o) for o in self.data[s.name][0]], deterministic=True)
        sync(self.device)

    def train_grouped(self) -> None:
        from nexus.actor.tenant_slot import grouped_forward_backward
        from nexus.algorithms.sft import sft_loss

        work = [(s, self.data[s.name][0], lambda p, f, pr, a=self.data[s.name][1]: sft_loss(p, f, pr, a))
                for s in self.slots]
        grouped_forward_backward(self.framework, work)
        for s in self.slots:
            s.optim_step()
        sync(self.device)

    def train_serial(self) -> None:
        from nexus.algorithms.sft import sft_loss

        for s in self.slots:
            obs, actions = self.data[s.name]
            feats, proprio = self.framework.tenant_features(s.name, obs)
            s.train_step(lambda p, feats=feats, proprio=proprio, a=actions: sft_loss(p, feats, proprio, a))
        sync(self.device)


def abba(a, b, reps: int) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``, alternating a b b a ... so drift hits both (one warm-up each)."""
    a(), b()
    ta, tb = [], []
    for r in range(reps):
        for fn, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def slot_memory(slot) -> dict[str, float]:
    """Bytes a slot owns: parameters, and the optimizer's tensors (ZeRO fp32 master partition, AdamW moments)."""
    import torch

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    policy = slot.policy
    adapter = list(policy.lora.parameters()) if policy.lora is not None else []
    zero = slot.engine.optimizer
    opt = nbytes(t for st in zero.optimizer.state.values() for t in st.values())
    master = nbytes(getattr(zero, "single_partition_of_fp32_groups", []))
    return {"head_params": sum(p.numel() for p in policy.parameters()) - sum(p.numel() for p in adapter),
            "adapter_params": sum(p.numel() for p in adapter),
            "param_bytes": nbytes(policy.parameters()), "optimizer_bytes": opt + master}


def measured_slot_growth(backbone, rank: int, args, n: int = 4) -> float | None:
    """GPU memory allocated per slot created (after one train step, so the optimizer state exists).

    None on CPU: the process RSS moves with allocator reuse by more than a slot's few MiB."""
    import gc

    import torch

    if args.device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    setup = Setup(backbone, n, rank, args)
    setup.train_serial()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    del setup
    return (after - before) / n


def throughput(args) -> tuple[list[dict], dict]:
    import torch

    from nexus.model.backbone import BackboneConfig, SharedBackbone

    cfg = BackboneConfig(family="qwen3vl", device=args.device, **{**PRESETS[args.device],
                                                                  **({"size": args.size} if args.size else {})})
    backbone = SharedBackbone(cfg)
    rows, memory = [], {}
    for rank in args.ranks:
        mem = None
        for n in args.tenants:
            setup = Setup(backbone, n, rank, args)
            if mem is None:
                mem = slot_memory(setup.slots[0])
            ig, is_ = abba(setup.infer_grouped, setup.infer_serial, args.reps)
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            tg, ts = abba(setup.train_grouped, setup.train_serial, args.reps)
            peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
            row = {"config": label(rank), "rank": rank, "tenants": n, "batch": args.batch,
                   "infer_grouped_ms": 1e3 * ig, "infer_serial_ms": 1e3 * is_, "infer_speedup": is_ / ig,
                   "train_grouped_ms": 1e3 * tg, "train_serial_ms": 1e3 * ts, "train_speedup": ts / tg,
                   "peak_gpu_bytes": peak}
            rows.append(row)
            print(f"  {row['config']:10s} tenants {n}: inference grouped {row['infer_grouped_ms']:.1f} ms vs serial "
                  f"{row['infer_serial_ms']:.1f} ms ({row['infer_speedup']:.2f}x); train step grouped "
                  f"{row['train_grouped_ms']:.1f} ms vs serial {row['train_serial_ms']:.1f} ms "
                  f"({row['train_speedup']:.2f}x)", flush=True)
            del setup
        mem["measured_bytes_per_slot"] = measured_slot_growth(backbone, rank, args)
        memory[label(rank)] = mem
    heads = {r["tenants"]: r for r in rows if r["rank"] == 0}
    for r in rows:  # what an adapter costs next to heads only, same tenants, same run
        if r["tenants"] in heads:
            r["infer_vs_heads"] = r["infer_grouped_ms"] / heads[r["tenants"]]["infer_grouped_ms"]
            r["train_vs_heads"] = r["train_grouped_ms"] / heads[r["tenants"]]["train_grouped_ms"]
    return rows, {"backbone": cfg.compat_key(), "backbone_params": sum(p.numel() for p in backbone.model.parameters()),
                  "memory": memory}


def sft(args) -> list[dict]:
    import numpy as np
    import torch

    from nexus.actor.host import ActorHost
    from nexus.actor.tasks import update_sft
    from nexus.actor.tenant_slot import TenantSlot
    from nexus.config.service import ServiceConfig
    from nexus.model.preprocessor import TenantPreprocessor
    from nexus.spec import TenantSpec
    from nexus.wire.messages import SFTWork

    work = Path(tempfile.mkdtemp(prefix="nexus-lora-sft-"))
    cfg = ServiceConfig(root=str(work), backbone={"family": "qwen3vl", "device": args.device,
                                                  **PRESETS[args.device], **({"size": args.size} if args.size else {})})
    svc = ActorHost(cfg)
    ds = svc.dataset(args.sft_dataset)
    out = []
    for rank in args.ranks:
        lora = lora_of(rank, tuple(args.targets))
        name = f"sft-r{rank}"
        spec = TenantSpec(name=name, dataset=args.sft_dataset, hidden_dim=args.hidden_dim, lr=args.sft_lr,
                          seed=args.seed, lora=lora)
        slot = svc.slots[name] = TenantSlot(spec, ds.schema, svc.feat_dim, grad_clip=spec.grad_clip,
                                            lora_shapes=svc.framework.backbone.lora_shapes(lora))
        svc.framework.add_tenant(name, slot.policy, TenantPreprocessor(ds.schema, svc.backbone_cfg))
        held = ds.heldout()
        hf, hp = svc.features(name, ds.observations(held))
        with torch.no_grad():
            first = float((slot.policy.mean_action(hf, hp) - torch.as_tensor(held["action"])).pow(2).mean())
        curve = [{"step": 0, "heldout_action_mse": first}]
        t0 = time.time()
        for step in range(args.sft_steps):
            evaluate = (step + 1) % args.eval_every == 0 or step + 1 == args.sft_steps
            m = update_sft(svc, slot, SFTWork(args.sft_dataset, step, args.sft_batch, eval_heldout=evaluate))
            if evaluate:
                curve.append({"step": step + 1, "heldout_action_mse": m["heldout_action_mse"], "loss": m["loss"]})
        seconds = time.time() - t0
        final = curve[-1]["heldout_action_mse"]
        out.append({"config": label(rank), "rank": rank, "dataset": args.sft_dataset, "steps": args.sft_steps,
                    "heldout_rows": int(len(held["action"])), "heldout_mse_start": first, "heldout_mse_end": final,
                    "heldout_mse_best": float(np.min([c["heldout_action_mse"] for c in curve])),
                    "s_per_step": seconds / args.sft_steps, "curve": curve})
        print(f"  SFT {label(rank):10s}: held-out action MSE {first:.4f} -> {final:.4f} "
              f"({seconds / args.sft_steps * 1e3:.0f} ms/step)", flush=True)
    return out


def table(rows: list[dict], meta: dict, sft_rows: list[dict]) -> str:
    lines = [f"backbone {meta['backbone']} ({meta['backbone_params'] / 1e6:.1f} M params); LoRA on "
             f"{', '.join(ALL_LINEAR) if meta['targets'] == list(ALL_LINEAR) else ', '.join(meta['targets'])}; "
             f"{meta['batch']} observations per tenant",
             "",
             "| config | tenants | inference grouped ms | serial ms | speed-up | train step grouped ms | serial ms "
             "| speed-up | grouped vs heads only (infer / train) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = "-" if r["rank"] == 0 else f"{r.get('infer_vs_heads', float('nan')):.2f}x / " \
                                         f"{r.get('train_vs_heads', float('nan')):.2f}x"
        lines.append(f"| {r['config']} | {r['tenants']} | {r['infer_grouped_ms']:.1f} | {r['infer_serial_ms']:.1f} | "
                     f"{r['infer_speedup']:.2f}x | {r['train_grouped_ms']:.1f} | {r['train_serial_ms']:.1f} | "
                     f"{r['train_speedup']:.2f}x | {vs} |")
    lines += ["", "| config | head params | adapter params | param + optimizer bytes per slot "
                  "| measured per slot (GPU) |",
              "|---|---|---|---|---|"]
    for name, m in meta["memory"].items():
        lines.append(f"| {name} | {m['head_params']:,} | {m['adapter_params']:,} | "
                     f"{(m['param_bytes'] + m['optimizer_bytes']) / 2**20:.2f} MiB | "
                     + (f"{m['measured_bytes_per_slot'] / 2**20:.2f} MiB |" if m["measured_bytes_per_slot"] is not None
                        else "- |"))
    if sft_rows:
        lines += ["", f"SFT on {sft_rows[0]['dataset']} ({sft_rows[0]['steps']} steps, held-out rows "
                      f"{sft_rows[0]['heldout_rows']}):", "",
                  "| config | held-out action MSE start | end | best | s / step |", "|---|---|---|---|---|"]
        for r in sft_rows:
            lines.append(f"| {r['config']} | {r['heldout_mse_start']:.4f} | {r['heldout_mse_end']:.4f} | "
                         f"{r['heldout_mse_best']:.4f} | {r['s_per_step']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tenants", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 8, 16], help="0 = heads only")
    p.add_argument("--targets", nargs="+", default=list(ALL_LINEAR))
    p.add_argument("--batch", type=int, default=4, help="observations per tenant")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--size", default=None, help="backbone preset (default: small on cpu, medium on cuda)")
    p.add_argument("--hidden-dim", type=int, default=None)
    p.add_argument("--sft-dataset", default="robosuite-lift-scripted")
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--sft-batch", type=int, default=16)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-sft", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: experiments/lora/results_<device>.json)")
    args = p.parse_args(argv)
    args.hidden_dim = args.hidden_dim or HEAD_WIDTH[args.device]

    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)  # shared 2-core machines: one thread per process is fastest (DESIGN.md §5)
    elif not torch.cuda.is_available():
        print("--device cuda needs a CUDA build of torch and a GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    print("throughput and memory", flush=True)
    rows, meta = throughput(args)
    meta.update(targets=args.targets, batch=args.batch)
    sft_rows = [] if args.skip_sft else (print("SFT", flush=True), sft(args))[1]
    text = table(rows, meta, sft_rows)
    print("\n" + text)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "device": args.device,
              "host": {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
                       "cpus": os.cpu_count(), "threads": torch.get_num_threads()},
              "args": {k: v for k, v in vars(args).items()}, "throughput": rows, **meta, "sft": sft_rows,
              "table": text, "wall_s": time.time() - t0}
    path = Path(args.out) if args.out else HERE / f"results_{args.device}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
