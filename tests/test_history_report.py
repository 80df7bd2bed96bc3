"""History rows, learning-curve plots, `nexus logs` text and the /nexus page's data shaping (no cluster)."""

from __future__ import annotations

import json

import pytest

from nexus.client.api import JobProgress
from nexus.client.report import format_log, manifest_log, merge_logs, write_report
from nexus.control.monitoring import dashboard
from nexus.data.output_dir import TenantOutputDir
from nexus.tracking.tracker import metric_name
from nexus.wire.history import by_kind, curves_figure, kind_of, panels, per_version, plot_curves, pyplot


def _rl_history() -> list[dict]:
    rows = []
    env_steps = 0
    for i in range(6):  # two rollout batches per version: the same version, a rising env-step count
        env_steps += 400
        rows.append({"kind": "rollout", "step": env_steps, "return": float(i), "success_rate": 0.1 * i,
                     "episodes": 8 * (i + 1), "env_steps": env_steps, "version": i // 2})
        rows.append({"kind": "train", "step": i + 1, "loss": 1.0 / (i + 1), "update_s": 0.5, "version": i + 1,
                     "updates": i + 1})
    rows.append({"kind": "queue", "step": 1, "dropped_stale": 1})
    rows.append({"kind": "eval", "step": 6, "success_rate": 0.5, "return": 9.0, "episodes": 8})
    return rows


def test_rows_group_by_kind_and_rollouts_aggregate_per_version():
    h = _rl_history()
    kinds = by_kind(h)
    assert {k: len(v) for k, v in kinds.items()} == {"train": 6, "rollout": 6, "eval": 1, "queue": 1}
    assert per_version(kinds["rollout"], "return") == [(0, 0.5, 0.0, 1.0, 2), (1, 2.5, 2.0, 3.0, 2),
                                                       (2, 4.5, 4.0, 5.0, 2)]
    # rows recorded before kinds existed are recognised by their fields
    assert [kind_of(r) for r in ({"step": 1, "loss": 1}, {"step": 0, "return": 1, "env_steps": 5},
                                 {"step": 2, "dropped_stale": 1}, {"step": 3, "success_rate": 1})] == [
        "train", "rollout", "queue", "eval"]
    assert panels(h) == ["loss", "return", "success_rate"]


def test_metric_names_are_namespaced():
    assert metric_name("train", "loss") == "train/loss"
    assert metric_name("rollout", "return") == "rollout/return"
    assert metric_name("rollout", "version") == "rollout/policy_version"
    assert metric_name("eval", "success_rate") == "eval/success_rate"
    assert metric_name("train", "weight_sync_s") == "system/weight_sync_s"


def test_curves_png_is_written_only_with_something_to_plot(tmp_path):
    assert plot_curves([{"kind": "queue", "step": 1, "dropped_stale": 1}], tmp_path / "none.png") is None
    path = plot_curves(_rl_history(), tmp_path / "c.png", title="t")
    assert path.stat().st_size > 10_000


def _histories() -> dict[str, list[dict]]:
    rl = _rl_history()
    heldout = [{"kind": "train", "step": i, "heldout_action_mse": 0.41 - 0.01 * i} for i in range(1, 7, 2)]
    return {"1 panel": [r for r in rl if r["kind"] == "train"], "3 panels": rl, "4 panels": rl + heldout}


@pytest.mark.parametrize("which", ["1 panel", "3 panels", "4 panels"])
def test_curves_text_stays_inside_the_figure_and_clear_of_the_panel_above(which):
    """The margins are fixed, not fitted to the drawn text: every title, axis label, tick label, legend and
    evaluation note lies inside the figure, and a panel's title under the axis label of the panel above."""
    rows = _histories()[which]
    fig = curves_figure(rows, title="tenant-a/rl-3 (a long job name)")
    fig.canvas.draw()  # labels are placed as the figure is drawn
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == int(which[0]) == len(panels(rows))
    # each panel with all it draws (tick labels, axis labels, title, legend, evaluation notes), in pixels
    extents = [e for ax in axes for e in (ax.get_tightbbox(renderer), ax.get_legend().get_window_extent(renderer),
                                         *(t.get_window_extent(renderer) for t in ax.texts))]
    for e in extents:
        assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0 and e.y1 <= box.y1 + 1, (e, box)
    drawn, size = fig.get_tightbbox(renderer), fig.get_size_inches()  # everything, the figure's title too (inches)
    assert drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= size[0] + 0.01 and drawn.y1 <= size[1] + 0.01
    for upper, lower in zip(axes, axes[2:], strict=False):  # two columns: the panel under each
        assert lower.title.get_window_extent(renderer).y1 < upper.xaxis.label.get_window_extent(renderer).y0
    pyplot().close(fig)


def test_logs_group_by_kind_and_read_the_manifest(tmp_path):
    out = TenantOutputDir(tmp_path / "ten")
    out.create({"name": "ten"}, {})
    out.add_job({"job": "ten-rl-1", "kind": "rl", "state": "done", "t_submit": 100.0, "t_end": 110.0,
                 "error": None, "history": _rl_history()})
    stored = manifest_log(out.path)
    assert stored["jobs"][0]["history"] == _rl_history() and stored["jobs"][0]["source"] == "manifest"
    live = {"tenant": {"tenant": "ten", "output_dir": str(out.path), "version": 7}, "t_start": 0, "spans": [],
            "jobs": [{"job": "ten-rl-1", "kind": "rl", "state": "running", "t_submit": 200.0, "t_end": None,
                      "error": None, "history": [], "metered_s": {"actor": 1.0}}]}
    merged = merge_logs(live, stored)  # the same job id in another service: both kept, oldest first
    assert [(j["job"], j["source"]) for j in merged["jobs"]] == [("ten-rl-1", "manifest"), ("ten-rl-1", "service")]
    lines = format_log(merged)
    text = "\n".join(lines)
    assert "[from the manifest]" in text and "wall 10.0 s" in text
    sections = [ln.strip().split(" (")[0] for ln in lines if ln.strip().startswith("-- ")]
    assert sections == ["-- train", "-- rollout", "-- eval", "-- queue"]  # grouped, not interleaved
    assert "(no metric history recorded)" in text  # the live job has none yet
    only = format_log(merged, kinds=["eval"], last=1)
    assert sum(ln.strip().startswith("-- ") for ln in only) == 1
    assert write_report(merged, tmp_path / "r") == [tmp_path / "r" / "ten-curves.png"]  # no spans: no timeline


def test_job_progress_reads_like_a_line():
    info = {"job": "a-sft-1", "tenant": "a", "kind": "sft", "state": "running", "spec": {"steps": 300},
            "progress": {"steps": 120, "version": 120, "loss": 0.0834, "heldout_action_mse": 0.12},
            "result": None, "error": None, "t_submit": 0.0, "t_end": 41.0}
    p = JobProgress.from_info(info)
    assert (p.done, p.total, p.unit, p.fraction, p.finished) == (120, 300, "steps", 0.4, False)
    assert str(p) == "a-sft-1  running  120/300 steps  v120  loss 0.0834  heldout_action_mse 0.12  (41 s)"
    ev = JobProgress.from_info({**info, "kind": "eval", "state": "done", "spec": {"episodes": 8},
                                "progress": {"episodes": 0, "version": 3}, "result": {"success_rate": 0.5}})
    assert (ev.done, ev.metrics, ev.finished) == (8, {"success_rate": 0.5}, True)


@pytest.fixture
def view():
    workers = [{"name": "sim-0", "address": "tcp://127.0.0.1:1", "status": "running", "resources": {"SIM": 1},
                "since_heartbeat_s": 0.4, "processing": 1},
               {"name": "actor-0", "address": "tcp://127.0.0.1:2", "status": "running", "resources": {"ACTOR": 1},
                "since_heartbeat_s": 0.2, "processing": 0}]
    jobs = [{"job": "a-sft-1", "tenant": "a", "kind": "sft", "state": "running", "spec": {"steps": 10},
             "progress": {"steps": 5, "version": 5, "loss": 0.5}, "result": None, "error": None, "t_submit": 1.0,
             "t_end": None},
            {"job": "b-eval-2", "tenant": "b", "kind": "eval", "state": "done", "spec": {"episodes": 4},
             "progress": {"episodes": 0, "version": 2}, "result": {"success_rate": 0.25}, "error": None,
             "t_submit": 2.0, "t_end": 5.0}]
    spans = [{"service": "simulator", "worker": "tcp://127.0.0.1:1", "tenant": "a", "t0": 10.0, "t1": 11.0},
             {"service": "inference", "worker": "infer-0", "tenant": "a+b", "t0": 10.5, "t1": 10.6}]
    status = {"tenants": [], "jobs": jobs, "workers": workers, "training_queue": {"depth": 0},
              "inference_queue": {"pending": 0}, "busy_s": {}, "config": {"root": "/r"}}
    return {"status": status, "spans": spans, "t_start": 10.0}


def test_page_data_jobs_roles_timeline_and_legend(view):
    jobs = dashboard.jobs_columns(view, now=11.0)
    assert jobs["job"] == ["b-eval-2", "a-sft-1"]  # newest first
    assert jobs["progress"] == ["4/4 episodes", "5/10 steps"] and jobs["pct"] == [100.0, 50.0]
    assert jobs["metric"] == ["success_rate 0.25", "loss 0.5"] and jobs["elapsed_s"] == [3.0, 10.0]
    roles = dashboard.roles_columns(view["status"])
    assert list(zip(roles["role"], roles["worker"], strict=True)) == [("actor", "actor-0"), ("simulator", "sim-0")]
    # the health manager's own list (status()["roles"], nexus.control.health.manager), when present, is shown as it is
    health = dashboard.roles_columns({"roles": [
        {"role": "engine/0", "kind": "engine", "worker": "infer-0", "state": "restarting", "restarts": 2,
         "restart_budget_left": 3, "since_heartbeat_s": 3.14159, "reason": "no heartbeat for 61 s"},
        {"role": "actor/0", "kind": "actor", "worker": "actor-0", "state": "healthy", "restarts": 0,
         "restart_budget_left": 5, "since_heartbeat_s": None, "reason": ""}]})
    assert health["role"] == ["actor/0", "engine/0"] and health["state"] == ["healthy", "restarting"]
    assert health["restarts"] == [0, 2] and health["restart_budget_left"] == [5, 3]
    assert health["since_heartbeat_s"] == ["-", 3.1] and health["reason"] == ["-", "no heartbeat for 61 s"]
    colors, lanes = dashboard.Colors(), {}
    tl = dashboard.timeline_columns(view, lanes, colors)
    assert tl["lane"] == ["simulator · sim-0", "inference · infer-0"]  # names, not addresses
    assert tl["legend"] == ["a", dashboard.GROUPED_LABEL] and tl["color"][1] == dashboard.GROUPED_COLOR
    legend = dashboard.legend_html(colors, grouped=True)
    assert "Legend" in legend and ">a</span>" in legend and dashboard.GROUPED_LABEL in legend


def test_page_curves_per_tenant():
    colors = dashboard.Colors()
    curves = dashboard.curves_columns([("r", _rl_history()), ("s", [{"kind": "train", "step": 2, "loss": 0.3},
                                                                     {"kind": "train", "step": 1, "loss": 0.5}])],
                                      colors)
    assert curves["loss"]["tenant"] == ["r", "s"] and curves["loss"]["xs"][1] == [1, 2]  # sorted by version
    assert curves["return"]["xs"] == [[0, 1, 2]] and curves["return"]["ys"] == [[0.5, 2.5, 4.5]]
    assert curves["eval"]["y"] == [0.5] and curves["eval"]["tenant"] == ["r"]
    assert json.dumps(curves)  # plain data for Bokeh
