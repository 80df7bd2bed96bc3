"""The tenant gateway: an HTTP + JSON API (FastAPI; OpenAPI docs at ``/docs``), the only door tenants use.

Every call carries ``Authorization: Bearer <token>``. A tenant token reads and writes its own tenant
only; the operator token may do everything, including the admin calls (all tenants' status,
monitoring, scale, delete any tenant). Inputs are checked here first — specs and jobs by the same
validation the scheduler runs (``nexus.validation``, with the tenant's quotas), observations
and batches by ``nexus.inputs`` — so a bad request is refused before it reaches Dask, and every refusal
is a :class:`nexus.errors.NexusError` answered with its ``http_status`` and a JSON body
``{"error": {"class", "code", "message"}}``; never a 500 for bad input.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import stat
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, BinaryIO, Literal

from fastapi import Body, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nexus.config import ServiceConfig, ServiceLimits
from nexus.errors import (
    Conflict,
    Forbidden,
    LimitExceeded,
    NexusError,
    NotFound,
    Overloaded,
    SpecError,
    describe_errors,
    quote,
)
from nexus.features import TenantSchema
from nexus.gateway.auth import Principal, TokenStore
from nexus.gateway.backend import Backend
from nexus.gateway.backend import plain as jsonable
from nexus.gateway.body_limit import BodyLimit
from nexus.gateway.contract import OVERLOADED_RESPONSE, document, relative_paths
from nexus.gateway.envs import add_env_routes
from nexus.gateway.fast_predict import PredictFastPath
from nexus.gateway.serving import PredictServer
from nexus.gateway.timing import PredictTiming, spans_of
from nexus.inputs import check_batch, check_observation
from nexus.paging import MAX_LIMIT as MAX_PAGE
from nexus.paths import confine, dir_bytes
from nexus.spec import (
    RL_ACTION_HEADS,
    SESSION_HEADER,
    AdamParams,
    JobSpec,
    TenantSpec,
    check_session,
    check_state_name,
)
from nexus.validation import validate_job, validate_tenant

logger = logging.getLogger("nexus.gateway")

MAX_WAIT_S = 60.0  # one result / stream poll holds a request at most this long
PageLimit = Annotated[int | None, Query(ge=1, le=MAX_PAGE, description="tenants (and jobs) per page")]
PageCursor = Annotated[str | None, Query(max_length=512, description="page.next_cursor of the previous page")]
FILE_CHUNK = 1 << 20  # bytes per chunk when a file is streamed to a client


class NexusJSON(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(jsonable(content), allow_nan=False, separators=(",", ":")).encode()


class FileBytes(StreamingResponse):
    media_type = "application/octet-stream"


class NDJSON(StreamingResponse):
    media_type = "application/x-ndjson"


MAX_MESSAGE = 2000  # characters of an error message: a bad value is quoted by a prefix (nexus.errors.quote)


def error_body(e: NexusError) -> dict[str, Any]:
    message = str(e)
    if len(message) > MAX_MESSAGE:  # the last guard: a message that quoted a huge value whole
        message = f"{message[:MAX_MESSAGE]}... (message cut: {len(message)} characters)"
    return {"error": {"class": type(e).__name__, "code": e.code, "message": message}}


def nexus_error_response(e: NexusError) -> Response:
    """A refusal's answer: its status and error body."""
    if isinstance(e, Overloaded):  # HTTP's Retry-After counts whole seconds; the body has the finer hint
        return NexusJSON({**error_body(e), "retry_after_s": e.retry_after_s}, status_code=e.http_status,
                         headers={"Retry-After": str(max(1, math.ceil(e.retry_after_s)))})
    return NexusJSON(error_body(e), status_code=e.http_status)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, as FastAPI's ``HTTPBearer`` reads it."""
    scheme, token = get_authorization_scheme_param(authorization)
    return token if authorization and scheme.lower() == "bearer" and token else None


def _validation_message(e: RequestValidationError) -> str:
    return "invalid request: " + describe_errors(list(e.errors()), root="body", skip=("body",))


# -- request bodies ------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ForwardBackwardBody(_Body):
    batch: dict[str, Any] = Field(description="observations (list), actions [N, A]; ppo: logprobs, advantages, "
                                              "returns (+ ppo config); grpo: logprobs, advantages (+ ref_logprobs, "
                                              "grpo config). Arrays as nested lists or {dtype, shape, b64}")
    loss: Literal["sft", "ppo", "grpo"] = "sft"


class ForwardBody(_Body):
    batch: dict[str, Any] = Field(description="observations (list), actions [N, A]: their log-probabilities, the "
                                              "policy's entropies and values, on the current weights, no gradient")


class OptimStepBody(_Body):
    adam: AdamParams | None = Field(None, description="this step's Adam settings; unset: the tenant's own")


class StateBody(_Body):
    name: str = Field(min_length=1, max_length=64, description="the saved state's name (letters, digits, . - _)")


class PredictBody(_Body):
    observation: dict[str, Any] = Field(description="state [proprio_dim], images {camera: uint8 [H, W, 3]}, "
                                                    "instruction")
    version: int | None = Field(None, ge=0, le=2**31 - 1, description="a live or pinned version; default: live")
    deterministic: bool = True
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="a reproducible sample (deterministic=false): "
                                                                  "sample j of n draws with seed + j")
    n: int = Field(1, ge=1, le=64, description="samples of the action (deterministic=false): actions, logprobs")
    deadline_ms: float | None = Field(None, gt=0, le=600_000, description="the answer is due this long after the "
                                      "request arrived: the engine's group starts in time for it")


class ScaleBody(_Body):
    engines: int = Field(ge=1, le=64, description="inference engines to run")


class ExportBody(_Body):
    version: int | None = Field(None, ge=0, le=2**31 - 1, description="policy version; default: the current one")
    path: str | None = Field(None, max_length=4096,
                             description="default: the tenant's exports/vNNNNNN/ (read it with GET .../files). "
                                         "Relative paths are inside the tenant's output dir; tenant tokens may "
                                         "name no path outside it, the operator token may")


# module level: with postponed annotations FastAPI resolves these names in the module's globals
bearer = HTTPBearer(auto_error=False, description="a tenant token (from create_tenant) or the operator token")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


async def principal(request: Request, cred: Credentials) -> Principal:
    t0 = time.perf_counter()
    who = request.app.state.gateway.tokens.identify(cred.credentials if cred else None)
    if (spans := spans_of(request.scope)) is not None:
        spans["auth"] = time.perf_counter() - t0
    return who


async def optional_principal(request: Request, cred: Credentials) -> Principal | None:
    return request.app.state.gateway.tokens.identify(cred.credentials) if cred else None


Who = Annotated[Principal, Depends(principal)]
MaybeWho = Annotated[Principal | None, Depends(optional_principal)]


async def op_session(session: Annotated[str | None, Header(alias=SESSION_HEADER, description=(
        "the client connection's id: its low-level ops are one MLflow run (default: the tenant's default "
        "session)"))] = None) -> str:
    return check_session(session)  # a bad one: SpecError, 422


OpSession = Annotated[str, Depends(op_session)]


class Gateway:
    """State of one gateway process: config, token store, backend, per-tenant counters."""

    def __init__(self, config: ServiceConfig, backend: Backend, tokens: TokenStore) -> None:
        self.config, self.backend, self.tokens = config, backend, tokens
        self.pending: dict[str, int] = defaultdict(int)  # low-level calls in flight per tenant
        self.create_lock = asyncio.Lock()
        self._schemas: dict[str, tuple[TenantSpec, TenantSchema]] = {}
        self.serving = PredictServer(backend, config.qos, lambda t: self.limits(t).max_inflight_predicts)
        self._dirs: dict[str, str] = {}  # tenant -> its output dir (fixed for the tenant's life)
        self.fast_path_served = 0  # predicts answered by nexus.gateway.fast_predict (the others: by the route)
        self.openpi = None  # nexus.gateway.openpi.OpenpiServer while it serves

    async def output_dir(self, tenant: str) -> str:
        if tenant not in self._dirs:
            self._dirs[tenant] = (await self.backend.tenant_view(tenant))["output_dir"]
        return self._dirs[tenant]

    async def shown(self, who: Principal | None, tenant: str, data: Any) -> Any:
        """An answer about ``tenant`` as ``who`` may see it: a tenant sees paths relative to its own output dir,
        never the server's absolute ones; the operator sees them as they are."""
        if who is not None and who.operator:
            return data
        return relative_paths(data, await self.output_dir(tenant), str(self.config.root))

    def forget(self, tenant: str) -> None:
        self._schemas.pop(tenant, None)
        self._dirs.pop(tenant, None)

    def limits(self, tenant: str) -> ServiceLimits:
        return self.config.limits_for(tenant)

    async def spec_schema(self, tenant: str) -> tuple[TenantSpec | None, TenantSchema]:
        """The tenant's spec (when the gateway created it) and its observation schema."""
        if tenant in self._schemas:
            return self._schemas[tenant]
        raw = self.tokens.spec(tenant)
        if raw is not None:
            spec, schema = validate_tenant(raw)
            self._schemas[tenant] = (spec, schema)
            return spec, schema
        view = await self.backend.tenant_view(tenant)  # created inside the service: schema from its env/dataset
        _, schema = validate_tenant({"name": tenant, "env": view["env"], "dataset": view["dataset"]})
        return None, schema

    async def predict(self, tenant: str, body: PredictBody, who: Principal, spans: dict[str, Any]) -> NexusJSON:
        """One predict (the route's, ``POST /v1/tenants/{tenant}/predict``), filling ``spans`` with its hops."""
        t_route = time.perf_counter()
        if "_t0" in spans:
            spans["http"] = t_route - spans["_t0"] - spans.get("auth", 0.0)
        who.may_act_on(tenant)
        if body.deterministic and (body.seed is not None or body.n > 1):
            raise SpecError("seed and n > 1 draw samples: set deterministic to false")
        self.serving.shed(tenant)  # over its fair share while others are served: 429 before the checks' cost
        _, schema = await self.spec_schema(tenant)
        lim = self.limits(tenant)
        obs = check_observation(body.observation, schema, max_instruction_chars=lim.max_instruction_chars)
        spans["check"] = time.perf_counter() - t_route
        deadline = None
        if body.deadline_ms is not None:  # from the request's arrival (the timing middleware's start when timed)
            deadline = time.monotonic() - (time.perf_counter() - spans.get("_t0", t_route)) + body.deadline_ms / 1e3
        out = await self.serving.predict(tenant, obs, body.version, body.deterministic, spans, body.seed, body.n,
                                         deadline)
        spans["_tenant"], spans["_t_done"] = tenant, time.perf_counter()
        return NexusJSON(out)  # rendered once here (numpy to lists, NaN to null)

    async def predict_raw(self, tenant: str, raw: bytes, authorization: str | None,
                          spans: dict[str, Any]) -> Response | None:
        """The same predict from the request's bytes (:mod:`nexus.gateway.fast_predict`); None for a body the
        model refuses: the route answers it, with the route's order of checks (body not JSON: 422; no valid token:
        401; then the body's fields: 422)."""
        try:
            body = PredictBody.model_validate_json(raw)
        except ValidationError:
            return None
        self.fast_path_served += 1
        t0 = time.perf_counter()
        try:
            who = self.tokens.identify(bearer_token(authorization))
        except NexusError as e:
            return nexus_error_response(e)
        spans["auth"] = time.perf_counter() - t0
        try:
            return await self.predict(tenant, body, who, spans)
        except NexusError as e:
            return nexus_error_response(e)

    async def own_job(self, who: Principal, job_id: str) -> dict[str, Any]:
        """The job's view if ``who`` may see it; a foreign job is as unknown as a missing one."""
        view = await self.backend.job(job_id)
        if not (who.operator or view["tenant"] == who.tenant):
            raise NotFound(f"unknown job {quote(job_id)}")
        return view

    async def check_storage(self, tenant: str, output_dir: str) -> None:
        limit = self.limits(tenant).max_storage_bytes
        used = await asyncio.to_thread(dir_bytes, output_dir)
        if used > limit:
            raise LimitExceeded(f"storage of tenant {tenant!r}: {used} bytes is over the limit "
                                f"max_storage_bytes={limit}")

    @asynccontextmanager
    async def queued(self, tenant: str):
        """Count a low-level call of ``tenant`` while it waits and runs (max_queued_ops)."""
        limit = self.limits(tenant).max_queued_ops
        if self.pending[tenant] >= limit:
            retry = self.config.qos.retry_after_s  # a budget of calls at once, not a quota: 429, send again later
            raise Overloaded(f"queued calls of tenant {tenant!r}: {self.pending[tenant] + 1} at once is over the "
                             f"limit max_queued_ops={limit}; retry after {retry:g} s", retry)
        self.pending[tenant] += 1
        try:
            yield
        finally:
            self.pending[tenant] -= 1


def create_app(config: ServiceConfig, backend: Backend, tokens: TokenStore, on_ready=None, *,
               host: str | None = None, openpi_host: str | None = None, openpi_ssl: Any = None) -> FastAPI:
    """The gateway's app. ``host``: the address the gateway listens on (default: the config's); off loopback,
    creating a tenant needs the operator token unless ``open_registration`` is set to true. Its lifespan also serves
    the openpi WebSocket endpoint (``config.openpi``) on ``openpi.bind_address`` (else ``openpi_host``, else
    ``config.host``), with TLS when ``openpi_ssl`` (an SSLContext)."""
    gw = Gateway(config, backend, tokens)
    bind = host or config.host
    registration_open = config.registration_open(bind)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.connect()
        reporter = asyncio.get_running_loop().create_task(gw.serving.report_forever())
        if config.openpi.enabled:
            from nexus.gateway.openpi import OpenpiServer

            bind_openpi = config.openpi.bind_address or openpi_host or config.host
            gw.openpi = OpenpiServer(gw, config.openpi, bind_openpi, openpi_ssl)
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
        return NexusJSON(error_body(SpecError(_validation_message(e))), status_code=SpecError.http_status)

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

    # -- service ----------------------------------------------------------------------------
    @app.get("/health", tags=["service"])
    async def health() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/v1/status", tags=["service"])
    async def status(who: Who, limit: PageLimit = None, cursor: PageCursor = None,
                     tenant: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
        """Operator: the whole service, a page at a time (``limit`` tenants and ``limit`` jobs, newest jobs
        first; ``page.next_cursor`` continues), or one ``tenant``'s. Tenant: its own tenant and a page of its
        jobs only."""
        if who.operator:
            return await backend.status(limit, cursor, tenant)
        if tenant is not None and tenant != who.tenant:  # another tenant is unknown to this token, as its jobs are
            return {"tenants": [], "jobs": [], "page": {"limit": limit, "next_cursor": None}}
        st = await backend.status(limit, cursor, tenant=who.tenant)
        return await gw.shown(who, who.tenant, {"tenants": st["tenants"], "jobs": st["jobs"], "page": st["page"]})

    # -- tenants ------------------------------------------------------------------------------
    @app.post("/v1/tenants", status_code=201, tags=["tenants"])
    async def create_tenant(spec: TenantSpec, who: MaybeWho) -> dict[str, Any]:
        """Validate a spec and allocate the tenant's slot; the answer carries its secret ``token`` (shown
        once). Re-creating an existing tenant needs its token (or the operator's) and returns no new one."""
        if not registration_open and not (who and who.operator):
            why = ("open_registration = false" if config.open_registration is False else
                   f"the gateway listens on {bind}, not loopback, and open_registration is not set to true")
            raise Forbidden(f"creating tenants needs the operator token on this service ({why})")
        name = spec.name
        validate_tenant(spec, gw.limits(name))
        if spec.init_from is not None and not (who and who.operator):  # a server path: never another's export
            own = (await backend.tenant_view(who.tenant))["output_dir"] if who and who.tenant else None
            await asyncio.to_thread(init_from_allowed, spec.init_from, own)
        raw = spec.model_dump()
        async with gw.create_lock:
            if name in tokens:
                if who is None or not (who.operator or who.tenant == name):
                    raise Conflict(f"tenant {name!r} exists; re-creating it needs its token")
                return await gw.shown(who, name, {**await backend.create_tenant(raw), "token": None})
            if (await backend.status(tenant=name))["tenants"]:
                raise Conflict(f"tenant {name!r} exists (created inside the service)")
            view = await backend.create_tenant(raw)
            gw.forget(name)  # a re-created name may have another output dir
            return await gw.shown(who, name, {**view, "token": tokens.issue(name, raw)})

    @app.get("/v1/tenants/{tenant}", tags=["tenants"])
    async def tenant_view(tenant: str, who: Who) -> dict[str, Any]:
        who.may_act_on(tenant)
        return await gw.shown(who, tenant, await backend.tenant_view(tenant))

    @app.delete("/v1/tenants/{tenant}", tags=["tenants"])
    async def delete_tenant(tenant: str, who: Who, purge: bool = False) -> dict[str, Any]:
        """Cancel the tenant's jobs, release its slot and forget it; its output dir stays unless ``purge``.
        Its token stops working."""
        who.may_act_on(tenant)
        own = await gw.output_dir(tenant)
        res = await backend.delete_tenant(tenant, keep_output=not purge)
        tokens.revoke(tenant)
        gw.forget(tenant)
        out = {**(res if isinstance(res, dict) else {}), "tenant": tenant, "deleted": True}
        return out if who.operator else relative_paths(out, own, str(config.root))

    @app.get("/v1/tenants/{tenant}/logs", tags=["tenants"])
    async def logs(tenant: str, who: Who) -> dict[str, Any]:
        """Every job of the tenant with its metric history; utilization spans of this tenant only."""
        who.may_act_on(tenant)
        log = await backend.tenant_log(tenant)
        # a grouped inference span names every tenant of the group: keep only this tenant's name
        log["spans"] = [{**sp, "tenant": tenant} for sp in log.get("spans", [])
                        if tenant in str(sp.get("tenant", "")).split("+")]
        return await gw.shown(who, tenant, log)

    @app.post("/v1/tenants/{tenant}/export", tags=["tenants"])
    async def export(tenant: str, who: Who, body: ExportBody | None = None) -> Any:
        """Write a policy version as a self-contained directory (``nexus.policy.load`` runs it without a
        service): by default the tenant's own ``exports/vNNNNNN/``, whose files ``GET .../files/exports/...``
        downloads. The answer names it (``path``; ``relative_path`` inside the output dir)."""
        who.may_act_on(tenant)
        body = body or ExportBody()
        output_dir = (await backend.tenant_view(tenant))["output_dir"]
        options: dict[str, Any] = {"version": body.version}
        if body.path is not None:
            options["path"] = await asyncio.to_thread(export_target, body.path, output_dir, who.operator)
        if not who.operator:
            await gw.check_storage(tenant, output_dir)
        return await gw.shown(who, tenant, await backend.export(tenant, **options))

    @app.get("/v1/tenants/{tenant}/files", tags=["files"])
    async def list_files(tenant: str, who: Who) -> dict[str, Any]:
        """The tenant's output dir (manifest, weights, eval reports, trajectories, checkpoints)."""
        who.may_act_on(tenant)
        root = (await backend.tenant_view(tenant))["output_dir"]
        return {"files": await asyncio.to_thread(_list_files, root)}

    @app.get("/v1/tenants/{tenant}/files/{path:path}", tags=["files"], response_class=FileBytes,
             responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                                  "format": "binary"}}}}})
    async def read_file(tenant: str, path: str, who: Who) -> Response:
        """One file of the tenant's output dir; paths leaving it (``..``, symlinks) are refused."""
        who.may_act_on(tenant)
        root = (await backend.tenant_view(tenant))["output_dir"]
        f = await asyncio.to_thread(_open_file, root, path)
        size = os.fstat(f.fileno()).st_size

        def chunks():  # streamed from the opened file: never whole in memory (checkpoints can be large)
            with f:
                while block := f.read(FILE_CHUNK):
                    yield block

        return FileBytes(chunks(), headers={"Content-Length": str(size)})

    # -- jobs -------------------------------------------------------------------------------
    @app.post("/v1/tenants/{tenant}/jobs", status_code=201, tags=["jobs"])
    async def submit(tenant: str, job: Annotated[JobSpec, Body()], who: Who) -> dict[str, Any]:
        """An SFT, RL or eval job (``kind``); sizes are checked against the tenant's quotas."""
        who.may_act_on(tenant)
        spec, _ = await gw.spec_schema(tenant)
        raw = job.model_dump()
        if spec is not None:
            validate_job(spec, raw, gw.limits(tenant))
        if job.kind in ("sft", "rl"):
            await gw.check_storage(tenant, (await backend.tenant_view(tenant))["output_dir"])
        return {"job": await backend.submit(tenant, raw)}

    @app.get("/v1/tenants/{tenant}/jobs", tags=["jobs"])
    async def jobs(tenant: str, who: Who, limit: PageLimit = None, cursor: PageCursor = None) -> dict[str, Any]:
        """A page of the tenant's jobs, newest first."""
        who.may_act_on(tenant)
        st = await backend.status(limit, cursor, tenant=tenant)
        return await gw.shown(who, tenant, {"jobs": st["jobs"], "page": st["page"]})

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def job(job_id: str, who: Who) -> dict[str, Any]:
        view = await gw.own_job(who, job_id)
        return await gw.shown(who, view["tenant"], view)

    @app.get("/v1/jobs/{job_id}/result", tags=["jobs"])
    async def result(job_id: str, who: Who, timeout: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 30.0
                     ) -> dict[str, Any]:
        """Wait up to ``timeout`` s for the job to end; the job's view either way (check ``state``)."""
        view = await gw.own_job(who, job_id)
        return await gw.shown(who, view["tenant"], await backend.wait(job_id, timeout))

    @app.get("/v1/jobs/{job_id}/stream", tags=["jobs"], response_class=NDJSON,
             responses={200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}}}})
    async def stream(job_id: str, who: Who, poll_s: Annotated[float, Query(ge=0.05, le=10)] = 0.5) -> Response:
        """Newline-delimited JSON: the job's view each time its state or progress changes, until it ends."""
        tenant = (await gw.own_job(who, job_id))["tenant"]

        async def lines() -> AsyncIterator[bytes]:
            last = None
            while True:
                info = await gw.shown(who, tenant, await backend.job(job_id))
                key = (info["state"], json.dumps(jsonable(info["progress"]), sort_keys=True))
                if key != last:
                    last = key
                    yield json.dumps(jsonable(info), allow_nan=False).encode() + b"\n"
                if info["state"] in ("done", "failed", "cancelled"):
                    return
                await asyncio.sleep(poll_s)

        return NDJSON(lines())

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"])
    async def cancel(job_id: str, who: Who) -> Any:
        view = await gw.own_job(who, job_id)
        return await gw.shown(who, view["tenant"], await backend.cancel(job_id))

    # -- low level (Tinker-style) -------------------------------------------------------------
    @app.post("/v1/tenants/{tenant}/forward_backward", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def forward_backward(tenant: str, body: ForwardBackwardBody, who: Who,
                               session: OpSession) -> dict[str, Any]:
        """Accumulate gradients of ``loss`` on a self-contained batch (goes to the actor worker directly)."""
        who.may_act_on(tenant)
        spec, schema = await gw.spec_schema(tenant)
        lim = gw.limits(tenant)
        if spec is not None:
            batch = await asyncio.to_thread(check_batch, body.batch, schema, body.loss, chunk=spec.chunk,
                                            gaussian=spec.action_head in RL_ACTION_HEADS, max_rows=lim.max_batch_rows,
                                            max_instruction_chars=lim.max_instruction_chars)
        else:  # the actor checks it against the slot
            batch = body.batch
        async with gw.queued(tenant):
            return await backend.op(tenant, "forward_backward", batch, body.loss, session)

    @app.post("/v1/tenants/{tenant}/forward", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def forward(tenant: str, body: ForwardBody, who: Who, session: OpSession) -> dict[str, Any]:
        """Without a gradient, ordered with the tenant's training calls: each row's log-probability of its action
        (``outputs.logprobs``), the policy's entropy and value there (Gaussian heads)."""
        who.may_act_on(tenant)
        spec, schema = await gw.spec_schema(tenant)
        lim = gw.limits(tenant)
        batch = body.batch
        if spec is not None:
            if spec.action_head not in RL_ACTION_HEADS:
                raise SpecError(f"tenant {tenant!r}: forward gives log-probabilities of actions, and its "
                                f"{spec.action_head!r} head is a flow-matching expert without them")
            batch = await asyncio.to_thread(check_batch, body.batch, schema, "sft", chunk=spec.chunk,
                                            max_rows=lim.max_batch_rows,
                                            max_instruction_chars=lim.max_instruction_chars)
        async with gw.queued(tenant):
            return await backend.op(tenant, "forward", batch, session=session)

    @app.post("/v1/tenants/{tenant}/optim_step", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def optim_step(tenant: str, who: Who, session: OpSession, body: OptimStepBody | None = None
                         ) -> dict[str, Any]:
        """Apply the accumulated gradients; ``adam``: this step's Adam settings (Tinker's ``AdamParams``)."""
        who.may_act_on(tenant)
        adam = body.adam.model_dump(exclude_none=True) if body is not None and body.adam is not None else None
        async with gw.queued(tenant):
            return await backend.op(tenant, "optim_step", session=session, **({"adam": adam} if adam else {}))

    @app.post("/v1/tenants/{tenant}/save_state", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def save_state(tenant: str, body: StateBody, who: Who, session: OpSession) -> dict[str, Any]:
        """Save the training state (head, adapter, optimizer state) under ``name`` in the tenant's ``states/``
        (a state of that name is replaced); it is not a policy version."""
        who.may_act_on(tenant)
        name = check_state_name(body.name)
        await gw.check_storage(tenant, await gw.output_dir(tenant))
        async with gw.queued(tenant):
            return await backend.op(tenant, "save_state", session=session, name=name)

    @app.post("/v1/tenants/{tenant}/load_state", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def load_state(tenant: str, body: StateBody, who: Who, session: OpSession) -> dict[str, Any]:
        """Back to a saved training state; the version does not move back (``save_weights`` publishes the loaded
        weights as a new version)."""
        who.may_act_on(tenant)
        name = check_state_name(body.name)
        async with gw.queued(tenant):
            return await backend.op(tenant, "load_state", session=session, name=name)

    @app.post("/v1/tenants/{tenant}/save_weights", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def save_weights(tenant: str, who: Who, session: OpSession) -> dict[str, Any]:
        """Publish the current head as a new policy version."""
        who.may_act_on(tenant)
        await gw.check_storage(tenant, (await backend.tenant_view(tenant))["output_dir"])
        async with gw.queued(tenant):
            return await backend.op(tenant, "save_weights", session=session)

    @app.post("/v1/tenants/{tenant}/predict", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
    async def predict(tenant: str, body: PredictBody, who: Who, request: Request) -> dict[str, Any]:
        """An action from the inference engine, grouped with other tenants' requests. A tenant has at most
        ``limits.max_inflight_predicts`` predicts queued or running at once, the gateway
        ``qos.max_gateway_predicts``: past them the answer is 429 with ``Retry-After`` (nothing was done;
        send again later). Tenants' queued predicts are served round-robin. ``deterministic: false`` samples:
        reproducibly with a ``seed``; ``n`` samples come with their log-probabilities in ``actions`` and
        ``logprobs``. The answer's ``Server-Timing`` header times each hop (http, auth, check, gateway_queue,
        to_engine, engine_queue, forward, reply)."""
        return await gw.predict(tenant, body, who, spans_of(request.scope) or {})  # type: ignore[return-value]

    add_env_routes(app, backend)  # environment sessions, predict_batch, uploaded episodes (nexus.gateway.envs)

    # -- admin --------------------------------------------------------------------------------
    @app.get("/v1/admin/monitoring", tags=["admin"])
    async def monitoring(who: Who, since: Annotated[float, Query(ge=0, le=1e12)] = 0.0, limit: PageLimit = None,
                         cursor: PageCursor = None) -> dict[str, Any]:
        """The status page (as ``/v1/status``) with its tenants' signals since ``since``."""
        who.require_operator("monitoring")
        return await backend.monitoring(since, limit, cursor)

    @app.post("/v1/admin/flush", tags=["admin"])
    async def flush(who: Who) -> dict[str, Any]:
        who.require_operator("flush")
        return {"flushed": await backend.flush()}

    @app.post("/v1/admin/scale", tags=["admin"])
    async def scale(body: ScaleBody, who: Who) -> Any:
        who.require_operator("scaling the inference service")
        return await backend.scale_inference(body.engines)

    @app.get("/v1/admin/ready", tags=["admin"])
    async def ready(who: Who, timeout: float = Query(60.0, ge=0, le=600)) -> Any:
        """Wait until the actor group and an inference engine serve."""
        who.require_operator("waiting for the service")
        return await backend.wait_ready(timeout)

    @app.get("/v1/admin/qos", tags=["admin"])
    async def qos(who: Who) -> dict[str, Any]:
        """The predict path now: budgets held per tenant, requests queued per engine, mean time per hop, predicts
        the fast path answered, the openpi endpoint's connections and frames answered."""
        who.require_operator("the QoS view")
        return {**gw.serving.view(), "fast_path_served": gw.fast_path_served,
                "openpi": gw.openpi.view() if gw.openpi is not None else None}

    @app.get("/v1/admin/tenants", tags=["admin"])
    async def all_tenants(who: Who, limit: PageLimit = None, cursor: PageCursor = None) -> dict[str, Any]:
        """A page of the tenants (``page.next_cursor`` continues) and the names holding a token."""
        who.require_operator("listing all tenants")
        st = await backend.status(limit, cursor)
        return {"tenants": st["tenants"], "page": st["page"], "with_token": tokens.tenants(), "time": time.time()}

    return app


# folders of an output dir the service writes and prunes itself (nexus.data.output_dir): no export goes there
_MANAGED = frozenset({"weights", "checkpoints", "trajectories", "eval", "jobs"})


def export_target(path: str, output_dir: str, operator: bool) -> str:
    """The absolute export path a caller may name. Relative paths are inside the tenant's output dir; a
    tenant's path must stay inside it (no '..', no symlink on the way, not the dir itself or a folder the
    service manages); the operator may name any absolute path."""
    if "\x00" in path or not path.strip():
        raise SpecError(f"export path {quote(path)} is not a path")
    full = path if os.path.isabs(path) else os.path.join(output_dir, path)
    if operator:
        return os.path.normpath(full)
    if ".." in path.split("/"):
        raise Forbidden(f"export path {quote(path)}: '..' is not allowed")
    try:
        target = confine(full, output_dir)
        rel = target.relative_to(confine(output_dir, output_dir))
    except (Forbidden, ValueError):
        raise Forbidden(f"export path {quote(path)} refused: a tenant exports only inside its own output dir "
                        "(default: exports/vNNNNNN)") from None
    if not rel.parts or rel.parts[0] in _MANAGED or rel.parts[0] == "manifest.json":
        raise Forbidden(f"export path {quote(path)} refused: it is the output dir or a folder the service manages; "
                        "use a path under exports/")
    return str(target)


def init_from_allowed(path: str, own_dir: str | None) -> None:
    """A tenant token may start a new tenant only from an export inside its own output dir."""
    if own_dir is None:
        raise Forbidden("init_from needs the operator token, or a tenant token whose output dir holds the export")
    if not os.path.isabs(path) or ".." in path.split("/"):
        raise Forbidden(f"init_from {quote(path)} refused: give the absolute path of an export in your output dir")
    try:
        confine(path, own_dir, must_exist=True)
    except (Forbidden, NotFound):
        raise Forbidden(f"init_from {quote(path)} refused: a tenant may start from an export inside its own output "
                        "dir only") from None


def _list_files(root: str) -> list[dict[str, Any]]:
    out = []
    base = confine(root, root)
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(dirpath, d))]
        for f in files:
            p = os.path.join(dirpath, f)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out.append({"path": os.path.relpath(p, base), "bytes": st.st_size})
    return sorted(out, key=lambda x: x["path"])


def _open_file(root: str, rel: str) -> BinaryIO:
    """The opened regular file at ``rel`` inside ``root`` (not through a symlink)."""
    if rel.startswith("/") or "\x00" in rel:
        raise SpecError(f"path {quote(rel)}: give a path relative to the tenant's output dir")
    if ".." in rel.split("/"):
        raise Forbidden(f"path {quote(rel)}: '..' is not allowed")
    path = confine(os.path.join(root, rel), root, must_exist=True)
    if os.path.isdir(path):
        raise SpecError(f"path {quote(rel)} is a directory; GET .../files lists them")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except IsADirectoryError:
        raise SpecError(f"path {quote(rel)} is a directory") from None
    except OSError as e:
        raise NotFound(f"no file {quote(rel)} ({e.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise SpecError(f"path {quote(rel)} is not a regular file")
    return f


__all__ = ["Gateway", "create_app", "export_target", "init_from_allowed", "jsonable"]
