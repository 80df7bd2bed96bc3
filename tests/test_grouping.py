"""Group batching for real: the firing rule (B, T, "every producer is waiting") and the inference
engine forming cross-tenant groups of several rows without mixing rows up.

The engine is the real ``InferenceEngine`` (real tiny Qwen3-VL backbone, real tenant heads) running
on its own asyncio loop in a thread, the way a Dask worker runs an actor's coroutines; producers are
threads that call it like rollout tasks do (submit, then block on the answer). No cluster needed.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from nexus.config.service import ServiceConfig
from nexus.engine.batching import GroupBatcher
from nexus.engine.engine import InferenceEngine
from nexus.features import CameraSpec, Observation, TenantSchema
from nexus.model.policy import TenantPolicy
from nexus.spec import TenantSpec

torch.set_num_threads(1)

SCHEMA = TenantSchema(proprio_dim=6, action_dim=4, instruction="push the cube", cameras=(CameraSpec("cam", 32, 32),))


# -- the firing rule (plain data, driven clock) ---------------------------------------------------

def test_fires_at_b_rows():
    b = GroupBatcher(max_wait_s=10.0, max_batch=8, fire_when_all_waiting=False)
    b.add("a", rows=4, now=0.0)
    assert b.due_in(now=0.0) == pytest.approx(10.0) and b.reason(now=0.0) is None
    b.add("b", rows=4, now=0.1)
    assert b.due_in(now=0.1) == 0.0 and b.reason(now=0.1) == "full"
    assert b.take() == ["a", "b"] and len(b) == 0


def test_take_keeps_requests_whole_up_to_b():
    b = GroupBatcher(max_wait_s=1.0, max_batch=6)
    for name in "abc":
        b.add(name, rows=4, now=0.0)
    assert b.take() == ["a"]  # a+b would be 8 > 6: b waits for the next group
    assert b.take() == ["b"]
    big = GroupBatcher(max_wait_s=1.0, max_batch=2)
    big.add("wide", rows=5, now=0.0)  # a request wider than B still goes out, whole
    assert big.reason(now=0.0) == "full" and big.take() == ["wide"]


def test_waits_for_a_producer_that_could_still_join_then_fires_when_all_wait():
    b = GroupBatcher(max_wait_s=1.0, max_batch=64, fire_when_all_waiting=True, producer_lease_s=5.0)
    b.open_producer("p1", now=0.0)
    b.open_producer("p2", now=0.0)
    b.add("x", rows=4, producer="p1", now=0.0)
    assert b.reason(now=0.01) is None and b.due_in(now=0.01) == pytest.approx(0.99)
    b.add("y", rows=4, producer="p2", now=0.02)
    assert b.reason(now=0.02) == "all_waiting" and b.due_in(now=0.02) == 0.0
    assert b.take() == ["x", "y"]
    # both are now waiting for their answers: a third, anonymous request does not wait for them
    b.add("z", rows=1, now=0.03)
    assert b.reason(now=0.03) == "all_waiting"
    b.take()
    b.answered(["p1", "p2"], now=0.05)
    b.add("x2", rows=4, producer="p1", now=0.06)
    assert b.reason(now=0.06) is None  # p2 is stepping its envs and will be back
    assert b.reason(now=1.06) == "timeout"  # ... but never for longer than T


def test_lone_producer_and_anonymous_requests_never_wait():
    b = GroupBatcher(max_wait_s=30.0, max_batch=64, fire_when_all_waiting=True)
    b.add("api", rows=1, now=0.0)  # no producer at all
    assert b.reason(now=0.0) == "all_waiting"
    b.take()
    b.open_producer("solo", now=0.0)
    b.add("k-actions", rows=4, producer="solo", now=0.0)
    assert b.due_in(now=0.0) == 0.0 and b.reason(now=0.0) == "all_waiting"
    off = GroupBatcher(max_wait_s=30.0, max_batch=64, fire_when_all_waiting=False)
    off.add("k", rows=4, producer="solo", now=0.0)
    assert off.reason(now=0.0) is None  # the rule is a knob: off, the lone request pays T


def test_closed_or_silent_producers_stop_holding_groups_back():
    b = GroupBatcher(max_wait_s=1.0, max_batch=64, fire_when_all_waiting=True, producer_lease_s=2.0)
    for p in ("p1", "p2", "p3"):
        b.open_producer(p, now=0.0)
    b.add("x", producer="p1", now=0.5)
    assert b.reason(now=0.5) is None
    b.close_producer("p2")
    assert b.reason(now=0.6) is None  # p3 is still within its lease
    assert b.producers(now=2.1) == ["p1"] and b.reason(now=2.1) == "all_waiting"  # p3 went silent: gone


def test_a_producer_not_due_within_t_does_not_hold_a_group_back():
    b = GroupBatcher(max_wait_s=0.005, max_batch=64, fire_when_all_waiting=True, expect_arrivals=True)
    b.open_producer("fast", now=0.0)
    b.open_producer("slow", now=0.0)
    # learn the gaps: "slow" steps its envs for 0.2 s between an answer and its next request
    t = 0.0
    for _ in range(3):
        b.add("f", producer="fast", now=t)
        b.add("s", producer="slow", now=t)
        assert b.reason(now=t) == "all_waiting"
        b.take()
        b.answered(["fast", "slow"], now=t + 0.01)
        t += 0.21
    b.answered([], now=t)
    b.add("f", producer="fast", now=t - 0.19)  # fast is back 0.01 s after its answer
    b.add("f2", producer="fast", now=t - 0.189)
    assert b.reason(now=t - 0.189) == "none_expected"  # slow is due in ~0.19 s >> T: no point waiting
    b.take()
    plain = GroupBatcher(max_wait_s=0.005, max_batch=64, fire_when_all_waiting=True)
    plain.open_producer("slow", now=0.0)
    plain.add("f", producer="fast", now=0.0)
    assert plain.reason(now=0.001) is None  # without the knob, only "all waiting" or T
    fresh = GroupBatcher(max_wait_s=0.005, max_batch=64, fire_when_all_waiting=True, expect_arrivals=True)
    fresh.open_producer("new", now=0.0)  # no estimate yet: it might come, so the group waits (up to T)
    fresh.add("x", producer="other", now=0.0)
    assert fresh.reason(now=0.001) is None and fresh.reason(now=0.006) == "timeout"


def test_bad_settings_rejected():
    with pytest.raises(ValueError):
        GroupBatcher(max_wait_s=-1)
    with pytest.raises(ValueError):
        GroupBatcher(max_batch=0)
    with pytest.raises(ValueError):
        GroupBatcher().add("x", rows=0)


# -- the real engine -------------------------------------------------------------------------------

class LoopThread:
    """An asyncio loop in a thread: the engine's coroutines run there, callers block on futures."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def weights(spec: TenantSpec, hidden: int) -> bytes:
    buf = io.BytesIO()
    torch.save(TenantPolicy.from_spec(spec, SCHEMA, hidden).state_dict(), buf)
    return buf.getvalue()


def obs_for(seed: int) -> Observation:
    rng = np.random.default_rng(seed)
    return Observation(state=rng.normal(size=6).astype(np.float32),
                       images={"cam": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)}, instruction="push the cube")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A real engine with two tenants (different heads) on a tiny backbone; T is long (5 s) so a
    group that fired on the timeout would stand out in the recorded reasons."""
    cfg = ServiceConfig(root=str(tmp_path_factory.mktemp("engine")), infer_max_wait_s=5.0, infer_max_batch=16)
    eng = InferenceEngine(cfg)
    loop = LoopThread()
    hidden = 64  # the tiny Qwen3-VL's width
    for name, seed in (("ta", 1), ("tb", 2)):
        spec = TenantSpec(name=name, env="maniskill/pushcube-state", seed=seed, hidden_dim=32)
        loop.call(eng.register_tenant(spec, SCHEMA, 0, weights(spec, hidden))).result(120)
    yield eng, loop
    loop.close()


def _reference(eng: InferenceEngine, loop: LoopThread, tenant: str, obs: list[Observation]) -> list[dict]:
    """Each observation alone (one row, no other producer open): what its action must be."""
    return [loop.call(eng.predict(tenant, o, None, True)).result(60) for o in obs]


def test_two_tenants_k_envs_form_groups_larger_than_two_and_rows_stay_wired(engine):
    eng, loop = engine
    k, steps = 4, 3
    observations = {(t, p): [[obs_for(1000 * i + 100 * s + 10 * p + j) for j in range(k)] for s in range(steps)]
                    for i, t in enumerate(("ta", "tb")) for p in range(2)}
    eng.reset_stats()
    for t, p in observations:
        loop.call(eng.open_producer(f"{t}-{p}", t)).result(10)

    def producer(key) -> list[list[dict]]:
        t, p = key
        replies = []
        for s in range(steps):  # like a rollout task: ask for all K actions, block, "step", repeat
            replies.append(loop.call(eng.predict_batch(t, observations[key][s], None, True, None, f"{t}-{p}",
                                                       True, 10_000)).result(60))
        loop.call(eng.close_producer(f"{t}-{p}")).result(10)
        return replies

    with ThreadPoolExecutor(len(observations)) as pool:
        got = dict(zip(observations, pool.map(producer, observations), strict=True))
    st = eng.engine_stats()
    sizes = {int(n): c for n, c in st["size_hist"].items()}
    assert max(sizes) > 2 and sum(n * c for n, c in sizes.items()) == 4 * k * steps
    assert st["tenants_hist"].get("2", 0) >= 1, st  # some group mixed both tenants' rows
    assert "timeout" not in st["reasons"], st["reasons"]  # every group fired on B or "all waiting"

    for (t, _p), replies in got.items():
        for s, reply in enumerate(replies):
            assert reply["group_rows"] >= k and reply["feature_key"] is not None
            ref = _reference(eng, loop, t, observations[(t, _p)][s])
            for j, (out, want) in enumerate(zip(reply["outputs"], ref, strict=True)):
                # deterministic action and value of exactly this env's observation under this tenant's head
                np.testing.assert_allclose(out["action"], want["action"], atol=1e-5, err_msg=f"{t} step {s} env {j}")
                assert out["value"] == pytest.approx(want["value"], abs=1e-5)
            assert reply["features"].shape == (k, 64)


@contextmanager
def _max_wait(eng, loop, t: float):
    """The engine's T set to ``t`` for a block (then back)."""

    async def set_to(x: float) -> dict:
        return eng.set_batching(x, eng.batching()["max_batch"])

    before = eng.batching()["max_wait_s"]
    loop.call(set_to(t)).result(10)
    try:
        yield
    finally:
        loop.call(set_to(before)).result(10)


def test_lone_producer_does_not_wait_for_t(engine):
    eng, loop = engine
    eng.reset_stats()
    with _max_wait(eng, loop, 3600.0):  # a T no test outlives: an answer within the 60 s wait fired on the rule
        loop.call(eng.open_producer("solo", "ta")).result(10)
        reply = loop.call(eng.predict_batch("ta", [obs_for(7), obs_for(8)], None, False, None, "solo")).result(60)
        loop.call(eng.close_producer("solo")).result(10)
    assert eng.engine_stats()["reasons"] == {"all_waiting": 1}
    assert reply["features"] is None and len(reply["outputs"]) == 2


def test_features_only_when_asked_and_narrow_enough(engine):
    eng, loop = engine
    o = [obs_for(3)]
    wide = loop.call(eng.predict_batch("ta", o, features=True, features_max_dim=10_000)).result(60)
    narrow = loop.call(eng.predict_batch("ta", o, features=True, features_max_dim=16)).result(60)
    assert wide["features"].shape == (1, 64) and narrow["features"] is None
    with pytest.raises(ValueError):
        loop.call(eng.predict_batch("ta", [])).result(60)
    with pytest.raises(KeyError):
        loop.call(eng.predict_batch("nobody", o)).result(60)


def test_a_new_t_applies_to_a_request_already_waiting(engine):
    eng, loop = engine
    eng.reset_stats()

    async def set_batching(t: float, b: int) -> dict:
        return eng.set_batching(t, b)

    # "other" is open and not waiting: the group waits up to T for it, here an hour (no test outlives it)
    for p in ("held", "other"):
        loop.call(eng.open_producer(p, "ta")).result(10)
    try:
        assert loop.call(set_batching(3600.0, 16)).result(10) == {"max_wait_s": 3600.0, "max_batch": 16}
        pending = loop.call(eng.predict_batch("ta", [obs_for(9)], None, True, None, "held"))
        time.sleep(0.3)
        assert not pending.done()
        assert loop.call(set_batching(0.0, 16)).result(10) == {"max_wait_s": 0.0, "max_batch": 16}
        reply = pending.result(60)  # fired on the new T, not after the old hour
    finally:
        loop.call(set_batching(5.0, 16)).result(10)
        for p in ("held", "other"):
            loop.call(eng.close_producer(p)).result(10)
    assert eng.engine_stats()["reasons"] == {"timeout": 1} and len(reply["outputs"]) == 1
    with pytest.raises(ValueError, match="B >= 1"):
        loop.call(set_batching(0.01, 0)).result(10)
    assert eng.batching() == {"max_wait_s": 5.0, "max_batch": 16}
