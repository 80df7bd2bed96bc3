"""Training-queue and inference-batching policy (pure Python, no cluster)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.control.dispatch.training_queue import AdmissionError, TenantLimits, TrainingItem, TrainingQueue
from nexus.engine.batching import GroupBatcher


def _queue(**limits: TenantLimits) -> TrainingQueue:
    q = TrainingQueue()
    for name, lim in limits.items():
        q.set_limits(name, lim)
    return q


def _put(q: TrainingQueue, tenant: str, kind: str = "rl", version: int = 0, tag: str = "") -> TrainingItem:
    assert q.reserve(tenant)
    item = TrainingItem(tenant=tenant, kind=kind, policy_version=version, work=tag)
    q.put(item)
    return item


def test_fifo_within_priority():
    q = _queue(a=TenantLimits(max_inflight=10), b=TenantLimits(max_inflight=10))
    order = [_put(q, t, tag=f"{t}{i}").work for i, t in enumerate("abab")]
    popped = []
    while (item := q.pop({})[0]) is not None:
        popped.append(item.work)
        q.done(item)
    assert popped == order


def test_priority_first_then_fifo():
    q = _queue(low=TenantLimits(max_inflight=5, priority=0), high=TenantLimits(max_inflight=5, priority=5))
    _put(q, "low", tag="l0")
    _put(q, "high", tag="h0")
    _put(q, "low", tag="l1")
    _put(q, "high", tag="h1")
    got = []
    while (item := q.pop({})[0]) is not None:
        got.append(item.work)
    assert got == ["h0", "h1", "l0", "l1"]


def test_inflight_cap_counts_reserved_queued_and_running():
    q = _queue(a=TenantLimits(max_inflight=2))
    first = _put(q, "a")
    assert q.reserve("a")
    assert not q.reserve("a"), "third admission must be refused"
    item, _ = q.pop({})
    assert item is first
    assert not q.reserve("a"), "a running item still holds its slot"
    q.done(item)
    assert q.reserve("a")


def test_put_without_reservation_is_refused_and_changes_nothing():
    q = _queue(a=TenantLimits(max_inflight=1))
    with pytest.raises(AdmissionError):
        q.put(TrainingItem(tenant="a", kind="sft", policy_version=0))
    assert len(q) == 0 and q.counters["a"].inflight == 0


def test_stale_rl_batch_dropped_and_counted_sft_never():
    q = _queue(a=TenantLimits(max_inflight=10, max_staleness=2))
    _put(q, "a", "rl", version=0, tag="stale")
    _put(q, "a", "sft", version=0, tag="sft-old")
    _put(q, "a", "rl", version=3, tag="fresh")
    _put(q, "a", "op", version=0, tag="op-old")
    item, dropped = q.pop({"a": 3})
    assert [d.work for d in dropped] == ["stale"]
    assert item.work == "sft-old"
    assert q.counters["a"].dropped_stale == 1
    rest = [q.pop({"a": 3})[0].work for _ in range(2)]
    assert rest == ["fresh", "op-old"]
    assert q.counters["a"].dropped_stale == 1
    assert q.counters["a"].inflight == 3  # the dropped item freed its slot; three are running


def test_lag_exactly_max_staleness_is_kept():
    q = _queue(a=TenantLimits(max_inflight=2, max_staleness=2))
    _put(q, "a", "rl", version=1)
    item, dropped = q.pop({"a": 3})
    assert item is not None and not dropped


def test_invalid_limits_rejected():
    with pytest.raises(ValueError):
        TenantLimits(max_inflight=0)
    with pytest.raises(ValueError):
        TenantLimits(max_staleness=-1)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["reserve", "put", "pop", "done", "cancel"]),
                              st.sampled_from(["a", "b", "c"])), max_size=120),
       caps=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)))
def test_cap_never_exceeded_under_random_load(ops, caps):
    q = _queue(**{t: TenantLimits(max_inflight=c) for t, c in zip("abc", caps, strict=True)})
    running: list[TrainingItem] = []
    for op, t in ops:
        if op == "reserve":
            q.reserve(t)
        elif op == "put" and q.counters[t].reserved:
            q.put(TrainingItem(tenant=t, kind="sft", policy_version=0))
        elif op == "cancel" and q.counters[t].reserved:
            q.cancel_reservation(t)
        elif op == "pop":
            item, _ = q.pop({})
            if item:
                running.append(item)
        elif op == "done" and running:
            q.done(running.pop(0))
        for name, c in q.counters.items():
            assert 0 <= c.inflight <= q.limits[name].max_inflight
            assert c.max_inflight_seen <= q.limits[name].max_inflight
    assert sum(q.depth().values()) == len(q)


def test_group_batcher_fires_on_size_or_wait():
    b = GroupBatcher(max_wait_s=0.010, max_batch=3)
    assert b.due_in() is None
    b.add("r0", now=100.0)
    assert b.due_in(now=100.004) == pytest.approx(0.006)
    assert b.due_in(now=100.020) == 0.0
    b.add("r1", now=100.001)
    b.add("r2", now=100.002)
    assert b.due_in(now=100.002) == 0.0  # reached B
    b.add("r3", now=100.003)
    assert b.take() == ["r0", "r1", "r2"]  # oldest first, at most B
    assert b.take() == ["r3"]
