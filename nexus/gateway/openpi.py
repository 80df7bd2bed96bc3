"""An openpi-compatible policy endpoint: robots running ``openpi-client``, unmodified, drive their tenant's policy.

openpi's policy server protocol (``openpi_client.websocket_client_policy``): a WebSocket on its own port; the
client may send ``Authorization: Api-Key <key>``; the server's first frame is a metadata dict; then each
``infer(obs)`` sends one binary msgpack frame (numpy arrays as ``__ndarray__`` maps,
:mod:`nexus.gateway.msgpack_arrays`) and reads one frame back: binary, a dict with ``actions`` (horizon,
action_dim), or text, an error the client raises.

Here, in the gateway process (:class:`OpenpiServer`, a ``websockets`` server on the gateway's event loop):

* the API key is the tenant's token (the gateway's bearer tokens, :mod:`nexus.gateway.auth`; the operator token
  names a tenant with ``?tenant=``); a wrong or missing key is refused at the handshake (HTTP 401, nothing
  opened), a tenant's connections past ``openpi.max_connections`` with 429. ``GET /healthz`` answers 200.
* metadata on connect: the tenant, the version pinned for the connection, action dim and horizon (the tenant's
  chunk), cameras, state dim, instruction, and the observation keys it reads.
* openpi's observation keys map to the tenant's schema: by default ``observation/image`` and
  ``observation/wrist_image`` to its first two cameras (a third and more: ``observation/<camera>``),
  ``observation/state`` to its state, ``prompt`` to its instruction; ``openpi.keys`` (service config) sets a
  tenant's map, the query ``?keys={json}`` a connection's.
* each frame goes through the same predict path as ``POST .../predict`` (budgets, fair queues, gathered calls:
  connections of many tenants share forwards) and is answered with ``actions`` (horizon, action_dim) float32,
  the ``version`` that acted and ``server_timing`` (ms: decode, queue, forward, total; openpi's ``infer_ms``).
* the version is pinned per connection: the one the engine served at connect, or ``?version=N``
  (``?version=live`` follows training); a pinned version that stops being live or pinned is an error frame.
* a frame refused for a budget or the fair share (HTTP's 429) is tried again after ``qos.retry_after_s`` for up
  to ``openpi.overload_wait_s`` before it is an error: a robot waits its turn, its connection stays.
* a deadline: ``deadline_ms`` in a frame or ``?deadline_ms=`` per connection; the engine's group starts in time
  for it (``nexus.engine.batching``: "deadline").
* a batch frame ``{"batch": [obs, ...]}`` (at most ``openpi.max_batch``): one reply, ``actions``
  (n, horizon, action_dim), its observations queued together into one grouped forward.
* a config frame ``{"config": {"version", "deadline_ms", "keys"}}`` changes the connection's settings and is
  answered with the new metadata.
* ``executed_prefix`` in an observation (real-time chunking, [k, action_dim], k <= the chunk): the reply's chunk
  starts with it (flow heads inpaint it while denoising, ``nexus.engine.engine``); ``"sample": true`` asks for a
  sample with its ``logprob`` and ``value`` (an RL robot's action).
* an episode frame ``{"episode": {columns}, "job": id}``: a robot's finished episodes into its tenant's RL job with
  ``rollouts="external"``, through the HTTP upload's path (checks, store, staleness, back-pressure), answered with
  ``{"episode": {job, accepted, rows, episodes, policy_version, pending}}``.

Any bad frame (not msgpack, unknown or missing keys, wrong shapes or dtypes, over ``limits.max_request_bytes``)
is answered with a text frame naming what was wrong, then the connection is closed (code 1008; 1013 for an
overloaded or unavailable service). Frames up to twice the limit are read and answered so; larger ones are cut
off at their header (close 1009), never buffered. Each connection handles one frame at a time and a reply its
client does not take within ``openpi.send_timeout_s`` drops the connection: a robot that stops reading holds at
most one predict and a bounded buffer, nothing of anyone else's.

Why a port of its own rather than a route of the FastAPI app: openpi clients connect to a bare ``host:port``
(path ``/``); the ``websockets`` server parses frames in C and reads a frame's size from its header, so a
per-connection limit (the tenant's ``max_request_bytes``, known after the handshake) is enforced before any
payload is buffered, and the robots' path skips the ASGI layers (the HTTP gateway's middlewares are all for
HTTP). It shares the gateway's process, event loop, tokens, limits and predict path, so nothing is duplicated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from nexus.config.service import OpenpiSettings
from nexus.errors import LimitExceeded, NexusError, NotFound, Overloaded, SpecError, Unauthorized, Unavailable
from nexus.features import TenantSchema
from nexus.gateway.envs import store_episodes
from nexus.gateway.msgpack_arrays import MalformedFrame, pack, unpack
from nexus.wire.inputs import check_observation

if TYPE_CHECKING:
    from nexus.gateway.state import Gateway

logger = logging.getLogger("nexus.gateway.openpi")

# frame keys that are not observation keys
RESERVED = frozenset({"batch", "config", "deadline_ms", "executed_prefix", "sample", "episode", "job"})
MAX_DEADLINE_MS = 600_000.0
CLOSE_BAD_INPUT, CLOSE_TRY_LATER, CLOSE_INTERNAL = 1008, 1013, 1011


# -- the observation map --------------------------------------------------------------------------------------
def default_keys(schema: TenantSchema) -> dict[str, str]:
    """openpi's usual observation keys -> the tenant's fields (see the module)."""
    keys = {"observation/state": "state", "prompt": "instruction"}
    for i, cam in enumerate(schema.cameras):
        key = ("observation/image", "observation/wrist_image")[i] if i < 2 else f"observation/{cam.name}"
        keys[key] = f"images.{cam.name}"
    return keys


def check_keys(keys: Any, schema: TenantSchema, where: str = "keys") -> dict[str, str]:
    """A map openpi key -> tenant field: every camera and the state once, the instruction at most once."""
    if not isinstance(keys, dict) or not keys:
        raise SpecError(f"{where}: expected an object openpi key -> field, got {type(keys).__name__}")
    fields = {"state", "instruction"} | {f"images.{c.name}" for c in schema.cameras}
    out: dict[str, str] = {}
    for k, v in keys.items():
        if not isinstance(k, str) or not k or len(k) > 200 or k in RESERVED:
            raise SpecError(f"{where}: {k!r:.60} is not an observation key (a string of 1-200 characters other "
                            f"than {sorted(RESERVED)})")
        if v not in fields:
            raise SpecError(f"{where}: {k!r} maps to {v!r:.60}; the tenant's fields are {sorted(fields)}")
        out[k] = v
    targets = list(out.values())
    for f in sorted(fields):
        n = targets.count(f)
        if n > 1 or (n == 0 and f != "instruction"):
            raise SpecError(f"{where}: field {f!r} is mapped {n} times; every camera and the state exactly once, "
                            "the instruction at most once")
    return out


def to_observation(obs: Any, keys: dict[str, str], schema: TenantSchema, max_instruction_chars: int,
                   where: str = "") -> Any:
    """An openpi observation dict -> the tenant's checked :class:`~nexus.features.Observation`."""
    if not isinstance(obs, dict):
        raise SpecError(f"{where or 'observation'}: expected a dict of observation keys, got {type(obs).__name__}")
    unknown = sorted(str(k)[:60] for k in obs if k not in keys)
    if unknown:
        raise SpecError(f"{where or 'observation'}: unknown key(s) {unknown}; this connection reads {sorted(keys)}")
    missing = sorted(k for k, f in keys.items() if f != "instruction" and k not in obs)
    if missing:
        raise SpecError(f"{where or 'observation'}: missing key(s) {missing}; this connection reads {sorted(keys)}")
    raw: dict[str, Any] = {"images": {}}
    for k, f in keys.items():
        if k not in obs:
            continue
        v = obs[k]
        if f.startswith("images."):
            cam = f.removeprefix("images.")
            if isinstance(v, np.ndarray) and v.ndim == 3 and v.shape[0] == 3 and v.shape[-1] != 3:
                v = v.transpose(1, 2, 0)  # openpi's CHW layout (e.g. ALOHA) -> HWC
            raw["images"][cam] = v
        else:
            raw[f] = v
    try:
        return check_observation(raw, schema, field="\0", max_instruction_chars=max_instruction_chars)
    except SpecError as e:  # name the openpi key the client sent, not our field
        msg = str(e)
        for k, f in sorted(keys.items(), key=lambda kv: -len(kv[1])):
            msg = msg.replace(f"\0.{f}", k)
        msg = msg.replace("\0", "observation")
        raise type(e)(f"{where}: {msg}" if where else msg) from None


# -- a connection's settings -----------------------------------------------------------------------------------
@dataclass
class Session:
    """One robot connection: its tenant, pinned version, observation map and default deadline."""

    tenant: str
    schema: TenantSchema
    chunk: int
    keys: dict[str, str]
    version: int | None = None  # None: the live version (follows training)
    follow_live: bool = False
    deadline_ms: float | None = None
    limit_bytes: int = 0
    spec: Any = None  # the tenant's TenantSpec (None: created inside the service): its chunk and head family
    who: Any = None  # the connection's principal (nexus.gateway.auth.Principal): its episode uploads act as it

    def metadata(self, settings: OpenpiSettings) -> dict[str, Any]:
        return {"server": "joynexus", "protocol": "openpi", "tenant": self.tenant,
                "version": "live" if self.follow_live else self.version,
                "action_dim": self.schema.action_dim, "action_horizon": self.chunk,
                "state_dim": self.schema.proprio_dim,
                "cameras": [{"name": c.name, "height": c.height, "width": c.width} for c in self.schema.cameras],
                "instruction": self.schema.instruction, "observation_keys": dict(self.keys),
                "required_keys": sorted(k for k, f in self.keys.items() if f != "instruction"),
                "max_batch": settings.max_batch, "max_frame_bytes": self.limit_bytes,
                "deadline_ms": self.deadline_ms}

    def configure(self, options: dict[str, Any]) -> None:
        """Apply connection options (the query's or a config frame's): version, deadline_ms, keys."""
        unknown = sorted(str(k)[:40] for k in options if k not in ("version", "deadline_ms", "keys"))
        if unknown:
            raise SpecError(f"config: unknown option(s) {unknown}; options are deadline_ms, keys, version")
        if "keys" in options:
            self.keys = check_keys(options["keys"], self.schema, "config.keys")
        if "deadline_ms" in options:
            self.deadline_ms = deadline_ms(options["deadline_ms"], "config.deadline_ms")
        if "version" in options:
            v = options["version"]
            if v == "live" or v is None:
                self.version, self.follow_live = None, True
            elif isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31:
                self.version, self.follow_live = v, False
            else:
                raise SpecError(f"config.version: expected a version number or 'live', got {v!r:.40}")


def deadline_ms(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating) \
            or not (math.isfinite(value) and 0 < value <= MAX_DEADLINE_MS):
        raise SpecError(f"{where}: expected milliseconds in (0, {MAX_DEADLINE_MS:g}], got {value!r:.40}")
    return float(value)


def _query_options(query: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        fields = parse_qs(query, keep_blank_values=True, max_num_fields=8)
    except ValueError:
        raise SpecError("query: more than 8 parameters") from None
    for k, vs in fields.items():
        v = vs[-1]
        if k == "tenant":
            out[k] = v
        elif k == "keys":
            try:
                out[k] = json.loads(v)
            except ValueError:
                raise SpecError("query keys: expected a JSON object openpi key -> field") from None
        elif k == "version":
            out[k] = v if v == "live" else _int(v, "query version")
        elif k == "deadline_ms":
            try:
                out[k] = float(v)
            except ValueError:
                raise SpecError(f"query deadline_ms: expected milliseconds, got {v!r:.40}") from None
        else:
            raise SpecError(f"query: unknown parameter {k!r:.40}; parameters are deadline_ms, keys, tenant, version")
    return out


def _int(v: str, where: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise SpecError(f"{where}: expected a number or 'live', got {v!r:.40}") from None


def api_key(authorization: str | None) -> str | None:
    """The key of ``Authorization: Api-Key <key>`` (openpi's) or ``Bearer <key>``."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() not in ("api-key", "bearer"):
        return None
    return key.strip() or None


def error_text(e: BaseException) -> str:
    """The text frame of an error (the client raises it): class, code and message."""
    if isinstance(e, NexusError):
        return f"{type(e).__name__} ({e.code}): {str(e)[:2000]}"
    return f"{type(e).__name__}: {str(e)[:2000]}"


# -- the server -----------------------------------------------------------------------------------------------
class OpenpiServer:
    def __init__(self, gw: Gateway, settings: OpenpiSettings, host: str,
                 ssl_context: ssl.SSLContext | None = None, envs: Any = None) -> None:
        """``envs``: the environment service's side (:class:`nexus.gateway.envs.EnvBackend`) that episode frames
        are stored through (None: episode frames are refused)."""
        self.gw, self.settings, self.host, self.ssl, self.envs = gw, settings, host, ssl_context, envs
        self._server: Server | None = None
        self.port: int | None = None
        self.connections = 0  # open now
        self.per_tenant: dict[str, int] = {}  # open connections of each tenant (openpi.max_connections)
        self.frames = 0  # answered (replies and error frames)

    async def start(self) -> int:
        # max_size: the largest limit any tenant could have, doubled (see the module); each connection lowers it
        limit = 2 * max([self.gw.config.limits.max_request_bytes]
                        + [int(v["max_request_bytes"]) for v in self.gw.config.tenant_limits.values()
                           if "max_request_bytes" in v])
        self._server = await serve(self._handle, self.host, self.settings.port, process_request=self._handshake,
                                   compression=None, max_size=limit, max_queue=1, ssl=self.ssl,
                                   server_header="joynexus-openpi")
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("openpi endpoint on %s:%d", self.host, self.port)
        return self.port

    def view(self) -> dict[str, Any]:
        return {"port": self.port, "connections": self.connections, "frames": self.frames,
                "tenants": dict(self.per_tenant)}

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -- handshake: health, the key, the tenant and the connection's options -----------------------------------
    async def _handshake(self, conn: ServerConnection, request: Request) -> Response | None:
        url = urlsplit(request.path)
        if url.path == "/healthz":
            return conn.respond(HTTPStatus.OK, "OK\n")
        if url.path not in ("", "/"):
            return conn.respond(HTTPStatus.NOT_FOUND, f"no endpoint {url.path[:100]!r}; connect to / (or GET "
                                "/healthz)\n")
        try:
            who = self.gw.tokens.identify(api_key(request.headers.get("Authorization")))
        except Unauthorized as e:
            return conn.respond(HTTPStatus.UNAUTHORIZED, f"{e}; connect with api_key=<the tenant's token> "
                                "(Authorization: Api-Key <token>)\n")
        try:
            options = _query_options(url.query)
            tenant = options.pop("tenant", None) or who.tenant
            if tenant is None:
                raise SpecError("the operator token names the tenant to drive: ?tenant=<name>")
            who.may_act_on(tenant)
            if self.per_tenant.get(tenant, 0) >= self.settings.max_connections:
                return conn.respond(HTTPStatus.TOO_MANY_REQUESTS, f"tenant {tenant!r} has "
                                    f"{self.settings.max_connections} connections open (openpi.max_connections); "
                                    "close one first\n")
            conn.nexus_session = await self._session(tenant, options)  # type: ignore[attr-defined]
            conn.nexus_session.who = who  # type: ignore[attr-defined]
        except NexusError as e:
            return conn.respond(e.http_status, error_text(e) + "\n")
        return None

    async def _session(self, tenant: str, options: dict[str, Any]) -> Session:
        spec, schema = await self.gw.spec_schema(tenant)
        chunk = spec.chunk if spec is not None else 1
        keys = self.settings.keys.get(tenant)
        s = Session(tenant, schema, chunk, check_keys(keys, schema, f"openpi.keys.{tenant}") if keys
                    else default_keys(schema), limit_bytes=self.gw.limits(tenant).max_request_bytes, spec=spec)
        s.configure(options)
        if not s.follow_live and s.version is None:  # pinned: the version the engine serves now
            try:
                s.version = await self.gw.backend.live_version(tenant)
            except KeyError:
                raise NotFound(f"tenant {tenant!r} is not served by an inference engine yet") from None
        return s

    # -- frames ----------------------------------------------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        s: Session = ws.nexus_session  # type: ignore[attr-defined]
        ws.protocol.max_message_size = 2 * s.limit_bytes  # this tenant's frames, doubled (see the module)
        self.connections += 1
        self.per_tenant[s.tenant] = self.per_tenant.get(s.tenant, 0) + 1
        try:
            await self._send(ws, pack(s.metadata(self.settings)))
            async for frame in ws:
                t0 = time.perf_counter()
                try:
                    reply = await self._answer(s, frame, t0)
                except Exception as e:
                    await self._refuse(ws, s, e)
                    return
                self.frames += 1
                await self._send(ws, reply)
        except (ConnectionClosed, TimeoutError):
            pass
        finally:
            self.connections -= 1
            self.per_tenant[s.tenant] -= 1
            if not self.per_tenant[s.tenant]:
                del self.per_tenant[s.tenant]

    async def _send(self, ws: ServerConnection, data: bytes | str) -> None:
        """Send, or drop the connection when its client does not take the frame in time (it stopped reading)."""
        try:
            await asyncio.wait_for(ws.send(data), self.settings.send_timeout_s)
        except TimeoutError:
            logger.info("openpi: a client did not read its reply for %g s; connection dropped",
                        self.settings.send_timeout_s)
            ws.transport.abort()
            raise

    async def _refuse(self, ws: ServerConnection, s: Session, e: Exception) -> None:
        if isinstance(e, NexusError | MalformedFrame):
            code = CLOSE_TRY_LATER if isinstance(e, Overloaded | Unavailable) else CLOSE_BAD_INPUT
        else:
            logger.exception("openpi: internal error on a frame of tenant %s", s.tenant)
            code = CLOSE_INTERNAL
        self.frames += 1
        try:
            await self._send(ws, error_text(e))
            await ws.close(code, type(e).__name__)
        except (ConnectionClosed, TimeoutError):
            pass

    async def _answer(self, s: Session, frame: bytes | str, t0: float) -> bytes:
        if isinstance(frame, str):
            raise SpecError("frames are binary msgpack (openpi_client's msgpack_numpy), got a text frame")
        if len(frame) > s.limit_bytes:
            raise LimitExceeded(f"a frame of {len(frame)} bytes is over the limit max_request_bytes="
                                f"{s.limit_bytes}")
        msg = unpack(frame)
        if not isinstance(msg, dict):
            raise SpecError(f"a frame is a dict (an observation, batch or config), got {type(msg).__name__}")
        if "config" in msg:
            if len(msg) != 1 or not isinstance(msg["config"], dict):
                raise SpecError("a config frame is {'config': {version, deadline_ms, keys}} alone")
            s.configure(msg["config"])
            if not s.follow_live and s.version is None:
                s.version = await self.gw.backend.live_version(s.tenant)
            return pack(s.metadata(self.settings))
        if "episode" in msg:
            return pack({"episode": await self._episode(s, msg)})
        sample = msg.pop("sample", False)
        if not isinstance(sample, bool):
            raise SpecError(f"sample: expected true or false, got {sample!r:.40}")
        frame_deadline = deadline_ms(msg.get("deadline_ms"), "deadline_ms")
        ms = frame_deadline if frame_deadline is not None else s.deadline_ms
        deadline = time.monotonic() - (time.perf_counter() - t0) + ms / 1e3 if ms is not None else None
        lim = self.gw.limits(s.tenant)
        spans: dict[str, float] = {}
        if "batch" in msg:
            batch = msg["batch"]
            if set(msg) - {"batch", "deadline_ms"}:
                raise SpecError(f"a batch frame has the keys batch and deadline_ms, got {sorted(map(str, msg))}")
            if not isinstance(batch, list) or not batch:
                raise SpecError("batch: expected a non-empty list of observations")
            if len(batch) > self.settings.max_batch:
                raise LimitExceeded(f"batch: {len(batch)} observations is over the limit openpi.max_batch="
                                    f"{self.settings.max_batch}")
            obs = [self._observation(s, o, lim.max_instruction_chars, f"batch[{i}]", sample)
                   for i, o in enumerate(batch)]
            t_check = time.perf_counter()
            outs = await self._admitted(t0, spans, self.gw.serving.predict_group, s.tenant, obs, s.version,
                                        not sample, spans, deadline)
            actions = np.stack([self._actions(s, o) for o in outs])
            reply: dict[str, Any] = {"actions": actions, "versions": [int(o["version"]) for o in outs]}
            if sample:
                reply["logprobs"] = [float(o.get("logprob") or 0.0) for o in outs]
                reply["values"] = [float(o.get("value") or 0.0) for o in outs]
        else:
            one = self._observation(s, {k: v for k, v in msg.items() if k != "deadline_ms"}, lim.max_instruction_chars,
                                    "", sample)
            t_check = time.perf_counter()
            out = await self._admitted(t0, spans, self.gw.serving.predict, s.tenant, one, s.version, not sample,
                                       spans, None, 1, deadline)
            reply = {"actions": self._actions(s, out), "version": int(out["version"])}
            if sample:
                reply["logprob"], reply["value"] = float(out.get("logprob") or 0.0), float(out.get("value") or 0.0)
        if s.version is None and not s.follow_live:
            s.version = int(reply.get("version", reply.get("versions", [0])[0]))
        t_end = time.perf_counter()
        spans["decode"] = t_check - t0
        total = t_end - t0
        self.gw.serving.observe(s.tenant, total, spans)  # the tenant's latency histogram, as HTTP predicts
        timing = {f"{k}_ms": 1e3 * v for k, v in spans.items()}
        timing["queue_ms"] = 1e3 * (spans.get("gateway_queue", 0.0) + spans.get("engine_queue", 0.0))
        timing["total_ms"] = timing["infer_ms"] = 1e3 * total
        if ms is not None:
            timing["deadline_ms"] = ms
        reply["server_timing"] = timing
        return pack(reply)

    def _observation(self, s: Session, frame: Any, max_instruction_chars: int, where: str = "",
                     sample: bool = False) -> Any:
        """A frame's observation, with its ``executed_prefix`` (real-time chunking) when it has one."""
        prefix = frame.pop("executed_prefix", None) if isinstance(frame, dict) else None
        obs = to_observation(frame, s.keys, s.schema, max_instruction_chars, where)
        if prefix is None:
            return obs
        return self.gw.with_prefix(s.spec, s.schema, obs, prefix, sample,
                                   f"{where}.executed_prefix" if where else "executed_prefix")

    async def _episode(self, s: Session, msg: dict[str, Any]) -> dict[str, Any]:
        """An episode frame ``{"episode": {columns}, "job": id}``: the robot's finished episodes into its tenant's
        RL job with ``rollouts="external"``, through the HTTP upload's path (:func:`nexus.gateway.envs.store_episodes`:
        its checks, store, staleness rule and back-pressure). The columns are the HTTP upload's (state, action,
        reward, logprob, value, terminated, truncated, success, policy_version, images by camera)."""
        if set(msg) != {"episode", "job"} or not isinstance(msg["job"], str) or not msg["job"]:
            raise SpecError(f"an episode frame is {{'episode': {{columns}}, 'job': '<RL job id>'}}, got the keys "
                            f"{sorted(map(str, msg))[:8]}")
        if self.envs is None:
            raise Unavailable("this endpoint stores no episodes (no environment service)")
        job = await self.gw.own_job(s.who, msg["job"])
        if job["tenant"] != s.tenant:  # the operator's connection drives one tenant: its jobs only
            raise NotFound(f"unknown job {msg['job'][:80]!r} of tenant {s.tenant!r}")
        out = await store_episodes(self.gw, self.envs, s.who, msg["job"], msg["episode"])
        return {k: out[k] for k in ("job", "accepted", "rows", "episodes", "policy_version", "pending")}

    async def _admitted(self, t0: float, spans: dict[str, float], call, *args: Any) -> Any:
        """``call(*args)``, tried again while refused as :class:`Overloaded` (a budget, the fair share) for up to
        ``openpi.overload_wait_s``: a robot's frame waits its turn, as an HTTP client retrying a 429 would;
        ``spans["overload_wait"]``: the time it waited."""
        while True:
            try:
                return await call(*args)
            except Overloaded as e:
                waited = time.perf_counter() - t0
                if waited + e.retry_after_s > self.settings.overload_wait_s:
                    raise
                spans["overload_wait"] = waited + e.retry_after_s
                await asyncio.sleep(e.retry_after_s)

    @staticmethod
    def _actions(s: Session, out: dict[str, Any]) -> np.ndarray:
        """The reply's action chunk (horizon, action_dim): a chunked head's chunk, else its one action."""
        a = s.schema.action_dim
        chunk = out.get("chunk")
        flat = np.asarray(chunk if chunk is not None else out["action"], dtype=np.float32)
        return flat.reshape(-1, a)


def openpi_address(gateway_dir: str | Path) -> str | None:
    """The running gateway's openpi endpoint ``ws://host:port`` from ``gateway.json`` (None: none or not yet)."""
    try:
        return json.loads((Path(gateway_dir) / "gateway.json").read_text()).get("openpi_url")
    except (FileNotFoundError, json.JSONDecodeError):
        return None
