"""A job's metric history: what its rows mean, how they group, and the learning-curve figure.

Each row the Master records is ``{"kind": ..., "step": ..., **metrics}``:

* ``train``   — one per update (SFT step, PPO update, low-level op); ``step`` = the version it produced
* ``rollout`` — one per RL batch collected; ``step`` = the job's cumulative env steps (monotonic),
  ``version`` = the policy version that collected it (several batches may share one)
* ``eval``    — one per evaluation; ``step`` = the evaluated (pinned) version
* ``queue``   — training-queue events (a stale batch dropped); ``step`` = the count so far

Plain data in, plain data or a PNG out: used by MLflow tracking (worker side) and by ``nexus report`` /
``nexus logs`` (client side). No torch.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

KINDS = ("train", "rollout", "eval", "queue")
# metric -> (axis label, what a good number is)
LABELS = {
    "loss": ("training loss", "lower is better"),
    "heldout_action_mse": ("held-out action MSE", "lower is better; predicting zeros ≈ 0.41 on pickcube-scripted"),
    "return": ("episode return", "higher is better"),
    "success_rate": ("success rate", "fraction of episodes solved, 0–1"),
    "v_loss": ("value loss", ""),
    "approx_kl": ("approx. KL to the collecting policy", ""),
}
COUNTERS = {"steps", "updates", "episodes", "env_steps", "version", "dropped_stale"}  # metrics that only count
# per job kind: the counter that measures a job's progress (its spec's field of the same name is the total),
# and the metrics worth a line (``nexus.client.api.JobProgress``, the ``/nexus`` page's jobs table)
JOB_COUNTERS = {"sft": "steps", "rl": "updates", "eval": "episodes"}
JOB_HEADLINE = {"sft": ("loss", "heldout_action_mse"), "rl": ("return", "success_rate"),
                "eval": ("success_rate", "return")}
SYSTEM = {"update_s", "weight_sync_s", "weight_sync_bytes"}


def kind_of(row: dict[str, Any]) -> str:
    """A row's kind (rows written before kinds were recorded are recognised by their fields)."""
    if row.get("kind") in KINDS:
        return row["kind"]
    if "loss" in row or "update_s" in row:
        return "train"
    if "env_steps" in row:
        return "rollout"
    if set(row) <= {"step", "dropped_stale"}:
        return "queue"
    return "eval"


def by_kind(history: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for row in history:
        out[kind_of(row)].append(row)
    return {k: v for k, v in out.items() if v}


def version_of(row: dict[str, Any]) -> int | float:
    """The policy version a row is about (rollouts: the collecting version; others: their step)."""
    return row.get("version", row.get("step", 0)) if kind_of(row) == "rollout" else row.get("step", 0)


def per_version(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float, float, float, int]]:
    """Rows aggregated per policy version: (version, mean, min, max, count), sorted by version."""
    groups: dict[float, list[float]] = defaultdict(list)
    for r in rows:
        if isinstance(r.get(key), int | float):
            groups[version_of(r)].append(float(r[key]))
    return [(v, sum(xs) / len(xs), min(xs), max(xs), len(xs)) for v, xs in sorted(groups.items())]


def panels(history: list[dict[str, Any]]) -> list[str]:
    """The metrics worth a panel for this history, in display order."""
    kinds = by_kind(history)
    have = {k for rows in kinds.values() for r in rows for k, v in r.items() if isinstance(v, int | float)}
    return [m for m in ("loss", "heldout_action_mse", "return", "success_rate") if m in have]


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (imported on first use: ~0.3 s; ``Tracker.warm``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(history: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """The learning curves (:func:`curves_figure`) as a PNG at ``path``; None when the history has nothing to plot."""
    fig = curves_figure(history, title)
    if fig is None:
        return None
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


def curves_figure(history: list[dict[str, Any]], title: str = "") -> Figure | None:
    """Learning curves vs policy version, drawn as what they are: training metrics as lines (one point per
    update), rollout metrics as the mean per version with its min–max band (batches of one version are not
    a sequence), evaluations as separate points (one per evaluated version, never joined). None when the
    history has nothing to plot.

    The margins are fixed (inches, for a panel's tick labels, axis labels, title and evaluation notes), not fitted to
    the drawn text (``tight_layout``): the fitting took half the CPU time of a job's curves (~0.2 of ~0.45 s, on the
    tracker's worker)."""
    plt = pyplot()
    metrics = panels(history)
    if not metrics:
        return None
    kinds = by_kind(history)
    cols = min(2, len(metrics))
    rows_n = (len(metrics) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.6 * cols, 3.4 * rows_n), squeeze=False)
    for ax, m in zip(axes.flat, metrics, strict=False):
        train = [(r["step"], r[m]) for r in kinds.get("train", []) if isinstance(r.get(m), int | float)]
        if train:
            sparse = len(train) < 0.5 * len(kinds["train"])  # e.g. held-out error: every 10th step
            ax.plot([p[0] for p in train], [p[1] for p in train], marker="o" if sparse else None, ms=3, lw=1.2,
                    label="training updates")
        agg = per_version(kinds.get("rollout", []), m)
        if agg:
            xs = [a[0] for a in agg]
            ax.fill_between(xs, [a[2] for a in agg], [a[3] for a in agg], alpha=0.2, color="tab:orange", lw=0)
            ax.plot(xs, [a[1] for a in agg], color="tab:orange", lw=1.5,
                    label="rollouts: mean per version (band: min–max)")
        evals = [(r["step"], r[m], r.get("episodes")) for r in kinds.get("eval", [])
                 if isinstance(r.get(m), int | float)]
        if evals:
            ax.scatter([e[0] for e in evals], [e[1] for e in evals], s=46, color="tab:green", zorder=3,
                       edgecolor="black", label="evaluations (one point each)")
            for v, y, n in evals:
                if n:
                    ax.annotate(f"{y:.2f} ({int(n)} ep.)", (v, y), textcoords="offset points", xytext=(4, 6),
                                fontsize=7)
        label, good = LABELS.get(m, (m, ""))
        ax.set_xlabel("policy version")
        ax.set_ylabel(label)
        # placed, not fitted above the tick labels (the fitting measures the drawn ticks, as tight_layout does)
        ax.set_title(f"{label}" + (f" — {good}" if good else ""), fontsize=9, y=1.0, pad=6)
        if m == "success_rate":
            ax.set_ylim(-0.05, 1.05)
        if m in ("loss", "heldout_action_mse") and train and min(p[1] for p in train) > 0:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    # inches: left of a panel its tick labels (up to "3.1×10⁻¹") and axis label, right of it an evaluation's note,
    # under it its tick labels and axis label, over it its title (and the figure's)
    left, right, gap_w, bottom, gap_h = 1.05, 0.85, 1.5, 0.6, 0.95
    top = 0.7 if title else 0.4
    w, h = fig.get_size_inches()
    axes_w = (w - left - right - gap_w * (cols - 1)) / cols
    axes_h = (h - bottom - top - gap_h * (rows_n - 1)) / rows_n
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h,
                        wspace=gap_w / axes_w, hspace=gap_h / axes_h)
    return fig
