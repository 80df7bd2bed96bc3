"""How far does float rounding carry a ManiSkill CPU episode? The tolerance of the demo-reproduction test.

ManiSkill/PhysX promise the same episodes for the same seed on the same machine, not across machines: another
CPU (other SIMD paths, other libm) rounds differently, and a contact-rich episode can amplify that. This
script re-records the scripted PickCube demonstrations (``datasets/generate_demos.py``'s expert, seed 0)

* twice unchanged — same machine, same seed: are the episodes bit-identical?
* with every action perturbed by a relative ``eps`` (float32 rounding is ~6e-8 relative; a different
  machine's arithmetic differs by a few such roundings per operation)

and prints, per perturbation, the largest state / action / reward deviation from the reference, how many
values moved by more than 1e-5, and whether success flags and episode lengths changed. JSON next to it.

    python experiments/reproducibility/physics_rounding.py              # ~1 min
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--eps", type=float, nargs="+", default=[1e-7, 1e-6, 1e-5])
    args = ap.parse_args()

    from nexus.config import catalog
    from nexus.sim.environment import PolicyOutput, collect_episodes, make_env

    spec = importlib.util.spec_from_file_location("generate_demos", REPO / "datasets" / "generate_demos.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen
    spec.loader.exec_module(gen)
    demo = gen.DEMOS["pickcube"]
    entry = catalog.env(demo.env)

    def record(eps: float, seed: int = 0) -> dict:
        env = make_env(entry, seed=seed, device="cpu")
        expert = demo.expert(env)
        rng = np.random.default_rng(1)

        def policy(obs):
            a = expert(obs).action
            if eps:
                a = (a * (1 + eps * rng.standard_normal(a.shape))).astype(np.float32)
            return PolicyOutput(action=a)

        try:
            return collect_episodes(env, policy, args.episodes, seed=seed, tenant="x")
        finally:
            env.close()

    ref, again = record(0.0), record(0.0)
    rows = [{"eps": 0.0, **compare(ref, again)}]
    for eps in args.eps:
        rows.append({"eps": eps, **compare(ref, record(eps))})
    print(f"{args.episodes} episodes of {demo.name}, {len(ref['state'])} steps; deviation from the reference run:")
    print(f"{'perturbation':>14s}{'max |d state|':>15s}{'state > 1e-5':>14s}{'max |d action|':>16s}"
          f"{'max |d reward|':>16s}{'success same':>14s}{'lengths same':>14s}")
    for r in rows:
        label = "none (rerun)" if r["eps"] == 0 else f"{r['eps']:.0e} rel."
        print(f"{label:>14s}{r['state_max']:>15.2e}{r['state_over_1e-5']:>9d}/{r['n_state']:<5d}"
              f"{r['action_max']:>15.2e}{r['reward_max']:>16.2e}{str(r['success_same']):>14s}"
              f"{str(r['lengths_same']):>14s}")
    out = HERE / "physics_rounding.json"
    out.write_text(json.dumps({"meta": {**vars(args), "machine": platform.processor() or platform.machine(),
                                        "python": platform.python_version(),
                                        "command": "python experiments/reproducibility/physics_rounding.py"},
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


def compare(a: dict, b: dict) -> dict:
    lengths_same = bool(np.array_equal(a["ep_length"], b["ep_length"]))
    out = {"lengths_same": lengths_same, "success_same": bool(np.array_equal(a["ep_success"], b["ep_success"])),
           "n_state": int(a["state"].size) if lengths_same else 0}
    if not lengths_same:  # episodes of different lengths: compare the common prefix of each
        n = min(len(a["state"]), len(b["state"]))
        a = {k: v[:n] for k, v in a.items() if k in ("state", "action", "reward")}
        b = {k: v[:n] for k, v in b.items() if k in ("state", "action", "reward")}
        out["n_state"] = int(a["state"].size)
    for k in ("state", "action", "reward"):
        d = np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64))
        out[f"{k}_max"] = float(d.max())
        out[f"{k}_over_1e-5"] = int((d > 1e-5).sum())
    return out


if __name__ == "__main__":
    main()
