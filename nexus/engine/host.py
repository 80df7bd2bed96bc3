"""One inference engine hosted by a worker, with the gate every request passes before it may join a group
(draining, unknown tenant, an observation that does not fit the tenant's schema), and the control plane's
operations on it (sync, pins, drain, stop, batching settings)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import Any

from nexus.config.service import ServiceConfig
from nexus.data.output_dir import TenantOutputDir
from nexus.engine.engine import InferenceEngine
from nexus.engine.request_check import check_request
from nexus.errors import Draining, NotFound, SpecError
from nexus.features import TenantSchema
from nexus.wire import devices
from nexus.wire.messages import EngineReport, TenantSetup

logger = logging.getLogger("nexus.worker")


def _engine(config: ServiceConfig, device: str | None) -> InferenceEngine:
    """The real engine, or the one the worker's model of its devices builds (``device``: the slot it is charged
    to; :mod:`nexus.wire.devices`)."""
    return devices.installed().engine(config, device) or InferenceEngine(config)


class EngineHost:
    def __init__(self, engine_id: str, config: ServiceConfig, served_log: deque[tuple[str, str]],
                 device: str | None = None) -> None:
        self.id = engine_id
        self.engine = _engine(config, device)
        self.schemas: dict[str, TenantSchema] = {}
        self.draining = False
        self.inflight = 0
        self.served = 0
        self.served_log = served_log  # (engine, request id) answered in this process: each request once
        self._idle = asyncio.Event()
        self._idle.set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._pins: Counter[tuple[str, int]] = Counter()

    def report(self) -> dict[str, Any]:
        return EngineReport(self.id, len(self.schemas), self.inflight, self.served, self.draining).to_dict()

    # -- data path ---------------------------------------------------------------------------------
    async def predict(self, tenant: str, obs: Any, version: int | None = None, deterministic: bool = False,
                      job: str | None = None, request_id: str | None = None, seed: int | None = None,
                      n: int = 1) -> dict[str, Any]:
        work = self.engine.predict(tenant, obs, version, deterministic, job, seed=seed, n=n)
        return await self._serve(tenant, [obs], request_id, work)

    async def predict_batch(self, tenant: str, observations: list, *args: Any, request_id: str | None = None,
                            **kwargs: Any) -> dict[str, Any]:
        """A producer's K observations as one request (``InferenceEngine.predict_batch``)."""
        return await self._serve(tenant, observations, request_id,
                                 self.engine.predict_batch(tenant, observations, *args, **kwargs))

    async def predict_many(self, requests: list[list[Any]]) -> dict[str, Any]:
        """Predicts of several callers (the gateway's gathered HTTP requests), each ``[tenant, obs, version,
        deterministic, request_id, seed, n]`` (and an 8th, ``budget_s``: seconds left to its deadline when it was sent,
        or None): each passes the gate alone (a refused one fails alone), the others run
        as one request of the inference queue (``InferenceEngine.predict_rows``: one group, whatever B).
        -> ``replies`` (per request, in order: ``{"output", "wait_s", "compute_s"}`` or ``{"error":
        NexusError}``) and ``engine_s`` (this call's time on the engine)."""
        t0 = time.perf_counter()
        replies: list[dict[str, Any] | None] = [None] * len(requests)
        accepted: list[int] = []
        for i, (tenant, obs, version, *_) in enumerate(requests):
            try:
                self._gate(tenant, [obs])
                if not self.engine.heads.serves(tenant, version):
                    raise NotFound(f"version {version} of tenant {tenant!r} is neither live nor pinned")
                accepted.append(i)
            except Exception as e:
                replies[i] = {"error": e}
        if accepted:
            budgets = [requests[i][7] for i in accepted if len(requests[i]) > 7 and requests[i][7] is not None]
            work = self.engine.predict_rows([(*requests[i][:4], *requests[i][5:7]) for i in accepted],
                                            min(budgets) if budgets else None)
            try:
                out = await self._run(work, [requests[i][4] for i in accepted])
            except Exception as e:  # the group failed: each of its requests sees why
                for i in accepted:
                    replies[i] = {"error": e}
            else:
                for j, i in enumerate(accepted):
                    replies[i] = {"output": out["outputs"][j], "wait_s": out["wait_s"],
                                  "compute_s": out["compute_s"]}
        return {"replies": replies, "engine_s": time.perf_counter() - t0}

    async def _serve(self, tenant: str, observations: list, request_id: str | None, work) -> dict[str, Any]:
        """The gate of every action request: refused while draining or for an unknown tenant, and each
        observation checked against the tenant's schema before it may join a group."""
        try:
            self._gate(tenant, observations)
        except BaseException:
            work.close()  # never started
            raise
        return await self._run(work, [request_id])

    def _gate(self, tenant: str, observations: list) -> None:
        if self.draining:
            raise Draining(f"inference engine {self.id} is draining")
        schema = self.schemas.get(tenant)
        if schema is None:
            raise NotFound(f"tenant {tenant!r} is not registered on inference engine {self.id}")
        if not isinstance(observations, list) or not observations:
            raise SpecError(f"tenant {tenant!r}: an action request needs at least one observation")
        for obs in observations:
            check_request(obs, schema, tenant)  # a bad request fails alone, before it joins a group

    async def _run(self, work, request_ids: list[str | None]) -> Any:
        """Run accepted work (counted in flight: draining waits for it); log its requests as answered."""
        self.inflight += 1
        self._idle.clear()
        try:
            out = await work
        except OSError as e:  # e.g. a missing weights file: not a comm failure, do not re-route
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        for rid in request_ids:
            self.served += 1
            if rid is not None:
                self.served_log.append((self.id, rid))
        return out

    async def load_weights(self, tenant: str, version: int, weights: bytes) -> int | None:
        """A new version from the actor; versions older than the one held are ignored (late pushes).
        None for a tenant this engine does not hold yet (it is syncing: the pool catches it up)."""
        if tenant not in self.schemas:
            return None
        async with self._lock(tenant):
            live = self.engine.heads.live_version(tenant)
            if live is not None and live >= version:
                return live
            return await self.engine.load_weights(tenant, version, weights)

    async def call(self, method: str, args: list, kwargs: dict) -> Any:
        # gated here (draining, schema, late pushes)
        if method in ("predict", "predict_batch", "predict_many", "load_weights"):
            return await getattr(self, method)(*args, **kwargs)
        if method.startswith("_"):
            raise AttributeError(f"engine method {method!r} is private")
        fn = getattr(self.engine, method)
        out = fn(*args, **kwargs)
        return await out if asyncio.iscoroutine(out) else out

    # -- control -----------------------------------------------------------------------------------
    async def control(self, action: str, **msg: Any) -> Any:
        """The control plane's operation ``action`` on this engine (``nexus_engine_ctl``)."""
        if action == "sync":
            return await self.sync(msg.get("tenants", []), msg.get("pins", []))
        if action == "drain":
            return await self.drain(float(msg.get("drain_timeout", 120.0)))
        if action == "stop":
            await self.stop()
            return True
        if action == "unregister":
            await self.unregister(msg["tenant"])
            return True
        if action == "pin":
            await self.pin(msg["tenant"], int(msg["version"]), msg["output_dir"])
            return True
        if action == "unpin":
            await self.unpin(msg["tenant"], int(msg["version"]))
            return True
        if action == "stats":
            return {**self.engine.engine_stats(), **self.report()}
        if action == "flush_signals":
            return await self.engine.flush_signals()
        if action == "batching":
            return self.engine.set_batching(float(msg["max_wait_s"]), int(msg["max_batch"]))
        raise ValueError(f"unknown engine op {action!r}")

    def _lock(self, tenant: str) -> asyncio.Lock:
        return self._locks.setdefault(tenant, asyncio.Lock())

    async def sync(self, tenants: list[TenantSetup], pins: list[list[Any]]) -> dict[str, Any]:
        """Hold every given tenant at (at least) its given version, and the given pins, read from the
        tenants' durable weights."""
        for s in tenants:
            async with self._lock(s.name):
                live = self.engine.heads.live_version(s.name)
                if live is not None and live >= s.version:
                    continue
                weights = await asyncio.to_thread(TenantOutputDir(s.output_dir).weights_path(s.version).read_bytes)
                if live is None:
                    await self.engine.register_tenant(s.spec, s.schema, s.version, weights)
                    self.schemas[s.name] = s.schema
                else:
                    await self.engine.load_weights(s.name, s.version, weights)
        for tenant, version, output_dir, count in pins:
            for _ in range(int(count) - self._pins[(tenant, version)]):
                await self.pin(tenant, int(version), output_dir)
        return self.engine.versions()

    async def pin(self, tenant: str, version: int, output_dir: str) -> None:
        await self.engine.pin(tenant, version, output_dir)
        self._pins[(tenant, version)] += 1

    async def unpin(self, tenant: str, version: int) -> None:
        if self._pins[(tenant, version)] > 0:
            self._pins[(tenant, version)] -= 1
            await self.engine.unpin(tenant, version)

    async def unregister(self, tenant: str) -> None:
        self.schemas.pop(tenant, None)
        for key in [k for k in self._pins if k[0] == tenant]:
            del self._pins[key]
        await self.engine.unregister_tenant(tenant)

    async def drain(self, timeout: float) -> dict[str, Any]:
        """Refuse new requests, answer the accepted ones."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            logger.warning("engine %s: %d requests still in flight after %g s of draining", self.id,
                           self.inflight, timeout)
        await self.engine.flush_signals()
        return {"served": self.served, "inflight": self.inflight}

    async def stop(self) -> None:
        self.draining = True
        await self.engine.flush_signals()
        self.engine.close()
