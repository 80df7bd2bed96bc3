"""``nexus report`` and ``nexus logs``: a tenant's history as PNG plots and as text.

A tenant's log comes from the running service (``nexus_tenant_log``: live jobs with full metric
histories, utilization spans) and from the tenant's output dir (the manifest's job records, each
job's full record with its history in ``jobs/<id>.json``), so jobs of earlier services show too, and
``logs`` works with no service.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nexus.wire.history import KINDS, LABELS, by_kind, plot_curves

LANE_ORDER = ("actor", "inference", "simulator")


# ------------------------------------------------------------------------------------------- sources
def manifest_log(output_dir: Path) -> dict[str, Any] | None:
    """The tenant's stored job records (with their histories) from its output dir, or None if it has none."""
    path = Path(output_dir) / "manifest.json"
    if not path.exists():
        return None
    m = json.loads(path.read_text())
    jobs = []
    for rec in m.get("jobs", []):
        rec = dict(rec)
        hist = rec.get("history_file")
        if hist and (Path(output_dir) / hist).exists():
            full = json.loads((Path(output_dir) / hist).read_text())  # the job's record, jobs/<id>.json
            rec["history"] = (full.get("history") or []) if isinstance(full, dict) else full
        rec.setdefault("history", [])
        rec["source"] = "manifest"
        jobs.append(rec)
    return {"tenant": {"tenant": m.get("tenant"), "output_dir": str(output_dir), "version": m.get("latest_version")},
            "jobs": jobs, "spans": [], "t_start": None}


def merge_logs(live: dict[str, Any] | None, stored: dict[str, Any] | None) -> dict[str, Any]:
    """Live jobs plus the stored jobs the live service does not know (earlier services), by submit time."""
    if live is None:
        return stored or {"tenant": {}, "jobs": [], "spans": [], "t_start": None}
    if stored is None:
        return live

    def key(j: dict[str, Any]) -> tuple[str, float]:  # job ids may repeat across services; submit times do not
        return j.get("job", ""), round(float(j.get("t_submit") or 0.0), 3)

    known = {key(j) for j in live["jobs"]}
    jobs = [j for j in stored["jobs"] if key(j) not in known] + [dict(j, source="service") for j in live["jobs"]]
    return {**live, "jobs": sorted(jobs, key=lambda j: j.get("t_submit") or 0.0)}


# ------------------------------------------------------------------------------------------- logs
COLUMN_ORDER = ("step", "version", "steps", "updates", "episodes", "env_steps", "loss", "heldout_action_mse", "mse",
                "flow_mse", "return", "success_rate", "pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac",
                "dropped_stale")


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = {k for r in rows for k in r if k != "kind"}
    cols = [k for k in COLUMN_ORDER if k in keys] + sorted(keys - set(COLUMN_ORDER))
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    out = ["    " + "  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["    " + "  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in cells]
    return out


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def format_log(log: dict[str, Any], kinds: list[str] | None = None, last: int | None = None) -> list[str]:
    """Each job of the tenant, then its history grouped by kind (train / rollout / eval / queue), one aligned
    table per kind."""
    lines = []
    tenant = log.get("tenant", {})
    lines.append(f"tenant {tenant.get('tenant')}  (version {tenant.get('version', '?')}, "
                 f"output dir {tenant.get('output_dir', '?')})")
    for job in log["jobs"]:
        wall = (job["t_end"] - job["t_submit"]) if job.get("t_end") and job.get("t_submit") else None
        metered = job.get("metered_s") or {}
        head = (f"== {job['job']}  {job.get('kind', '?')}  {job.get('state', '?')}  "
                f"submitted {_when(job.get('t_submit'))}"
                + (f"  wall {wall:.1f} s" if wall is not None else "")
                + ("  metered " + ", ".join(f"{k} {v:.1f} s" for k, v in metered.items() if v) if metered else "")
                + ("  [from the manifest]" if job.get("source") == "manifest" else ""))
        lines.append(head)
        if job.get("error"):
            lines.append(f"   error: {job['error']}")
        groups = by_kind(job.get("history", []))
        if not groups:
            result = job.get("result") or {}
            shown = {k: v for k, v in result.items() if isinstance(v, int | float | str) and k != "report_path"}
            lines.append("   (no metric history recorded)" + (f" result: {shown}" if shown else ""))
        for kind in KINDS:
            if kind not in groups or (kinds and kind not in kinds):
                continue
            rows = groups[kind]
            shown = rows[-last:] if last else rows
            lines.append(f"  -- {kind} ({len(rows)} rows" + (f", last {len(shown)}" if len(shown) < len(rows) else "")
                         + ")")
            lines += _table(shown)
    return lines


# ------------------------------------------------------------------------------------------- plots
def write_report(log: dict[str, Any], out: Path) -> list[Path]:
    """Write ``<tenant>-curves.png`` (learning curves vs policy version: training lines, rollouts aggregated
    per version, evaluations as points) and ``<tenant>-utilization.png`` into ``out``."""
    tenant = log["tenant"]["tenant"]
    out.mkdir(parents=True, exist_ok=True)
    history = [h for job in log["jobs"] for h in job.get("history", [])]
    written = []
    curves = plot_curves(history, out / f"{tenant}-curves.png", title=f"{tenant}: learning curves")
    if curves is not None:
        written.append(curves)
    if log.get("spans"):
        written.append(plot_utilization(log, tenant, out / f"{tenant}-utilization.png"))
    return written


def plot_utilization(log: dict[str, Any], tenant: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = log["spans"]
    lanes = sorted({(s["service"], s["worker"]) for s in spans},
                   key=lambda x: (LANE_ORDER.index(x[0]) if x[0] in LANE_ORDER else 9, x[1]))
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(lanes) + 1.8))
    t0 = log["t_start"] or min(s["t0"] for s in spans)
    for y, lane in enumerate(lanes):
        for s in spans:
            if (s["service"], s["worker"]) != lane:
                continue
            names = s["tenant"].split("+")
            color = ("tab:red" if names == [tenant] else "tab:purple" if tenant in names else "tab:gray")
            ax.barh(y, s["t1"] - s["t0"], left=s["t0"] - t0, color=color, alpha=0.35 if color == "tab:gray" else 0.9,
                    height=0.8)
    ax.set_yticks(range(len(lanes)), [f"{a} · {b}" for a, b in lanes])
    ax.set_xlabel("seconds since the service started")
    ax.set_ylabel("service · worker")
    ax.set_title(f"utilization timeline — when each service worked for {tenant}")
    ax.legend(handles=[Patch(color="tab:red", label=f"{tenant} alone"),
                       Patch(color="tab:purple", label=f"{tenant} in a grouped forward with other tenants"),
                       Patch(color="tab:gray", alpha=0.35, label="other tenants")],
              fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


__all__ = ["LABELS", "format_log", "manifest_log", "merge_logs", "plot_utilization", "write_report"]
