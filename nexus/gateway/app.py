"""The tenant gateway: an HTTP + JSON API (FastAPI; OpenAPI docs at ``/docs``), the only door tenants use.

Every call carries ``Authorization: Bearer <token>``. A tenant token reads and writes its own tenant
only; the operator token may do everything, including the admin calls (all tenants' status,
monitoring, scale, delete any tenant). Inputs are checked here first — specs and jobs by the same
validation the scheduler runs (``nexus.config.validation``, with the tenant's quotas), observations
and batches by ``nexus.wire.inputs`` — so a bad request is refused before it reaches Dask, and every refusal
is a :class:`nexus.errors.NexusError` answered with its ``http_status`` and a JSON body
``{"error": {"class", "code", "message"}}``; never a 500 for bad input.
"""

# (the docstring above is the OpenAPI document's description.) The routes are routers by resource
# (nexus.gateway.routes), the gateway's state nexus.gateway.state.Gateway; create_app assembles them with the
# error handlers and the middleware.

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nexus.config.service import ServiceConfig
from nexus.errors import NexusError, NotFound, SpecError, quote
from nexus.gateway.auth import TokenStore
from nexus.gateway.backend import Backend
from nexus.gateway.body_limit import BodyLimit
from nexus.gateway.contract import document
from nexus.gateway.envs import EnvBackend
from nexus.gateway.fast_predict import PredictFastPath
from nexus.gateway.openpi import OpenpiServer
from nexus.gateway.routes import ROUTERS
from nexus.gateway.routes.tenants import export_target, init_from_allowed
from nexus.gateway.state import (
    MAX_MESSAGE,
    Gateway,
    NexusJSON,
    error_body,
    jsonable,
    nexus_error_response,
    validation_message,
)
from nexus.gateway.timing import PredictTiming

logger = logging.getLogger("nexus.gateway")


def create_app(config: ServiceConfig, backend: Backend, tokens: TokenStore, on_ready=None, *,
               host: str | None = None, openpi_host: str | None = None, openpi_ssl: Any = None) -> FastAPI:
    """The gateway's app. ``host``: the address the gateway listens on (default: the config's); off loopback,
    creating a tenant needs the operator token unless ``open_registration`` is set to true. Its lifespan also serves
    the openpi WebSocket endpoint (``config.openpi``) on ``openpi.bind_address`` (else ``openpi_host``, else
    ``config.host``), with TLS when ``openpi_ssl`` (an SSLContext)."""
    gw = Gateway(config, backend, tokens, host)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.connect()
        reporter = asyncio.get_running_loop().create_task(gw.serving.report_forever())
        if config.openpi.enabled:
            bind_openpi = config.openpi.bind_address or openpi_host or config.host
            gw.openpi = OpenpiServer(gw, config.openpi, bind_openpi, openpi_ssl, envs=app.state.envs)
            await gw.openpi.start()
        if on_ready is not None:
            on_ready()
        yield
        reporter.cancel()
        if gw.openpi is not None:
            await gw.openpi.stop()
        await backend.close()

    app = FastAPI(title="JoyNexus tenant gateway", version="1", lifespan=lifespan, default_response_class=NexusJSON,
                  description=__doc__)
    app.state.gateway = gw
    app.add_middleware(PredictFastPath, serve=gw.predict_raw, enabled=config.gateway.predict_fast_path)
    app.add_middleware(PredictTiming, observe=lambda: gw.serving.observe)  # outside the fast path: times it too
    document(app)  # every route's error responses and their body (nexus.gateway.contract)

    # -- errors: every refusal a NexusError with its status ----------------------------------
    @app.exception_handler(NexusError)
    async def _nexus_error(request: Request, e: NexusError) -> Response:
        return nexus_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        return NexusJSON(error_body(SpecError(validation_message(e))), status_code=SpecError.http_status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 400:  # a body FastAPI could not parse (not JSON): an invalid request, as any other
            err = SpecError(f"{request.method} {request.url.path}: the body is not valid JSON ({e.detail})")
            return NexusJSON(error_body(err), status_code=err.http_status)
        cls = NotFound if e.status_code == 404 else NexusError
        err = cls(f"{request.method} {quote(request.url.path, 200)}: {e.detail}")
        return NexusJSON(error_body(err), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return NexusJSON({"error": {"class": "InternalError", "code": "internal",
                                    "message": f"{type(e).__name__}: {e}"}}, status_code=500)

    app.add_middleware(BodyLimit, limit=config.limits.max_request_bytes,
                       refuse=lambda e: NexusJSON(error_body(e), status_code=413))

    app.state.envs = EnvBackend(backend)  # the environment routes' side of the service (nexus.gateway.envs)
    for router in ROUTERS:
        app.include_router(router)
    return app


__all__ = ["MAX_MESSAGE", "Gateway", "create_app", "error_body", "export_target", "init_from_allowed", "jsonable"]
