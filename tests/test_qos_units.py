"""QoS pieces without a cluster: the gateway's socket, admission budgets, fair queueing, latency histograms."""

from __future__ import annotations

import asyncio
import pickle
import random
import socket
import time

import numpy as np
import pytest

from nexus.client.http import Backoff
from nexus.config.service import QosSettings
from nexus.control.dispatch.sim_share import SimSlots
from nexus.control.monitoring.predict_latency import PredictLatency
from nexus.deploy.gc_tuning import GcPauses
from nexus.deploy.gc_tuning import apply as apply_gc
from nexus.errors import Draining, NotFound, Overloaded, SpecError, Unavailable
from nexus.gateway.__main__ import listen_socket
from nexus.gateway.fair_share import FairShare
from nexus.gateway.fast_predict import PredictFastPath, json_body
from nexus.gateway.serving import Budgets, EngineLane, Pending, PredictServer
from nexus.sim.host import SimHost
from nexus.wire.messages import EngineEndpoint
from nexus.wire.qos import BUCKETS_S, LatencyHistogram, parse_server_timing, server_timing


def test_gateway_connections_have_no_nagle_delay():
    """asyncio sets TCP_NODELAY on each accepted connection only for a socket whose proto is TCP: the
    gateway's replies (headers and body: two writes) must not wait for the client's delayed ACK."""
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            s = writer.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            w.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


# -- latency histograms and Server-Timing -------------------------------------------------------------
def test_histogram_quantiles_buckets_and_round_trip():
    h = LatencyHistogram()
    for ms in [1] * 50 + [12] * 49 + [400]:
        h.observe(ms / 1e3)
    assert h.count == 100
    assert h.quantile(0.5) <= 0.002 < h.quantile(0.6) <= 0.015  # half at 1 ms, the rest in (10, 15] ms
    assert 0.3 < h.quantile(0.999) <= 0.5
    cum = h.cumulative()
    assert cum[-1] == ("+Inf", 100) and all(a[1] <= b[1] for a, b in zip(cum, cum[1:], strict=False))
    again = LatencyHistogram.from_dict(h.to_dict())
    again.add(h)
    assert again.count == 200 and again.sum_s == pytest.approx(2 * h.sum_s)
    assert LatencyHistogram().quantile(0.5) is None
    for bad in ({"counts": [1, 2]}, {"counts": [-1] * (len(BUCKETS_S) + 1)}):
        with pytest.raises(ValueError):
            LatencyHistogram.from_dict(bad)


def test_server_timing_header_round_trip():
    spans = {"http": 0.0012, "forward": 0.0053}
    assert parse_server_timing(server_timing(spans)) == pytest.approx(spans)
    assert parse_server_timing("garbage, x;desc=1, y;dur=abc") == {}


def test_control_plane_adds_reports_and_refuses_malformed_ones():
    lat = PredictLatency()
    h = LatencyHistogram()
    h.observe(0.004)
    h.rejected = 3
    asyncio.run(lat.report({"tenants": {"a": h.to_dict(), "b": h.to_dict()}}))
    asyncio.run(lat.report({"tenants": {"a": h.to_dict()}}))
    rows = {r["tenant"]: r for r in lat.rows()}
    assert rows["a"]["count"] == 2 and rows["a"]["rejected"] == 6 and rows["b"]["count"] == 1
    for bad in ({"tenants": {"a": {"counts": "x"}}}, {"tenants": [1]}, "nope", {"tenants": {"a": {"counts": [1]}}}):
        with pytest.raises(SpecError):
            asyncio.run(lat.report(bad))
    assert {r["tenant"]: r["count"] for r in lat.rows()} == {"a": 2, "b": 1}  # nothing changed
    families = {f.name: f for f in lat.prometheus()}
    samples = {(s.name, s.labels.get("tenant"), s.labels.get("le")): s.value
               for s in families["nexus_predict_latency_seconds"].samples}
    assert samples[("nexus_predict_latency_seconds_count", "a", None)] == 2
    assert samples[("nexus_predict_latency_seconds_bucket", "a", "0.005")] == 2


# -- budgets, fair lanes, the predict server ------------------------------------------------------------
def test_budgets_refuse_past_the_tenant_or_the_gateway_limit_and_free_on_release():
    b = Budgets(total=3, per_tenant=lambda t: 2, retry_after_s=0.25)
    b.acquire("a")
    b.acquire("a")
    with pytest.raises(Overloaded, match="max_inflight_predicts=2") as e:
        b.acquire("a")
    assert e.value.retry_after_s == 0.25 and e.value.http_status == 429
    b.acquire("b")
    with pytest.raises(Overloaded, match="qos.max_gateway_predicts"):
        b.acquire("c")
    b.release("a")
    b.acquire("c")
    assert b.held_total == 3 and dict(b.held) == {"a": 1, "b": 1, "c": 1}
    again = pickle.loads(pickle.dumps(Overloaded("x", 0.5)))
    assert again.retry_after_s == 0.5 and str(again) == "x"


def _pending(tenant: str) -> Pending:
    return Pending(tenant, None, None, True, asyncio.get_running_loop().create_future())


def test_lane_serves_tenants_round_robin_and_gathers_while_calls_run():
    calls: list[list[str]] = []
    release = asyncio.Event()

    async def send(batch: list[Pending]) -> None:
        calls.append([p.tenant for p in batch])
        await release.wait()
        for p in batch:
            p.future.set_result(None)

    async def main() -> None:
        lane = EngineLane(send, max_requests=4, in_flight=1)
        first = _pending("noisy")
        lane.put(first)  # sent at once: gathering never waits
        await asyncio.sleep(0)
        assert calls == [["noisy"]]
        for _ in range(9):
            lane.put(_pending("noisy"))
        lane.put(_pending("q1"))
        lane.put(_pending("q2"))
        assert len(lane) == 11  # waiting for the one call in flight
        release.set()
        await first.future
        for _ in range(10):
            await asyncio.sleep(0)
        assert calls[1][:3] == ["noisy", "q1", "q2"]  # one each per turn: the quiet ones ride the next call
        assert all(len(c) <= 4 for c in calls) and sum(map(len, calls)) == 12

    asyncio.run(main())


class Engines:
    """A stand-in for the engine RPC: answers each gathered call after ``delay_s`` (it records the calls);
    ``draining`` engines refuse every request as a draining engine does."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s, self.calls, self.draining, self.reports = delay_s, [], {"e0"}, []
        self.fail: Exception | None = None
        self.hold: asyncio.Event | None = None  # set: calls answer only once it is set (not after delay_s)

    async def reached(self, n: int) -> None:
        """Until the engine has been called ``n`` times."""
        while len(self.calls) < n:
            await asyncio.sleep(0)

    async def endpoint(self, tenant: str) -> EngineEndpoint:
        return EngineEndpoint("e0", "tcp://e0")

    async def reroute(self, tenant, stale, error) -> EngineEndpoint:
        return EngineEndpoint("e1", "tcp://e1")

    async def predict_many(self, ep: EngineEndpoint, requests: list[list]) -> dict:
        self.calls.append((ep.engine, [r[0] for r in requests]))
        await (self.hold.wait() if self.hold is not None else asyncio.sleep(self.delay_s))
        if self.fail is not None:
            raise self.fail
        if ep.engine in self.draining:
            return {"replies": [{"error": Draining("draining")} for _ in requests], "engine_s": 0.0}
        return {"replies": [{"output": {"tenant": r[0]}, "wait_s": 0.001, "compute_s": 0.002} for r in requests],
                "engine_s": 0.003}

    async def qos_report(self, report: dict) -> bool:
        self.reports.append(report)
        return True


def test_predict_server_reroutes_refused_requests_refuses_past_budget_and_reports():
    routes = Engines()
    server = PredictServer(routes, QosSettings(max_gateway_predicts=8), lambda t: 3)

    async def main() -> None:
        spans: dict[str, float] = {}
        out = await server.predict("a", None, None, True, spans)
        assert out == {"tenant": "a"} and routes.calls[0][0] == "e0" and routes.calls[-1][0] == "e1"
        assert {"gateway_queue", "to_engine", "engine_queue", "forward"} <= set(spans)
        results = await asyncio.gather(*(server.predict("b", None, None, True, {}) for _ in range(5)),
                                       return_exceptions=True)
        assert sum(isinstance(r, Overloaded) for r in results) == 2  # 3 at once for tenant b
        assert server.budgets.held_total == 0
        server.observe("b", 0.004, {"forward": 0.002})
        server.stats.rejected("b")
        assert await server.report_once()
        sent = routes.reports[-1]["tenants"]["b"]
        assert LatencyHistogram.from_dict(sent).count == 1 and sent["rejected"] == 3
        assert server.stats.tenants == {}  # sent: the next report has only what comes after
        routes.draining = set()
        routes.fail = RuntimeError("model thread died")
        with pytest.raises(Unavailable, match="model thread died"):  # a 503, never a 500
            await server.predict("a", None, None, True, {})
        assert server.budgets.held_total == 0

    asyncio.run(main())


def test_fair_share_rates_decay_and_only_a_tenant_far_above_the_mean_is_over():
    f = FairShare(factor=2.0, window_s=1.0)
    for i in range(100):  # one second: 15 tenants at 8/s, one at 80/s
        now = i / 100
        if i % 12 == 0:
            for q in range(15):
                f.admitted(f"q{q}", now)
        f.admitted("loud", now + 0.001)
    assert f.over("loud", 1.0) and not f.over("q0", 1.0)
    assert 40 < f.rate("loud", 1.0) < 80 and f.rate("loud", 4.0) < 0.1 * f.rate("loud", 1.0)
    alone = FairShare(factor=2.0)
    for i in range(50):
        alone.admitted("solo", i / 50)
    assert not alone.over("solo", 1.0)  # alone, a tenant has the whole engine
    assert not FairShare(factor=0).over("loud", 1.0)  # off


def test_fair_share_never_finds_tenants_at_equal_poisson_rates_over_not_even_as_they_start():
    settings = QosSettings()
    rng = np.random.default_rng(0)
    arrivals = sorted((t, f"q{q}") for q in range(15) for t in np.cumsum(rng.exponential(1 / 8, 600)) if t < 60)
    f = FairShare(settings.fair_share_factor, settings.fair_share_window_s)
    over = 0
    for t, tenant in arrivals:  # a minute of 15 tenants at 8/s each, Poisson arrivals, all starting at once
        over += f.over(tenant, t)
        f.admitted(tenant, t)
    assert over == 0, f"{over} of {len(arrivals)} predicts of equal tenants were over their fair share"
    loud = FairShare(settings.fair_share_factor, settings.fair_share_window_s)
    for t, tenant in arrivals:
        loud.admitted(tenant, t)
        if tenant == "q0":  # one tenant at 10x the others' rate
            for k in range(9):
                loud.admitted("loud", t + k * 1e-4)
    assert loud.over("loud", 60.0)


def test_fair_share_does_not_hold_a_tenant_s_solo_rate_against_it_when_others_join():
    settings = QosSettings()
    rng = np.random.default_rng(1)
    solo = [(t, "q0") for t in np.arange(0, 3, 1 / 200)]  # q0 alone at 200/s for 3 s (it had the engine), then
    joined = sorted((3 + t, f"q{q}") for q in range(16)  # one of 16 tenants at 60/s each, Poisson, for 5 s
                    for t in np.cumsum(rng.exponential(1 / 60, 400)) if t < 5)
    f = FairShare(settings.fair_share_factor, settings.fair_share_window_s)
    over = []
    for t, tenant in solo + joined:
        if f.over(tenant, t):
            over.append((round(t, 3), tenant))
        else:
            f.admitted(tenant, t)
    assert over == [], f"{len(over)} predicts of equal tenants refused, first {over[:3]}"
    assert 40 < f.rate("q0", 8.0) < 80  # its rate is now its share
    for q in range(16):  # and a tenant joining at 10x the others' rate is over once it has a window of its own
        f.admitted(f"q{q}", 8.0)
    for i in range(int(1.5 * 600)):
        f.admitted("late", 8.0 + i / 600)
    assert f.over("late", 9.5) and not f.over("q0", 9.5)


def test_predict_server_sheds_a_tenant_over_its_fair_share_only_while_another_is_served():
    routes = Engines(delay_s=0.02)
    server = PredictServer(routes, QosSettings(max_gateway_predicts=64, engine_calls_in_flight=4,
                                               fair_share_factor=2.0), lambda t: 64)

    routes.draining = set()
    server.fair.admitted("q", time.monotonic() - 2.0)  # q has sent before: its rate counts for the mean

    async def main() -> None:
        burst = [server.predict("loud", None, None, True, {}) for _ in range(12)]
        await asyncio.gather(*burst)  # alone, even many at once: a lone tenant keeps the whole engine
        for _ in range(8):
            await server.predict("loud", None, None, True, {})
        await server.predict("q", None, None, True, {})
        assert server.shed_count == 0 and server.fair.over("loud")
        assert not server.contended("loud")
        routes.hold = asyncio.Event()  # the engine answers once released: "first" is in flight until then
        first = asyncio.ensure_future(server.predict("q", None, None, True, {}))  # another tenant in flight,
        await asyncio.wait_for(routes.reached(len(routes.calls) + 1), 60)
        assert not first.done()
        assert server.contended("loud") and not server.contended("q") and not any(server.lanes.values())  # none waits
        with pytest.raises(Overloaded, match="fair_share_factor") as e:
            await server.predict("loud", None, None, True, {})
        assert e.value.retry_after_s == server.settings.retry_after_s and server.shed_count == 1
        assert server.budgets.held == {"q": 1}  # the refusal held nothing
        second = asyncio.ensure_future(server.predict("q", None, None, True, {}))
        await asyncio.wait_for(routes.reached(len(routes.calls) + 1), 60)  # the quiet tenant is admitted meanwhile
        assert not first.done() and server.budgets.held == {"q": 2}
        routes.hold.set()
        await asyncio.gather(first, second)
        routes.hold = None
        assert not server.contended("loud") and server.budgets.held_total == 0
        await server.predict("loud", None, None, True, {})  # nobody else served: admitted again
        assert server.shed_count == 1

    asyncio.run(main())


def test_gc_apply_freezes_sets_the_threshold_and_pauses_are_counted():
    import gc

    before = gc.get_threshold()
    pauses = GcPauses()
    try:
        done = apply_gc(freeze=True, gen0_threshold=5000)
        assert done["frozen"] > 0 and gc.get_threshold()[0] == 5000
        gc.collect()
        view = pauses.view()
        assert view["count"][2] >= 2 and view["total_ms"][2] >= 0
        # the permanent generation only shrinks after a freeze (another thread of this process may free a frozen
        # object at any moment), so the view's count lies between the freeze's and now's
        assert 0 < gc.get_freeze_count() <= view["frozen"] <= done["frozen"]
        pauses.reset()
        assert pauses.view()["count"] == [0, 0, 0]
    finally:
        pauses.close()
        gc.unfreeze()
        gc.set_threshold(*before)
    assert pauses._callback not in gc.callbacks


# -- simulators' fair share -------------------------------------------------------------------------
def test_a_waiter_granted_a_released_slot_gets_its_last_holder_s_end_on_the_devices_clock():
    """A rollout that waited for its place starts when the place's holder ended on the devices' clock
    (``Place.ended_at`` -> the next one's ``freed_at``), not when the holder's task came back to the scheduler."""
    cap = [1]
    slots = SimSlots(lambda: cap[0], fair=True, recheck_s=0.05)

    async def main() -> None:
        async with slots.slot("a") as first:
            assert first.freed_at == 0.0  # free at once
            waiting = asyncio.ensure_future(slots.acquire("b"))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            first.ended_at = 1234.5
        assert await asyncio.wait_for(waiting, 60) == 1234.5
        late = [asyncio.ensure_future(slots.acquire(t)) for t in ("c", "d")]
        await asyncio.sleep(0.01)
        cap[0] = 3  # two places at once, none released: no holder's end to pass on
        assert await asyncio.wait_for(asyncio.gather(*late), 60) == [0.0, 0.0]
        slots.release("b", 99.0)
        assert slots.busy == 2

    asyncio.run(main())


def test_sim_slots_go_to_the_tenant_holding_fewest_and_cancelled_waiters_leave():
    cap = [2]
    slots = SimSlots(lambda: cap[0], fair=True, recheck_s=0.05)

    async def main() -> None:
        await slots.acquire("a")
        await slots.acquire("a")
        a3 = asyncio.ensure_future(slots.acquire("a"))
        a4 = asyncio.ensure_future(slots.acquire("a"))
        await asyncio.sleep(0.01)
        b1 = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0.01)
        assert not (a3.done() or b1.done())
        slots.release("a")
        assert slots.held["b"] == 1 and slots.held["a"] == 1  # b holds none: its later request goes first
        await asyncio.wait_for(b1, 60)
        assert not a3.done()
        a4.cancel()
        await asyncio.sleep(0.01)
        slots.release("b")
        await asyncio.wait_for(a3, 60)
        assert dict(slots.held) == {"a": 2} and slots.view()["waiting"] == {}
        cap[0] = 3  # a SIM worker joined: waiters see it on their next look
        await asyncio.wait_for(slots.acquire("c"), 60)
        assert slots.busy == 3

    asyncio.run(main())
    unfair = SimSlots(lambda: 1, fair=False)
    assert asyncio.run(unfair.acquire("a")) == 0.0  # free at once: no end to start from
    unfair.release("a")
    asyncio.run(unfair.acquire("a"))
    asyncio.run(unfair.acquire("a"))  # Dask's order: granted at once, Dask queues the task
    assert unfair.busy == 2


def test_in_critical_order_a_freed_sim_slot_goes_to_the_tenant_with_the_most_simulator_work_left():
    left = {"long": 30.0, "short": 5.0}
    slots = SimSlots(lambda: 2, fair=True, recheck_s=0.05)
    slots.remaining = lambda t: left.get(t, 0.0)

    async def main(order: str) -> list[str]:
        slots.order = order
        await slots.acquire("short")
        await slots.acquire("long")  # long holds as many as short
        granted: list[str] = []

        async def ask(t: str) -> None:
            await slots.acquire(t)
            granted.append(t)

        waiters = [asyncio.ensure_future(ask(t)) for t in ("short", "long", "long")]
        await asyncio.sleep(0.01)
        slots.release("short")
        slots.release("long")
        await asyncio.sleep(0.01)
        for w in waiters:
            w.cancel()
        for t in list(slots.held.elements()):
            slots.release(t)
        return granted

    # fair: short waited longest and holds no more than long; critical: long's work left comes first
    assert asyncio.run(main("fair")) == ["short", "long"]
    assert asyncio.run(main("critical")) == ["long", "long"]
    assert slots.view()["order"] == "critical"


def test_sim_host_stops_a_cancelled_jobs_producers_and_refuses_its_late_ones():
    sim = SimHost()
    with sim.producer("j1:0", "j1", "a", "eval") as p, sim.producer("j2:0", "j2", "b", "rl") as q:
        assert sim.stop("j1") == 1
        assert p.stopped and not q.stopped
    with sim.producer("j1:8", "j1", "a", "eval") as late:
        assert late.stopped  # a task of the cancelled job that Dask started afterwards


# -- the client's backoff -----------------------------------------------------------------------------
def test_backoff_doubles_from_the_hint_is_capped_and_jittered():
    b = Backoff(retries=4, max_s=1.0, rng=random.Random(1))
    delays = [b.delay(i, 0.1) for i in range(6)]
    for i, d in enumerate(delays):
        assert 0.5 * min(1.0, 0.1 * 2 ** i) <= d <= min(1.0, 0.1 * 2 ** i)
    assert max(delays) <= 1.0


def test_nexus_page_latency_table_rows():
    from nexus.control.monitoring.dashboard import LATENCY_COLUMNS, latency_columns

    lat = PredictLatency()
    h = LatencyHistogram()
    for s in (0.003, 0.004, 0.2):
        h.observe(s)
    asyncio.run(lat.report({"tenants": {"b": h.to_dict(), "a": LatencyHistogram(rejected=2).to_dict()}}))
    cols = latency_columns(lat)
    assert set(cols) == {k for k, _ in LATENCY_COLUMNS}
    assert cols["tenant"] == ["a", "b"] and cols["count"] == [0, 3] and cols["rejected"] == [2, 0]
    assert cols["p50_ms"][0] == "-" and 2 <= cols["p50_ms"][1] <= 5 and cols["p99_ms"][1] > 100
    assert latency_columns(None) == {k: [] for k, _ in LATENCY_COLUMNS}


# -- the engine's gathered call ------------------------------------------------------------------------------
def test_engine_predict_many_gates_each_request_alone_and_runs_the_rest_as_one_group(tmp_path):
    import io
    from collections import deque

    import numpy as np
    import torch

    from nexus.config.service import ServiceConfig
    from nexus.config.validation import validate_tenant
    from nexus.engine.host import EngineHost
    from nexus.features import Observation
    from nexus.model.policy import TenantPolicy
    from nexus.spec import TenantSpec

    torch.set_num_threads(1)
    host = EngineHost("engine-0.1", ServiceConfig(root=str(tmp_path), infer_max_batch=2), deque(maxlen=100))
    hidden = host.engine.heads.framework.backbone.hidden_size
    obs = Observation(state=np.linspace(-1, 1, 35).astype(np.float32))

    async def main() -> dict:
        for i, name in enumerate(("a", "b")):
            spec, schema = validate_tenant(TenantSpec(name=name, env="maniskill/pushcube-state", seed=i + 1))
            buf = io.BytesIO()
            torch.save(TenantPolicy.from_spec(spec, schema, hidden).state_dict(), buf)
            await host.engine.register_tenant(spec, schema, 0, buf.getvalue())
            host.schemas[name] = schema
        alone = await host.predict("a", obs, None, True)
        sampled = await host.predict("b", obs, None, False, seed=7, n=2)
        host.engine.reset_stats()
        bad = Observation(state=np.zeros(3, np.float32))
        # [tenant, obs, version, deterministic, request_id, seed, n]
        out = await host.predict_many([["a", obs, None, True, "r1", None, 1], ["nope", obs, None, True, "r2", None, 1],
                                       ["a", obs, 999, True, "r3", None, 1], ["b", bad, None, True, "r4", None, 1],
                                       ["b", obs, None, False, "r5", 7, 2], ["a", obs, None, True, "r6", None, 1]])
        return {"alone": alone, "sampled": sampled, "out": out, "stats": host.engine.engine_stats()}

    res = asyncio.run(main())
    host.engine.close()
    replies = res["out"]["replies"]
    assert [("output" in r) for r in replies] == [True, False, False, False, True, True]
    assert isinstance(replies[1]["error"], NotFound) and isinstance(replies[2]["error"], NotFound)
    assert isinstance(replies[3]["error"], SpecError)  # a malformed observation fails alone
    np.testing.assert_allclose(replies[0]["output"]["action"], res["alone"]["action"], rtol=1e-5, atol=1e-6)
    # two seeded samples in the gathered group: the same as asked alone (each row draws from its own seed)
    assert replies[4]["output"]["actions"].shape == (2, 4) and len(replies[4]["output"]["logprobs"]) == 2
    np.testing.assert_allclose(replies[4]["output"]["actions"], res["sampled"]["actions"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(replies[4]["output"]["actions"][0], replies[4]["output"]["actions"][1])
    assert res["stats"]["groups"] == 1 and res["stats"]["requests"] == 4  # 4 rows (r5: 2) in one group, B=2 or not
    assert {rid for _, rid in host.served_log} >= {"r1", "r5", "r6"}
    assert not {"r2", "r3", "r4"} & {rid for _, rid in host.served_log}


def test_engine_groups_take_tenants_in_turn():
    from nexus.engine.batching import GroupBatcher

    b = GroupBatcher(max_wait_s=1.0, max_batch=4)
    for k in range(4):
        b.open_producer(f"n{k}", "noisy", now=0.0)
    b.open_producer("q0", "quiet", now=0.0)
    for k in range(4):
        b.add(f"noisy-{k}", rows=2, producer=f"n{k}", now=0.1 * k)
    b.add("quiet-0", rows=2, producer="q0", now=0.5)
    assert b.take() == ["noisy-0", "quiet-0"]  # arrival order would have been noisy-0, noisy-1
    assert b.take() == ["noisy-1", "noisy-2"] and b.take() == ["noisy-3"]
    alone = GroupBatcher(max_wait_s=1.0, max_batch=4)
    for name in "abc":
        alone.add(name, rows=2, now=0.0)
    assert alone.take() == ["a", "b"]  # no producers' tenants: oldest first, as before


def test_fast_path_takes_only_json_predicts_and_hands_the_rest_on_whole():
    """``PredictFastPath`` as plain ASGI: which requests it serves, and a body it declines reaches the app whole."""
    served: list[tuple[str, bytes, str | None]] = []
    inner: list[bytes] = []

    async def serve(tenant, raw, auth, spans):
        served.append((tenant, raw, auth))
        return None if raw == b"decline" else answer

    async def answer(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def app(scope, receive, send):  # the FastAPI app behind it: reads the body as the route would
        body, more = b"", True
        while more:
            m = await receive()
            body, more = body + m.get("body", b""), m.get("more_body", False)
        inner.append(body)

    def request(path: str, body: bytes, ctype: bytes = b"application/json", method: str = "POST", enabled=True):
        chunks = [body[:3], body[3:]]

        async def receive():
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}

        async def send(message):
            pass

        headers = [(b"content-type", ctype), (b"authorization", b"Bearer tok")]
        scope = {"type": "http", "method": method, "path": path, "headers": headers}
        asyncio.run(PredictFastPath(app, serve, enabled)(scope, receive, send))

    request("/v1/tenants/t1/predict", b'{"observation": {}}')
    assert served == [("t1", b'{"observation": {}}', "Bearer tok")] and inner == []
    request("/v1/tenants/t1/predict", b"decline")  # the model refused it: the route gets the whole body
    assert inner == [b"decline"]
    for path, ctype, method, enabled in [("/v1/tenants/t1/predict_batch", b"application/json", "POST", True),
                                         ("/v1/tenants/a/b/predict", b"application/json", "POST", True),
                                         ("/v1/tenants/t1/predict", b"application/nexus+json", "POST", True),
                                         ("/v1/tenants/t1/predict", b"text/plain", "POST", True),
                                         ("/v1/tenants/t1/predict", b"application/json", "GET", True),
                                         ("/v1/tenants/t1/predict", b"application/json", "POST", False)]:
        request(path, b"{}", ctype, method, enabled)
    assert len(served) == 2 and inner == [b"decline"] + [b"{}"] * 6
    assert json_body([(b"content-type", b"Application/JSON; charset=utf-8")])
