"""Environment sessions on the control plane: quotas, placement on a ``SIM`` worker, and their records.

A tenant's own algorithm opens a session of N envs of a catalog env (``nexus_env_open``); the control plane
checks the tenant's quotas (``limits.max_env_sessions``, ``max_envs_per_session``), places the session on
the simulator worker hosting the fewest session envs and asks it to build them (``nexus_env_ctl``). A vector
session (autoreset) of several envs is split into shards, one per worker, over up to
``limits.env_session_workers`` of the least loaded workers: each shard is a session of the same id on its
worker, holding a contiguous share of the envs, and the gateway steps all shards at once. From then on the
gateway talks to those workers directly (resets and steps: observations never pass through the scheduler).
A worker closes a session idle past ``limits.env_session_idle_s`` and reports its sessions in its heartbeat; a
session with a shard missing there, or whose worker left, or whose tenant was deleted, is dropped here (and
its other shards closed).
Simulator seconds are metered on the worker (monitoring signal ``env``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nexus.config import catalog
from nexus.config.service import ServiceLimits
from nexus.control.dispatch.shares import even_shares
from nexus.control.tenants.registry import TenantPhase
from nexus.errors import Conflict, LimitExceeded, NotFound, SpecError, Unavailable

if TYPE_CHECKING:
    from nexus.control.runtime import DaskRuntime
    from nexus.control.tenants.registry import TenantRegistry

logger = logging.getLogger("nexus.env_sessions")

SEED_RANGE = 2**32  # simulators take seeds in [0, 2**32)
REPORT_GRACE_S = 2.0  # a heartbeat made this soon after a session opened may not list it yet


@dataclass(frozen=True)
class Shard:
    """A contiguous share of a session's envs on one simulator worker (which knows it by the session's id)."""

    address: str
    worker: str
    num_envs: int

    def view(self) -> dict[str, Any]:
        return {"address": self.address, "worker": self.worker, "num_envs": self.num_envs}


@dataclass
class SessionRecord:
    session: str
    tenant: str
    env: str
    shards: list[Shard]
    t_open: float = field(default_factory=time.time)

    @property
    def num_envs(self) -> int:
        return sum(s.num_envs for s in self.shards)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.shards]

    def view(self) -> dict[str, Any]:
        first = self.shards[0]  # worker and address: the first shard's (the only one of most sessions)
        return {"session": self.session, "tenant": self.tenant, "env": self.env, "num_envs": self.num_envs,
                "worker": first.worker, "address": first.address, "shards": [s.view() for s in self.shards],
                "t_open": self.t_open}


class EnvSessions:
    def __init__(self, runtime: DaskRuntime, registry: TenantRegistry,
                 limits_for: Callable[[str], ServiceLimits]) -> None:
        self.runtime, self.registry, self.limits_for = runtime, registry, limits_for
        self.sessions: dict[str, SessionRecord] = {}
        self._opening: dict[str, int] = {}  # tenant -> sessions being opened (they count for the quota)

    def of_tenant(self, tenant: str) -> list[SessionRecord]:
        return [s for s in self.sessions.values() if s.tenant == tenant]

    # -- handlers ---------------------------------------------------------------------------------------
    async def open(self, tenant: str, env: str, num_envs: int = 1, seed: int = 0,
                   autoreset: bool = False) -> dict[str, Any]:
        t = self.registry.get(tenant)
        if t.phase != TenantPhase.READY:
            raise Conflict(f"tenant {tenant!r} is {t.phase}; open a session once it is ready")
        limits = self.limits_for(tenant)
        if not isinstance(num_envs, int) or num_envs < 1:
            raise SpecError(f"num_envs={str(num_envs)[:20]}: at least 1 env")
        if num_envs > limits.max_envs_per_session:
            raise LimitExceeded(f"num_envs={num_envs} is over the limit max_envs_per_session="
                                f"{limits.max_envs_per_session}")
        if not isinstance(seed, int) or not 0 <= seed <= SEED_RANGE - num_envs:
            raise SpecError(f"seed={str(seed)[:20]}: env i is reset with seed + i, which must stay in [0, 2**32)")
        try:
            entry = catalog.env(str(env))
        except catalog.CatalogError as e:
            raise SpecError(f"environment session: {str(e)[:300]}") from None
        n_open = len(self.of_tenant(tenant)) + self._opening.get(tenant, 0)
        if n_open >= limits.max_env_sessions:
            raise LimitExceeded(f"environment sessions={n_open + 1} of tenant {tenant!r} is over the limit "
                                f"max_env_sessions={limits.max_env_sessions}; close one first")
        spread = min(limits.env_session_workers, num_envs) if autoreset else 1
        addresses = self._place(spread)
        sizes = even_shares(num_envs, len(addresses))
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        sid = uuid.uuid4().hex
        self._opening[tenant] = self._opening.get(tenant, 0) + 1
        try:  # env i of the session is env i - offset of its shard: its first reset's seed stays seed + i
            answers = await asyncio.gather(*(
                self.runtime.call(a, "nexus_env_ctl", timeout=600, action="open", tenant=tenant, env=entry.name,
                                  num_envs=n, seed=seed + off, autoreset=bool(autoreset),
                                  idle_s=limits.env_session_idle_s, session=sid,
                                  inline_s=limits.env_session_inline_s)
                for a, n, off in zip(addresses, sizes, offsets, strict=True)), return_exceptions=True)
        finally:
            self._opening[tenant] -= 1
        shards = [Shard(a, self.runtime.worker_name(a) or "", n) for a, n in zip(addresses, sizes, strict=True)]
        rec = SessionRecord(sid, tenant, entry.name, shards)
        failed = next((e for e in answers if isinstance(e, BaseException)), None)
        if failed is not None:  # nothing half-open stays behind
            opened = [sh for sh, a in zip(shards, answers, strict=True) if not isinstance(a, BaseException)]
            if opened:
                self.runtime.spawn(self._close_on_worker(SessionRecord(sid, tenant, entry.name, opened)))
            if isinstance(failed, OSError | TimeoutError):
                raise Unavailable(f"the simulator worker could not open the session ({type(failed).__name__}: "
                                  f"{failed})") from None
            raise failed
        if self.registry.find(tenant) is not t:  # deleted meanwhile: nobody may use it
            self.runtime.spawn(self._close_on_worker(rec))
            raise NotFound(f"unknown tenant {tenant!r}")
        self.sessions[sid] = rec
        view = rec.view()
        return {**answers[0], "num_envs": num_envs, "seed": seed, "worker": view["worker"],
                "address": view["address"], "shards": view["shards"], "idle_timeout_s": limits.env_session_idle_s}

    async def close(self, tenant: str, session: str) -> dict[str, Any]:
        rec = self._get(tenant, session)
        self.sessions.pop(session, None)
        out = await self._close_on_worker(rec)
        return out or {"session": session, "closed": True}

    def view(self, tenant: str, session: str | None = None) -> list[dict[str, Any]]:
        """A tenant's open sessions (``session``: that one, or NotFound)."""
        if session is not None:
            return [self._get(tenant, session).view()]
        return [s.view() for s in self.of_tenant(tenant)]

    # -- the cluster's view -------------------------------------------------------------------------------
    def on_heartbeat(self, msg: dict[str, Any]) -> None:
        """Drop sessions their worker no longer hosts (closed after idling: the other shards are closed too);
        close those of deleted tenants."""
        address = msg.get("address")
        hosted = {s.get("session") for s in msg.get("sessions") or ()}
        made = float(msg.get("t") or time.time())  # when the worker made the report (it may arrive late)
        for rec in [r for r in self.sessions.values() if address in r.addresses]:
            if rec.session not in hosted and made - rec.t_open > REPORT_GRACE_S:
                logger.info("environment session %s of %s closed on its worker", rec.session, rec.tenant)
                self._drop(rec, gone=address)
            elif self.registry.find(rec.tenant) is None:
                self.sessions.pop(rec.session, None)
                self.runtime.spawn(self._close_on_worker(rec))

    def on_worker_removed(self, address: str) -> None:
        for rec in [r for r in self.sessions.values() if address in r.addresses]:
            logger.info("environment session %s of %s lost with its worker", rec.session, rec.tenant)
            self._drop(rec, gone=address)

    def load(self) -> dict[str, int]:
        """Session envs per SIM worker address."""
        out = {w.address: 0 for w in self.runtime.workers("SIM")}
        for rec in self.sessions.values():
            for sh in rec.shards:
                if sh.address in out:
                    out[sh.address] += sh.num_envs
        return out

    # -- helpers ------------------------------------------------------------------------------------------
    def _place(self, spread: int = 1) -> list[str]:
        """The ``spread`` least loaded simulator workers (fewer where the cluster has fewer)."""
        load = self.load()
        if not load:
            raise Unavailable("no simulator worker (resource SIM) is in the cluster")
        return sorted(load, key=lambda a: (load[a], a))[:spread]

    def _drop(self, rec: SessionRecord, gone: str) -> None:
        """A shard is gone (idle, or with its worker): the session is, and its other shards are closed."""
        self.sessions.pop(rec.session, None)
        rest = [sh for sh in rec.shards if sh.address != gone]
        if rest:
            self.runtime.spawn(self._close_on_worker(SessionRecord(rec.session, rec.tenant, rec.env, rest)))

    def _get(self, tenant: str, session: str) -> SessionRecord:
        rec = self.sessions.get(str(session))
        if rec is None or rec.tenant != tenant:  # another tenant's session is as unknown as a closed one
            raise NotFound(f"no environment session {str(session)[:40]!r} of tenant {tenant!r} (closed, timed out "
                           "after idling, or its simulator worker was lost)")
        return rec

    async def _close_on_worker(self, rec: SessionRecord) -> dict[str, Any] | None:
        """Close every shard -> the session's steps and simulator seconds (None: no shard was still open)."""
        async def one(sh: Shard) -> dict[str, Any] | None:
            try:
                return await self.runtime.call(sh.address, "nexus_env_ctl", timeout=120, action="close",
                                               session=rec.session, tenant=rec.tenant)
            # already gone with its worker or by idling (NotFound), or the worker failed: closing is best effort
            except Exception as e:
                logger.info("closing environment session %s on %s: %s", rec.session, sh.worker, e)
                return None

        closed = [c for c in await asyncio.gather(*(one(sh) for sh in rec.shards)) if c is not None]
        if not closed:
            return None
        if len(closed) == 1:
            return closed[0]
        return {**closed[0], "steps": sum(int(c.get("steps", 0)) for c in closed),
                "simulator_s": round(sum(float(c.get("simulator_s", 0.0)) for c in closed), 6)}
