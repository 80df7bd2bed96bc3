"""Where an actor slot's memory goes: N tenant slots (real DeepSpeed ZeRO-2 engines) built and stepped in this
process, their RSS growth and their tensors' bytes by component.

Every slot is the service's ``TenantSlot`` for ``maniskill/pushcube-state`` at ``--hidden-dim`` (default 256, the
default spec's) on the service's default backbone width (features come from the frozen backbone, outside every
engine). Measured per slot, after building all of them and again after one SFT step of each:

* RSS growth per slot (glibc trimmed first, ``malloc_trim``; and untrimmed, to show what the arenas keep);
* tensor bytes per component, each storage counted once: the module's parameters (the ZeRO flat buffer they
  are views of), ZeRO's fp32 master partition (counted only where it has its own storage), AdamW's moments,
  gradient buffers still held between steps (``param.grad``, ZeRO's partitioned / bucketed gradients);
* the rest (RSS minus tensors): Python objects of the engine, the policy module, autograd hooks, allocator slack;
  ``--tracemalloc`` measures the Python heap's share of it (slow).

Each variant runs in a fresh process of its own, one after the other: ``before`` (ZeRO's defaults: the fp32
master its own copy, 5e8-element gradient buckets), then each cut of ``nexus.actor.zero_memory`` added in turn,
up to ``now`` (the service's slots). The rest is split into what glibc's malloc holds beyond the tensors (C++
objects: tensor and autograd structures, hooks; large Python objects) and the remainder (Python's small-object
arenas, page slack), and the Python objects are attributed to their owners (engine config, ZeRO optimizer,
parameters' attributes, the policy's modules, the engine's rest).

    python experiments/scale/slot_memory.py                     # 64 slots of width 256, table + JSON
    python experiments/scale/slot_memory.py --via actor         # through the actor's own code (ActorHost)
    python experiments/scale/slot_memory.py --hidden-dim 128 --slots 32
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
ENV = "maniskill/pushcube-state"
MIB = 2**20


def trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def nbytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def components(slot) -> dict[str, int]:
    """Tensor bytes of one slot by component; a storage already counted under an earlier component is not
    counted again (so an fp32 master that aliases the parameters adds 0)."""
    import torch

    zero = slot.engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    params = list(slot.policy.parameters())
    buffers = list(slot.policy.buffers())
    grads = [p.grad for p in params]
    grads += [t.grad for t in getattr(zero, "single_partition_of_fp32_groups", [])]
    grads += [getattr(zero, "grads_in_partition", None)]
    for bucket in getattr(zero, "ipg_buckets", {}).values():
        grads += list(bucket.buffer)
    for attr in ("averaged_gradients", "all_grad_tensors"):
        for v in getattr(zero, attr, {}).values():
            grads += [v] if isinstance(v, torch.Tensor) else list(v or [])
    groups = {
        "parameters": params + buffers,
        "fp32 master": list(getattr(zero, "single_partition_of_fp32_groups", [])),
        "AdamW moments": [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)],
        "gradients held": grads,
    }
    out, seen = {}, set()
    for name, ts in groups.items():
        fresh = []
        for t in ts:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                fresh.append(t)
        out[name] = nbytes(fresh)
    out["n_params"] = sum(p.numel() for p in params)
    return out


def bare_path(args, tmp: str):
    """Slots built and stepped directly: ``TenantSlot`` + the SFT loss on fixed features, a checkpoint and a
    weight export for the save (what ``save_weights`` does with ``checkpoint_every = 1``)."""
    import numpy as np
    import torch

    from nexus.actor.tenant_slot import TenantSlot
    from nexus.algorithms.sft import sft_loss
    from nexus.config.validation import validate_tenant
    from nexus.model.backbone import BackboneConfig, SharedBackbone

    feat_dim = SharedBackbone(BackboneConfig()).hidden_size  # the service's default
    _, schema = validate_tenant({"name": "probe", "env": ENV})
    rng = np.random.default_rng(0)
    feats = torch.from_numpy(rng.standard_normal((args.batch, feat_dim)).astype(np.float32))
    proprio = torch.from_numpy(rng.standard_normal((args.batch, schema.proprio_dim)).astype(np.float32))
    actions = torch.from_numpy(rng.uniform(-1, 1, (args.batch, schema.action_dim)).astype(np.float32))

    def build(i: int) -> TenantSlot:
        spec, _ = validate_tenant({"name": f"s{i:04d}", "env": ENV, "seed": i, "hidden_dim": args.hidden_dim})
        return TenantSlot(spec, schema, feat_dim)

    def train(slot: TenantSlot) -> None:
        slot.train_step(lambda policy: sft_loss(policy, feats, proprio, actions))

    def save(slot: TenantSlot) -> None:
        slot.bump_version()
        slot.save_checkpoint(os.path.join(tmp, slot.name))
        slot.export_weights()

    return build, train, save, lambda slot: slot


def actor_path(args, tmp: str):
    """Tenants hosted by an ``ActorHost`` (this process plays the actor rank, no Dask): ``build_slot`` (its
    version 0 written, the framework's registration), the low-level ``forward_backward`` op on a client's batch
    through the backbone + ``optim_step``, and ``publish`` (checkpoint + weights file, no inference push)."""
    import numpy as np

    from nexus.actor.host import ActorHost
    from nexus.actor.ops import forward_backward
    from nexus.actor.slots import build_slot
    from nexus.config.service import ServiceConfig
    from nexus.config.validation import validate_tenant
    from nexus.data.output_dir import TenantOutputDir
    from nexus.features import Observation
    from nexus.wire.messages import SyncRule, TenantSetup

    actor = ActorHost(ServiceConfig(root=os.path.join(tmp, "service")))
    rng = np.random.default_rng(0)
    _, schema = validate_tenant({"name": "probe", "env": ENV})
    batch = {"observations": [Observation(state=rng.standard_normal(schema.proprio_dim).astype(np.float32))
                              for _ in range(args.batch)],
             "actions": rng.uniform(-1, 1, (args.batch, schema.action_dim)).astype(np.float32)}

    def build(i: int) -> TenantSetup:
        spec, schema = validate_tenant({"name": f"s{i:04d}", "env": ENV, "seed": i, "hidden_dim": args.hidden_dim})
        setup = TenantSetup(spec.name, spec, schema, str(actor.config.tenants_dir / spec.name))
        build_slot(actor, setup)
        return setup

    def train(setup: TenantSetup) -> None:
        slot = actor.slot(setup.name)
        forward_backward(actor, slot, "sft", batch)
        slot.optim_step()

    def save(setup: TenantSetup) -> None:
        actor.publish(actor.slot(setup.name), TenantOutputDir(setup.output_dir), None, "save_weights",
                      SyncRule(policy="lazy"))

    return build, train, save, lambda setup: actor.slot(setup.name)


VARIANTS = {
    "before": "ZeRO's defaults: the fp32 master its own copy, 5e8-element buckets",
    "round1": "+ the master a view of the weights, buckets of the slot's size (the first round)",
    "unlinked": "+ no per-parameter links into the master and the moments (zero_memory.drop_hp_links)",
    "config": "+ one parsed config shared by equal engines (zero_memory.share_config)",
    "now": "+ one stateless GELU module shared by every head (model.layers.gelu_module): the service's slots",
}


def as_variant(variant: str) -> None:
    """Build the slots as ``variant`` does (for the side-by-side baselines): the service's slots with the later
    cuts left out."""
    import torch

    import nexus.actor.tenant_slot as tenant_slot
    from nexus.actor import zero_memory
    from nexus.model import layers

    if variant == "now":
        return
    layers.gelu_module = torch.nn.GELU  # a GELU module of its own in every place, as before
    if variant in ("before", "round1"):
        tenant_slot.drop_hp_links = lambda engine: 0  # DeepSpeed re-links at every load, as it does
    if variant == "before":
        tenant_slot.slim_engine = lambda engine: None
        tenant_slot.bucket_elements = lambda params: 500_000_000
    elif variant == "round1":
        def round1(engine) -> None:
            zero_memory.share_fp32_master(engine)
            engine.optimizer._link_all_hp_params()  # what the first round did: re-linked to the view
        tenant_slot.slim_engine = round1
    elif variant == "config":
        return
    elif variant == "unlinked":
        tenant_slot.slim_engine = lambda engine: (zero_memory.share_fp32_master(engine),
                                                  zero_memory.drop_hp_links(engine))


def fill_flight_recorder() -> None:
    """torch.distributed's flight recorder keeps the last 2000 collectives of the process (about 0.85 KiB each,
    tracebacks included): a fixed ring, not a slot's. Filled first, so that the slots' collectives replace
    entries instead of growing it (a thousand tenants fill it long before the last one)."""
    import torch

    t = torch.zeros(1)
    for _ in range(2048):
        torch.distributed.all_reduce(t)


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not got back (tensors' data, C++ objects, large Python objects;
    not Python's small-object arenas, which are mmapped)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def python_objects(slots, pre: set[int]) -> dict[str, int]:
    """Bytes (``sys.getsizeof``) of the Python objects the slots hold that did not exist before them, each
    counted once, by owner: walked in this order, an object goes to the first owner that reaches it (shared
    ones, like a config shared by equal engines, count once for all slots). Tensors count their Python object
    only (their data are the components above)."""
    import torch

    seen: set[int] = set()

    def walk(roots) -> int:
        total, stack = 0, list(roots)
        while stack:
            o = stack.pop()
            if id(o) in seen or id(o) in pre or isinstance(o, type | types.ModuleType):
                continue
            seen.add(id(o))
            total += sys.getsizeof(o)
            stack.extend(gc.get_referents(o))
            if isinstance(o, torch.Tensor) and getattr(o, "__dict__", None):
                stack.append(o.__dict__)
        return total

    slots = list(slots)
    engines = [s.engine for s in slots]
    params = [p for s in slots for p in s.policy.parameters()]
    seen.update(id(x) for x in [*slots, *engines, *params, *(e.optimizer for e in engines)])
    out = {"engine config": walk(e._config for e in engines)}
    out["ZeRO optimizer (+ AdamW)"] = walk(v for e in engines for v in vars(e.optimizer).values())
    out["parameters' attributes"] = walk(v for p in params for v in vars(p).values()) + sum(
        sys.getsizeof(p) for p in params)
    out["policy modules"] = walk(s.policy for s in slots)
    out["engine, the rest"] = walk(v for e in engines for k, v in vars(e).items() if k not in ("module", "optimizer"))
    out["slot"] = walk(v for s in slots for v in vars(s).values())
    return out


def measure(args) -> dict:
    """One variant in this process -> MiB per slot by component and phase."""
    import torch

    torch.set_num_threads(1)
    as_variant(args.variant)
    tmp = tempfile.mkdtemp(prefix="nexus-slot-memory-")
    build, train, save, slot_of = (actor_path if args.via == "actor" else bare_path)(args, tmp)
    # one-off costs (DeepSpeed's first engine, torch's first kernels, the actor's backbone) are paid first
    warm = build(9999)
    train(warm)
    save(warm)
    fill_flight_recorder()
    n, phases = args.slots, ("built", "stepped", "saved")
    t0 = time.time()
    gc.collect()
    pre = {id(o) for o in gc.get_objects()}
    trim()
    r0, m0 = rss(), malloc_in_use()
    if args.tracemalloc:
        tracemalloc.start()
    slots = [build(i) for i in range(n)]
    comps, trimmed, untrimmed, py, heap = {}, {}, {}, {}, {}
    for phase in phases:
        if phase == "stepped":
            t_step = time.perf_counter()
            for s in slots:
                train(s)
            t_step = (time.perf_counter() - t_step) / n
        elif phase == "saved":
            for s in slots:
                save(s)
        py[phase] = tracemalloc.get_traced_memory()[0] if args.tracemalloc else 0
        untrimmed[phase] = rss() - r0
        trim()
        trimmed[phase] = rss() - r0
        heap[phase] = malloc_in_use() - m0
        comps[phase] = components(slot_of(slots[0]))
    tracemalloc.stop()
    objects = python_objects((slot_of(s) for s in slots), pre)
    wall = time.time() - t0
    shutil.rmtree(tmp, ignore_errors=True)
    keys = [k for k in comps["built"] if k != "n_params"]
    tensors = {ph: sum(comps[ph][k] for k in keys) for ph in phases}
    table: dict[str, dict[str, float]] = {
        "RSS per slot (trimmed)": {ph: trimmed[ph] / n / MIB for ph in phases},
        "RSS per slot (untrimmed)": {ph: untrimmed[ph] / n / MIB for ph in phases},
        **{k: {ph: comps[ph][k] / MIB for ph in phases} for k in keys},
        "tensors, all": {ph: tensors[ph] / MIB for ph in phases},
        "rest (RSS - tensors)": {ph: (trimmed[ph] / n - tensors[ph]) / MIB for ph in phases},
        "of which malloc, not tensors": {ph: (heap[ph] / n - tensors[ph]) / MIB for ph in phases},
        "of which Python arenas, slack": {ph: (trimmed[ph] - heap[ph]) / n / MIB for ph in phases},
    }
    if args.tracemalloc:
        table["of which Python heap"] = {ph: py[ph] / n / MIB for ph in phases}
    zero = slot_of(slots[0]).engine.optimizer
    buckets = 2 if zero.overlap_comm else 1
    return {"n_params": comps["saved"]["n_params"], "wall_s": wall, "load_avg": os.getloadavg(),
            "first_step_ms": 1e3 * t_step, "mib_per_slot": table,
            # after the saves, sys.getsizeof of the objects each owner holds (a lower bound: no allocator headers)
            "python_objects_kib_per_slot": {k: v / n / 1024 for k, v in objects.items()},
            # virtual: only what a backward's gradients fill is touched, the rest is mapped and unmapped each time
            "gradient_bucket_mib_per_backward": buckets * zero.reduce_bucket_size * 4 / MIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--hidden-dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="rows of each slot's SFT step")
    ap.add_argument("--via", choices=("slot", "actor"), default="slot",
                    help="slot: TenantSlot objects alone; actor: tenants hosted by the actor's own code (ActorHost)")
    ap.add_argument("--variant", choices=tuple(VARIANTS), help="measure one variant in this process (internal: "
                    "by default each runs in a fresh process of its own, one after the other)")
    ap.add_argument("--tracemalloc", action="store_true", help="also measure the Python heap per slot (slow)")
    ap.add_argument("--out", default=str(HERE / "slot_memory.json"))
    args = ap.parse_args()
    if args.variant:
        Path(args.out).write_text(json.dumps(measure(args)))
        return
    t0 = time.time()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            out = os.path.join(tmp, f"{variant}.json")
            cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--out", out]
            subprocess.run(cmd, check=True)
            results[variant] = json.loads(Path(out).read_text())
    n_params = results["now"]["n_params"]
    phases = ("built", "stepped")  # "saved" too in the JSON
    print(f"{args.slots} slots ({args.via}), head width {args.hidden_dim}, {n_params} parameters each "
          f"({n_params * 4 / MIB:.3f} MiB fp32); load average {os.getloadavg()[0]:.1f}; {time.time() - t0:.0f} s")
    print(f"{'MiB per slot':30s} " + " ".join(f"{v + ' ' + ph:>16s}" for v in VARIANTS for ph in phases))
    for name in results["now"]["mib_per_slot"]:
        cells = [results[v]["mib_per_slot"][name][ph] for v in VARIANTS for ph in phases]
        indent = "" if name.startswith("RSS") else "    " if name.startswith("of which") else "  "
        print(f"{indent + name:30s} " + " ".join(f"{c:16.3f}" for c in cells))
    print(f"{'Python objects, KiB per slot':30s} " + " ".join(f"{v:>16s}" for v in VARIANTS))
    for name in results["now"]["python_objects_kib_per_slot"]:
        print(f"{'  ' + name:30s} " + " ".join(f"{results[v]['python_objects_kib_per_slot'][name]:16.1f}"
                                                for v in VARIANTS))
    for v in VARIANTS:
        print(f"{v}: gradient bucket mapped per backward {results[v]['gradient_bucket_mib_per_backward']:.1f} MiB "
              f"(virtual), first SFT step {results[v]['first_step_ms']:.1f} ms per slot")
    Path(args.out).write_text(json.dumps({
        "meta": {**vars(args), "cpu_count": os.cpu_count(), "python": platform.python_version(),
                 "command": "python experiments/scale/slot_memory.py " + " ".join(sys.argv[1:]),
                 "load_avg": os.getloadavg(), "wall_s": time.time() - t0, "variants": VARIANTS},
        "n_params": n_params, **results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
