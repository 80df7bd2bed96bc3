"""The gateway's gRPC robot API (issue 52 items 2 and 4): ``joynexus.v1.RobotPolicy`` of ``proto/nexus_robot.proto``.

* ``Act``: a bidirectional stream: a robot's observations in (cameras as raw bytes + dtype + shape, state,
  instruction, an optional deadline — the message's ``deadline_ms`` or the call's gRPC deadline, the earlier: the
  inference queue starts the observation's group in time for it — and the executed prefix of its previous chunk:
  real-time chunking, the chunk starts with it), one action chunk out per
  observation, in order, with the policy version that acted and the queue / forward / total time. Each
  observation takes the HTTP predict's path (:meth:`nexus.gateway.serving.PredictServer.predict`: the same
  budgets, fair queues and gathered calls), so the robots of many tenants share grouped forwards with the HTTP
  clients, and the same checks (:func:`nexus.wire.inputs.check_observation`).
* ``UploadEpisodes``: a robot's finished episodes into its tenant's RL job with ``rollouts="external"``, through
  the HTTP upload's own path (:func:`nexus.gateway.envs.store_episodes`: the same checks, trajectory store,
  staleness rule and back-pressure).
* ``Info``: the tenant's policy version, action dim and chunk, state dim and cameras.

Tokens as on the HTTP gateway: metadata ``authorization: Bearer <token>``; a tenant token reaches only its own
tenant. The listener binds the gateway's address (loopback unless configured) on ``ServiceConfig.grpc_port``
(0: any free port; unset: no gRPC listener) and serves TLS with the gateway's certificate when the gateway
serves HTTPS. Messages over ``limits.max_request_bytes`` are refused by grpc itself (RESOURCE_EXHAUSTED).
Requests are parsed here, not by grpc, so a malformed message is INVALID_ARGUMENT (grpc would answer INTERNAL);
every refusal is a :class:`~nexus.errors.NexusError` turned into its status (:data:`STATUS`) and ends the stream,
whose predicts in flight are taken out of the queue; the other streams go on as they were. The exception: an
observation refused for now (:class:`~nexus.errors.Overloaded`: a budget of predicts at once, the tenant's fair
share) is answered on the open stream with ``retry_after_s`` and no actions, as HTTP answers 429: a robot's
stream survives a busy moment. A client that stops reading holds nobody up: its replies wait in grpc's
flow-control window, then its own stream's handler waits, holding no predict budget (a predict gives its budget
back when its answer comes); the server pings idle connections (:data:`KEEPALIVE`), so a robot that vanished
without closing its stream has it ended.

**LeRobot's async inference protocol is refused.** LeRobot's ``AsyncInference`` service (``Ready``,
``SendPolicyInstructions``, ``SendObservations``, ``GetActions``) carries its observations, actions and policy
settings as *pickled* Python objects (``TimedObservation``, ``TimedAction``, ``RemotePolicyConfig``).
Unpickling bytes from a stranger runs whatever code they name: one observation could execute a shell on the
gateway, which holds every tenant's tokens. An unpickler restricted to an allow-list is not a safe way out
here: LeRobot's payloads are not plain types (dataclasses of numpy arrays and torch tensors), so the list
would have to admit ``numpy``'s and ``torch``'s reconstructors (``numpy.core.multiarray._reconstruct``,
``torch._utils._rebuild_tensor_v2`` and the storage classes), whose arguments drive allocation and object
construction — the ground of past pickle escapes — and any LeRobot release may change the classes. So the
gateway speaks no ``AsyncInference``; a LeRobot robot talks to this API (or to the openpi endpoint) through a
small client of its own: its observations are numpy arrays, which this protocol carries as raw bytes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from nexus.errors import (
    Conflict,
    Forbidden,
    LimitExceeded,
    NexusError,
    NotFound,
    NotSupported,
    Overloaded,
    SpecError,
    Unauthorized,
    Unavailable,
)
from nexus.gateway.auth import Principal
from nexus.gateway.proto import nexus_robot_pb2 as pb
from nexus.wire.inputs import MAX_ELEMENTS, WIRE_DTYPES, check_observation

logger = logging.getLogger("nexus.gateway.grpc")

SERVICE = "joynexus.v1.RobotPolicy"
# each NexusError class's status; a subclass not listed takes its nearest listed base's (LimitExceeded first)
STATUS: dict[type[NexusError], grpc.StatusCode] = {
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SpecError: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    Forbidden: grpc.StatusCode.PERMISSION_DENIED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    Conflict: grpc.StatusCode.FAILED_PRECONDITION,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    NotSupported: grpc.StatusCode.UNIMPLEMENTED,
}
MAX_DETAILS = 2000  # characters of a status message
# ping a connection silent for a minute, drop it when the ping is not answered in 20 s (a robot gone without closing)
KEEPALIVE = (("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_timeout_ms", 20_000))


def status_of(e: NexusError) -> grpc.StatusCode:
    for cls in type(e).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return grpc.StatusCode.INVALID_ARGUMENT if e.http_status < 500 else grpc.StatusCode.UNAVAILABLE


# -- arrays ---------------------------------------------------------------------------------------
def to_array(t: pb.Tensor, field: str) -> np.ndarray:
    """The array of a :class:`Tensor` message (a read-only view of its bytes); SpecError naming ``field``."""
    dtype = WIRE_DTYPES.get(t.dtype)
    if dtype is None:
        raise SpecError(f"{field}: dtype {t.dtype[:40]!r} is not one of {sorted(WIRE_DTYPES)}")
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape) or math.prod(shape) > MAX_ELEMENTS:
        raise SpecError(f"{field}: shape {list(shape)[:8]} is not a shape of at most {MAX_ELEMENTS} elements")
    want = math.prod(shape) * np.dtype(dtype).itemsize
    if len(t.data) != want:
        raise SpecError(f"{field}: {len(t.data)} bytes do not fit shape {list(shape)} of {t.dtype} ({want} bytes)")
    return np.frombuffer(t.data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def to_tensor(a: Any) -> pb.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype.name not in WIRE_DTYPES:
        a = a.astype(np.float32)
    return pb.Tensor(data=a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(), dtype=a.dtype.name,
                     shape=list(a.shape))


def _parse(message_type: type, raw: bytes, what: str):
    try:
        return message_type.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise SpecError(f"{what}: not a valid joynexus.v1.{message_type.__name__} message ({e})") from None


EPISODE_TENSORS = ("state", "action", "reward", "logprob", "value", "terminated", "truncated", "success",
                   "policy_version")


def episode_columns(msg: pb.EpisodeUpload) -> dict[str, Any]:
    """The upload's per-step columns as :func:`nexus.wire.episodes.check_episodes` takes them (absent ones left out:
    it names what is missing)."""
    cols: dict[str, Any] = {k: to_array(getattr(msg, k), f"episodes.{k}") for k in EPISODE_TENSORS
                            if msg.HasField(k)}
    if msg.images:
        cols["images"] = {cam: to_array(t, f"episodes.images.{cam}") for cam, t in msg.images.items()}
    return cols


# -- the service ------------------------------------------------------------------------------------
class RobotPolicy:
    """The handlers of ``joynexus.v1.RobotPolicy`` on one gateway (:class:`nexus.gateway.app.Gateway`)."""

    def __init__(self, gateway, envs) -> None:
        self.gw, self.envs = gateway, envs

    def who(self, context: grpc.aio.ServicerContext) -> Principal:
        token = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                scheme, _, rest = value.partition(" ")
                token = rest.strip() if scheme.lower() == "bearer" else None
        return self.gw.tokens.identify(token)

    async def _refuse(self, context: grpc.aio.ServicerContext, e: NexusError) -> None:
        details = str(e)
        if len(details) > MAX_DETAILS:
            details = details[:MAX_DETAILS] + "... (cut)"
        meta: tuple[tuple[str, str], ...] = (("nexus-error-class", type(e).__name__), ("nexus-error-code", e.code))
        if isinstance(e, Overloaded):
            meta += (("retry-after-s", f"{e.retry_after_s:g}"),)
        await context.abort(status_of(e), details, trailing_metadata=meta)

    # Act ----------------------------------------------------------------------------------------
    async def act(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            who = self.who(context)  # refused before anything is read
            async for raw in requests:
                t0 = time.perf_counter()
                who = self.who(context)  # again per observation: a token revoked meanwhile stops working
                msg = _parse(pb.Observation, raw, "observation")
                try:
                    reply = await self.one(who, msg, t0, context.time_remaining())
                except Overloaded as e:  # a transient refusal: the robot sends again; its stream stays open
                    reply = pb.ActionChunk(request_id=msg.request_id, retry_after_s=max(e.retry_after_s, 1e-3),
                                           timing=pb.Timing(total_ms=1e3 * (time.perf_counter() - t0)))
                yield reply.SerializeToString()
        except NexusError as e:
            await self._refuse(context, e)

    async def one(self, who: Principal, msg: pb.Observation, t0: float,
                  call_remaining_s: float | None = None) -> pb.ActionChunk:
        """One observation's action chunk, through the HTTP predict's path; its deadline (:func:`deadline_of`: the
        message's ``deadline_ms``, the gRPC call's own deadline, the earlier) goes to the inference queue, whose
        forming group starts in time for it, as an HTTP predict's or an openpi frame's."""
        gw = self.gw
        due_ms = deadline_of(msg.deadline_ms, call_remaining_s, time.perf_counter() - t0)
        tenant = msg.tenant
        if not tenant:
            raise SpecError("observation.tenant: missing; name the tenant whose policy acts")
        who.may_act_on(tenant)
        if not msg.sample and msg.HasField("seed"):
            raise SpecError("observation.seed draws a reproducible sample: set sample to true")
        gw.serving.shed(tenant)  # over its fair share while others are served: refused before the checks' cost
        spec, schema = await gw.spec_schema(tenant)
        lim = gw.limits(tenant)
        raw: dict[str, Any] = {"images": {c: to_array(t, f"observation.images.{c}") for c, t in msg.images.items()},
                               "instruction": msg.instruction}
        if msg.HasField("state"):
            raw["state"] = to_array(msg.state, "observation.state")
        obs = check_observation(raw, schema, max_instruction_chars=lim.max_instruction_chars)
        if msg.HasField("executed_prefix"):
            obs = gw.with_prefix(spec, schema, obs, to_array(msg.executed_prefix, "observation.executed_prefix"),
                                 msg.sample, "observation.executed_prefix")
        version = msg.version if msg.HasField("version") else None
        if version is not None and version < 0:
            raise SpecError(f"observation.version: {version}; versions are 0 or more")
        spans: dict[str, float] = {"check": time.perf_counter() - t0}
        deadline = time.monotonic() - (time.perf_counter() - t0) + due_ms / 1e3 if due_ms is not None else None
        out = await gw.serving.predict(tenant, obs, version, not msg.sample, spans,
                                       msg.seed if msg.HasField("seed") else None, 1, deadline)
        actions = np.asarray(out.get("chunk", out["action"]), np.float32).reshape(-1, schema.action_dim)
        total = time.perf_counter() - t0
        gw.serving.observe(tenant, total, spans)  # the tenant's latency histogram, as an HTTP predict's
        return pb.ActionChunk(
            request_id=msg.request_id, actions=to_tensor(actions), policy_version=int(out["version"]),
            logprob=float(out.get("logprob") or 0.0), value=float(out.get("value") or 0.0),
            timing=pb.Timing(queue_ms=1e3 * (spans.get("gateway_queue", 0.0) + spans.get("engine_queue", 0.0)),
                             forward_ms=1e3 * spans.get("forward", 0.0), total_ms=1e3 * total,
                             deadline_ms=due_ms or 0.0),
            deadline_missed=due_ms is not None and 1e3 * total > due_ms)

    # UploadEpisodes -------------------------------------------------------------------------------
    async def upload_episodes(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        from nexus.gateway.envs import store_episodes

        try:
            who = self.who(context)
            msg = _parse(pb.EpisodeUpload, raw, "upload")
            if not msg.job:
                raise SpecError("upload.job: missing; name the RL job (rollouts='external') the episodes are for")
            out = await store_episodes(self.gw, self.envs, who, msg.job, episode_columns(msg))
        except NexusError as e:
            await self._refuse(context, e)
            raise AssertionError("unreachable") from None  # abort raises
        return pb.UploadReply(job=str(out["job"]), accepted=bool(out["accepted"]), rows=int(out["rows"]),
                              episodes=int(out["episodes"]), policy_version=int(out["policy_version"]),
                              pending=int(out["pending"])).SerializeToString()

    # Info ---------------------------------------------------------------------------------------------
    async def info(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            who = self.who(context)
            tenant = _parse(pb.InfoRequest, raw, "info").tenant
            if not tenant:
                raise SpecError("info.tenant: missing")
            who.may_act_on(tenant)
            spec, schema = await self.gw.spec_schema(tenant)
            view = await self.gw.backend.tenant_view(tenant)
        except NexusError as e:
            await self._refuse(context, e)
            raise AssertionError("unreachable") from None
        return pb.PolicyInfo(tenant=tenant, version=int(view["version"]), action_dim=schema.action_dim,
                             chunk=spec.chunk if spec is not None else 1, proprio_dim=schema.proprio_dim,
                             cameras=[pb.Camera(name=c.name, height=c.height, width=c.width) for c in schema.cameras],
                             instruction=schema.instruction).SerializeToString()

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods, taking raw bytes (parsed in the handlers: a malformed message is
        INVALID_ARGUMENT) and answering serialized messages."""
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Act": grpc.stream_stream_rpc_method_handler(self.act),
            "UploadEpisodes": grpc.unary_unary_rpc_method_handler(self.upload_episodes),
            "Info": grpc.unary_unary_rpc_method_handler(self.info),
        })


MAX_DEADLINE_MS = 600_000.0  # as HTTP's deadline_ms (nexus.gateway.state.PredictBody)


def deadline_of(field_ms: float, call_remaining_s: float | None, elapsed_s: float) -> float | None:
    """An observation's deadline in ms from its arrival: the message's ``deadline_ms`` (0: none) or what is left of
    the gRPC call's deadline (``context.time_remaining()``, None: no deadline), counted back to the arrival
    ``elapsed_s`` ago, whichever is earlier; None when neither is set. A field that is not a number of ms in
    [0, 600000] is a SpecError."""
    if not (math.isfinite(field_ms) and 0 <= field_ms <= MAX_DEADLINE_MS):
        raise SpecError(f"observation.deadline_ms: expected milliseconds in [0, {MAX_DEADLINE_MS:g}] (0: none), got "
                        f"{field_ms!r:.40}")
    due = [field_ms] if field_ms > 0 else []
    if call_remaining_s is not None and math.isfinite(call_remaining_s):
        due.append(max(0.0, 1e3 * (call_remaining_s + elapsed_s)))
    return min(due) if due else None


async def start(gateway, envs, host: str, port: int, max_message_bytes: int, certfile: str | None = None,
                keyfile: str | None = None) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server of the robot API on ``host:port`` (0: any free port) -> (server, bound port).
    Called in the gateway's event loop once the gateway serves."""
    service = RobotPolicy(gateway, envs)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0), *KEEPALIVE])
    server.add_generic_rpc_handlers((service.handler(),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if certfile is not None and keyfile is not None:
        creds = grpc.ssl_server_credentials([(Path(keyfile).read_bytes(), Path(certfile).read_bytes())])
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    if not bound:
        raise OSError(f"the gRPC robot API cannot listen on {address}")
    await server.start()
    logger.info("gRPC robot API (%s) on %s:%d%s", SERVICE, host, bound, " (TLS)" if certfile else "")
    return server, bound


__all__ = ["SERVICE", "STATUS", "RobotPolicy", "deadline_of", "episode_columns", "start", "status_of", "to_array",
           "to_tensor"]
