"""Inference Model Service: a Dask actor on an ``INFER`` worker.

It holds the frozen backbone, the latest head of every tenant and the versions pinned by running
evaluations. Rollout producers call :meth:`InferenceEngine.predict_batch` directly (worker to worker:
observations never pass through the scheduler) with the observations of all the envs they step, one
request per step. Requests are grouped next to the model (``GroupBatcher``): a group fires when it
holds ``B`` rows, when every producer that could add a request is already waiting (producers open and
close themselves here, :meth:`open_producer`), or when its oldest request waited ``T``; compatible rows
of all tenants in the group share one backbone forward.

Request bookkeeping and firing (``predict_batch`` … ``_fire``) are kept apart from the model code
(``_forward``, which sees a flat list of rows).

The engine's methods are coroutines: they run on the worker's event loop and hand all model work
to one model thread, so the loop stays free and model state is touched by one thread only.
Module-level imports stay light (the scheduler names this class to create the actor).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nexus.config import ServiceConfig
from nexus.services.batching import GroupBatcher
from nexus.signals import emit


@dataclass
class _Request:
    """One row of a group: one observation of one tenant (what ``_forward`` computes)."""

    tenant: str
    obs: Any  # nexus.features.Observation
    version: int | None
    deterministic: bool
    job: str | None
    features: bool = False  # also return the row's pooled backbone feature
    t_arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Call:
    """One request: the rows a producer asked for at once; answered together."""

    rows: list[_Request]
    producer: str | None
    future: asyncio.Future
    t_arrival: float = field(default_factory=time.monotonic)


@dataclass
class EngineStats:
    groups: int = 0
    requests: int = 0  # rows
    calls: int = 0
    busy_s: float = 0.0
    group_sizes: list[int] = field(default_factory=list)  # rows per group, last 1000
    waits_s: list[float] = field(default_factory=list)  # last 1000
    size_hist: Counter = field(default_factory=Counter)  # rows per group -> groups (whole run)
    calls_hist: Counter = field(default_factory=Counter)  # requests per group -> groups
    tenants_hist: Counter = field(default_factory=Counter)  # tenants per group -> groups
    reasons: Counter = field(default_factory=Counter)  # why groups fired (GroupBatcher reasons)

    def record(self, size: int, waits: list[float], busy: float, calls: int = 1, tenants: int = 1,
               reason: str = "timeout") -> None:
        self.groups += 1
        self.requests += size
        self.calls += calls
        self.busy_s += busy
        self.group_sizes = (self.group_sizes + [size])[-1000:]
        self.waits_s = (self.waits_s + waits)[-1000:]
        self.size_hist[size] += 1
        self.calls_hist[calls] += 1
        self.tenants_hist[tenants] += 1
        self.reasons[reason] += 1


def _empty_signal() -> dict[str, Any]:
    return {"busy_s": 0.0, "by_tenant": {}, "by_job": {}, "spans": [], "sizes": [], "waits": []}


class InferenceEngine:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServiceConfig.model_validate(config)
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="nexus-infer")
        dp = self.config.datapath
        self._batcher = GroupBatcher(self.config.infer_max_wait_s, self.config.infer_max_batch,
                                     fire_when_all_waiting=dp.fire_when_all_waiting,
                                     producer_lease_s=dp.producer_lease_s, expect_arrivals=dp.expect_arrivals)
        self._feature_keys: dict[str, str] = {}  # tenant -> compat key of the forward its rows run in
        self._framework = None
        self._specs: dict[str, tuple[Any, Any]] = {}  # tenant -> (TenantSpec, TenantSchema)
        self._live: dict[str, tuple[int, Any]] = {}  # tenant -> (version, TenantPolicy)
        self._pinned: dict[tuple[str, int], list] = {}  # (tenant, version) -> [policy, refcount]
        self._timer: asyncio.TimerHandle | None = None
        self._firing = False
        self.stats = EngineStats()
        self._signal = _empty_signal()
        self._last_flush = time.time()
        self._flush_timer: asyncio.TimerHandle | None = None

    # -- model thread ----------------------------------------------------------------------
    async def _in_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    def _fw(self):
        if self._framework is None:
            import torch

            from nexus.model.backbone import BackboneConfig, SharedBackbone
            from nexus.model.framework import VLAFramework

            torch.set_num_threads(1)
            self._framework = VLAFramework(SharedBackbone(BackboneConfig(**self.config.backbone.model_dump())))
        return self._framework

    def _policy_from_bytes(self, tenant: str, weights: bytes):
        from nexus.services.tenant_slot import TenantSlot

        spec, schema = self._specs[tenant]
        bb = self._fw().backbone
        return TenantSlot.load_weights_bytes(weights, spec, schema, bb.hidden_size,
                                             lora_shapes=bb.lora_shapes(spec.lora))

    # -- weights and pins --------------------------------------------------------------------
    async def register_tenant(self, spec: dict, schema: dict, version: int, weights: bytes) -> int:
        from nexus.control.validation import schema_from_dict
        from nexus.model.preprocessor import TenantPreprocessor
        from nexus.spec import TenantSpec

        def build():
            spec_, schema_ = TenantSpec.model_validate(spec), schema_from_dict(schema)
            self._specs[spec_.name] = (spec_, schema_)
            policy = self._policy_from_bytes(spec_.name, weights)
            fw = self._fw()
            pre = TenantPreprocessor(schema_, fw.backbone.cfg)
            fw.add_tenant(spec_.name, policy, pre)
            self._live[spec_.name] = (version, policy)
            self._feature_keys[spec_.name] = pre.compat_key

        await self._in_model_thread(build)
        return version

    async def load_weights(self, tenant: str, version: int, weights: bytes) -> int:
        """Weight sync from the actor: the tenant's live head becomes ``version``."""
        def load():
            policy = self._policy_from_bytes(tenant, weights)
            self._live[tenant] = (version, policy)
            self._fw().policies[tenant] = policy

        await self._in_model_thread(load)
        return version

    async def unregister_tenant(self, tenant: str) -> None:
        """Forget a deleted tenant (its live head and pinned versions)."""
        def drop():
            self._specs.pop(tenant, None)
            self._live.pop(tenant, None)
            for key in [k for k in self._pinned if k[0] == tenant]:
                del self._pinned[key]
            self._fw().remove_tenant(tenant)

        await self._in_model_thread(drop)

    async def pin(self, tenant: str, version: int, output_dir: str) -> int:
        """Keep ``version`` of a tenant's head for an evaluation, whatever training does meanwhile."""
        key = (tenant, version)
        if key in self._pinned:
            self._pinned[key][1] += 1
            return version

        def load():
            from nexus.data.output_dir import TenantOutputDir

            live_version, live = self._live[tenant]
            if live_version == version:
                return live
            return self._policy_from_bytes(tenant, TenantOutputDir(output_dir).weights_path(version).read_bytes())

        self._pinned[key] = [await self._in_model_thread(load), 1]
        return version

    async def unpin(self, tenant: str, version: int) -> None:
        key = (tenant, version)
        if key in self._pinned:
            self._pinned[key][1] -= 1
            if self._pinned[key][1] <= 0:
                del self._pinned[key]

    def versions(self) -> dict[str, Any]:
        return {"live": {t: v for t, (v, _) in self._live.items()},
                "pinned": sorted(f"{t}@{v}" for t, v in self._pinned)}

    def engine_stats(self) -> dict[str, Any]:
        s = self.stats

        def hist(c: Counter) -> dict[str, int]:
            return {str(k): int(v) for k, v in sorted(c.items())}

        return {"groups": s.groups, "requests": s.requests, "calls": s.calls, "busy_s": s.busy_s,
                "group_sizes": list(s.group_sizes), "waits_s": list(s.waits_s),
                "size_hist": hist(s.size_hist), "calls_hist": hist(s.calls_hist),
                "tenants_hist": hist(s.tenants_hist), "reasons": dict(s.reasons)}

    def reset_stats(self) -> bool:
        """Start the engine's counters afresh (benchmarks measure one phase at a time)."""
        self.stats = EngineStats()
        return True

    def set_batching(self, max_wait_s: float, max_batch: int) -> dict[str, Any]:
        """New T and B (a scheduling policy's) for the groups formed from now on; pending requests are
        re-checked at once against the new rule."""
        self._batcher.set_limits(max_wait_s, max_batch)
        if self._timer is not None:  # armed for the old deadline
            self._timer.cancel()
            self._timer = None
        self._schedule()
        return self.batching()

    def batching(self) -> dict[str, Any]:
        return {"max_wait_s": self._batcher.max_wait_s, "max_batch": self._batcher.max_batch}

    # -- producers -------------------------------------------------------------------------
    async def open_producer(self, producer: str, tenant: str | None = None) -> bool:
        """A rollout producer starts: until it closes (or its lease ends), groups wait for it unless
        it is already waiting itself (the "all producers waiting" rule)."""
        self._batcher.open_producer(producer, tenant)
        return True

    async def close_producer(self, producer: str) -> bool:
        self._batcher.close_producer(producer)
        self._schedule()  # its leaving may complete the "all waiting" condition
        return True

    def producers(self) -> list[str]:
        return self._batcher.producers()

    # -- requests --------------------------------------------------------------------------
    async def predict(self, tenant: str, obs: Any, version: int | None = None,
                      deterministic: bool = False, job: str | None = None) -> dict[str, Any]:
        """One action for one observation; grouped with other tenants' requests.

        ``job`` only labels the request for metering."""
        reply = await self.predict_batch(tenant, [obs], version, deterministic, job)
        return reply["outputs"][0]

    async def predict_batch(self, tenant: str, observations: list, version: int | None = None,
                            deterministic: bool = False, job: str | None = None, producer: str | None = None,
                            features: bool = False, features_max_dim: int = 0) -> dict[str, Any]:
        """Actions for several observations of one tenant (a producer's envs), as one request.

        -> ``outputs`` (one dict per observation, in order: action, logprob, value, version),
        ``features`` float32 [n, H] pooled backbone features or None (asked with ``features`` and
        only when H <= ``features_max_dim``), ``feature_key`` (the forward's compat key), ``wait_s``
        (this request's wait for its group), ``compute_s`` (the group's compute), ``group_rows``.
        ``producer`` names the calling producer (see :meth:`open_producer`)."""
        if tenant not in self._live:
            raise KeyError(f"tenant {tenant!r} is not registered on this inference engine")
        if version is not None and (tenant, version) not in self._pinned and self._live[tenant][0] != version:
            raise KeyError(f"version {version} of tenant {tenant!r} is neither live nor pinned")
        if not observations:
            raise ValueError("predict_batch needs at least one observation")
        want = bool(features) and self._fw().backbone.hidden_size <= features_max_dim
        now = time.monotonic()
        rows = [_Request(tenant, o, version, deterministic, job, want, now) for o in observations]
        call = _Call(rows, producer, asyncio.get_running_loop().create_future(), now)
        self._batcher.add(call, rows=len(rows), producer=producer, now=now)
        self._schedule()
        outs, wait, compute, group_rows = await call.future
        feats = None
        if want:
            import numpy as np

            feats = np.stack([o.pop("feature") for o in outs])
        return {"outputs": outs, "features": feats, "feature_key": self._feature_keys.get(tenant) if want else None,
                "wait_s": wait, "compute_s": compute, "group_rows": group_rows}

    def _schedule(self) -> None:
        if self._firing:
            return  # the running group re-checks when it ends
        due = self._batcher.due_in()
        if due is None:
            return
        if due == 0:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._firing = True
            reason = self._batcher.reason() or "timeout"
            asyncio.get_running_loop().create_task(self._fire(reason))
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    async def _fire(self, reason: str) -> None:
        calls: list[_Call] = self._batcher.take()
        now = time.monotonic()
        group = [r for c in calls for r in c.rows]
        try:
            t0, wall0 = time.perf_counter(), time.time()
            outs = await self._in_model_thread(self._forward, group)
            busy, waits = time.perf_counter() - t0, [now - r.t_arrival for r in group]
            self.stats.record(len(group), waits, busy, calls=len(calls),
                              tenants=len({r.tenant for r in group}), reason=reason)
            self._account(group, wall0, time.time(), busy, waits)
            start = 0
            for c in calls:
                part = outs[start:start + len(c.rows)]
                start += len(c.rows)
                if not c.future.done():
                    c.future.set_result((part, now - c.t_arrival, busy, len(group)))
        except Exception as e:
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(e)
        finally:
            self._batcher.answered([c.producer for c in calls])
            self._firing = False
            self._schedule()

    # -- metering signals ------------------------------------------------------------------
    def _account(self, group: list[_Request], t0: float, t1: float, busy: float, waits: list[float]) -> None:
        """Split a group's busy time over its tenants by their share of its requests."""
        counts = Counter(r.tenant for r in group)
        acc = self._signal
        acc["busy_s"] += busy
        for tenant, c in counts.items():
            acc["by_tenant"][tenant] = acc["by_tenant"].get(tenant, 0.0) + busy * c / len(group)
        for job, c in Counter(r.job for r in group if r.job).items():
            acc["by_job"][job] = acc["by_job"].get(job, 0.0) + busy * c / len(group)
        acc["spans"].append((t0, t1, sorted(counts)))
        acc["sizes"].append(len(group))
        acc["waits"].extend(waits)
        if time.time() - self._last_flush >= 1.0:
            self._flush_signal()
        elif self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(1.0, self._flush_signal)

    def _flush_signal(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._signal["sizes"]:
            emit("inference", **self._signal, pending=len(self._batcher))
        self._signal = _empty_signal()
        self._last_flush = time.time()

    async def flush_signals(self) -> bool:
        """Send the pending metering signal now (tests, shutdown)."""
        self._flush_signal()
        return True

    def _policy_of(self, tenant: str, version: int | None):
        live_version, live = self._live[tenant]
        return live if version is None or version == live_version else self._pinned[(tenant, version)][0]

    def _forward(self, group: list[_Request]) -> list[dict[str, Any]]:
        """One grouped backbone forward per compatible group, then each tenant's own head (live or
        pinned version). A chunked policy returns its first action (receding horizon) and the chunk."""
        import numpy as np
        import torch

        fw = self._fw()
        feats = [fw.preprocessors[r.tenant](r.obs) for r in group]
        # each row runs through its own version's LoRA adapter (if any) inside the shared forward
        row_policies = [self._policy_of(r.tenant, r.version) for r in group]
        per_tenant = fw.group_features([(r.tenant, f) for r, f in zip(group, feats, strict=True)],
                                       row_policies=row_policies)
        outs: list[dict[str, Any] | None] = [None] * len(group)
        for tenant, (idx, cond) in per_tenant.items():
            live_version, live = self._live[tenant]
            heads: dict[tuple[int, bool], list[int]] = {}  # (version, deterministic) -> rows of this tenant
            for row, i in enumerate(idx):
                r = group[i]
                heads.setdefault((live_version if r.version is None else r.version, r.deterministic), []).append(row)
            for (version, det), rows in heads.items():
                policy = live if version == live_version else self._pinned[(tenant, version)][0]
                proprio = torch.as_tensor(np.stack([feats[idx[row]].proprio for row in rows]))
                with torch.no_grad():
                    action, logprob, value = policy.act(cond[rows], proprio, deterministic=det)
                action = action.float().cpu().numpy()  # unclipped sample: its logprob is PPO's
                for j, row in enumerate(rows):
                    out = {"action": action[j][:policy.action_dim], "logprob": float(logprob[j]),
                           "value": float(value[j]), "version": version}
                    if policy.chunk > 1:
                        out["chunk"] = action[j]
                    if group[idx[row]].features:  # datapath: the rollout keeps it for the PPO update
                        out["feature"] = cond.pooled[row].float().cpu().numpy()
                    outs[idx[row]] = out
        return outs  # type: ignore[return-value]
