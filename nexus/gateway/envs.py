"""Gateway routes of environment sessions and external rollouts (issue 22 items 1-2).

* ``POST /v1/tenants/{t}/envs`` opens a session of ``num_envs`` envs of a catalog env on a simulator worker
  (the control plane checks the quotas and places it); ``.../envs/{session}/reset`` and ``/step`` go from
  here to that worker directly (observations never pass through the scheduler); ``DELETE`` closes it.
  ``GET /v1/tenants/{t}/envs`` lists the tenant's sessions.
* ``POST /v1/tenants/{t}/predict_batch``: actions for several observations in one request (the tenant's own
  envs), each with the log-probability, value and policy version it came from.
* ``POST /v1/jobs/{job}/episodes``: finished episodes of the tenant's own env or robot for its RL job with
  ``rollouts="external"`` (stored in the tenant's trajectory store, then trained on as one update's batch).

Arrays travel in the wire form of :func:`nexus.wire.inputs.encode_array` both ways (booleans as uint8). Observations
have the one layout of :mod:`nexus.wire.inputs` (``state``, ``images``), so env i's row of a reset or step goes
to ``predict`` as it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from nexus.errors import NexusError, NotFound, SpecError, Unavailable
from nexus.gateway.auth import Principal
from nexus.gateway.contract import OVERLOADED_RESPONSE
from nexus.gateway.env_shards import join_answers, split_reset, split_step
from nexus.wire.episodes import check_episodes, newest_version
from nexus.wire.inputs import check_observation, decode_array, wire
from nexus.wire.sim_client import call_sim

logger = logging.getLogger("nexus.gateway.envs")

MAX_SEED = 2**32 - 1
MAX_PREDICT_BATCH = 256  # observations of one predict_batch request
RECORD_WAIT_S = 5.0  # how long an upload waits for the control plane to record the version predict answered

_bearer = HTTPBearer(auto_error=False, description="a tenant token (from create_tenant) or the operator token")


async def _who(request: Request,
               cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
    return request.app.state.gateway.tokens.identify(cred.credentials if cred else None)


Who = Annotated[Principal, Depends(_who)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class OpenEnvBody(_Body):
    env: str = Field(max_length=200, description="a catalog env, e.g. 'maniskill/pushcube-state'")
    num_envs: int = Field(1, ge=1, le=4096, description="envs of the session (limits.max_envs_per_session)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="env i's first episode is reset with seed + i")
    autoreset: bool = Field(False, description="an env whose episode ended is reset in the same step (vector "
                                               "envs); its last observation comes in 'final'")


class ResetBody(_Body):
    seed: int | list[int | None] | None = Field(None, description="one seed (env i gets seed + i), one per env, "
                                                "or none (each env's first reset uses the session's seed)")
    mask: list[bool] | None = Field(None, description="reset only these envs (the others keep their episode)")


class StepBody(_Body):
    actions: Any = Field(description="[num_envs, action_dim] floats (clipped to the action bounds)")


class PredictBatchBody(_Body):
    observations: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_PREDICT_BATCH)
    version: int | None = Field(None, ge=0, le=2**31 - 1, description="a live or pinned version; default: live")
    deterministic: bool = False


class EpisodesBody(_Body):
    episodes: dict[str, Any] = Field(description="per-step columns (nexus.wire.episodes): state, action, reward, "
                                     "logprob, value, terminated, truncated, policy_version, optional success and "
                                     "images")


class EnvBackend:
    """The gateway's side of environment sessions: the control plane's handlers, and the simulator workers
    hosting each session's shards (asked of the control plane once, then remembered)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        # session -> (tenant, its shards: (worker address, num_envs) each, in the order of the session's envs)
        self.where: dict[str, tuple[str, list[tuple[str, int]]]] = {}
        self._sim: str | None = None

    def _remember(self, tenant: str, info: dict[str, Any]) -> dict[str, Any]:
        """Keep where a session's shards are; -> the info without worker addresses (not the tenant's business)."""
        shards = info.get("shards") or [{"address": info["address"], "num_envs": info["num_envs"]}]
        self.where[info["session"]] = (tenant, [(sh["address"], int(sh["num_envs"])) for sh in shards])
        out = {k: v for k, v in info.items() if k != "address"}
        if "shards" in out:
            out["shards"] = [{k: v for k, v in sh.items() if k != "address"} for sh in out["shards"]]
        return out

    async def open(self, tenant: str, body: OpenEnvBody) -> dict[str, Any]:
        info = await self.backend._call("nexus_env_open", tenant=tenant, env=body.env, num_envs=body.num_envs,
                                        seed=body.seed, autoreset=body.autoreset)
        return self._remember(tenant, info)

    async def close(self, tenant: str, session: str) -> dict[str, Any]:
        self.where.pop(session, None)
        return await self.backend._call("nexus_env_close", tenant=tenant, session=session)

    async def sessions(self, tenant: str) -> list[dict[str, Any]]:
        rows = await self.backend._call("nexus_env_sessions", tenant=tenant)
        return [self._remember(tenant, r) for r in rows]

    async def locate(self, tenant: str, session: str) -> list[tuple[str, int]]:
        hit = self.where.get(session)
        if hit is None or hit[0] != tenant:
            (row,) = await self.backend._call("nexus_env_sessions", tenant=tenant, session=session)
            self._remember(tenant, row)
            hit = self.where[session]
        return hit[1]

    async def call(self, tenant: str, session: str, method: str, parts: list[dict[str, Any]]) -> Response:
        """A reset or step on the session's workers, ``parts[i]`` for shard i, all at once: their answers come as
        JSON bytes, passed on as they are (one shard) or joined (:func:`nexus.gateway.env_shards.join_answers`)."""
        shards = await self.locate(tenant, session)
        answers = await asyncio.gather(*(self._call_shard(address, session, tenant, method, part)
                                         for (address, _), part in zip(shards, parts, strict=True)),
                                       return_exceptions=True)
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is None:
            return Response(answers[0] if len(answers) == 1 else join_answers(answers), media_type="application/json")
        if len(shards) > 1 and isinstance(failed, NotFound | Unavailable):  # a shard is gone: the others stepped
            self.where.pop(session, None)  # alone, out of step with it; nobody may use the session any more
            try:
                await self.backend._call("nexus_env_close", tenant=tenant, session=session)
            except Exception as e:  # best effort: already closed, or the control plane drops it with its worker
                logger.info("closing environment session %s after a shard failed: %s", session[:12], e)
        raise failed

    async def _call_shard(self, address: str, session: str, tenant: str, method: str,
                          part: dict[str, Any]) -> bytes:
        try:
            return await call_sim(self.backend.client, address, method, plain=True, session=session, tenant=tenant,
                                  **part)
        except NotFound:
            self.where.pop(session, None)
            raise
        except NexusError:
            raise
        except (OSError, TimeoutError) as e:
            self.where.pop(session, None)
            raise Unavailable(f"the simulator worker of environment session {session[:12]} is unreachable "
                              f"({type(e).__name__}); open a new session") from None

    async def store(self, **payload: Any) -> dict[str, Any]:
        """An upload of episodes into the tenant's trajectory store, on a simulator worker."""
        for attempt in range(2):
            if self._sim is None or attempt:
                info = await self.backend.client.scheduler.identity()
                self._sim = next((a for a, w in sorted(info["workers"].items())
                                  if "SIM" in w.get("resources", {})), None)
                if self._sim is None:
                    raise Unavailable("no simulator worker (resource SIM) is in the cluster")
            try:
                return await call_sim(self.backend.client, self._sim, "store_episodes", timeout=300, **payload)
            except (OSError, TimeoutError):
                if attempt:
                    raise Unavailable("no simulator worker could store the episodes") from None
        raise AssertionError("unreachable")


router = APIRouter(tags=["environments"])


def _envs(request: Request) -> EnvBackend:
    return request.app.state.envs


@router.post("/v1/tenants/{tenant}/envs", status_code=201)
async def open_env(tenant: str, body: OpenEnvBody, who: Who, request: Request) -> dict[str, Any]:
    """Open an environment session: ``num_envs`` envs of a catalog env on one simulator worker. The answer
    describes the spaces (state / camera shapes, action bounds, episode length); reset before the first step.
    Quotas: ``max_env_sessions`` per tenant, ``max_envs_per_session``; closed after ``env_session_idle_s``
    without a call."""
    who.may_act_on(tenant)
    return await _envs(request).open(tenant, body)


@router.get("/v1/tenants/{tenant}/envs")
async def list_envs(tenant: str, who: Who, request: Request) -> dict[str, Any]:
    who.may_act_on(tenant)
    return {"sessions": await _envs(request).sessions(tenant)}


JSON_ANSWER = {200: {"content": {"application/json": {}}, "description": "arrays in their wire form"}}


@router.post("/v1/tenants/{tenant}/envs/{session}/reset", responses=JSON_ANSWER)
async def reset_env(tenant: str, session: str, who: Who, request: Request,
                    body: ResetBody | None = None) -> Response:
    """Start new episodes (all envs, or those of ``mask``) -> ``obs`` (``state`` [N, P], ``images``
    ``{camera: [N, H, W, 3]}``): the observation layout ``predict`` takes, batched over the envs."""
    who.may_act_on(tenant)
    body = body or ResetBody()
    envs = _envs(request)
    sizes = [n for _, n in await envs.locate(tenant, session)]
    n = sum(sizes)
    if isinstance(body.seed, list):
        if len(body.seed) != n or any(s is not None and not 0 <= s <= MAX_SEED for s in body.seed):
            raise SpecError(f"seed: a list of {n} seeds in [0, 2**32) (or null) expected, got {len(body.seed)}")
        seeds = list(body.seed)
    elif body.seed is not None:
        if not 0 <= body.seed <= MAX_SEED - n:
            raise SpecError(f"seed={body.seed}: env i is reset with seed + i, which must stay in [0, 2**32)")
        seeds = [body.seed + i for i in range(n)]
    else:
        seeds = [None] * n
    if body.mask is not None and len(body.mask) != n:
        raise SpecError(f"reset: a mask of {len(body.mask)} for a session of {n} envs")
    return await envs.call(tenant, session, "reset", split_reset(sizes, seeds, body.mask))


@router.post("/v1/tenants/{tenant}/envs/{session}/step", responses=JSON_ANSWER)
async def step_env(tenant: str, session: str, body: StepBody, who: Who, request: Request) -> Response:
    """One step of every env -> ``obs``, ``reward``, ``terminated``, ``truncated`` (the catalog's episode length
    included), ``success``, ``episode_return`` / ``episode_length`` (of the envs whose episode ended) and, with
    autoreset, ``final`` (``mask`` + the last observations of the envs that were reset)."""
    who.may_act_on(tenant)
    envs = _envs(request)
    sizes = [n for _, n in await envs.locate(tenant, session)]
    try:
        actions = np.asarray(decode_array(body.actions), np.float32)
    except (ValueError, TypeError):
        raise SpecError("actions: [num_envs, action_dim] numbers expected") from None
    if len(sizes) > 1:  # what every shard would refuse alike is refused here, so that no shard steps alone
        if actions.ndim != 2 or actions.shape[0] != sum(sizes):
            raise SpecError(f"step: actions of shape {tuple(actions.shape)}, expected ({sum(sizes)}, action_dim)")
        if not np.isfinite(actions).all():
            raise SpecError("step: actions contain NaN or inf")
        return await envs.call(tenant, session, "step", split_step(sizes, actions))
    # msgpack-ready (not pickled): the float32 bytes and their shape, rebuilt on the simulator worker
    return await envs.call(tenant, session, "step", [{"actions": actions.tobytes(), "shape": list(actions.shape)}])


@router.delete("/v1/tenants/{tenant}/envs/{session}")
async def close_env(tenant: str, session: str, who: Who, request: Request) -> dict[str, Any]:
    """Close a session: its envs go back to the simulator worker's pool; answers its steps and simulator seconds."""
    who.may_act_on(tenant)
    return await _envs(request).close(tenant, session)


@router.post("/v1/tenants/{tenant}/predict_batch", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def predict_batch(tenant: str, body: PredictBatchBody, who: Who, request: Request) -> dict[str, Any]:
    """Actions for several observations of the tenant (one request, grouped with other tenants' requests):
    ``outputs``, one per observation: ``action`` (the policy's sample, unclipped), ``logprob``, ``value`` and
    the ``version`` it came from — what an upload of external episodes needs."""
    who.may_act_on(tenant)
    gw = request.app.state.gateway
    _, schema = await gw.spec_schema(tenant)
    lim = gw.limits(tenant)
    obs = [check_observation(o, schema, field=f"observations[{i}]", max_instruction_chars=lim.max_instruction_chars)
           for i, o in enumerate(body.observations)]
    async with gw.queued(tenant):
        outs = await gw.backend.predict_batch(tenant, obs, body.version, body.deterministic)
    return {"outputs": [wire({k: np.asarray(v, np.float32) if k in ("action", "chunk") else v
                              for k, v in o.items()}) for o in outs]}


@router.post("/v1/jobs/{job_id}/episodes", tags=["jobs"])
async def upload_episodes(job_id: str, body: EpisodesBody, who: Who, request: Request) -> dict[str, Any]:
    """Finished episodes of the tenant's own env or robot for its running RL job with ``rollouts="external"``:
    stored in the tenant's trajectory store, then one update's batch (dropped like the service's rollouts when
    its oldest ``policy_version`` lags more than the tenant's ``max_staleness``). Waits while the job holds
    untrained uploads."""
    return await store_episodes(request.app.state.gateway, _envs(request), who, job_id, body.episodes)


async def store_episodes(gw, envs: EnvBackend, who: Principal, job_id: str, episodes: Any) -> dict[str, Any]:
    """An upload of episodes into the job's tenant's RL (the HTTP route's and the gRPC API's): the same checks
    (the job's owner, ``rollouts="external"``, the columns, the versions, storage), the same store and queue."""
    job = await gw.own_job(who, job_id)
    tenant = job["tenant"]
    if job["kind"] != "rl" or job["spec"].get("rollouts") != "external":
        raise SpecError(f"job {job_id!r} is not an RL job with rollouts='external': it takes no uploaded episodes")
    _, schema = await gw.spec_schema(tenant)
    view = await recorded_view(gw.backend, tenant, newest_version(episodes))
    lim = gw.limits(tenant)
    columns = await asyncio.to_thread(check_episodes, episodes, schema, int(view["version"]),
                                      lim.max_batch_rows, lim.max_episodes_per_batch)
    await gw.check_storage(tenant, view["output_dir"])
    stored = await envs.store(output_dir=view["output_dir"], tenant=tenant, schema=schema, columns=columns)
    return await gw.backend._call("nexus_feed_rollouts", tenant=tenant, job=job_id, batch=stored["batch"],
                                  stats=stored["stats"])


async def recorded_view(backend, tenant: str, wanted: int | None, timeout: float = RECORD_WAIT_S,
                        poll: float = 0.05) -> dict[str, Any]:
    """The tenant's view once the control plane has recorded version ``wanted``. The actor pushes a new
    version to the engines before its update's result reaches the control plane, so predict can answer a
    version one ahead of the record for a moment; only that version is waited for (``timeout`` at most)."""
    view = await backend.tenant_view(tenant)
    deadline = time.monotonic() + timeout
    while wanted is not None and wanted == int(view["version"]) + 1 and time.monotonic() < deadline:
        await asyncio.sleep(poll)
        view = await backend.tenant_view(tenant)
    return view


__all__ = ["EnvBackend", "router", "store_episodes"]
