"""The MLflow tracker after a restart (integ's TrackerLink resends unacknowledged batches to a new tracker):
ux's namespaced, monotonic series stay monotonic — a resent point is not logged twice — and the job's own
start/end times are kept. A real sqlite MLflow store; no cluster."""

from __future__ import annotations

from nexus.tracking.tracker import Tracker


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


def test_a_restart_closes_left_runs_as_their_job_records_say_and_never_rewrites_an_ended_run(tmp_path):
    """A killed service may leave a run RUNNING whose job had ended (its end call never reached MLflow): the next
    start closes it with the job record's state and end time; runs of jobs without an ending record fail; a run
    that had ended keeps its state."""
    cfg = {"root": str(tmp_path)}
    old = Tracker(cfg)
    ids = {job: old.start_run(job, "t", "rl", {}, None, start_time=1_000.0)
           for job in ("t-rl-1", "t-eval-2", "t-rl-3", "t-rl-4")}
    old.end_run("t-rl-4", "cancelled", [], {}, None, None, end_time=1_002.0)  # ended normally: KILLED

    new = Tracker(cfg)  # the restarted service's tracker
    ended = {"t-rl-1": ["done", 1_005.0], "t-eval-2": ["cancelled", 1_006.0], "t-rl-4": ["done", 1_009.0]}
    failed = new.fail_interrupted(before_ms=2_000_000, root=str(tmp_path), reason="service stopped", ended=ended)
    client = new._mlflow()
    runs = {job: client.get_run(run_id) for job, run_id in ids.items()}
    assert failed == ["t-rl-3"]
    assert (runs["t-rl-1"].info.status, runs["t-rl-1"].info.end_time) == ("FINISHED", 1_005_000)
    assert runs["t-eval-2"].info.status == "KILLED"
    assert runs["t-rl-3"].info.status == "FAILED" and runs["t-rl-3"].data.tags["nexus.error"] == "service stopped"
    assert (runs["t-rl-4"].info.status, runs["t-rl-4"].info.end_time) == ("KILLED", 1_002_000)  # not rewritten
