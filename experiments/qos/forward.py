"""An inference engine's forward per row, before / after, side by side in one run (issue 21, second round).

What is timed: ``InferenceEngine._forward`` (what the engine's model thread runs for one group: preprocessing,
the shared backbone forward, each tenant's head) on groups of R rows spread round-robin over the tenants of
one case, on the service's default engine (tiny offline Qwen3-VL, fp32, one torch thread):

* ``state``: 16 ``maniskill/pushcube-state`` tenants (no camera: the backbone sees the instruction only);
* ``lora``: 4 ``maniskill/pushcube-state`` tenants, each with its own LoRA adapter (rank 8, q/v projections);
* ``rgb``: 4 ``maniskill/pickcube-rgb`` tenants (a 64 px camera: every row's image differs).

Variants, each in its own child process (its own ``nexus`` package), measured in turns (ABC CBA ...) so all
see the same load from the rest of the machine:

* ``before``: another checkout (``--baseline DIR``, e.g. main before this work);
* ``no-cache``: this checkout with ``caches.prefix_cache_mb = 0`` (what the prefix cache alone buys);
* ``after``: this checkout.

Every variant also answers one fixed group per case (deterministic rows and seeded samples), and the parent
checks that all variants gave the same actions, log-probabilities and values (``answers_equal``).

    mkdir -p /tmp/qos-base && git archive 15b84a7 | tar -x -C /tmp/qos-base
    python experiments/qos/forward.py --baseline /tmp/qos-base --out experiments/qos/forward_cpu.json

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CASES = {"state": ("maniskill/pushcube-state", 16), "lora": ("maniskill/pushcube-state", 4),
         "rgb": ("maniskill/pickcube-rgb", 4)}


# -- the child: one engine of one checkout ----------------------------------------------------------
class Child:
    def __init__(self, cache: bool) -> None:
        import numpy as np
        import torch

        from nexus.catalog import env
        from nexus.config import ServiceConfig
        from nexus.model.policy import TenantPolicy
        from nexus.services.inference import InferenceEngine, _Request
        from nexus.spec import LoraConfig, TenantSpec

        self.np, self.Request = np, _Request
        cfg = {"root": os.environ.get("TMPDIR", "/tmp")}
        if not cache:
            cfg["caches"] = {"prefix_cache_mb": 0}
        self.engine = InferenceEngine(ServiceConfig.model_validate(cfg))
        heads = self.engine.heads
        hidden = heads.framework.backbone.hidden_size
        self.schemas, self.tenants = {}, {}
        for case, (name, n) in CASES.items():
            schema = self.schemas[case] = env(name).schema
            self.tenants[case] = [f"{case}{i}" for i in range(n)]
            for i, tenant in enumerate(self.tenants[case]):
                lora = LoraConfig(rank=8, alpha=16) if case == "lora" else None
                spec = TenantSpec(name=tenant, env=name, seed=i, lora=lora)
                policy = TenantPolicy.from_spec(spec, schema, hidden,
                                                lora_shapes=heads.framework.backbone.lora_shapes(lora))
                if lora is not None:  # a trained-looking adapter (a fresh one adds nothing: B = 0)
                    with torch.no_grad():
                        for p in policy.lora.parameters():
                            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.1)
                buf = io.BytesIO()
                torch.save(policy.state_dict(), buf)
                heads.register(spec, schema, 0, buf.getvalue())

    def group(self, case: str, rows: int, seed: int) -> list:
        """``rows`` rows round-robin over the case's tenants: fresh states (and frames), every other row a
        deterministic action, the others seeded samples."""
        from nexus.features import Observation

        np, schema = self.np, self.schemas[case]
        rng = np.random.default_rng(seed)
        out = []
        for r in range(rows):
            images = {c.name: rng.integers(0, 256, (c.height, c.width, 3), dtype=np.uint8) for c in schema.cameras}
            obs = Observation(state=rng.normal(size=schema.proprio_dim).astype(np.float32), images=images)
            det = r % 2 == 0
            out.append(self.Request(self.tenants[case][r % len(self.tenants[case])], obs, None, det, None,
                                    seed=None if det else seed * 1000 + r))
        return out

    def time(self, case: str, rows: int, reps: int, seed: int) -> list[float]:
        groups = [self.group(case, rows, seed + k) for k in range(reps)]
        self.engine._forward(groups[0])  # the tenants' first use (lazy parts) is not timed
        times = []
        for g in groups:
            t = time.perf_counter()
            self.engine._forward(g)
            times.append(time.perf_counter() - t)
        return times

    def answers(self, case: str, rows: int) -> list[list[float]]:
        outs = self.engine._forward(self.group(case, rows, 7))
        return [[*map(float, o["action"]), o["logprob"], o["value"]] for o in outs]


def child_main(cache: bool) -> None:
    child = Child(cache)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "time":
            reply = child.time(cmd["case"], cmd["rows"], cmd["reps"], cmd["seed"])
        else:
            reply = child.answers(cmd["case"], cmd["rows"])
        print(json.dumps(reply), flush=True)


# -- the parent ------------------------------------------------------------------------------------
class Variant:
    def __init__(self, name: str, checkout: Path, cache: bool) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        args = [sys.executable, str(Path(__file__).resolve()), "--child"] + ([] if cache else ["--no-cache"])
        self.proc = subprocess.Popen(args, cwd=str(checkout), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.times: dict[tuple[str, int], list[float]] = {}

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"variant {self.name!r} did not start")

    def ask(self, **cmd) -> object:
        self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"variant {self.name!r} died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", type=Path, help="another checkout measured as 'before'")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 20, 64], help="rows per group (state case)")
    ap.add_argument("--lora-rows", type=int, nargs="+", default=[1, 8], help="rows per group (lora case)")
    ap.add_argument("--rgb-rows", type=int, nargs="+", default=[1, 8], help="rows per group (rgb case)")
    ap.add_argument("--rounds", type=int, default=6, help="turns of every variant per cell")
    ap.add_argument("--reps", type=int, default=20, help="forwards per variant and turn")
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args()
    if args.child:
        child_main(cache=not args.no_cache)
        return

    variants = ([Variant("before", args.baseline.resolve(), True)] if args.baseline else [])
    variants += [Variant("no-cache", REPO, False), Variant("after", REPO, True)]
    t0, load0 = time.time(), loadavg()
    try:
        for v in variants:
            v.wait_ready()
        cells = ([("state", r) for r in args.rows] + [("lora", r) for r in args.lora_rows]
                 + [("rgb", r) for r in args.rgb_rows])
        answers_equal: dict[str, bool] = {}
        for case, rows in (("state", 20), ("lora", 8), ("rgb", 8)):
            got = {v.name: v.ask(op="answers", case=case, rows=rows) for v in variants}
            ref = got[variants[0].name]
            answers_equal[case] = all(
                all(abs(a - b) <= 1e-5 + 1e-5 * abs(b) for ra, rb in zip(g, ref, strict=True)
                    for a, b in zip(ra, rb, strict=True)) for g in got.values())
        for case, rows in cells:
            for k in range(args.rounds):
                order = variants if k % 2 == 0 else variants[::-1]
                for v in order:
                    v.times.setdefault((case, rows), []).extend(
                        v.ask(op="time", case=case, rows=rows, reps=args.reps, seed=100 * k))  # type: ignore[arg-type]
    finally:
        for v in variants:
            v.close()

    results = []
    for case, rows in cells:
        row = {"case": case, "env": CASES[case][0], "tenants": CASES[case][1], "rows": rows}
        for v in variants:
            med = statistics.median(v.times[(case, rows)])
            row[v.name] = {"ms_per_group": round(1e3 * med, 3), "ms_per_row": round(1e3 * med / rows, 4),
                           "p90_ms": round(1e3 * sorted(v.times[(case, rows)])[int(0.9 * len(v.times[(case, rows)]))],
                                           3)}
        base = row["before"] if "before" in row else row["no-cache"]
        row["speedup"] = round(base["ms_per_group"] / row["after"]["ms_per_group"], 2)
        row["speedup_cache_alone"] = round(row["no-cache"]["ms_per_group"] / row["after"]["ms_per_group"], 2)
        results.append(row)
    out = {"what": "InferenceEngine._forward per group, medians over rounds x reps, variants in turns",
           "baseline": str(args.baseline) if args.baseline else None, "rounds": args.rounds, "reps": args.reps,
           "answers_equal": answers_equal, "seconds": round(time.time() - t0, 1),
           "loadavg_before": load0, "loadavg_after": loadavg(), "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "results": results}
    names = [v.name for v in variants]
    print(f"answers equal across variants: {answers_equal}; load {load0} -> {out['loadavg_after']}")
    print("| case (tenants) | rows | " + " | ".join(f"{n} ms/group (ms/row)" for n in names)
          + " | speed-up | cache alone |")
    print("|---|---:|" + "---:|" * (len(names) + 2))
    for r in results:
        cols = " | ".join(f"{r[n]['ms_per_group']:.2f} ({r[n]['ms_per_row']:.3f})" for n in names)
        print(f"| {r['case']} ({r['tenants']}) | {r['rows']} | {cols} | {r['speedup']}x "
              f"| {r['speedup_cache_alone']}x |")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
