"""The MLflow tracker after a restart (integ's TrackerLink resends unacknowledged batches to a new tracker):
ux's namespaced, monotonic series stay monotonic — a resent point is not logged twice — and the job's own
start/end times are kept. A real sqlite MLflow store; no cluster."""

from __future__ import annotations

from nexus.services.tracking import Tracker


def test_a_new_tracker_continues_a_run_without_repeating_steps(tmp_path):
    cfg = {"root": str(tmp_path)}
    first = Tracker(cfg)
    run_id = first.start_run("t-rl-1", "t", "rl", {"lr": 1e-3}, None, start_time=1_000.0)
    first.log_metrics("t-rl-1", {"loss": 1.0, "version": 1}, 1, "train")
    first.log_metrics("t-rl-1", {"return": 2.0, "version": 1}, 40, "rollout")

    second = Tracker(cfg)  # the tracker's worker was lost; the link reopens the known runs, then resends
    second.reopen({"t-rl-1": run_id})
    assert second.start_run("t-rl-1", "t", "rl", {"lr": 1e-3}) == run_id  # a resent start adopts the run
    second.log_metrics("t-rl-1", {"loss": 1.0, "version": 1}, 1, "train")  # resent: already in MLflow
    second.log_metrics("t-rl-1", {"loss": 0.5, "version": 2}, 2, "train")
    second.log_metrics("t-rl-1", {"return": 3.0, "version": 2}, 80, "rollout")
    second.end_run("t-rl-1", "done", [], {"version": 2}, None, {"actor": 1.5}, end_time=1_010.0)

    client = second._mlflow()
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2]
    assert [m.step for m in client.get_metric_history(run_id, "rollout/return")] == [40, 80]
    assert [m.value for m in client.get_metric_history(run_id, "rollout/policy_version")] == [1.0, 2.0]
    run = client.get_run(run_id)
    assert (run.info.start_time, run.info.end_time) == (1_000_000, 1_010_000) and run.info.status == "FINISHED"
    assert run.data.metrics["system/metered_actor_s"] == 1.5 and run.data.tags["nexus.version"] == "2"
    assert "train/version" not in run.data.metrics  # a train row's step is its version already
