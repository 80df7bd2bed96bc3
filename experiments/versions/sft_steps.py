"""Does an SFT step cost more the more versions a tenant has published? (It did: the manifest listed
every pruned version and was rewritten at every step.)

One tenant on a local service runs ``--jobs`` SFT jobs of ``--steps`` steps one after another (each step
publishes a version, retention keeps the newest 50); prints each job's time next to the versions
published before it and writes JSON. Run it against two checkouts (``PYTHONPATH=<checkout>``) to compare.

    python experiments/versions/sft_steps.py               # 5 jobs x 300 steps, ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(HERE / "results_cpu.json"))
    args = ap.parse_args()

    import nexus
    from nexus.client.api import Nexus
    from nexus.spec import TenantSpec

    rows = []
    with Nexus.local(Path(tempfile.mkdtemp(prefix="nexus-versions-")) / "service", n_sim=1) as nx:
        nx.create_tenant(TenantSpec(name="sft", hidden_dim=128, seed=3, dataset="pickcube-scripted",
                                    env="maniskill/pickcube-state", action_dim=4, lr=1e-3))
        t = nx.tenant("sft")
        print(f"{'job':>4s}{'versions before':>17s}{'job s':>9s}{'manifest bytes':>16s}")
        for i in range(args.jobs):
            before = t.version
            h = t.submit({"kind": "sft", "steps": args.steps, "batch_size": 32})
            h.result(timeout=3600)
            info = h.info()
            size = len(t.read_file("manifest.json"))
            rows.append({"job": i, "versions_before": before, "job_s": info["t_end"] - info["t_start"],
                         "manifest_bytes": size})
            print(f"{i:>4d}{before:>17d}{rows[-1]['job_s']:>9.1f}{size:>16d}", flush=True)
    ratio = rows[-1]["job_s"] / rows[0]["job_s"]
    print(f"last / first job time: {ratio:.2f}x")
    Path(args.out).write_text(json.dumps({"nexus": str(Path(nexus.__file__).parent), "steps": args.steps,
                                          "jobs": rows, "last_over_first": ratio, "cpu_count": os.cpu_count(),
                                          "time": time.time()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
