"""Environment sessions on a simulator worker: a tenant's own algorithm steps N envs of a catalog env.

A session is pinned to one ``SIM`` worker (the control plane placed it, :mod:`nexus.control.tenants.env_sessions`;
a vector session of several envs may be split into shards on several workers, each one a session of the same
id here, its envs the session's contiguous share) and lives in that worker's
:class:`~nexus.sim.host.SimHost`: its envs come from the worker's env pool and go back to it when the
session closes. Resets and steps come from the gateway worker-to-worker (the
observations never pass through the scheduler); every call runs on the host's one session thread, so the
simulators of a process are stepped by one thread of sessions at a time.

A step answers batched arrays: ``obs`` (``state`` [N, P] and ``images`` ``{camera: [N, H, W, 3]}``), the one
observation layout of :mod:`nexus.wire.inputs` batched, reward, terminated, truncated, success; the catalog's
episode length is authoritative (``truncated`` at the limit). With ``autoreset`` (vector sessions) an env whose
episode ended is reset in the same step: its answer is the new episode's first observation, and ``final`` holds
the last one (gymnasium's same-step autoreset).
The time spent in resets and steps is metered to the tenant as simulator seconds.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nexus.config import catalog
from nexus.config.catalog import EnvEntry
from nexus.data.output_dir import TenantOutputDir
from nexus.data.trajectory_store import TrajectoryStore, episode_stats
from nexus.errors import Conflict, NotFound, SpecError, Unavailable
from nexus.features import Observation, TenantSchema
from nexus.sim.vector import LockstepEnvs


def spaces_of(entry: EnvEntry, low: np.ndarray, high: np.ndarray) -> dict[str, Any]:
    """What a client needs to build the gymnasium spaces (plain values)."""
    s = entry.schema
    return {"env": entry.name, "proprio_dim": s.proprio_dim, "action_dim": s.action_dim,
            "cameras": [{"name": c.name, "height": c.height, "width": c.width} for c in s.cameras],
            "instruction": s.instruction, "max_episode_steps": entry.max_episode_steps,
            "action_low": [float(x) for x in low], "action_high": [float(x) for x in high]}


def stack_observations(entry: EnvEntry, obs: list[Observation]) -> dict[str, Any]:
    """``state`` [N, P] float32 and ``images`` ``{camera: [N, H, W, 3] uint8}`` (envs with cameras): the one
    observation layout (what ``predict`` takes, row by row), batched over the envs."""
    out: dict[str, Any] = {"state": np.stack([np.asarray(o.state, np.float32) for o in obs])}
    if entry.schema.cameras:  # no empty "images" (gymnasium refuses an empty Dict space)
        out["images"] = {c.name: np.stack([np.asarray(o.images[c.name], np.uint8) for o in obs])
                         for c in entry.schema.cameras}
    return out


@dataclass
class EnvSession:
    id: str
    tenant: str
    entry: EnvEntry
    group: LockstepEnvs
    autoreset: bool
    idle_s: float
    seed: int  # env i's first episode is reset with seed + i unless the first reset names one
    inline_s: float = 0.0  # calls faster than this may run on the worker's event loop (limits.env_session_inline_s)
    t_open: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    steps: int = 0  # env steps over the session's life
    busy_s: float = 0.0  # simulator seconds not yet reported (metering)
    busy_total_s: float = 0.0
    last_call_s: float = float("inf")  # how long the previous reset or step took
    pending: int = 0  # calls handed to the session thread and not finished (the event loop's count)

    @property
    def inline(self) -> bool:
        """May the next call run on the worker's event loop? Only a fast session with no call under way."""
        return self.inline_s > 0 and self.pending == 0 and self.last_call_s < self.inline_s

    def __post_init__(self) -> None:
        n = self.group.num_envs
        self.elapsed = np.zeros(n, np.int64)  # steps of each env's current episode
        self.returns = np.zeros(n, np.float64)
        self.ended = np.ones(n, bool)  # an env must be reset before its first step
        self._last: dict[int, Observation] = {}  # each env's latest observation

    @property
    def num_envs(self) -> int:
        return self.group.num_envs

    def reset(self, seeds: list[int | None], mask: list[bool] | None) -> dict[str, Any]:
        n = self.num_envs
        if len(seeds) != n:
            raise SpecError(f"reset: {len(seeds)} seeds for a session of {n} envs")
        if mask is not None and len(mask) != n:
            raise SpecError(f"reset: a mask of {len(mask)} for a session of {n} envs")
        which = [i for i in range(n) if mask is None or mask[i] or i not in self._last]  # never reset: now
        first = {i: self.seed + i for i in which if i not in self._last}
        obs = self.group.reset_some({i: first.get(i) if seeds[i] is None else seeds[i] for i in which})
        for i in which:
            self.elapsed[i], self.returns[i], self.ended[i] = 0, 0.0, False
        self._last.update(obs)
        return {"obs": stack_observations(self.entry, [self._last[i] for i in range(n)])}

    def step(self, actions: np.ndarray | bytes, shape: list[int] | None = None) -> dict[str, Any]:
        """``actions`` [N, A], or their float32 bytes and ``shape`` (how the gateway sends them: msgpack, no pickle)."""
        n, a = self.num_envs, self.entry.schema.action_dim
        if shape is not None:
            try:
                actions = np.frombuffer(actions, np.float32).reshape(shape)
            except (TypeError, ValueError):
                raise SpecError(f"step: actions do not fill the shape {shape}") from None
        actions = np.asarray(actions, np.float32)
        if actions.shape != (n, a):
            raise SpecError(f"step: actions of shape {tuple(actions.shape)}, expected ({n}, {a})")
        if not np.isfinite(actions).all():
            raise SpecError("step: actions contain NaN or inf")
        if self.ended.any() and (not self.autoreset or len(self._last) < n):
            ended = [int(i) for i in np.flatnonzero(self.ended)]
            raise Conflict(f"step: the episode of env(s) {ended} ended (or never started): reset first")
        low, high = self.group.action_bounds
        results = self.group.step(np.clip(actions, low, high))
        obs = [r.obs for r in results]
        reward = np.asarray([r.reward for r in results], np.float32)
        terminated = np.asarray([r.terminated for r in results], bool)
        self.elapsed += 1
        self.returns += reward
        truncated = np.asarray([r.truncated for r in results], bool) | (
            (self.elapsed >= self.entry.max_episode_steps) & ~terminated)
        done = terminated | truncated
        out: dict[str, Any] = {"reward": reward, "terminated": terminated, "truncated": truncated,
                               "success": np.asarray([r.success for r in results], bool),
                               "episode_return": np.where(done, self.returns, 0.0).astype(np.float32),
                               "episode_length": np.where(done, self.elapsed, 0)}
        self.steps += n
        if done.any() and self.autoreset:
            out["final"] = {"mask": done, **stack_observations(self.entry, obs)}
            fresh = self.group.reset_some({int(i): None for i in np.flatnonzero(done)})
            for i, o in fresh.items():
                obs[i] = o
            self.elapsed[done], self.returns[done] = 0, 0.0
        else:
            self.ended |= done
        self._last = dict(enumerate(obs))
        out["obs"] = stack_observations(self.entry, obs)
        return out


class SessionTable:
    """The environment sessions of one simulator worker (:class:`~nexus.sim.host.SimHost`)."""

    def __init__(self, pool) -> None:
        self.pool = pool  # the worker's EnvPool
        self.sessions: dict[str, EnvSession] = {}
        self._closed_busy: dict[str, float] = {}  # closed sessions' simulator seconds not yet reported
        self._lock = threading.Lock()

    def open(self, tenant: str, env: str, num_envs: int, seed: int, autoreset: bool, idle_s: float,
             session: str | None = None, inline_s: float = 0.0) -> dict[str, Any]:
        try:
            entry = catalog.env(env)
        except catalog.CatalogError as e:
            raise SpecError(str(e)) from None
        t0 = time.perf_counter()
        (group,) = self.pool.checkout(entry, [num_envs], "lockstep")
        s = EnvSession(session or uuid.uuid4().hex, tenant, entry, group, autoreset, idle_s, seed, inline_s)
        s.busy_s += time.perf_counter() - t0  # building (or reusing) its envs is the tenant's simulator time
        with self._lock:
            self.sessions[s.id] = s
        low, high = group.action_bounds
        return {"session": s.id, "num_envs": num_envs, "autoreset": autoreset, "seed": seed,
                **spaces_of(entry, low, high)}

    def get(self, session: str, tenant: str) -> EnvSession:
        s = self.sessions.get(session)
        if s is None or s.tenant != tenant:  # another tenant's session is as unknown as a closed one
            raise NotFound(f"no environment session {session[:40]!r} of tenant {tenant!r} on this simulator "
                           "worker (closed, timed out after idling, or its worker restarted)")
        return s

    def call(self, method: str, session: str, tenant: str, **kw: Any) -> dict[str, Any]:
        """A reset or a step of a session (on the host's session thread)."""
        s = self.get(session, tenant)
        t0 = time.perf_counter()
        try:
            return s.reset(**kw) if method == "reset" else s.step(**kw)
        except (SpecError, Conflict):
            raise
        except Exception as e:  # a simulator that failed mid-call is not trusted again
            s.busy_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            self.close(session, tenant, keep_envs=False)
            raise Unavailable(f"environment session {session[:12]}: the simulator failed ({type(e).__name__}: "
                              f"{e}); the session is closed, open a new one") from None
        finally:
            s.last_call_s = time.perf_counter() - t0
            s.busy_s += s.last_call_s
            s.last_used = time.time()

    def close(self, session: str, tenant: str, keep_envs: bool = True) -> dict[str, Any]:
        s = self.get(session, tenant)
        with self._lock:
            self.sessions.pop(session, None)
            busy, s.busy_s = s.busy_s, 0.0
            s.busy_total_s += busy
            self._closed_busy[s.tenant] = self._closed_busy.get(s.tenant, 0.0) + busy
        if keep_envs:
            self.pool.checkin(s.entry, [s.group], "lockstep")
        else:
            s.group.close()
        return {"session": s.id, "closed": True, "steps": s.steps, "simulator_s": round(s.busy_total_s, 6)}

    def expired(self, now: float) -> list[EnvSession]:
        with self._lock:
            return [s for s in self.sessions.values() if now - s.last_used > s.idle_s and not s.pending]

    @property
    def pending_metering(self) -> bool:
        return bool(self._closed_busy)

    def drain_metering(self) -> dict[str, float]:
        """Simulator seconds per tenant since the last call (reported as a monitoring signal)."""
        with self._lock:
            sessions = list(self.sessions.values())
            out, self._closed_busy = self._closed_busy, {}
        for s in sessions:
            busy, s.busy_s = s.busy_s, 0.0
            if busy > 0:
                s.busy_total_s += busy
                out[s.tenant] = out.get(s.tenant, 0.0) + busy
        return out

    def reports(self) -> list[dict[str, Any]]:
        now = time.time()
        with self._lock:
            return [{"session": s.id, "tenant": s.tenant, "envs": s.num_envs, "idle_s": round(now - s.last_used, 3)}
                    for s in self.sessions.values()]


def store_episodes(output_dir: str, tenant: str, schema: TenantSchema, columns: dict[str, np.ndarray]) -> dict:
    """An upload of a tenant's own episodes (external rollouts) into its trajectory store -> the batch
    reference (plain) and the episodes' statistics."""
    store = TrajectoryStore(TenantOutputDir(output_dir).trajectories, tenant, schema)
    try:
        ref = store.append(columns)
    except ValueError as e:
        raise SpecError(f"episodes: {e}") from None
    return {"batch": ref.to_dict(), "stats": episode_stats(columns)}
