"""Inference Model Service: one engine on an ``INFER`` worker (hosted by ``nexus.engine.host``).

It holds the frozen backbone, the latest head of every tenant and the versions pinned by running
evaluations (:class:`~nexus.engine.tenant_heads.TenantHeads`). Rollout producers call
:meth:`InferenceEngine.predict_batch` directly (worker to worker: observations never pass through the
scheduler) with the observations of all the envs they step, one request per step. Requests wait in the
inference queue next to the model (:class:`~nexus.engine.queue.InferenceQueue`) until their
group fires; compatible rows of all tenants in a group share one backbone forward (:meth:`_forward`).

The engine's methods are coroutines: they run on the worker's event loop and hand all model work to one
model thread, so the loop stays free and model state is touched by one thread only.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nexus.config.service import ServiceConfig
from nexus.deploy.gc_tuning import pauses as gc_pauses
from nexus.engine.batching import GroupBatcher
from nexus.engine.queue import Group, InferenceQueue
from nexus.engine.stats import EngineMeter, EngineStats
from nexus.engine.tenant_heads import TenantHeads
from nexus.features import Observation, TenantSchema
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.head_bank import HeadBank
from nexus.model.policy import gaussian_logprob
from nexus.spec import TenantSpec

MAX_SAMPLES = 64  # samples of one predict request (the gateway allows as many)

@dataclass
class _Request:
    """One row of a group: one observation of one tenant (what ``_forward`` computes)."""

    tenant: str
    obs: Observation
    version: int | None
    deterministic: bool
    job: str | None
    features: bool = False  # also return the row's pooled backbone feature
    t_arrival: float = field(default_factory=time.monotonic)
    seed: int | None = None  # a sampled row's own noise seed (reproducible, whatever group it joins)


class InferenceEngine:
    def __init__(self, config: ServiceConfig | dict[str, Any]) -> None:
        self.config = config if isinstance(config, ServiceConfig) else ServiceConfig.restore(config)
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="nexus-infer")
        self.heads = TenantHeads(self.config)
        dp = self.config.datapath
        batcher = GroupBatcher(self.config.infer_max_wait_s, self.config.infer_max_batch,
                               fire_when_all_waiting=dp.fire_when_all_waiting, producer_lease_s=dp.producer_lease_s,
                               expect_arrivals=dp.expect_arrivals)
        self.queue = InferenceQueue(batcher, self._forward_group, self._record)
        self.stats = EngineStats()
        self.meter = EngineMeter(pending=lambda: len(self.queue))

    async def _in_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    def close(self) -> None:
        self._model_thread.shutdown(wait=False)

    # -- weights and pins (the heads registry, in the model thread) ----------------------------------
    async def register_tenant(self, spec: TenantSpec, schema: TenantSchema, version: int, weights: bytes) -> int:
        await self._in_model_thread(self.heads.register, spec, schema, version, weights)
        return version

    async def load_weights(self, tenant: str, version: int, weights: bytes) -> int:
        """Weight sync from the actor: the tenant's live head becomes ``version``."""
        await self._in_model_thread(self.heads.load, tenant, version, weights)
        return version

    async def unregister_tenant(self, tenant: str) -> None:
        await self._in_model_thread(self.heads.unregister, tenant)

    async def pin(self, tenant: str, version: int, output_dir: str) -> int:
        """Keep ``version`` of a tenant's head for an evaluation, whatever training does meanwhile."""
        key = (tenant, version)
        if key in self.heads.pinned:
            self.heads.pinned[key][1] += 1
            return version
        self.heads.pinned[key] = [await self._in_model_thread(self.heads.load_pinned, tenant, version, output_dir), 1]
        return version

    async def unpin(self, tenant: str, version: int) -> None:
        key = (tenant, version)
        if key in self.heads.pinned:
            self.heads.pinned[key][1] -= 1
            if self.heads.pinned[key][1] <= 0:
                del self.heads.pinned[key]

    def versions(self) -> dict[str, Any]:
        return self.heads.versions()

    # -- statistics and settings ------------------------------------------------------------------------
    def engine_stats(self) -> dict[str, Any]:
        return {**self.stats.view(), "prefix_cache": self.heads.prefix_cache_stats(), "gc": gc_pauses().view()}

    def reset_stats(self) -> bool:
        """Start the engine's counters afresh (benchmarks measure one phase at a time)."""
        self.stats = EngineStats()
        self.heads.prefix_cache_stats(reset=True)
        gc_pauses().reset()
        return True

    def set_batching(self, max_wait_s: float, max_batch: int) -> dict[str, Any]:
        """New T and B (a scheduler's) for the groups formed from now on."""
        self.queue.set_limits(max_wait_s, max_batch)
        return self.batching()

    def batching(self) -> dict[str, Any]:
        return {"max_wait_s": self.queue.batcher.max_wait_s, "max_batch": self.queue.batcher.max_batch}

    async def flush_signals(self) -> bool:
        """Send the pending metering signal now (tests, shutdown)."""
        self.meter.flush()
        return True

    def _record(self, g: Group) -> None:
        self.stats.record(len(g.rows), g.waits_s, g.busy_s, calls=g.calls, tenants=len({r.tenant for r in g.rows}),
                          reason=g.reason, row_tenants=[r.tenant for r in g.rows])
        self.meter.account([r.tenant for r in g.rows], [r.job for r in g.rows], g.t0, g.t1, g.busy_s, g.waits_s)

    # -- producers and requests ---------------------------------------------------------------------------
    async def open_producer(self, producer: str, tenant: str | None = None) -> bool:
        """A rollout producer starts: until it closes (or its lease ends), groups wait for it unless
        it is already waiting itself (the "all producers waiting" rule)."""
        self.queue.open_producer(producer, tenant)
        return True

    async def close_producer(self, producer: str) -> bool:
        self.queue.close_producer(producer)
        return True

    def producers(self) -> list[str]:
        return self.queue.batcher.producers()

    async def predict(self, tenant: str, obs: Any, version: int | None = None,
                      deterministic: bool = False, job: str | None = None, seed: int | None = None,
                      n: int = 1) -> dict[str, Any]:
        """One action for one observation; grouped with other tenants' requests. A sample (not
        ``deterministic``) drawn with ``seed`` is reproducible; ``n`` > 1 samples (sample j with ``seed + j``) come
        as ``actions`` [n, A] and ``logprobs`` [n] besides the first one's fields.

        ``job`` only labels the request for metering."""
        reply = await self.predict_batch(tenant, [obs] * _samples(n), version, deterministic, job,
                                         seeds=_sample_seeds(seed, n))
        return _one_reply(reply["outputs"])

    async def predict_batch(self, tenant: str, observations: list, version: int | None = None,
                            deterministic: bool = False, job: str | None = None, producer: str | None = None,
                            features: bool = False, features_max_dim: int = 0,
                            seeds: list[int | None] | None = None, lead_s: float = 0.0) -> dict[str, Any]:
        """Actions for several observations of one tenant (a producer's envs), as one request.

        -> ``outputs`` (one dict per observation, in order: action, logprob, value, version),
        ``features`` float32 [n, H] pooled backbone features or None (asked with ``features`` and
        only when H <= ``features_max_dim``), ``feature_key`` (the forward's compat key), ``wait_s``
        (this request's wait for its group), ``compute_s`` (the group's compute), ``group_rows``.
        ``producer`` names the calling producer (see :meth:`open_producer`); ``seeds``: each row's sampling seed;
        ``lead_s``: how long before it arrived the caller made the request on its devices' clock (0: as it arrived;
        the queue's ``waits_of`` may count from then, the default counts from the arrival)."""
        if tenant not in self.heads.live:
            raise KeyError(f"tenant {tenant!r} is not registered on this inference engine")
        if not self.heads.serves(tenant, version):
            raise KeyError(f"version {version} of tenant {tenant!r} is neither live nor pinned")
        if not observations:
            raise ValueError("predict_batch needs at least one observation")
        want = bool(features) and self.heads.framework.backbone.hidden_size <= features_max_dim
        now = time.monotonic()
        seeds = seeds or [None] * len(observations)
        rows = [_Request(tenant, o, version, deterministic, job, want, now, s) for o, s in zip(observations, seeds,
                                                                                                strict=True)]
        lead = float(lead_s) if math.isfinite(lead_s) and lead_s > 0 else 0.0
        outs, wait, compute, group_rows = await self.queue.submit(rows, producer, lead)
        feats = np.stack([o.pop("feature") for o in outs]) if want else None
        return {"outputs": outs, "features": feats,
                "feature_key": self.heads.feature_keys.get(tenant) if want else None,
                "wait_s": wait, "compute_s": compute, "group_rows": group_rows}

    async def predict_rows(self, requests: list[tuple[str, Any, int | None, bool, int | None, int]],
                           budget_s: float | None = None) -> dict[str, Any]:
        """Several callers' predicts ``(tenant, obs, version, deterministic, seed, n)``, possibly of different
        tenants (the gateway's gathered HTTP requests; each already checked): one request of the inference
        queue, so they share one group whatever B (the queue takes whole requests); a request of ``n`` samples
        is ``n`` rows (as :meth:`predict`). ``budget_s``: the earliest of their deadlines, in seconds from now (the
        group starts by then minus the expected forward). -> ``outputs`` in order (one per request), ``wait_s``,
        ``compute_s`` (the group's), ``group_rows``."""
        for tenant, _, version, *_ in requests:
            if not self.heads.serves(tenant, version):
                raise KeyError(f"version {version} of tenant {tenant!r} is neither live nor pinned")
        now = time.monotonic()
        rows, spans = [], []
        for tenant, obs, version, det, seed, n in requests:
            seeds = _sample_seeds(seed, n) or [None] * _samples(n)
            spans.append((len(rows), len(seeds)))
            rows += [_Request(tenant, obs, version, det, None, False, now, s) for s in seeds]
        deadline = now + budget_s if budget_s is not None and math.isfinite(budget_s) else None
        outs, wait, compute, group_rows = await self.queue.submit(rows, None, deadline=deadline)
        return {"outputs": [_one_reply(outs[i:i + k]) for i, k in spans], "wait_s": wait, "compute_s": compute,
                "group_rows": group_rows}

    # -- the model ----------------------------------------------------------------------------------------
    async def _forward_group(self, group: list[_Request]) -> list[dict[str, Any]]:
        return await self._in_model_thread(self._forward, group)

    @torch.inference_mode()  # no autograd bookkeeping at all (~8 % of a 20-row group on CPU, vs no_grad)
    def _forward(self, group: list[_Request]) -> list[dict[str, Any]]:
        """One grouped backbone forward per compatible group, then each tenant's own head (live or
        pinned version). A chunked policy returns its first action (receding horizon) and the chunk."""
        fw = self.heads.framework
        feats = [fw.preprocessors[r.tenant](r.obs) for r in group]
        # each row runs through its own version's LoRA adapter (if any) inside the shared forward
        row_policies = [self.heads.policy_of(r.tenant, r.version) for r in group]
        per_tenant = fw.group_features([(r.tenant, f) for r, f in zip(group, feats, strict=True)],
                                       row_policies=row_policies)
        outs: list[dict[str, Any] | None] = [None] * len(group)
        units: list[_Unit] = []  # rows of one tenant, version and mode
        for tenant, (idx, cond) in per_tenant.items():
            live_version = self.heads.live[tenant][0]
            heads: dict[tuple[int, bool], list[int]] = {}  # (version, deterministic) -> rows of this tenant
            for row, i in enumerate(idx):
                r = group[i]
                heads.setdefault((live_version if r.version is None else r.version, r.deterministic), []).append(row)
            for (version, det), rows in heads.items():
                policy = self.heads.policy_of(tenant, version)
                proprio = torch.as_tensor(np.stack([feats[idx[row]].proprio for row in rows]))
                bank = self.heads.bank_of(tenant, policy) if isinstance(cond, BackboneFeatures) else None
                units.append(_Unit(tenant, version, det, policy, [idx[row] for row in rows], cond[rows], proprio,
                                   [group[idx[row]].seed for row in rows], bank,
                                   [group[idx[row]].obs.executed_prefix for row in rows]))
        by_bank: dict[HeadBank, list[_Unit]] = {}  # a bank hashes by identity
        for u in units:
            if u.bank is not None and not u.rtc_flow:
                by_bank.setdefault(u.bank, []).append(u)
        alone = [u for u in units if u.bank is None or u.rtc_flow]
        for us in by_bank.values():
            if not _worth_batching(us):
                alone += us
                continue
            action, logprob, value = _act_banked(us)
            at = 0
            for u in us:
                n = len(u.rows)
                _emit(outs, group, u, action[at:at + n], logprob[at:at + n], value[at:at + n])
                at += n
        for u in alone:
            _emit(outs, group, u, *_act(u.policy, u.cond, u.proprio, u.deterministic, u.seeds, u.prefixes))
        return outs  # type: ignore[return-value]


@dataclass
class _Unit:
    """A group's rows of one tenant, one head version and one mode: what one head call answers."""

    tenant: str
    version: int
    deterministic: bool
    policy: Any
    rows: list[int]  # indices into the group
    cond: BackboneFeatures
    proprio: torch.Tensor
    seeds: list[int | None]
    bank: HeadBank | None  # the bank holding this head, if any
    prefixes: list[np.ndarray | None]  # each row's executed prefix (real-time chunking), if any

    @property
    def rtc_flow(self) -> bool:
        """A flow head with rows that bring an executed prefix: inpainted in its own call, never banked."""
        return not self.policy.gaussian and any(p is not None for p in self.prefixes)


def _prefix_tensors(prefixes: list[np.ndarray | None], chunk: int, action_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows' executed prefixes as (actions [N, chunk, A] zero-padded, mask [N, chunk, 1]); None when no row has one."""
    if all(p is None for p in prefixes):
        return None
    target = torch.zeros(len(prefixes), chunk, action_dim)
    mask = torch.zeros(len(prefixes), chunk, 1)
    for r, p in enumerate(prefixes):
        if p is not None:
            k = min(len(p), chunk)
            target[r, :k] = torch.as_tensor(np.asarray(p, np.float32)[:k])
            mask[r, :k] = 1.0
    return target, mask


def _worth_batching(units: list[_Unit]) -> bool:
    """Several tenants' rows, and not so lopsided that padding outweighs the calls saved."""
    tenants = [u.tenant for u in units for _ in u.rows]
    return len(set(tenants)) > 1 and units[0].bank.padded_rows(tenants) <= 4 * len(tenants)  # type: ignore[union-attr]


def _act_banked(units: list[_Unit]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_act` for rows of several tenants in one bank: one batched forward, then each row's own noise (a
    seeded row from its own generator, as alone; a deterministic row none)."""
    bank = units[0].bank
    assert bank is not None
    tenants = [u.tenant for u in units for _ in u.rows]
    mean, log_std, value = bank.forward(tenants, torch.cat([u.cond.pooled for u in units]),
                                        torch.cat([u.proprio for u in units]))
    noise = torch.zeros_like(mean)
    unseeded: list[int] = []
    at = 0
    for u in units:
        if not u.deterministic:
            for j, s in enumerate(u.seeds):
                if s is None:
                    unseeded.append(at + j)
                else:
                    noise[at + j] = torch.randn(mean.shape[1], generator=torch.Generator().manual_seed(s))
        at += len(u.rows)
    if unseeded:
        noise[unseeded] = torch.randn(len(unseeded), mean.shape[1])
    scale = log_std.exp()
    action = mean + scale * noise
    return action, gaussian_logprob(action, mean, scale), value


def _emit(outs: list[dict[str, Any] | None], group: list[_Request], unit: _Unit, action: torch.Tensor,
          logprob: torch.Tensor, value: torch.Tensor) -> None:
    """A unit's answers into ``outs`` at its rows' places. A chunked policy answers its first action (receding
    horizon) and the chunk."""
    policy, actions = unit.policy, action.float().cpu().numpy()  # unclipped sample: its logprob is PPO's
    for j, p in enumerate(unit.prefixes):  # real-time chunking: the chunk starts with what the robot executed
        if p is not None:
            k = min(len(p), policy.chunk)
            actions[j, :k * policy.action_dim] = np.asarray(p, np.float32)[:k].reshape(-1)
    for j, i in enumerate(unit.rows):
        out = {"action": actions[j][:policy.action_dim], "logprob": float(logprob[j]), "value": float(value[j]),
               "version": unit.version}
        if policy.chunk > 1:
            out["chunk"] = actions[j]
        if group[i].features:  # datapath: the rollout keeps it for the PPO update
            out["feature"] = unit.cond.pooled[j].float().cpu().numpy()
        outs[i] = out


def _samples(n: int) -> int:
    if not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"n={n}: 1 to {MAX_SAMPLES} samples")
    return n


def _sample_seeds(seed: int | None, n: int) -> list[int | None] | None:
    """Sample j of a seeded request is drawn with ``seed + j`` (None: the engine's own randomness)."""
    return None if seed is None else [seed + j for j in range(_samples(n))]


def _one_reply(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """A request's answer from its rows' outputs: the first sample's fields, and with several samples all
    of them as ``actions`` [n, A] and ``logprobs`` [n]."""
    out = dict(outputs[0])
    if len(outputs) > 1:
        out["actions"] = np.stack([o["action"] for o in outputs])
        out["logprobs"] = [o["logprob"] for o in outputs]
    return out


def _act(policy, cond, proprio: torch.Tensor, deterministic: bool, seeds: list[int | None],
         prefixes: list[np.ndarray | None] | None = None):
    """The head's actions of some rows; a row with a seed draws its sample from its own generator, so the same
    request gives the same sample in any group. ``prefixes``: rows' executed prefixes, inpainted into a flow
    head's denoising (a Gaussian head's are put in front by :func:`_emit`)."""
    rtc = None if policy.gaussian else _prefix_tensors(prefixes or [None] * len(seeds), policy.chunk,
                                                       policy.action_dim)
    if deterministic or all(s is None for s in seeds):  # plain: the engine's policies are plain modules
        return policy.act(cond, proprio, deterministic=deterministic, plain=True, prefix=rtc)
    width = policy.chunk * policy.action_dim
    noise = torch.stack([torch.randn(width) if s is None else
                         torch.randn(width, generator=torch.Generator().manual_seed(s)) for s in seeds])
    return policy.act(cond, proprio, noise=noise, plain=True, prefix=rtc)
