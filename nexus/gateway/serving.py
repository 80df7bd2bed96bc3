"""The gateway's predict path at QoS: concurrency budgets, per-tenant fair queues, calls gathered per engine.

* :class:`Budgets`: predicts of one tenant (``limits.max_inflight_predicts``) and of all tenants
  (``qos.max_gateway_predicts``) queued or running at once; past either a predict is refused at once with
  :class:`~nexus.errors.Overloaded` (429 + ``Retry-After``), so queues stay bounded and latency with them.
* :class:`EngineLane`: one engine's admitted predicts wait in one FIFO per tenant, served round-robin (one
  request per tenant per turn), so a tenant sending ten times the others' rate gets its turn like the others
  and its backlog stays its own. At most ``qos.engine_calls_in_flight`` calls run on the engine; requests of
  many HTTP clients arriving meanwhile are gathered into the next call (at most ``qos.gather_max_requests``),
  which joins the engine's inference queue at once and runs as one grouped forward. A lone request is sent
  at once: gathering never waits.
* :class:`PredictServer`: the above per request, re-routing a request that an engine refused or lost
  (``Draining``, a comm failure), timing its hops (:data:`nexus.wire.qos.HOPS`) and counting each tenant's
  latencies (:class:`nexus.wire.qos.LatencyHistogram`), which :meth:`PredictServer.report_forever` sends to the
  control plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nexus.config.service import QosSettings
from nexus.deploy.gc_tuning import pauses as gc_pauses
from nexus.errors import NexusError, NotSupported, Overloaded, Unavailable
from nexus.gateway.fair_share import FairShare
from nexus.wire.engine_client import retryable
from nexus.wire.messages import EngineEndpoint
from nexus.wire.qos import HOPS, LatencyHistogram

logger = logging.getLogger("nexus.gateway")


class Budgets:
    """Concurrent predicts per tenant and in all; :meth:`acquire` refuses past either (nothing is queued)."""

    def __init__(self, total: int, per_tenant: Callable[[str], int], retry_after_s: float) -> None:
        self.total, self.per_tenant, self.retry_after_s = total, per_tenant, retry_after_s
        self.held: dict[str, int] = defaultdict(int)
        self.held_total = 0

    def acquire(self, tenant: str) -> None:
        limit = self.per_tenant(tenant)
        if self.held[tenant] >= limit:
            raise Overloaded(f"predicts of tenant {tenant!r}: {self.held[tenant] + 1} at once is over the limit "
                             f"max_inflight_predicts={limit}; retry after {self.retry_after_s:g} s",
                             self.retry_after_s)
        if self.held_total >= self.total:
            raise Overloaded(f"the gateway serves {self.total} predicts at once (qos.max_gateway_predicts); "
                             f"retry after {self.retry_after_s:g} s", self.retry_after_s)
        self.held[tenant] += 1
        self.held_total += 1

    def release(self, tenant: str) -> None:
        self.held_total -= 1
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]


@dataclass
class Pending:
    """One admitted predict waiting for (or in) a call to its engine."""

    tenant: str
    obs: Any
    version: int | None
    deterministic: bool
    future: asyncio.Future
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    seed: int | None = None  # a reproducible sample
    n: int = 1  # samples (each a row of the engine's group)
    t_queued: float = field(default_factory=time.perf_counter)
    t_sent: float = 0.0
    deadline: float | None = None  # time.monotonic() by which the answer is due (a robot's chunk)

    def wire(self) -> list[Any]:
        out = [self.tenant, self.obs, self.version, self.deterministic, self.request_id, self.seed, self.n]
        if self.deadline is not None:  # the engine's clock is its own: the time left travels
            out.append(max(0.0, self.deadline - time.monotonic()))
        return out


class EngineLane:
    """One engine's predicts: a FIFO per tenant served round-robin into gathered calls (see the module)."""

    def __init__(self, send: Callable[[list[Pending]], Awaitable[None]], max_requests: int, in_flight: int) -> None:
        self._send, self.max_requests, self.in_flight = send, max_requests, in_flight
        self._queues: dict[str, deque[Pending]] = {}
        self._turns: deque[str] = deque()  # tenants with a request waiting, in round-robin order
        self._running: set[asyncio.Task] = set()
        self.waiting = 0  # requests queued, not yet in a call

    def __len__(self) -> int:
        return self.waiting

    @property
    def idle(self) -> bool:
        return not self._turns and not self._running

    def put(self, p: Pending) -> None:
        self.put_many([p])

    def put_many(self, ps: list[Pending]) -> None:
        """Queue requests together: they go out in one call (up to ``max_requests``), so one grouped forward."""
        for p in ps:
            q = self._queues.get(p.tenant)
            if q is None:
                q = self._queues[p.tenant] = deque()
                self._turns.append(p.tenant)
            q.append(p)
        self.waiting += len(ps)
        self._pump()

    def discard(self, p: Pending) -> None:
        """Take a request that is still waiting out (its caller gave up)."""
        q = self._queues.get(p.tenant)
        if q is not None and p in q:
            q.remove(p)
            self.waiting -= 1
            if not q:
                del self._queues[p.tenant]
                self._turns.remove(p.tenant)

    def take(self) -> list[Pending]:
        """The next call: one request of each waiting tenant in turn, up to ``max_requests``."""
        batch: list[Pending] = []
        while self._turns and len(batch) < self.max_requests:
            tenant = self._turns.popleft()
            q = self._queues[tenant]
            batch.append(q.popleft())
            if q:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
        self.waiting -= len(batch)
        return batch

    def _pump(self) -> None:
        while len(self._running) < self.in_flight and self._turns:
            task = asyncio.get_running_loop().create_task(self._send(self.take()))
            self._running.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a call to an engine failed unexpectedly: %r", task.exception())
        self._pump()


class EngineRoutes(Protocol):
    """What :class:`PredictServer` needs of the service (the gateway's ``Backend`` provides it)."""

    async def endpoint(self, tenant: str) -> EngineEndpoint: ...

    async def reroute(self, tenant: str, stale: EngineEndpoint, error: BaseException) -> EngineEndpoint: ...

    async def predict_many(self, ep: EngineEndpoint, requests: list[list[Any]]) -> dict[str, Any]: ...

    async def qos_report(self, report: dict[str, Any]) -> Any: ...


class QosStats:
    """Per-tenant latency histograms (since the last report) and the hops' running sums."""

    def __init__(self) -> None:
        self.tenants: dict[str, LatencyHistogram] = defaultdict(LatencyHistogram)
        self.hop_s: dict[str, float] = dict.fromkeys(HOPS, 0.0)
        self.timed = 0

    def observe(self, tenant: str, total_s: float, spans: dict[str, float]) -> None:
        self.tenants[tenant].observe(total_s)
        for k, v in spans.items():
            if k in self.hop_s:
                self.hop_s[k] += v
        self.timed += 1

    def rejected(self, tenant: str) -> None:
        self.tenants[tenant].rejected += 1

    def take(self) -> dict[str, LatencyHistogram]:
        out, self.tenants = self.tenants, defaultdict(LatencyHistogram)
        return out

    def put_back(self, hists: dict[str, LatencyHistogram]) -> None:
        for t, h in hists.items():
            self.tenants[t].add(h)


class PredictServer:
    def __init__(self, routes: EngineRoutes, settings: QosSettings, tenant_budget: Callable[[str], int],
                 route_timeout_s: float = 60.0) -> None:
        self.routes, self.settings = routes, settings
        self.budgets = Budgets(settings.max_gateway_predicts, tenant_budget, settings.retry_after_s)
        self.route_timeout_s = route_timeout_s
        self.lanes: dict[tuple[str, str], EngineLane] = {}
        self.stats = QosStats()
        self.fair = FairShare(settings.fair_share_factor, settings.fair_share_window_s)
        self.shed_count = 0  # predicts refused for being over the fair share

    def contended(self, tenant: str) -> bool:
        """Another tenant has a predict queued or running: ``tenant``'s extra predicts would take CPU and engine
        turns from it."""
        return len(self.budgets.held) > (tenant in self.budgets.held)

    def shed(self, tenant: str) -> None:
        """Refuse (429) a predict of a tenant over its fair share while the path is contended: called before the
        observation is checked, so the refusal costs little (:mod:`nexus.gateway.fair_share`)."""
        if self.fair.factor > 0 and self.contended(tenant) and self.fair.over(tenant):
            self.stats.rejected(tenant)
            self.shed_count += 1
            raise Overloaded(f"tenant {tenant!r} sends predicts faster than {self.fair.factor:g}x the other "
                             f"tenants' mean while they are served (qos.fair_share_factor); retry after "
                             f"{self.settings.retry_after_s:g} s", self.settings.retry_after_s)

    def _lane(self, ep: EngineEndpoint) -> EngineLane:
        key = (ep.engine, ep.address)
        lane = self.lanes.get(key)
        if lane is None:
            for k in [k for k, v in self.lanes.items() if v.idle]:  # engines replaced or gone: forget their lanes
                del self.lanes[k]
            lane = self.lanes[key] = EngineLane(lambda batch: self._call(ep, batch), self.settings.gather_max_requests,
                                                self.settings.engine_calls_in_flight)
        return lane

    async def predict(self, tenant: str, obs: Any, version: int | None, deterministic: bool,
                      spans: dict[str, float], seed: int | None = None, n: int = 1,
                      deadline: float | None = None) -> dict[str, Any]:
        """One predict (``n`` samples, reproducible with ``seed``): admitted (or :class:`Overloaded`), queued
        fairly, sent gathered, re-routed if refused. Fills ``spans`` with its hops from ``gateway_queue`` on.
        ``deadline`` (``time.monotonic``): the engine's group starts in time for it (``nexus.engine.batching``)."""
        self.shed(tenant)
        try:
            self.budgets.acquire(tenant)
        except Overloaded:
            self.stats.rejected(tenant)
            raise
        self.fair.admitted(tenant)
        try:
            route_deadline = time.monotonic() + self.route_timeout_s
            ep = await self.routes.endpoint(tenant)
            while True:
                p = Pending(tenant, obs, version, deterministic, asyncio.get_running_loop().create_future(),
                            seed=seed, n=n, deadline=deadline)
                lane = self._lane(ep)
                lane.put(p)
                try:
                    reply = await p.future
                except asyncio.CancelledError:
                    lane.discard(p)
                    raise
                except Exception as e:
                    if retryable(e) and time.monotonic() <= route_deadline:
                        ep = await self.routes.reroute(tenant, ep, e)
                        continue
                    if isinstance(e, NexusError):
                        raise
                    raise Unavailable(f"the inference engine is unavailable ({type(e).__name__}: {e})") from None
                spans["gateway_queue"] = p.t_sent - p.t_queued
                spans["to_engine"] = max(0.0, reply["rtt_s"] - reply["wait_s"] - reply["compute_s"])
                spans["engine_queue"], spans["forward"] = reply["wait_s"], reply["compute_s"]
                return reply["output"]
        finally:
            self.budgets.release(tenant)

    async def predict_group(self, tenant: str, observations: list[Any], version: int | None, deterministic: bool,
                            spans: dict[str, float], deadline: float | None = None) -> list[dict[str, Any]]:
        """Several observations of one tenant answered together (a robot's batch frame): each admitted as a
        predict (all or none, :class:`Overloaded`), queued together so they go out in one call and run as one
        group, re-routed together if refused. ``spans``: the group's hops (as :meth:`predict`'s)."""
        self.shed(tenant)
        taken = 0
        try:
            for _ in observations:
                self.budgets.acquire(tenant)
                taken += 1
        except Overloaded:
            self.stats.rejected(tenant)
            for _ in range(taken):
                self.budgets.release(tenant)
            raise
        for _ in observations:
            self.fair.admitted(tenant)
        try:
            route_deadline = time.monotonic() + self.route_timeout_s
            ep = await self.routes.endpoint(tenant)
            while True:
                loop = asyncio.get_running_loop()
                ps = [Pending(tenant, o, version, deterministic, loop.create_future(), deadline=deadline)
                      for o in observations]
                lane = self._lane(ep)
                lane.put_many(ps)
                try:
                    replies = await asyncio.gather(*(p.future for p in ps))
                except asyncio.CancelledError:
                    for p in ps:
                        lane.discard(p)
                    raise
                except Exception as e:
                    await asyncio.gather(*(p.future for p in ps), return_exceptions=True)  # all settled
                    if retryable(e) and time.monotonic() <= route_deadline:
                        ep = await self.routes.reroute(tenant, ep, e)
                        continue
                    if isinstance(e, NexusError):
                        raise
                    raise Unavailable(f"the inference engine is unavailable ({type(e).__name__}: {e})") from None
                first, last = ps[0], replies[-1]
                spans["gateway_queue"] = max(p.t_sent for p in ps) - first.t_queued
                spans["to_engine"] = max(0.0, last["rtt_s"] - last["wait_s"] - last["compute_s"])
                spans["engine_queue"], spans["forward"] = last["wait_s"], last["compute_s"]
                return [r["output"] for r in replies]
        finally:
            for _ in observations:
                self.budgets.release(tenant)

    async def _call(self, ep: EngineEndpoint, batch: list[Pending]) -> None:
        """One gathered call to ``ep``; each request's future gets its own reply or error."""
        t0 = time.perf_counter()
        for p in batch:
            p.t_sent = t0
        try:
            out = await self.routes.predict_many(ep, [p.wire() for p in batch])
        except Exception as e:  # the whole call failed (comm, engine gone): every request sees it
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        rtt = time.perf_counter() - t0
        for p, r in zip(batch, out["replies"], strict=True):
            if p.future.done():
                continue
            if "error" in r:
                p.future.set_exception(r["error"])
            else:
                p.future.set_result({**r, "rtt_s": rtt})

    def observe(self, tenant: str, total_s: float, spans: dict[str, float]) -> None:
        self.stats.observe(tenant, total_s, spans)

    def view(self) -> dict[str, Any]:
        """Budgets held now and the hops' mean times since start (``GET /v1/admin/qos``)."""
        n = max(1, self.stats.timed)
        return {"inflight": dict(self.budgets.held), "inflight_total": self.budgets.held_total,
                "queued": {f"{k[0]}@{k[1]}": len(lane) for k, lane in self.lanes.items()},
                "shed": self.shed_count, "timed": self.stats.timed,
                "hops_mean_ms": {k: 1e3 * v / n for k, v in self.stats.hop_s.items()},
                "gc": gc_pauses().view(), "settings": self.settings.model_dump()}

    async def report_once(self) -> bool:
        """Send the per-tenant histograms gathered since the last report; kept for the next one if refused."""
        hists = self.stats.take()
        if not hists:
            return True
        try:
            await self.routes.qos_report({"tenants": {t: h.to_dict() for t, h in hists.items()}})
        except NotSupported:
            return False  # an older control plane: nothing to report to
        except (Unavailable, OSError, TimeoutError) as e:
            logger.info("qos report deferred: %s", e)
            self.stats.put_back(hists)
        return True

    async def report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.report_every_s)
            try:
                if not await self.report_once():
                    return
            except Exception as e:  # monitoring only: never take the gateway down
                logger.warning("qos report failed: %s", e)
