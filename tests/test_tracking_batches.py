"""The tracker writes a batch's metrics in one store transaction per run, and the link lets calls gather
before it sends them. A real sqlite MLflow store; no cluster."""

from __future__ import annotations

import asyncio

from nexus.control.monitoring.tracking_link import TrackerLink
from nexus.tracking.host import TrackerHost


def _row(job: str, step: int, kind: str = "train", **metrics: float) -> list:
    return ["log_metrics", {"job_id": job, "metrics": metrics, "step": step, "kind": kind}]


def test_consecutive_metric_calls_are_one_write_per_run_in_order(tmp_path):
    host = TrackerHost({"root": str(tmp_path)})
    client = host.tracker._mlflow()
    writes: list[tuple[str, int]] = []
    log_batch = client.log_batch

    def counted(run_id, metrics=(), **kw):
        writes.append((run_id, len(metrics)))
        return log_batch(run_id, metrics=metrics, **kw)

    client.log_batch = counted
    calls = [["start_run", {"job_id": "a-sft-1", "tenant": "a", "kind": "sft", "params": {}}],
             ["start_run", {"job_id": "b-rl-1", "tenant": "b", "kind": "rl", "params": {}}],
             _row("a-sft-1", 1, loss=1.0, version=1), _row("b-rl-1", 32, "rollout", ret=0.5, version=0),
             _row("a-sft-1", 2, loss=0.8), _row("a-sft-1", 2, loss=9.9),  # a repeated step: dropped
             _row("ghost", 1, loss=1.0),  # no such run: skipped, the others still land
             _row("a-sft-1", 3, loss=float("nan"), lr=1e-3), ["no_such_method", {}],
             ["end_run", {"job_id": "a-sft-1", "status": "done", "artifacts": [], "result": {"version": 3}}]]
    writes.clear()
    out = host._run_all(calls)
    assert len(out) == len(calls) and isinstance(out[0], str) and isinstance(out[1], str)
    assert out[2:] == [None] * (len(calls) - 2)
    a, b = out[0], out[1]
    metric_writes = [w for w in writes if w[1]]  # end_run writes its (empty) metering batch too
    assert sorted(metric_writes) == sorted([(a, 3), (b, 2)])  # six calls, two writes

    hist = {m: [(p.step, p.value) for p in client.get_metric_history(a, m)] for m in ("train/loss", "train/lr")}
    assert hist == {"train/loss": [(1, 1.0), (2, 0.8)], "train/lr": [(3, 1e-3)]}
    assert [(p.step, p.value) for p in client.get_metric_history(b, "rollout/policy_version")] == [(32, 0.0)]
    assert client.get_run(a).info.status == "FINISHED"  # the end came after its metrics


def test_link_lets_calls_gather_and_a_flush_sends_at_once():
    """Without a wall clock: a linger no test outlives (an hour) shows what goes out without waiting it out
    (a full batch, a flush), and a short linger that calls queued together go out as one message."""

    async def main():
        sent: list[list[str]] = []
        arrived = asyncio.Event()

        async def send(address, calls):
            sent.append([c[0] for c in calls])
            arrived.set()
            return [None] * len(calls)

        link = TrackerLink(send, max_batch=4, linger_s=3600.0)
        link.start()
        link.attach("tcp://t")
        for step in range(3):
            link.log_metrics("j", {"loss": 1.0}, step)
            await asyncio.sleep(0.02)  # the sender has the loop between the calls
        assert sent == [] and link.pending == 3  # still gathering

        for step in range(3):  # the fourth call fills a batch: it goes without lingering, the rest lingers
            link.log_metrics("j", {"loss": 1.0}, 10 + step)
        await asyncio.wait_for(arrived.wait(), 60)
        await asyncio.sleep(0.05)
        assert sent == [["reopen"] + ["log_metrics"] * 4] and link.pending == 2

        link.log_metrics("j", {"loss": 1.0}, 20)
        link.lost()
        await asyncio.sleep(0.1)
        assert link.pending == 3 and len(sent) == 1  # no tracker: nothing is sent, nothing lost
        link.attach("tcp://t2")
        assert await link.flush(60)  # a flush does not wait out the (hour-long) linger
        assert sent[1] == ["reopen", "log_metrics", "log_metrics", "log_metrics"] and link.pending == 0
        await link.close()

        sent.clear()
        arrived.clear()
        short = TrackerLink(send, max_batch=4, linger_s=0.05)  # the linger ends by itself: one message
        short.start()
        short.attach("tcp://t")
        for step in range(3):
            short.log_metrics("j", {"loss": 1.0}, step)
        await asyncio.wait_for(arrived.wait(), 60)
        assert sent == [["reopen", "log_metrics", "log_metrics", "log_metrics"]] and short.pending == 0
        await short.close()

    asyncio.run(main())


def test_the_tracker_connects_at_its_start_and_a_store_that_failed_then_is_asked_again(tmp_path):
    host = TrackerHost({"root": str(tmp_path / "a")})
    assert host.warmed.result(timeout=120) is True  # before any call: the store and the experiment exist
    assert host.tracker._client is not None and (tmp_path / "a" / "mlflow.db").exists()

    store = tmp_path / "blocked" / "mlflow.db"  # a file stands where its folder goes: the warm-up cannot open it
    store.parent.write_text("")
    late = TrackerHost({"root": str(tmp_path / "b"), "tracking_uri": f"sqlite:///{store}"})
    assert late.warmed.result(timeout=120) is False and late.tracker._client is None
    store.parent.unlink()
    out = late._run_all([["start_run", {"job_id": "a-sft-1", "tenant": "a", "kind": "sft", "params": {}}]])
    assert isinstance(out[0], str) and store.exists()  # the first call connected
    assert late.tracker._mlflow().get_run(out[0]).data.tags["nexus.job"] == "a-sft-1"
