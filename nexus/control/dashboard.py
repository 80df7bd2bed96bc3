"""The ``/nexus`` page of the Dask dashboard (Bokeh), served by the scheduler process.

Tenants table (kind, state, version, in-flight, queued, dropped, metered device-seconds), both
queues' depth over time, a utilization timeline per service (who used the actor, the inference
engine and the simulators when: the paper's execution-trace picture) and the inference queue's
group-size and wait histograms. It reads the plugin's state in-process, once a second.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]
TENANT_COLUMNS = [("tenant", "tenant"), ("kind", "kind"), ("state", "state"), ("version", "version"),
                  ("inflight", "in-flight"), ("queued", "queued"), ("dropped_stale", "dropped"),
                  ("actor_s", "actor s"), ("inference_s", "inference s"), ("simulator_s", "simulator s")]


def tenants_columns(view: dict[str, Any]) -> dict[str, list]:
    rows = view["status"]["tenants"]
    data: dict[str, list] = {key: [] for key, _ in TENANT_COLUMNS}
    for r in rows:
        for key, _ in TENANT_COLUMNS:
            if key.endswith("_s"):
                data[key].append(round(r["metered_s"].get(key[:-2], 0.0), 2))
            else:
                data[key].append(r[key])
    return data


def timeline_columns(view: dict[str, Any], lanes: dict[str, int], colors: dict[str, str]) -> dict[str, list]:
    t_start = view["t_start"]
    data: dict[str, list] = {k: [] for k in ("left", "right", "bottom", "top", "color", "tenant", "lane")}
    for sp in view["spans"]:
        lane = f"{sp['service']} · {sp['worker']}"
        y = lanes.setdefault(lane, len(lanes))
        tenant = sp["tenant"]
        color = colors.setdefault(tenant, PALETTE[len(colors) % len(PALETTE)])
        data["left"].append(sp["t0"] - t_start)
        data["right"].append(max(sp["t1"], sp["t0"] + 1e-3) - t_start)
        data["bottom"].append(y - 0.4)
        data["top"].append(y + 0.4)
        data["color"].append(color)
        data["tenant"].append(tenant)
        data["lane"].append(lane)
    return data


def histogram(values: list[float], bins: int | np.ndarray) -> dict[str, list]:
    if not values:
        return {"left": [], "right": [], "count": []}
    counts, edges = np.histogram(np.asarray(values, dtype=float), bins=bins)
    return {"left": edges[:-1].tolist(), "right": edges[1:].tolist(), "count": counts.tolist()}


def nexus_doc(scheduler, extra, doc) -> None:
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, DataTable, Div, HoverTool, TableColumn
    from bokeh.plotting import figure

    tenants = ColumnDataSource({key: [] for key, _ in TENANT_COLUMNS})
    queues = ColumnDataSource({"t": [], "training": [], "inference": []})
    spans = ColumnDataSource({k: [] for k in ("left", "right", "bottom", "top", "color", "tenant", "lane")})
    sizes = ColumnDataSource({"left": [], "right": [], "count": []})
    waits = ColumnDataSource({"left": [], "right": [], "count": []})
    lanes: dict[str, int] = {}
    colors: dict[str, str] = {}

    header = Div(text="<h2>JoyNexus</h2><p>No Nexus plugin on this scheduler.</p>")
    table = DataTable(source=tenants, columns=[TableColumn(field=k, title=t) for k, t in TENANT_COLUMNS],
                      height=220, sizing_mode="stretch_width", index_position=None)
    q = figure(title="Queue depth", height=220, sizing_mode="stretch_width", x_axis_label="s since start")
    q.step("t", "training", source=queues, legend_label="training queue", mode="after", line_width=2)
    q.step("t", "inference", source=queues, legend_label="inference queue", mode="after", color="#ff7f0e",
           line_width=2)
    q.legend.location = "top_left"
    tl = figure(title="Utilization timeline (colour = tenant)", height=300, sizing_mode="stretch_width",
                x_axis_label="s since start")
    tl.quad(left="left", right="right", bottom="bottom", top="top", color="color", source=spans, line_alpha=0)
    tl.add_tools(HoverTool(tooltips=[("tenant", "@tenant"), ("lane", "@lane")]))
    hs = figure(title="Inference group size", height=220, sizing_mode="stretch_width")
    hs.quad(left="left", right="right", bottom=0, top="count", source=sizes)
    hw = figure(title="Inference wait (ms)", height=220, sizing_mode="stretch_width")
    hw.quad(left="left", right="right", bottom=0, top="count", source=waits, color="#2ca02c")

    def update() -> None:
        plugin = scheduler.plugins.get("nexus")
        if plugin is None:
            return
        view = plugin.monitoring_view()
        st = view["status"]
        header.text = (f"<h2>JoyNexus</h2><p>{len(st['tenants'])} tenants · training queue "
                       f"{st['training_queue']['depth']} · jobs running "
                       f"{sum(j['state'] == 'running' for j in st['jobs'])} · busy s: "
                       + ", ".join(f"{k} {v:.1f}" for k, v in sorted(st['busy_s'].items())) + "</p>")
        tenants.data = tenants_columns(view)
        t0 = view["t_start"]
        queues.data = {"t": [s["t"] - t0 for s in view["samples"]],
                       "training": [s["training_depth"] for s in view["samples"]],
                       "inference": [s["inference_pending"] for s in view["samples"]]}
        spans.data = timeline_columns(view, lanes, colors)
        tl.yaxis.ticker = list(range(len(lanes)))
        tl.yaxis.major_label_overrides = {i: name for name, i in lanes.items()}
        sizes.data = histogram(view["group_sizes"], np.arange(0.5, max(view["group_sizes"] or [1]) + 1.5))
        waits.data = histogram([w * 1e3 for w in view["group_waits"]], 20)

    update()
    doc.add_periodic_callback(update, 1000)
    doc.title = "JoyNexus"
    doc.add_root(column(header, table, row(q, hs, hw, sizing_mode="stretch_width"), tl,
                        sizing_mode="stretch_width"))


def register() -> None:
    """Add the page and its navigation link; must run before the scheduler builds its dashboard."""
    try:
        from distributed.dashboard import scheduler as dash
    except ImportError:  # bokeh not installed: no dashboard at all
        return
    dash.applications["/nexus"] = nexus_doc
    if getattr(dash.template_variables, "_nexus", False):
        return
    original = dash.template_variables

    def template_variables(scheduler):
        out = original(scheduler)
        if "nexus" not in out["pages"]:
            out["pages"].append("nexus")
        return out

    template_variables._nexus = True  # type: ignore[attr-defined]
    dash.template_variables = template_variables
