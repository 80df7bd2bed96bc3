"""The GPU check: the CUDA code paths (bf16, the mixed-adapter LoRA, ZeRO over NCCL, the GPU simulator beside the
engine, predict latency) run once on a CUDA host, in under 8 minutes, into one JSON.

Checks (each in its own try/except: a failure is recorded with its error and the others go on; a global time
budget skips what is left, with the reason):

1. ``grouped_forward``: bf16 shared-backbone forward, grouped vs one per tenant, at the paper's 8 tenants x
   local batch 4 (``experiments/group_batching/bench.py``'s ``FamilyBench.measure``; also its train step).
2. ``lora_mixed``: the mixed-adapter LoRA forward and forward/backward, 8 tenants each with its own rank-8
   adapter, grouped vs serial (``experiments/lora/bench.py``'s ``Setup``).
3. ``zero_ranks``: a DeepSpeed ZeRO-2 update (the tenant slots' engine config) on 2 ranks against 1 rank, same
   global batch: per-step time and the weights' relative difference. NCCL with one GPU per rank; with one
   GPU both ranks share it over gloo (NCCL refuses two ranks on one device), and the JSON says so.
4. ``sim_beside_engine``: a ManiSkill ``physx_cuda`` rollout (random actions) and grouped engine forwards on
   the same GPU, each alone and both at once (two threads): the contention factor (issue 51).
5. ``predict_latency``: an exported policy (``nexus.export.policy``) at a real-shape preset, loaded on the
   device, ``predict_action`` median / p90 over N calls.

    python experiments/gpu_check/run.py                  # CUDA host: writes experiments/gpu_check/results.json
    python experiments/gpu_check/run.py --dry-run-cpu --out /tmp/gpu_check.json   # every check's code on CPU,
                                                          # tiny presets, 1 iteration (what the test runs)

On a host without CUDA (and without ``--dry-run-cpu``) every check is written as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

UNITS = "suffixes: _ms milliseconds, _s seconds, _bytes bytes, _gib GiB; speedup/factor: ratios (serial or " \
        "concurrent over grouped or alone; > 1 means the first is slower)"
ENV = "maniskill/pushcube-state"


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the CUDA plan, or the CPU dry run (tiny presets, one iteration)."""

    device: str
    dtype: str
    size: str  # backbone preset of checks 1, 2, 4
    predict_size: str  # the real-shape preset of check 5
    image_size: int
    head_width: int
    tenants: int = 8
    batch: int = 4
    reps: int = 5
    zero_steps: int = 5
    zero_width: int = 4096
    sim_envs: int = 64
    sim_steps: int = 50
    engine_forwards: int = 20
    predict_calls: int = 50


CUDA = Plan(device="cuda", dtype="bfloat16", size="medium", predict_size="2b", image_size=224, head_width=512)
DRY = Plan(device="cpu", dtype="float32", size="tiny", predict_size="tiny", image_size=64, head_width=32,
           tenants=2, batch=1, reps=1, zero_steps=1, zero_width=32, sim_envs=1, sim_steps=2, engine_forwards=1,
           predict_calls=1)


def _bench(name: str) -> Any:
    """An experiment's bench module by path (``experiments/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", ROOT / "experiments" / name / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def _reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -- 1. grouped forward ---------------------------------------------------------------------------------

def check_grouped_forward(plan: Plan) -> dict[str, Any]:
    gb = _bench("group_batching")
    # the bench's per-device presets, with this plan's dtype and image side (the dry run: tiny, fp32)
    gb.PRESETS[plan.device] = dict(size=plan.size, image_size=plan.image_size, dtype=plan.dtype)
    out: dict[str, Any] = {"tenants": plan.tenants, "local_batch": plan.batch, "reps": plan.reps,
                           "backbone_size": plan.size, "dtype": plan.dtype, "image_px": plan.image_size,
                           "paper_forward_speedup_8x4": gb.PAPER_8X4, "families": {}}
    for family in gb.FAMILIES:
        _reset_peak(plan.device)
        bench = gb.FamilyBench(family, plan.device, plan.tenants, plan.head_width, size=plan.size)
        r = bench.measure(plan.tenants, plan.batch, plan.reps)
        out["families"][family] = {
            "forward_grouped_ms": 1e3 * r["forward_grouped_s"], "forward_serial_ms": 1e3 * r["forward_serial_s"],
            "forward_speedup": r["forward_speedup"], "step_grouped_ms": 1e3 * r["step_grouped_s"],
            "step_serial_ms": 1e3 * r["step_serial_s"], "step_speedup": r["step_speedup"],
            "backbone_calls_grouped": r["backbone_calls_grouped"], "padding_overhead": r["padding_overhead"],
            "backbone_params": sum(p.numel() for p in bench.backbone.model.parameters()),
            "peak_gpu_bytes": _peak(plan.device)}
        print(f"  {family}: forward {r['forward_speedup']:.2f}x, train step {r['step_speedup']:.2f}x", flush=True)
        del bench
    return out


# -- 2. mixed-adapter LoRA --------------------------------------------------------------------------------

def check_lora_mixed(plan: Plan, rank: int = 8) -> dict[str, Any]:
    import math

    from nexus.config.service import BackboneConfig
    from nexus.model.backbone import SharedBackbone

    lb = _bench("lora")
    args = argparse.Namespace(device=plan.device, targets=list(lb.ALL_LINEAR), hidden_dim=plan.head_width,
                              batch=plan.batch)
    backbone = SharedBackbone(BackboneConfig(family="qwen3vl", size=plan.size, image_size=plan.image_size,
                                             dtype=plan.dtype, device=plan.device))
    _reset_peak(plan.device)
    setup = lb.Setup(backbone, plan.tenants, rank, args)
    ig, is_ = lb.abba(setup.infer_grouped, setup.infer_serial, plan.reps)
    tg, ts = lb.abba(setup.train_grouped, setup.train_serial, plan.reps)
    finite = all(math.isfinite(float(p.detach().float().sum())) for s in setup.slots for p in s.policy.parameters())
    out = {"tenants": plan.tenants, "local_batch": plan.batch, "lora_rank": rank, "targets": list(lb.ALL_LINEAR),
           "backbone_size": plan.size, "dtype": plan.dtype, "reps": plan.reps,
           "infer_grouped_ms": 1e3 * ig, "infer_serial_ms": 1e3 * is_, "infer_speedup": is_ / ig,
           "train_grouped_ms": 1e3 * tg, "train_serial_ms": 1e3 * ts, "train_speedup": ts / tg,
           "weights_finite_after_steps": finite, "peak_gpu_bytes": _peak(plan.device)}
    print(f"  LoRA r{rank}: inference {out['infer_speedup']:.2f}x, train step {out['train_speedup']:.2f}x",
          flush=True)
    if not finite:
        raise RuntimeError("a tenant's weights are not finite after the mixed-adapter train steps")
    return out


# -- 3. ZeRO: 2 ranks against 1 -----------------------------------------------------------------------------

def _zero_settings(backend: str, device: str) -> dict[str, Any]:
    """ZeRO-2 as the tenant slots run it; over gloo with CUDA tensors (one GPU, two ranks) gloo has only
    broadcast and all_reduce, so gradients are all-reduced and updated partitions broadcast (DeepSpeed's
    ``reduce_scatter`` / ``allgather_partitions`` off). The CPU dry run uses the one-GPU settings, so they
    are exercised here."""
    if backend == "gloo":
        return {"stage": 2, "reduce_scatter": False, "allgather_partitions": False}
    return {"stage": 2}


def _zero_rank(rank: int, world: int, backend: str, device: str, store_path: str, width: int, steps: int,
               out_path: str) -> None:
    """One rank: a DeepSpeed ZeRO-2 engine (the tenant slots' config) over an MLP, ``steps`` updates on this
    rank's share of the same global batch; rank 0 writes the step times and the final weights."""
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    dev = torch.device(device)
    if device == "cuda":
        n = torch.cuda.device_count()
        dev = torch.device("cuda", rank % n)
        torch.cuda.set_device(dev)
        os.environ["LOCAL_RANK"] = str(rank % n)
    store = torch.distributed.FileStore(store_path, world)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world)
    from nexus.actor.process_group import _quiet_deepspeed

    _quiet_deepspeed()
    import deepspeed

    if device == "cpu":
        # as the actor does (nexus.actor.process_group): no minutes of g++ for an op ZeRO does not use
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": _zero_settings(backend, device), "gradient_clipping": 1.0,
              "steps_per_print": 2**31 - 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()),
                                           dist_init_required=False)
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps + 1):  # step 0 warms up (ZeRO allocates its buffers)
        x, y = torch.randn(16, width, generator=gen), torch.randn(16, 8, generator=gen)
        share = slice(rank * (16 // world), (rank + 1) * (16 // world))
        _sync(device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(engine(x[share].to(dev)).float(), y[share].to(dev))
        engine.backward(loss)
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    weights = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
    if rank == 0:
        torch.save({"times": times[1:], "weights": weights,
                    "params": sum(p.numel() for p in model.parameters())}, out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _zero_group(world: int, backend: str, plan: Plan, tmp: Path, timeout_s: float) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    out = tmp / f"w{world}-{backend}.pt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_zero_rank, args=(r, world, backend, plan.device, str(tmp / f"store-{world}-{backend}"),
                                                  plan.zero_width, plan.zero_steps, str(out)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 1.0))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if hung or any(p.exitcode for p in procs):
        raise RuntimeError(f"{world}-rank {backend} group failed: exit codes {[p.exitcode for p in procs]}"
                           f"{' (timed out)' if hung else ''}")
    return torch.load(out, weights_only=True)


def check_zero_ranks(plan: Plan, timeout_s: float = 150.0) -> dict[str, Any]:
    import torch

    gpus = torch.cuda.device_count() if plan.device == "cuda" else 0
    if plan.device == "cpu":
        backend, layout = "gloo", "cpu: both ranks on the CPU over gloo (dry run)"
    elif gpus >= 2:
        backend, layout = "nccl", f"one GPU per rank ({gpus} visible), nccl"
    else:
        backend, layout = "gloo", ("one GPU: both ranks on cuda:0 over gloo (NCCL refuses two ranks on one "
                                   "device); the NCCL path needs 2 GPUs")
    with tempfile.TemporaryDirectory(prefix="gpu-check-zero-") as d:
        one = _zero_group(1, backend, plan, Path(d), timeout_s)
        two = _zero_group(2, backend, plan, Path(d), timeout_s)
    w1, w2 = one["weights"], two["weights"]
    diff = sum(float((w1[k].double() - w2[k].double()).pow(2).sum()) for k in w1)
    rel = (diff / sum(float(w1[k].double().pow(2).sum()) for k in w1)) ** 0.5
    m1, m2 = statistics.median(one["times"]), statistics.median(two["times"])
    print(f"  ZeRO-2 {backend}: 1 rank {1e3 * m1:.1f} ms/step, 2 ranks {1e3 * m2:.1f} ms/step, rel. err {rel:.1e}",
          flush=True)
    return {"backend": backend, "layout": layout, "zero_optimization": _zero_settings(backend, plan.device),
            "model": f"MLP {plan.zero_width} wide, 3 layers",
            "params": one["params"], "global_batch_rows": 16, "steps": plan.zero_steps,
            "step_1rank_ms": 1e3 * m1, "step_2ranks_ms": 1e3 * m2, "speedup": m1 / m2,
            "relative_weight_error": rel}


# -- 4. GPU simulator beside the engine -----------------------------------------------------------------------

class _CpuSim:
    """The dry run's stand-in for ``ManiSkillBatchedEnv``: the same task on ``physx_cpu``, one sub-scene."""

    def __init__(self, entry: Any) -> None:
        from nexus.sim.maniskill import ManiSkillEnv

        self.env, self.num_envs = ManiSkillEnv(entry), 1

    def reset_some(self, seeds: dict[int, int | None]) -> dict[int, Any]:
        return {0: self.env.reset(seed=seeds[0])}

    def step(self, actions: Any) -> list[Any]:
        return [self.env.step(actions[0])]

    def close(self) -> None:
        self.env.close()


def _loop(fn, n: int) -> float:
    """Seconds per call of ``fn`` over ``n`` calls (after one warm-up)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _together(fns: dict[str, Any], seconds: float) -> dict[str, float]:
    """Median seconds per call of each ``fns`` loop while all run at once (``seconds`` long, each loop at least
    one call): calls that ended after the first loop stopped do not count. The first loop runs in the calling
    thread (the simulator stays on the thread that created it), the others in a thread each."""
    stop = threading.Event()
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    errors: list[BaseException] = []

    def loop(name: str) -> None:
        try:
            while not stop.is_set() or not times[name]:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append((t0, time.perf_counter()))
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the calling thread)
            errors.append(e)
        finally:
            stop.set()  # one loop failing or ending stops the others

    first, *rest = fns
    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in rest]
    for t in threads:
        t.start()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()
    loop(first)
    timer.cancel()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    overlap_end = min(ts[-1][1] for ts in times.values())
    return {k: statistics.median([b - a for a, b in ts if b <= overlap_end] or [ts[0][1] - ts[0][0]])
            for k, ts in times.items()}


def check_sim_beside_engine(plan: Plan) -> dict[str, Any]:
    import numpy as np

    from nexus.config import catalog

    gb = _bench("group_batching")
    gb.PRESETS[plan.device] = dict(size=plan.size, image_size=plan.image_size, dtype=plan.dtype)
    entry = catalog.env(ENV)
    if plan.device == "cuda":
        from nexus.sim.maniskill import ManiSkillBatchedEnv

        sim = ManiSkillBatchedEnv(entry, plan.sim_envs)
    else:
        sim = _CpuSim(entry)
    try:
        sim.reset_some({i: i for i in range(sim.num_envs)})
        rng = np.random.default_rng(0)

        def sim_step() -> None:
            res = sim.step(rng.uniform(-1, 1, (sim.num_envs, entry.schema.action_dim)).astype(np.float32))
            done = {i: None for i, r in enumerate(res) if r.terminated or r.truncated}
            if done:  # as a rollout does: a finished sub-scene starts its next episode
                sim.reset_some(done)

        bench = gb.FamilyBench("oft", plan.device, plan.tenants, plan.head_width, size=plan.size)
        reqs, _ = bench.requests(plan.tenants, plan.batch, seed=0)

        def forward() -> None:
            bench.forward(reqs, True)

        sim_alone, eng_alone = _loop(sim_step, plan.sim_steps), _loop(forward, plan.engine_forwards)
        # both at once, for as long as the longer loop took alone
        span = max(sim_alone * plan.sim_steps, eng_alone * plan.engine_forwards)
        t0 = time.perf_counter()
        both = _together({"sim": sim_step, "engine": forward}, span)
        wall = time.perf_counter() - t0
    finally:
        sim.close()
    out = {"env": ENV, "sim_backend": "physx_cuda" if plan.device == "cuda" else "physx_cpu (dry run)",
           "sim_envs": sim.num_envs, "engine": f"oft grouped forward, {plan.tenants} tenants x {plan.batch}",
           "backbone_size": plan.size, "dtype": plan.dtype,
           "concurrency": "sim on the main thread, engine on a second one; medians of the calls made while both ran",
           "sim_step_alone_ms": 1e3 * sim_alone, "sim_step_concurrent_ms": 1e3 * both["sim"],
           "sim_env_steps_per_s_alone": sim.num_envs / sim_alone,
           "engine_forward_alone_ms": 1e3 * eng_alone, "engine_forward_concurrent_ms": 1e3 * both["engine"],
           "sim_contention_factor": both["sim"] / sim_alone, "engine_contention_factor": both["engine"] / eng_alone,
           "concurrent_wall_s": wall}
    print(f"  sim {1e3 * sim_alone:.1f} -> {1e3 * both['sim']:.1f} ms/step, engine {1e3 * eng_alone:.1f} -> "
          f"{1e3 * both['engine']:.1f} ms/forward", flush=True)
    return out


# -- 5. predict latency --------------------------------------------------------------------------------------

def check_predict_latency(plan: Plan) -> dict[str, Any]:
    import numpy as np
    import torch

    from nexus.config.service import BackboneConfig
    from nexus.export import policy as exported
    from nexus.model.backbone import SharedBackbone
    from nexus.model.policy import TenantPolicy
    from nexus.model.synthetic_tenants import SyntheticTenant, tenant_schemas
    from nexus.spec import TenantSpec

    kind, schema = next(iter(tenant_schemas().items()))
    spec = TenantSpec(name="latency", env=ENV, chunk=8, hidden_dim=plan.head_width, seed=0)
    t0 = time.perf_counter()
    # the export is written from a CPU-side copy of the head; the backbone is built on the device once for
    # writing (its fingerprint) and once more by load(), as a deployment would
    backbone = SharedBackbone(BackboneConfig(family="qwen3vl", size=plan.predict_size, image_size=plan.image_size,
                                             dtype=plan.dtype, device=plan.device))
    head = TenantPolicy.from_spec(spec, schema, backbone.hidden_size)
    with tempfile.TemporaryDirectory(prefix="gpu-check-export-") as d:
        path = Path(d) / "policy"
        exported.write(path, spec=spec, schema=schema, version=1, state_dict=head.state_dict(), backbone=backbone)
        params = sum(p.numel() for p in backbone.model.parameters())
        del backbone
        _reset_peak(plan.device)
        pol = exported.load(path, device=plan.device, verify=False)
        setup_s = time.perf_counter() - t0
        obs, _ = SyntheticTenant(schema, chunk=8).batch(plan.predict_calls + 1, 0)
        times = []
        for i, o in enumerate(obs):
            _sync(plan.device)
            s = time.perf_counter()
            a = pol.predict_action(o)
            _sync(plan.device)
            if i:  # the first call warms up
                times.append(time.perf_counter() - s)
        if not np.all(np.isfinite(a["action"])):
            raise RuntimeError(f"predict_action returned a non-finite action: {a['action']}")
    ms = sorted(1e3 * t for t in times)
    out = {"backbone": f"qwen3vl {plan.predict_size}", "backbone_params": params, "dtype": plan.dtype,
           "image_px": plan.image_size, "tenant_schema": kind, "calls": len(ms),
           "predict_median_ms": statistics.median(ms), "predict_p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))],
           "predict_min_ms": ms[0], "setup_s": setup_s, "peak_gpu_bytes": _peak(plan.device),
           "torch_threads": torch.get_num_threads()}
    print(f"  predict_action median {out['predict_median_ms']:.1f} ms ({plan.predict_size})", flush=True)
    return out


CHECKS = {"grouped_forward": check_grouped_forward, "lora_mixed": check_lora_mixed, "zero_ranks": check_zero_ranks,
          "sim_beside_engine": check_sim_beside_engine, "predict_latency": check_predict_latency}


def host_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "python": platform.python_version(),
                            "machine": platform.processor() or platform.machine(), "cpu_cores": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                    device_memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}",
                    bf16=torch.cuda.is_bf16_supported())
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001  (the host line must still be written)
            info["nccl"] = f"unknown: {e}"
    else:
        info["device_name"] = "cpu"
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001  (the host line must still be written)
        info["deepspeed"] = f"not importable: {e}"
    return info


# Seconds a check needs at least on a CUDA host (model builds, process spawns, the simulator's start): with
# less budget left it is skipped rather than started, so the run ends in time.
NEEDS_S = {"grouped_forward": 60.0, "lora_mixed": 30.0, "zero_ranks": 45.0, "sim_beside_engine": 45.0,
           "predict_latency": 120.0}


def run(plan: Plan | None, budget_s: float, only: list[str], skip_reason: str | None = None,
        save=lambda checks: None) -> dict[str, Any]:
    """Every check of ``only`` under ``plan`` within ``budget_s``; ``plan`` None: all skipped with ``skip_reason``.
    ``save(checks)`` after each check, so a run killed in a check still leaves the ones before it."""
    start = time.monotonic()
    results: dict[str, Any] = {}
    for name in CHECKS:
        left = budget_s - (time.monotonic() - start)
        needs = NEEDS_S[name] if plan is not None and plan.device == "cuda" else 0.0
        if name not in only:
            results[name] = {"skipped": "not selected (--only)"}
        elif plan is None:
            results[name] = {"skipped": skip_reason}
        elif left <= needs:
            results[name] = {"skipped": f"time budget: {max(left, 0):.0f} s of {budget_s:.0f} s left, the check "
                             f"needs about {needs:.0f} s" if needs else
                             f"time budget of {budget_s:.0f} s spent before this check started"}
        else:
            print(f"[{name}] ({left:.0f} s of budget left)", flush=True)
            t0 = time.perf_counter()
            try:
                results[name] = {"ok": True, **CHECKS[name](plan)}
            except Exception as e:  # noqa: BLE001  (recorded; the other checks go on)
                results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc(limit=8).splitlines()[-12:]}
                print(f"  FAILED: {type(e).__name__}: {e}", flush=True)
            results[name]["check_wall_s"] = time.perf_counter() - t0
            gc.collect()
            _reset_peak(plan.device)
        save(results)
    return {"checks": results, "total_wall_s": time.monotonic() - start}


def _holds_cuda_run(path: Path | None) -> bool:
    try:
        return path is not None and json.loads(path.read_text()).get("mode") == "cuda"
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="every check's code on the CPU, tiny presets, 1 iteration (no figures worth keeping)")
    p.add_argument("--budget-s", type=float, default=450.0, help="global time budget; checks left are skipped")
    p.add_argument("--only", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    p.add_argument("--size", default=None, help="backbone preset of checks 1, 2, 4 (default: medium on cuda)")
    p.add_argument("--predict-size", default=None, help="backbone preset of check 5 (default: 2b on cuda)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: experiments/gpu_check/results.json; a dry run writes only with --out)")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1 if args.dry_run_cpu else min(os.cpu_count() or 1, 8))
    info = host_info()
    skip = None
    if args.dry_run_cpu:
        plan: Plan | None = DRY
        mode = "dry-run-cpu"
    elif torch.cuda.is_available():
        plan, mode = CUDA, "cuda"
    else:
        plan, mode = None, "no-cuda"
        skip = (f"no CUDA device: torch {torch.__version__} (CUDA runtime {torch.version.cuda}) sees no GPU; "
                "run this on a CUDA host (or --dry-run-cpu to exercise the code on CPU)")
        print(f"no CUDA here: every check skipped ({skip})", flush=True)
    if plan is not None:
        plan = Plan(**{**asdict(plan), **({"size": args.size} if args.size else {}),
                       **({"predict_size": args.predict_size} if args.predict_size else {})})
    out = args.out or (None if args.dry_run_cpu else HERE / "results.json")
    if args.out is None and plan is None and _holds_cuda_run(out):
        print(f"{out} holds a CUDA run: kept (pass --out to write this host's skips elsewhere)")
        out = None
    report: dict[str, Any] = {"mode": mode, "host": info, "plan": asdict(plan) if plan else None,
                              "budget_s": args.budget_s, "units": UNITS,
                              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def save(checks: dict[str, Any], final: bool = False) -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            body = {**report, "complete": final, "checks": {**{k: {"skipped": "not reached (run interrupted)"}
                                                               for k in CHECKS}, **checks}}
            out.write_text(json.dumps(body, indent=2, default=str) + "\n")

    report.update(run(plan, args.budget_s, args.only, skip, save))
    save(report["checks"], final=True)
    if out is not None:
        print(f"wrote {out}")
    failed = [k for k, v in report["checks"].items() if v.get("ok") is False]
    print(f"{mode}: " + ", ".join(f"{k} {'ok' if v.get('ok') else 'FAILED' if 'error' in v else 'skipped'}"
                                  for k, v in report["checks"].items()))
    # a CUDA run's failures are findings written to the JSON; a dry run's failure is a bug in a check
    return 1 if failed and args.dry_run_cpu else 0


if __name__ == "__main__":
    sys.exit(main())
