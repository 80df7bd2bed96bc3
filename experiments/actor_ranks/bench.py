"""Update time of the actor group with 1 vs N ranks, side by side in one run, on the same requests.

Two actor groups live at once on real Dask worker processes (``tests/rank_group.py``: the real actor tasks,
driven the way the control plane drives them): a 1-rank group and an N-rank group (one gloo / nccl group).
Both get the same tenants and the same updates, alternating 1, N, N, 1, ... per update; each update's wall
time is the call from submit to rank 0's result (every rank's backbone forward on its shard, the head's
forward / backward, DeepSpeed's gradient reduction and step, the checkpoint and rank 0's weights write).

Workloads (camera tenants, so the backbone forward — what the split divides — is part of every update):

- ``sft-oft``: SFT, OFT head, ``--sft-batch`` rows of ``robosuite-lift-scripted`` (agent-view + wrist);
- ``sft-groot``: SFT, GR00T flow expert (chunk 4) reading the prefix tokens, same batches;
- ``ppo``: PPO on a stored ``maniskill/pickcube-rgb`` batch of ``--rl-rows`` steps (features recomputed on
  each rank's rows; 2 epochs, minibatch ``--minibatch``);
- ``ppo-lora``: the same with a LoRA adapter (rank 8): each minibatch's features through the adapter.

Besides time: the relative weight error of the N-rank group against the 1-rank one after all updates
(``||w_N - w_1|| / ||w_1||``) and the optimizer-state bytes each rank holds (measured from the engines' tensors).

    python experiments/actor_ranks/bench.py                  # CPU: gloo, fp32, one torch thread per rank
    python experiments/actor_ranks/bench.py --device cuda    # GPU: nccl, bf16 backbone, one GPU per rank
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
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # tests.rank_group: the actor-group driver the tests use

PRESETS = {"cpu": dict(size="small", image_size=64, dtype="float32", device="cpu"),
           "cuda": dict(size="medium", image_size=224, dtype="bfloat16", device="cuda")}
DATASET, ENV = "robosuite-lift-scripted", "maniskill/pickcube-rgb"


def specs(head_width: int):
    from nexus.spec import LoraConfig, TenantSpec

    return {"sft-oft": TenantSpec(name="sft-oft", dataset=DATASET, hidden_dim=head_width, lr=1e-3, seed=1),
            "sft-groot": TenantSpec(name="sft-groot", dataset=DATASET, hidden_dim=head_width, lr=1e-3, seed=2,
                                    action_head="groot", chunk=4),
            "ppo": TenantSpec(name="ppo", env=ENV, hidden_dim=head_width, lr=3e-4, seed=3),
            "ppo-lora": TenantSpec(name="ppo-lora", env=ENV, hidden_dim=head_width, lr=3e-4, seed=4,
                                   lora=LoraConfig(rank=8))}


def rl_batch(path: Path, rows: int, seed: int):
    """A stored camera batch of whole 16-step episodes, laid out as a rollout stores it (no cached features)."""
    import numpy as np

    from nexus.config import catalog
    from nexus.data.trajectory_store import columns_to_table, write_ipc
    from nexus.wire.messages import BatchRef

    schema = catalog.env(ENV).schema
    rng = np.random.default_rng(seed)
    steps = 16
    episodes = max(rows // steps, 1)
    n = episodes * steps
    last = np.tile(np.arange(steps) == steps - 1, episodes)
    cols = {"episode": np.repeat(np.arange(episodes), steps).astype(np.int64),
            "step": np.tile(np.arange(steps), episodes).astype(np.int32),
            "state": rng.normal(size=(n, schema.proprio_dim)).astype(np.float32),
            "action": rng.uniform(-1, 1, (n, schema.action_dim)).astype(np.float32),
            "reward": rng.normal(size=n).astype(np.float32), "terminated": last, "truncated": np.zeros(n, bool),
            "success": last, "logprob": rng.normal(-3, 0.5, n).astype(np.float32),
            "value": rng.normal(size=n).astype(np.float32), "policy_version": np.zeros(n, np.int64)}
    for c in schema.cameras:
        cols[f"image.{c.name}"] = rng.integers(0, 256, (n, c.height, c.width, 3), dtype=np.uint8)
    write_ipc(columns_to_table(cols, schema, "bench"), path)
    return BatchRef(str(path), n, episodes, 0, "bench")


def relative_error(a: dict, b: dict) -> float:
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (diff / sum(float(a[k].double().pow(2).sum()) for k in a)) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the group compared with 1 rank")
    ap.add_argument("--size", default=None, help="backbone preset (default: small on cpu, medium on cuda)")
    ap.add_argument("--updates", type=int, default=4, help="timed updates per workload and group")
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--rl-rows", type=int, default=64)
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--head-width", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from nexus.algorithms.ppo import PPOConfig
    from nexus.config import catalog
    from nexus.config.service import ServiceConfig
    from nexus.control import tasks
    from nexus.data.output_dir import TenantOutputDir
    from nexus.wire.messages import RLWork, SFTWork, TenantSetup, UpdateRequest
    from tests.rank_group import RankGroup

    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--device cuda needs one GPU per rank: {torch.cuda.device_count()} visible, {args.ranks} ranks")
    preset = dict(PRESETS[args.device], **({"size": args.size} if args.size else {}))
    tenants = specs(args.head_width)
    ppo = PPOConfig(update_epochs=2, minibatch_size=args.minibatch)
    tmp = Path(tempfile.mkdtemp(prefix="nexus-ranks-"))
    batches = [rl_batch(tmp / f"rl-{k}.arrow", args.rl_rows, 100 + k) for k in range(args.updates + 1)]
    sizes = (1, args.ranks)
    groups, setups = {}, {}
    try:
        for n in sizes:
            root = tmp / f"root{n}"
            t0 = time.perf_counter()
            groups[n] = RankGroup(ServiceConfig(root=str(root), backbone=preset), n).start()
            setups[n] = {name: TenantSetup(name, s, catalog.dataset(s.dataset).schema if s.dataset else
                                           catalog.env(s.env).schema, str(root / "tenants" / name))
                         for name, s in tenants.items()}
            for s in setups[n].values():
                groups[n].run(tasks.INIT_TENANT, lambda r, s=s: (s,))
            print(f"{n}-rank group up with {len(tenants)} tenants in {time.perf_counter() - t0:.1f} s", flush=True)

        def work(name: str, k: int):
            if name.startswith("sft"):
                return SFTWork(DATASET, k, args.sft_batch)
            return RLWork(batches[k], ppo)

        times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in tenants}
        for k in range(args.updates + 1):  # update 0 warms up (first step allocates ZeRO's buffers)
            for name in tenants:
                for n in (sizes if k % 2 == 0 else sizes[::-1]):
                    req = lambda r, n=n, name=name, k=k: (UpdateRequest(f"{name}-{k}", None, work(name, k),  # noqa: E731
                                                                        setups[n][name], (), rank=r, world_size=n),)
                    _, dt = groups[n].timed(tasks.RUN_UPDATE, req)
                    if k:
                        times[name][n].append(dt)
            print(f"update {k} done", flush=True)
        states = {n: groups[n].slot_states() for n in sizes}
        rows = []
        for name in tenants:
            w = {n: torch.load(TenantOutputDir(setups[n][name].output_dir).weights_path(args.updates + 1),
                               weights_only=True) for n in sizes}
            med = {n: statistics.median(times[name][n]) for n in sizes}
            rows.append({"workload": name, "update_s": {str(n): med[n] for n in sizes},
                         "all_update_s": {str(n): times[name][n] for n in sizes},
                         "speedup": med[1] / med[args.ranks],
                         "relative_weight_error": relative_error(w[1], w[args.ranks]),
                         "optimizer_bytes_per_rank": {str(n): [st[name]["optimizer_bytes"] for st in states[n]]
                                                      for n in sizes}})
    finally:
        for g in groups.values():
            g.close()

    print(f"\nactor group, {args.ranks} ranks vs 1 ({args.device}, backbone {preset['size']} {preset['dtype']}, "
          f"{os.cpu_count()} cores): median of {args.updates} updates")
    print(f"{'workload':<10} {'1 rank s':>9} {f'{args.ranks} ranks s':>10} {'speed-up':>9} {'rel. err':>9} "
          f"{'optimizer bytes/rank':>24}")
    for r in rows:
        per = r["optimizer_bytes_per_rank"]
        print(f"{r['workload']:<10} {r['update_s']['1']:>9.3f} {r['update_s'][str(args.ranks)]:>10.3f} "
              f"{r['speedup']:>8.2f}x {r['relative_weight_error']:>9.1e} "
              f"{per['1'][0]:>10d} -> {'/'.join(str(b) for b in per[str(args.ranks)]):>10}")
    out = args.out or HERE / f"results_{args.device}.json"
    out.write_text(json.dumps({"device": args.device, "ranks": args.ranks, "backbone": preset,
                               "cores": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                               "torch": torch.__version__, "updates": args.updates, "sft_batch": args.sft_batch,
                               "rl_rows": args.rl_rows, "minibatch": args.minibatch, "head_width": args.head_width,
                               "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
