"""The state of one gateway process (:class:`Gateway`: config, token store, backend, predict serving, per-tenant
counters) and what every route answers with: :class:`NexusJSON`, the error body of a refusal.

The routes themselves live in :mod:`nexus.gateway.routes` (one router per resource), assembled by
:func:`nexus.gateway.app.create_app`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nexus.config.paths import dir_bytes
from nexus.config.service import ServiceConfig, ServiceLimits
from nexus.config.validation import validate_tenant
from nexus.errors import LimitExceeded, NexusError, NotFound, Overloaded, SpecError, describe_errors, quote
from nexus.features import Observation, TenantSchema
from nexus.gateway.auth import Principal, TokenStore
from nexus.gateway.backend import Backend
from nexus.gateway.backend import plain as jsonable
from nexus.gateway.contract import relative_paths
from nexus.gateway.serving import PredictServer
from nexus.spec import TenantSpec
from nexus.wire.inputs import attach_prefix, check_observation


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


def validation_message(e: RequestValidationError) -> str:
    return "invalid request: " + describe_errors(list(e.errors()), root="body", skip=("body",))


# -- request bodies ------------------------------------------------------------------------
class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PredictBody(StrictBody):
    observation: dict[str, Any] = Field(description="state [proprio_dim], images {camera: uint8 [H, W, 3]}, "
                                                    "instruction")
    version: int | None = Field(None, ge=0, le=2**31 - 1, description="a live or pinned version; default: live")
    deterministic: bool = True
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="a reproducible sample (deterministic=false): "
                                                                  "sample j of n draws with seed + j")
    n: int = Field(1, ge=1, le=64, description="samples of the action (deterministic=false): actions, logprobs")
    deadline_ms: float | None = Field(None, gt=0, le=600_000, description="the answer is due this long after the "
                                      "request arrived: the engine's group starts in time for it")
    executed_prefix: Any = Field(None, description="real-time chunking: the actions of the previous chunk the "
                                 "robot executed, [k, action_dim] (k <= the chunk; a list of lists or an encoded "
                                 "array): the reply's chunk starts with them and a flow head plans the rest after them")


class Gateway:
    """State of one gateway process: config, token store, backend, per-tenant counters."""

    def __init__(self, config: ServiceConfig, backend: Backend, tokens: TokenStore, host: str | None = None) -> None:
        """``host``: the address the gateway listens on (default: the config's); off loopback, creating a tenant
        needs the operator token unless ``open_registration`` is set to true."""
        self.config, self.backend, self.tokens = config, backend, tokens
        self.bind = host or config.host
        self.registration_open = config.registration_open(self.bind)
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
        spec, schema = await self.spec_schema(tenant)
        lim = self.limits(tenant)
        obs = check_observation(body.observation, schema, max_instruction_chars=lim.max_instruction_chars)
        if body.executed_prefix is not None:
            obs = self.with_prefix(spec, schema, obs, body.executed_prefix, not body.deterministic)
        spans["check"] = time.perf_counter() - t_route
        deadline = None
        if body.deadline_ms is not None:  # from the request's arrival (the timing middleware's start when timed)
            deadline = time.monotonic() - (time.perf_counter() - spans.get("_t0", t_route)) + body.deadline_ms / 1e3
        out = await self.serving.predict(tenant, obs, body.version, body.deterministic, spans, body.seed, body.n,
                                         deadline)
        spans["_tenant"], spans["_t_done"] = tenant, time.perf_counter()
        return NexusJSON(out)  # rendered once here (numpy to lists, NaN to null)

    @staticmethod
    def with_prefix(spec: TenantSpec | None, schema: TenantSchema, obs: Observation, value: Any, sample: bool,
                    field: str = "executed_prefix") -> Observation:
        """``obs`` with a robot's executed prefix (real-time chunking), checked against the tenant's chunk."""
        return attach_prefix(obs, value, spec.chunk if spec is not None else 1, schema.action_dim,
                             spec.action_head if spec is not None else "oft", sample, field)

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


__all__ = ["FileBytes", "Gateway", "NDJSON", "NexusJSON", "PredictBody", "StrictBody", "bearer_token", "error_body",
           "jsonable", "nexus_error_response", "validation_message"]
