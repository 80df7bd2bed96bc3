"""The gateway's one adapter to the service: Nexus scheduler handlers and the inference engine.

Everything the gateway does to the service goes through :class:`Backend`; it is the only module that
knows handler names and argument shapes, so a change of the control plane touches only this file.
Each operation is one method. Handlers that this service version lacks (checked once at connect)
answer :class:`nexus.errors.NotSupported` instead of a hang or a 500.

Low-level payloads go from here to the actor worker directly (``scatter(direct=True)``), and only a
published dataset name goes through the scheduler; observations go to the inference engine actor
directly (worker to worker).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from nexus.errors import NexusError, NotFound, NotSupported, Unavailable, quote
from nexus.wire.engine_client import EngineClient, call_engine
from nexus.wire.messages import EngineEndpoint

logger = logging.getLogger("nexus.gateway")

OPTIONAL = ("nexus_cancel", "nexus_delete_tenant", "nexus_scale_inference", "nexus_export", "nexus_qos_report")


class Backend:
    def __init__(self, address: str, security: Any = None, timeout: float = 60, engine_stream: bool = True) -> None:
        self.address, self.security, self.timeout = address, security, timeout
        self.engine_stream = engine_stream  # predicts over the direct stream to the engine's worker (gateway.*)
        self.client = None
        self.handlers: set[str] = set()
        self._engines = None  # EngineClient: routes each tenant to its engine
        self._actor: str | None = None

    async def connect(self) -> None:
        from distributed import Client

        self.client = await Client(self.address, asynchronous=True, security=self.security, timeout=self.timeout,
                                   name="nexus-gateway", set_as_default=False)
        self.handlers = set(await self.client.run_on_scheduler(_handler_names))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def _call(self, handler: str, **kwargs: Any) -> Any:
        if handler not in self.handlers:
            self.handlers = set(await self.client.run_on_scheduler(_handler_names))  # a plugin may have reloaded
            if handler not in self.handlers:
                raise NotSupported(f"this service has no {handler.removeprefix('nexus_')!r} operation")
        try:
            return plain(await getattr(self.client.scheduler, handler)(**kwargs))
        except NexusError:
            raise
        except (OSError, TimeoutError) as e:
            raise Unavailable(f"the service's scheduler is unreachable ({type(e).__name__}: {e})") from None

    # -- tenants and jobs ------------------------------------------------------------------
    async def create_tenant(self, spec: dict[str, Any]) -> dict[str, Any]:
        return await self._call("nexus_create_tenant", spec=spec)

    async def status(self, limit: int | None = None, cursor: str | None = None,
                     tenant: str | None = None) -> dict[str, Any]:
        """One page of the status (``tenant``: that tenant and its jobs only)."""
        return await self._call("nexus_status", limit=limit, cursor=cursor, tenant=tenant)

    async def tenant_view(self, tenant: str) -> dict[str, Any]:
        rows = (await self.status(tenant=tenant))["tenants"]
        if not rows:
            raise NotFound(f"unknown tenant {quote(tenant)}")
        return rows[0]

    async def submit(self, tenant: str, job: dict[str, Any]) -> str:
        return await self._call("nexus_submit", tenant=tenant, job=job)

    async def job(self, job_id: str) -> dict[str, Any]:
        return await self._call("nexus_job", job_id=job_id)

    async def wait(self, job_id: str, timeout: float) -> dict[str, Any]:
        return await self._call("nexus_wait", job_id=job_id, timeout=timeout)

    async def tenant_log(self, tenant: str) -> dict[str, Any]:
        return await self._call("nexus_tenant_log", tenant=tenant)

    async def monitoring(self, since: float, limit: int | None = None, cursor: str | None = None) -> dict[str, Any]:
        return await self._call("nexus_monitoring", since=since, limit=limit, cursor=cursor)

    async def flush(self) -> bool:
        return await self._call("nexus_flush")

    # handlers being added by the control plane (issue 8) and export (issue 11): one method each
    async def cancel(self, job_id: str) -> Any:
        return await self._call("nexus_cancel", job_id=job_id)

    async def delete_tenant(self, tenant: str, keep_output: bool = True) -> Any:
        return await self._call("nexus_delete_tenant", tenant=tenant, keep_output=keep_output)

    async def scale_inference(self, engines: int) -> Any:
        return await self._call("nexus_scale_inference", n=engines)

    async def wait_ready(self, timeout: float) -> Any:
        return await self._call("nexus_wait_ready", timeout=timeout)

    async def export(self, tenant: str, **options: Any) -> Any:
        return await self._call("nexus_export", tenant=tenant, **options)

    # -- low level -------------------------------------------------------------------------
    async def _actor_address(self, refresh: bool = False) -> str | None:
        if self._actor is None or refresh:
            info = await self.client.scheduler.identity()
            self._actor = next((a for a, w in info["workers"].items() if "ACTOR" in w.get("resources", {})), None)
        return self._actor

    async def op(self, tenant: str, verb: str, batch: dict[str, Any] | None = None, loss: str = "sft",
                 session: str | None = None, **options: Any) -> Any:
        """A Tinker-style op; the batch goes to the actor worker directly, the scheduler sees its name.
        ``session``: the client connection's id (its ops are one MLflow run); ``options``: ``adam`` (optim_step),
        ``name`` (save_state / load_state)."""
        if batch is None:
            return await self._call("nexus_op", tenant=tenant, verb=verb, loss=loss, session=session, **options)
        name = f"nexus-op-{tenant}-{uuid.uuid4().hex[:12]}"
        actor = await self._actor_address()
        workers = [actor] if actor else None
        try:
            # a list, so the whole dict is one datum under a fresh key (a dict would scatter per key)
            (fut,) = await self.client.scatter([batch], direct=True, workers=workers, hash=False)
        except (OSError, TimeoutError, ValueError):  # the actor worker was replaced: ask again
            workers = [a] if (a := await self._actor_address(refresh=True)) else None
            (fut,) = await self.client.scatter([batch], direct=True, workers=workers, hash=False)
        await self.client.publish_dataset(fut, name=name)
        try:
            return await self._call("nexus_op", tenant=tenant, verb=verb, data=name, loss=loss, session=session,
                                    **options)
        finally:
            try:
                await self.client.unpublish_dataset(name)
            except Exception:  # already unpublished by the plugin
                pass

    # -- the predict path (nexus.gateway.serving.PredictServer calls these) ------------------------
    @property
    def engines(self) -> EngineClient:
        if self._engines is None:
            self._engines = EngineClient(self.client, route_timeout_s=60.0)
        return self._engines

    async def endpoint(self, tenant: str) -> EngineEndpoint:
        """The engine serving ``tenant`` (the route is cached for 2 s, then asked again)."""
        try:
            return await self.engines.endpoint(tenant)
        except (OSError, TimeoutError) as e:
            raise Unavailable(f"the service's scheduler is unreachable ({type(e).__name__}: {e})") from None

    async def reroute(self, tenant: str, stale: EngineEndpoint, error: BaseException) -> EngineEndpoint:
        try:
            return await self.engines.reroute(tenant, stale, error)
        except (OSError, TimeoutError) as e:
            raise Unavailable(f"the service's scheduler is unreachable ({type(e).__name__}: {e})") from None

    async def predict_many(self, ep: EngineEndpoint, requests: list[list[Any]]) -> dict[str, Any]:
        """Gathered predicts on one engine, straight to its worker (``EngineHost.predict_many``)."""
        return await call_engine(self.client, ep, "predict_many", requests, timeout=self.engines.request_timeout_s,
                                 stream=self.engine_stream)

    async def live_version(self, tenant: str) -> int | None:
        """The version the engine serving ``tenant`` answers with now (None: it does not hold the tenant yet)."""
        ep = await self.endpoint(tenant)
        try:
            versions = await call_engine(self.client, ep, "versions", timeout=self.engines.request_timeout_s)
        except (OSError, TimeoutError) as e:
            raise Unavailable(f"the inference engine is unavailable ({type(e).__name__}: {e})") from None
        live = versions.get("live", {}).get(tenant)
        return None if live is None else int(live)

    async def qos_report(self, report: dict[str, Any]) -> Any:
        return await self._call("nexus_qos_report", report=report)

    async def predict_batch(self, tenant: str, observations: list, version: int | None,
                            deterministic: bool) -> list[dict[str, Any]]:
        """Actions for several observations of ``tenant`` in one request (its own envs: external rollouts)."""
        if self._engines is None:
            self._engines = EngineClient(self.client, route_timeout_s=60.0)
        try:
            return await self._engines.apredict_batch(tenant, observations, version, deterministic)
        except NexusError:
            raise
        except KeyError as e:
            raise NotFound(str(e.args[0]) if e.args else f"unknown tenant {quote(tenant)}") from None
        except (RuntimeError, OSError, TimeoutError) as e:
            raise Unavailable(f"the inference engine is unavailable ({type(e).__name__}: {e})") from None


def plain(x: Any) -> Any:
    """JSON-ready values: numpy arrays and scalars to lists and numbers, NaN and inf to None."""
    import math

    import numpy as np

    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set):
        return [plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return plain(x.tolist())
    if isinstance(x, np.generic):
        return plain(x.item())
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _handler_names(dask_scheduler) -> list[str]:
    return sorted(h for h in dask_scheduler.handlers if h.startswith("nexus_"))
