"""The ``/nexus`` page of the Dask dashboard (Bokeh), served by the scheduler process: an operator's home.

Top to bottom: the dashboard's own navigation bar (back to Status, Workers, …), a summary line with links,
the health of every role (from the health manager's ``roles`` when the status has them, else from the
workers' heartbeats), the jobs table with a progress bar per job, the tenants table (state, version,
queues, metered device-seconds), per-tenant learning curves (training loss, rollout return per version,
evaluation success as points), the utilization timeline (who used the actor, the inference engine and
each simulator when — the paper's execution-trace picture) with its colour legend, and the queues and
inference-batching histograms, every axis labelled. It reads the plugin's state in-process once a second
(plain data, no I/O). The data shaping is in plain functions (tested without a browser).
"""

from __future__ import annotations

import html
import time
from typing import Any

import numpy as np

from nexus.wire.history import JOB_COUNTERS, JOB_HEADLINE, by_kind, per_version

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#aec7e8"]
GROUPED_COLOR = "#444444"  # an inference forward shared by several tenants (group batching)
GROUPED_LABEL = "grouped inference forward (several tenants)"
TENANT_COLUMNS = [("tenant", "tenant"), ("kind", "kind"), ("state", "state"), ("version", "version"),
                  ("inflight", "in-flight"), ("queued", "queued"), ("dropped_stale", "dropped stale"),
                  ("actor_s", "actor s"), ("inference_s", "inference s"), ("simulator_s", "simulator s")]
JOB_COLUMNS = [("job", "job"), ("tenant", "tenant"), ("kind", "kind"), ("state", "state"),
               ("progress", "progress"), ("version", "version"), ("metric", "latest metrics"),
               ("elapsed_s", "elapsed s")]
# the health manager's role views (``status()["roles"]``: healthy / suspect / failed / restarting / starting)
ROLE_COLUMNS = [("role", "role"), ("kind", "kind"), ("state", "state"), ("worker", "worker"), ("restarts", "restarts"),
                ("restart_budget_left", "budget left"), ("since_heartbeat_s", "since heartbeat s"),
                ("reason", "reason")]
# predict latency per tenant at the gateways (nexus.control.monitoring.predict_latency)
LATENCY_COLUMNS = [("tenant", "tenant"), ("count", "predicts"), ("rejected", "refused (429)"),
                   ("mean_ms", "mean ms"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms")]
# the jobs table's metric column: an evaluation shows its success rate only
HEADLINE = {**JOB_HEADLINE, "eval": JOB_HEADLINE["eval"][:1]}
ROLE_OF_RESOURCE = {"SIM": "simulator", "ACTOR": "actor", "INFER": "inference", "TRACK": "tracker"}
ROW_PX, HEADER_PX, MAX_ROWS = 25, 30, 14  # tables longer than MAX_ROWS scroll


class Colors:
    """One colour per tenant, stable for the page's lifetime; grouped spans share one colour."""

    def __init__(self) -> None:
        self.of: dict[str, str] = {}

    def __call__(self, tenant: str) -> str:
        if "+" in tenant:
            return GROUPED_COLOR
        if tenant not in self.of:
            self.of[tenant] = PALETTE[len(self.of) % len(PALETTE)]
        return self.of[tenant]


# ------------------------------------------------------------------------------------------- data
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


def latency_columns(latency: Any) -> dict[str, list]:
    """The predict-latency table (``PredictLatency.rows``), ms rounded to 0.1."""
    data: dict[str, list] = {key: [] for key, _ in LATENCY_COLUMNS}
    for r in latency.rows() if latency is not None else []:
        for key, _ in LATENCY_COLUMNS:
            v = r[key]
            data[key].append(round(v, 1) if isinstance(v, float) else ("-" if v is None else v))
    return data


def jobs_columns(view: dict[str, Any], now: float | None = None) -> dict[str, list]:
    """One row per job, newest first: progress as done/total and a percentage (drawn as a bar)."""
    now = now or time.time()
    data: dict[str, list] = {key: [] for key, _ in JOB_COLUMNS} | {"pct": []}
    for j in sorted(view["status"]["jobs"], key=lambda j: -(j.get("t_submit") or 0)):
        p = {**j.get("progress", {}), **(j.get("result") or {})}
        unit = JOB_COUNTERS.get(j["kind"], "steps")
        total = int(j.get("spec", {}).get(unit, 0) or 0)
        done = total if j["state"] == "done" and j["kind"] == "eval" else int(p.get(unit, 0) or 0)
        pct = 100.0 * done / total if total else 0.0
        metrics = "  ".join(f"{k} {p[k]:.3g}" for k in HEADLINE.get(j["kind"], ()) if isinstance(p.get(k), int | float))
        data["job"].append(j["job"])
        data["tenant"].append(j["tenant"])
        data["kind"].append(j["kind"])
        data["state"].append(j["state"] + (f": {j['error']}" if j.get("error") else ""))
        data["progress"].append(f"{done}/{total} {unit}")
        data["pct"].append(round(pct, 1))
        data["version"].append(p.get("version", ""))
        data["metric"].append(metrics or "-")
        end = j.get("t_end") or now
        data["elapsed_s"].append(round(end - (j.get("t_submit") or end), 1))
    return data


def roles_columns(status: dict[str, Any]) -> dict[str, list]:
    """Health of each role: the health manager's ``roles`` list when present, else one row per worker."""
    rows = status.get("roles")
    if rows is None:
        rows = []
        for w in status.get("workers", []):
            role = next((ROLE_OF_RESOURCE[r] for r in w.get("resources", {}) if r in ROLE_OF_RESOURCE), "worker")
            rows.append({"role": role, "kind": "worker", "worker": w["name"], "state": w["status"], "restarts": "-",
                         "since_heartbeat_s": w["since_heartbeat_s"]})
    data: dict[str, list] = {key: [] for key, _ in ROLE_COLUMNS}
    for r in sorted(rows, key=lambda r: (str(r.get("role")), str(r.get("worker")))):
        for key, _ in ROLE_COLUMNS:
            v = r.get(key)
            data[key].append(round(v, 1) if isinstance(v, float) else "-" if v in (None, "") else v)
    return data


def worker_names(status: dict[str, Any]) -> dict[str, str]:
    """Worker address -> its name (``sim-0``, ``actor-0``, …)."""
    return {w["address"]: str(w["name"]) for w in status.get("workers", [])}


def timeline_columns(view: dict[str, Any], lanes: dict[str, int], colors: Colors) -> dict[str, list]:
    t_start = view["t_start"]
    names = worker_names(view["status"])
    data: dict[str, list] = {k: [] for k in ("left", "right", "bottom", "top", "color", "tenant", "lane", "legend")}
    for sp in view["spans"]:
        worker = names.get(sp["worker"], sp["worker"])
        lane = f"{sp['service']} · {worker}"
        y = lanes.setdefault(lane, len(lanes))
        tenant = sp["tenant"]
        data["left"].append(sp["t0"] - t_start)
        data["right"].append(max(sp["t1"], sp["t0"] + 1e-3) - t_start)
        data["bottom"].append(y - 0.4)
        data["top"].append(y + 0.4)
        data["color"].append(colors(tenant))
        data["tenant"].append(tenant.replace("+", ", "))
        data["lane"].append(lane)
        data["legend"].append(GROUPED_LABEL if "+" in tenant else tenant)
    return data


def legend_html(colors: Colors, grouped: bool) -> str:
    """The timeline's colour legend as HTML (readable text, not canvas)."""
    items = [(c, html.escape(t)) for t, c in colors.of.items()]
    if grouped:
        items.append((GROUPED_COLOR, GROUPED_LABEL))
    swatches = "".join(f'<span style="display:inline-block;margin-right:14px"><span style="display:inline-block;'
                       f'width:12px;height:12px;background:{c};margin-right:4px;vertical-align:middle"></span>{t}'
                       "</span>" for c, t in items)
    return f'<div style="font-size:12px"><b>Legend</b> (colour = tenant): {swatches or "no work yet"}</div>'


def _downsample(xs: list, ys: list, n: int = 400) -> tuple[list, list]:
    if len(xs) <= n:
        return xs, ys
    idx = np.linspace(0, len(xs) - 1, n).astype(int)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def curves_columns(jobs: list[tuple[str, list[dict[str, Any]]]], colors: Colors) -> dict[str, dict[str, list]]:
    """Per-tenant learning curves from (tenant, history) pairs: training loss vs version (a line per tenant),
    rollout return as the mean per collecting version (a line per tenant), evaluation success as points."""

    loss: dict[str, tuple[list, list]] = {}
    ret: dict[str, list] = {}
    evals: dict[str, list] = {k: [] for k in ("x", "y", "tenant", "color", "episodes")}
    for tenant, history in jobs:
        kinds = by_kind(history)
        xs, ys = loss.setdefault(tenant, ([], []))
        for r in kinds.get("train", []):
            if isinstance(r.get("loss"), int | float):
                xs.append(r["step"])
                ys.append(float(r["loss"]))
        ret.setdefault(tenant, []).extend(kinds.get("rollout", []))
        for r in kinds.get("eval", []):
            if isinstance(r.get("success_rate"), int | float):
                evals["x"].append(r["step"])
                evals["y"].append(float(r["success_rate"]))
                evals["tenant"].append(tenant)
                evals["color"].append(colors(tenant))
                evals["episodes"].append(r.get("episodes", ""))

    def lines(series: dict[str, tuple[list, list]]) -> dict[str, list]:
        out: dict[str, list] = {"xs": [], "ys": [], "tenant": [], "color": []}
        for tenant, (xs, ys) in series.items():
            if xs:
                order = np.argsort(xs, kind="stable")
                xs2, ys2 = _downsample([xs[i] for i in order], [ys[i] for i in order])
                out["xs"].append(xs2)
                out["ys"].append(ys2)
                out["tenant"].append(tenant)
                out["color"].append(colors(tenant))
        return out

    returns = {t: ([a[0] for a in per_version(rows, "return")], [a[1] for a in per_version(rows, "return")])
               for t, rows in ret.items()}
    return {"loss": lines(loss), "return": lines(returns), "eval": evals}


def histogram(values: list[float], bins: int | np.ndarray) -> dict[str, list]:
    if not values:
        return {"left": [], "right": [], "count": []}
    counts, edges = np.histogram(np.asarray(values, dtype=float), bins=bins)
    return {"left": edges[:-1].tolist(), "right": edges[1:].tolist(), "count": counts.tolist()}


def summary_html(view: dict[str, Any]) -> str:
    st = view["status"]
    cfg = st.get("config", {})
    running = sum(j["state"] == "running" for j in st["jobs"])
    busy = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(st["busy_s"].items())) or "none yet"
    uri = cfg.get("tracking_uri") or f"sqlite:///{cfg.get('root', '?')}/mlflow.db"
    return (f'<h2 style="margin:4px 0">JoyNexus</h2><p style="margin:2px 0">{len(st["tenants"])} tenants · '
            f'{running} jobs running of {len(st["jobs"])} · training queue {st["training_queue"]["depth"]} · '
            f'inference pending {st["inference_queue"]["pending"]} · busy: {busy}</p>'
            f'<p style="margin:2px 0;font-size:12px"><a href="status">← Dask dashboard</a> · '
            f'<a href="nexus/api/state">status JSON</a> · <a href="metrics">Prometheus</a> · '
            f'MLflow: <code>{html.escape(uri)}</code> · root <code>{html.escape(str(cfg.get("root", "?")))}</code></p>')


def _section(title: str, note: str = "") -> str:
    return (f'<h3 style="margin:10px 0 2px 0">{title}</h3>'
            + (f'<p style="margin:0;font-size:12px;color:#555">{note}</p>' if note else ""))


# ------------------------------------------------------------------------------------------- page
def nexus_doc(scheduler, extra, doc) -> None:
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, DataTable, Div, HoverTool, HTMLTemplateFormatter, TableColumn
    from bokeh.plotting import figure

    tenants = ColumnDataSource({key: [] for key, _ in TENANT_COLUMNS})
    jobs = ColumnDataSource({key: [] for key, _ in JOB_COLUMNS} | {"pct": []})
    roles = ColumnDataSource({key: [] for key, _ in ROLE_COLUMNS})
    latency = ColumnDataSource({key: [] for key, _ in LATENCY_COLUMNS})
    queues = ColumnDataSource({"t": [], "training": [], "inference": []})
    spans = ColumnDataSource({k: [] for k in ("left", "right", "bottom", "top", "color", "tenant", "lane", "legend")})
    sizes = ColumnDataSource({"left": [], "right": [], "count": []})
    waits = ColumnDataSource({"left": [], "right": [], "count": []})
    loss = ColumnDataSource({"xs": [], "ys": [], "tenant": [], "color": []})
    returns = ColumnDataSource({"xs": [], "ys": [], "tenant": [], "color": []})
    evals = ColumnDataSource({k: [] for k in ("x", "y", "tenant", "color", "episodes")})
    lanes: dict[str, int] = {}
    colors = Colors()
    width = {"sizing_mode": "stretch_width"}

    header = Div(text="<h2>JoyNexus</h2><p>No Nexus plugin on this scheduler.</p>", **width)
    bar = HTMLTemplateFormatter(template=(
        '<div style="position:relative;background:#eee;height:16px;margin-top:3px">'
        '<div style="background:#8fd18f;height:16px;width:<%= pct %>%"></div>'
        '<span style="position:absolute;left:4px;top:0;font-size:11px"><%= value %> (<%= pct %>%)</span></div>'))
    job_table = DataTable(source=jobs, index_position=None, height=HEADER_PX + ROW_PX, row_height=ROW_PX, **width,
                          columns=[TableColumn(field=k, title=t, formatter=bar) if k == "progress"
                                   else TableColumn(field=k, title=t) for k, t in JOB_COLUMNS])
    tenant_table = DataTable(source=tenants, columns=[TableColumn(field=k, title=t) for k, t in TENANT_COLUMNS],
                             height=HEADER_PX + ROW_PX, row_height=ROW_PX, index_position=None, **width)
    latency_table = DataTable(source=latency, columns=[TableColumn(field=k, title=t) for k, t in LATENCY_COLUMNS],
                              height=HEADER_PX + ROW_PX, row_height=ROW_PX, index_position=None, **width)
    role_table = DataTable(source=roles, columns=[TableColumn(field=k, title=t) for k, t in ROLE_COLUMNS],
                           height=HEADER_PX + ROW_PX, row_height=ROW_PX, index_position=None, **width)

    fl = figure(title="Training loss per tenant (per update)", height=260, y_axis_type="log",
                x_axis_label="policy version", y_axis_label="training loss", **width)
    fl.multi_line("xs", "ys", color="color", legend_field="tenant", source=loss, line_width=1.5)
    fr = figure(title="Rollout return per tenant (mean per version)", height=260,
                x_axis_label="policy version", y_axis_label="episode return", **width)
    fr.multi_line("xs", "ys", color="color", legend_field="tenant", source=returns, line_width=1.5)
    fe = figure(title="Evaluation success (a point per evaluation)", height=260, y_range=(-0.05, 1.05),
                x_axis_label="evaluated policy version", y_axis_label="success rate (0-1)", **width)
    fe.scatter("x", "y", color="color", legend_field="tenant", source=evals, size=9, line_color="black")
    fe.add_tools(HoverTool(tooltips=[("tenant", "@tenant"), ("version", "@x"), ("success", "@y"),
                                     ("episodes", "@episodes")]))
    for f in (fl, fr, fe):
        f.legend.location = "top_right"
        f.legend.label_text_font_size = "9pt"

    tl = figure(title="Utilization timeline: which tenant each service worked for, when", height=300,
                x_axis_label="seconds since the service started", y_axis_label="service · worker", **width)
    tl.quad(left="left", right="right", bottom="bottom", top="top", color="color", source=spans, line_alpha=0,
            legend_field="legend")
    tl.legend.location = "top_left"
    tl.legend.label_text_font_size = "8pt"
    tl.legend.orientation = "horizontal"
    tl.add_tools(HoverTool(tooltips=[("tenant(s)", "@tenant"), ("lane", "@lane")]))
    legend = Div(text=legend_html(colors, False), **width)

    q = figure(title="Queue depth", height=220, x_axis_label="seconds since the service started",
               y_axis_label="items waiting", **width)
    q.step("t", "training", source=queues, legend_label="training queue", mode="after", line_width=2)
    q.step("t", "inference", source=queues, legend_label="inference queue", mode="after", color="#ff7f0e",
           line_width=2)
    q.legend.location = "top_left"
    hs = figure(title="Inference group size", height=220, x_axis_label="requests in one grouped forward",
                y_axis_label="forwards", **width)
    hs.quad(left="left", right="right", bottom=0, top="count", source=sizes)
    hw = figure(title="Inference wait", height=220, x_axis_label="wait before the forward fired (ms)",
                y_axis_label="requests", **width)
    hw.quad(left="left", right="right", bottom=0, top="count", source=waits, color="#2ca02c")

    def update() -> None:
        plugin = scheduler.plugins.get("nexus")
        if plugin is None:
            return
        view = plugin.monitoring_view()
        st = view["status"]
        header.text = summary_html(view)
        tenants.data = tenants_columns(view)
        jobs.data = jobs_columns(view)
        roles.data = roles_columns(st)
        latency.data = latency_columns(getattr(plugin, "latency", None))
        for table, source in ((job_table, jobs), (tenant_table, tenants), (role_table, roles),
                              (latency_table, latency)):
            n = len(next(iter(source.data.values())))  # rows shown: the table's own height, no blank space
            table.height = HEADER_PX + ROW_PX * min(max(1, n), MAX_ROWS)
        t0 = view["t_start"]
        queues.data = {"t": [s["t"] - t0 for s in view["samples"]],
                       "training": [s["training_depth"] for s in view["samples"]],
                       "inference": [s["inference_pending"] for s in view["samples"]]}
        spans.data = timeline_columns(view, lanes, colors)
        legend.text = legend_html(colors, GROUPED_LABEL in spans.data["legend"])
        tl.yaxis.ticker = list(range(len(lanes)))
        tl.yaxis.major_label_overrides = {i: name for name, i in lanes.items()}
        curves = curves_columns([(js.tenant, js.history) for js in list(plugin.jobs.values())], colors)
        loss.data, returns.data, evals.data = curves["loss"], curves["return"], curves["eval"]
        sizes.data = histogram(view["group_sizes"], np.arange(0.5, max(view["group_sizes"] or [1]) + 1.5))
        waits.data = histogram([w * 1e3 for w in view["group_waits"]], 20)

    update()
    doc.add_periodic_callback(update, 1000)
    doc.title = "JoyNexus"
    doc.add_root(column(
        header,
        Div(text=_section("Health", "every role of the service: state, restarts, seconds since its last heartbeat"),
            **width), role_table,
        Div(text=_section("Jobs", "newest first; progress in steps (SFT), updates (RL) or episodes (eval)"),
            **width), job_table,
        Div(text=_section("Tenants", "device-seconds metered to each tenant per service"), **width), tenant_table,
        Div(text=_section("Predict latency", "per tenant, at the gateway: request in to answer out (p50/p99 "
                                             "from histogram buckets); refused: 429, a concurrency budget spent"),
            **width), latency_table,
        Div(text=_section("Learning curves", "loss: lower is better · return: higher is better · success: 0-1, "
                                             "the fraction of evaluation episodes solved"), **width),
        row(fl, fr, fe, **width),
        tl, legend,
        row(q, hs, hw, **width),
        **width))
    _use_dashboard_template(doc, extra)


def _use_dashboard_template(doc, extra: dict[str, Any]) -> None:
    """The Dask dashboard's page template: its navigation bar (Status, Workers, …, Nexus) and theme."""
    try:
        from distributed.dashboard.components.scheduler import BOKEH_THEME, env
    except ImportError:
        return
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


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
