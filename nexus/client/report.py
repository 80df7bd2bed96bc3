"""``nexus report TENANT``: learning curves vs policy version and the utilization timeline, as PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nexus.services.tracking import plot_history

LANE_ORDER = ("actor", "inference", "simulator")


def write_report(log: dict[str, Any], out: Path) -> list[Path]:
    """Write ``<tenant>-curves.png`` and ``<tenant>-utilization.png`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tenant = log["tenant"]["tenant"]
    out.mkdir(parents=True, exist_ok=True)
    history = [h for job in log["jobs"] for h in job["history"]]
    written = []
    curves = plot_history(history, out / f"{tenant}-curves.png", title=f"{tenant}: metrics vs policy version")
    if curves is not None:
        written.append(curves)

    spans = log["spans"]
    lanes = sorted({(s["service"], s["worker"]) for s in spans}, key=lambda x: (LANE_ORDER.index(x[0]), x[1]))
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(lanes) + 1.5))
    t0 = log["t_start"]
    for y, lane in enumerate(lanes):
        for s in spans:
            if (s["service"], s["worker"]) != lane:
                continue
            mine = tenant in s["tenant"].split("+")
            ax.barh(y, s["t1"] - s["t0"], left=s["t0"] - t0, color="tab:red" if mine else "tab:gray",
                    alpha=0.9 if mine else 0.35, height=0.8)
    ax.set_yticks(range(len(lanes)), [f"{a} · {b}" for a, b in lanes])
    ax.set_xlabel("s since service start")
    ax.set_title(f"utilization timeline — {tenant} in red, other tenants in grey")
    fig.tight_layout()
    path = out / f"{tenant}-utilization.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    written.append(path)
    return written
