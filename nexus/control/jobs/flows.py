"""The three flows of a job (SFT, RL, Eval) and the low-level ops, as coroutines on the control plane.

Admission slots: a producer takes a slot before it produces an item (an SFT batch reference, a
rollout); the slot is held until the item's update finishes, and *every* other outcome gives it
back — a dropped stale batch, a failed rollout that is not retried, a cancelled job. A rollout that
fails (its simulator worker died and Dask's retries ran out, or it raised) is re-run with the same
episode ids and seeds, keeping its slot, up to ``rollout_attempts`` times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nexus.config import catalog
from nexus.config.service import DataPathSettings, DispatchSettings, SimulatorSettings, SplitRule
from nexus.control import tasks
from nexus.control.dispatch.shares import even_shares
from nexus.control.dispatch.sim_share import SimSlots, ready_from
from nexus.control.dispatch.training_queue import TrainingItem
from nexus.errors import JobFailed
from nexus.spec import REWARD_PREFIX
from nexus.wire.messages import BatchRef, GRPOWork, OpWork, RLWork, RolloutRequest, RolloutResult, SFTWork, SyncRule

if TYPE_CHECKING:
    from nexus.control.dispatch.dispatcher import Dispatcher
    from nexus.control.dispatch.training_queue import TrainingQueue
    from nexus.control.health.engine_pool import EnginePool
    from nexus.control.health.manager import HealthManager
    from nexus.control.jobs.state import JobState
    from nexus.control.runtime import DaskRuntime
    from nexus.control.tenants.registry import TenantState
    from nexus.spec import RLJob

logger = logging.getLogger("nexus.flows")


@dataclass
class FlowContext:
    dispatcher: Dispatcher
    queue: TrainingQueue
    pool: EnginePool
    health: HealthManager
    runtime: DaskRuntime
    rollout_attempts: int
    log: Callable[[JobState, dict[str, Any], int, str], None]  # (job, metrics, step, history kind)
    datapath: DataPathSettings = field(default_factory=DataPathSettings)
    eval_fanout: int = 2  # rollout tasks per evaluation job at once (dispatch.eval_fanout)
    rollout_split: int = 1  # an RL batch over up to this many rollout tasks (dispatch.rollout_split)
    rollout_split_rule: SplitRule = "free"  # only while simulator places are free now, or "always"
    simulators: SimulatorSettings | None = None  # fair share and evaluation task size (None: Dask's order)
    sim_slots: SimSlots | None = None  # built from ``simulators`` unless given

    def __post_init__(self) -> None:
        if self.sim_slots is None and self.simulators is not None:
            self.sim_slots = SimSlots.of_cluster(self.runtime, self.simulators.fair_share)

    @property
    def sim_task_episodes(self) -> int:
        """An evaluation's rollout tasks run at most this many episodes each."""
        return self.simulators.task_episodes if self.simulators is not None else 1_000_000

    def follow(self, dispatch: DispatchSettings) -> None:
        """The dispatch settings for the flows that start from now on (the service's at boot, a switched
        scheduler's later)."""
        self.eval_fanout, self.rollout_split = dispatch.eval_fanout, dispatch.rollout_split
        self.rollout_split_rule = dispatch.rollout_split_rule
        if self.sim_slots is not None:
            self.sim_slots.order = dispatch.sim_order

    def batch_split(self, split: int, episodes: int, env: str) -> int:
        """Rollout tasks for one RL batch: the job's ``split``, or more — up to ``dispatch.rollout_split``, no
        more than one wave of a producer's envs each (a part with fewer episodes than a producer's envs would not
        end sooner), and under the rule ``"free"`` no more than the simulator places free now that no tenant waits
        for (``"always"``: the parts queue for places like any rollout task, so the split does not race timing)."""
        if self.rollout_split <= split or self.sim_slots is None:
            return split
        envs = max(self.datapath.envs_per_producer, catalog.env(env).num_envs)
        waves = -(-episodes // envs)
        free = waves if self.rollout_split_rule == "always" else self.sim_slots.free()
        return max(split, min(self.rollout_split, waves, free))

    def sync_rule(self, live_consumers: bool) -> SyncRule:
        """Lazy weight sync (decided on the actor, ``SyncRule.should_push``): a tenant's RL job reads its live
        head (rollouts); SFT and pinned evaluations do not."""
        return SyncRule(self.datapath.sync_mode, self.datapath.sync_every, live_consumers)

    def log_update(self, js: JobState, res: dict[str, Any], **counters: int) -> None:
        self.log(js, {**res["metrics"], **counters, "version": res["version"]}, res["version"], "train")

    def rl_item_done(self, js: JobState, res: dict[str, Any], tally: UpdateTally) -> None:
        """An RL job's update item came back: dropped as stale, or an update (its metrics logged)."""
        if res.get("dropped"):
            tally.dropped += 1
            self.log(js, {"dropped_stale": tally.dropped}, tally.dropped, "queue")
        else:
            tally.updates += 1
            self.log_update(js, res, updates=tally.updates)


@dataclass
class UpdateTally:
    """An RL job's update items so far (service or external rollouts)."""

    updates: int = 0
    dropped: int = 0

    def rl_work(self, batch: BatchRef, spec: RLJob, queued: int, ref_version: int | None = None) -> RLWork | GRPOWork:
        """The job's next update item; its place (updates done, then ``queued`` items) sets its share of the learning
        rate (``anneal_lr``); ``ref_version``: GRPO's KL reference."""
        scale = spec.lr_scale(self.updates + queued)
        if spec.algorithm == "grpo":
            return GRPOWork(batch=batch, config=spec.grpo, ref_version=ref_version, lr_scale=scale)
        return RLWork(batch=batch, config=spec.ppo, lr_scale=scale)


def producer_role(job_id: str) -> str:
    return f"producer/{job_id}"


async def _rollout(ctx: FlowContext, t: TenantState, js: JobState, key: str, **req: Any) -> RolloutResult:
    """One rollout task on a SIM slot (taken from the fair share first, when there is one)."""
    if ctx.sim_slots is None:
        return await _run_rollout(ctx, t, js, key, **req)
    asked = time.time()
    async with ctx.sim_slots.slot(t.name) as place:
        req["ready_at"] = ready_from(req.get("ready_at", 0.0), asked, time.time(), place.freed_at)
        out = await _run_rollout(ctx, t, js, key, **req)
        place.ended_at = out.batch.ended_at if out.batch is not None else 0.0  # the next holder's start
        return out


async def _run_rollout(ctx: FlowContext, t: TenantState, js: JobState, key: str, **req: Any) -> RolloutResult:
    r = RolloutRequest(tenant=t.setup(), env=req.pop("env", None) or t.spec.env or "", job=js.job_id,
                       route=ctx.pool.route(t.name),
                       datapath=ctx.datapath, **req)
    return await ctx.runtime.run(tasks.RUN_ROLLOUT, r, key=key, resources={"SIM": 1})


def _spawn(coro) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coro)


async def _cancel_all(futs) -> None:
    for f in futs:
        f.cancel()
    if futs:
        await asyncio.gather(*futs, return_exceptions=True)


# SFT: ready batches from the offline dataset; back-pressure from the tenant's in-flight cap.
async def run_sft(ctx: FlowContext, js: JobState, t: TenantState) -> dict[str, Any]:
    spec = js.spec
    role = producer_role(js.job_id)
    ctx.health.register(role, "dataset")
    pending: set[asyncio.Task] = set()
    done_steps = 0
    js.progress.update(steps=0, version=t.version)
    # the held-out error costs several steps' compute (flow experts integrate an ODE): ~60 points a job
    heldout_every = max(10, spec.steps // 60)

    def harvest(finished: set[asyncio.Task]) -> None:
        nonlocal done_steps
        for f in sorted(finished, key=lambda f: f.result()["version"]):  # monotonic steps
            done_steps += 1
            ctx.log_update(js, f.result(), steps=done_steps)

    try:
        for k in range(spec.steps):
            await ctx.dispatcher.reserve(t.name)
            work = SFTWork(dataset=t.spec.dataset or "", step=k, batch_size=spec.batch_size,
                           eval_heldout=k == spec.steps - 1 or k % heldout_every == 0)
            item = TrainingItem(tenant=t.name, kind="sft", policy_version=t.version, work=work, job=js.job_id,
                                sync=ctx.sync_rule(live_consumers=False))
            pending.add(_spawn(ctx.dispatcher.submit(item)))
            ctx.health.progress(role, batches=k + 1)
            finished = {f for f in pending if f.done()}
            pending -= finished
            harvest(finished)
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            harvest(finished)
    finally:
        await _cancel_all(pending)
        ctx.health.remove(role)
    return {"version": t.version, "steps": done_steps, **js.progress}


# RL: rollouts of the current policy on SIM workers overlap with updates on the actor.
async def run_rl(ctx: FlowContext, js: JobState, t: TenantState) -> dict[str, Any]:
    spec = js.spec
    # GRPO's KL reference is the version the job starts from: retention keeps it while the job runs
    ref_version = t.version if spec.algorithm == "grpo" and spec.grpo.kl_coef > 0 else None
    if ref_version is None:
        return await _train_rl(ctx, js, t, None)
    await ctx.runtime.run(tasks.MARK_EVALUATION, t.output_dir, js.job_id, ref_version,
                          key=f"nexus-refmark-{js.job_id}", resources={"SIM": 1})
    try:
        out = await _train_rl(ctx, js, t, ref_version)
    except BaseException as e:
        if js.cancel_requested or not isinstance(e, asyncio.CancelledError):  # closing: the next boot unmarks
            await _unmark(ctx, t, js)
        raise
    await _unmark(ctx, t, js)
    return out


async def _train_rl(ctx: FlowContext, js: JobState, t: TenantState, ref_version: int | None) -> dict[str, Any]:
    spec = js.spec
    name = t.name
    role = producer_role(js.job_id)
    ctx.health.register(role, "rollout")
    tally, episodes, env_steps = UpdateTally(), 0, 0
    rollouts: dict[asyncio.Task, tuple[int, int]] = {}  # task -> (episode offset, attempt)
    items: set[asyncio.Task] = set()
    js.progress.update(updates=0, version=t.version, dropped_stale=0, episodes=0)
    # simulator vs action-wait time and round trips of this job's producers (nexus.sim.environment)
    producer_totals = dict.fromkeys(("sim_s", "action_wait_s", "requests", "rows", "timed", "rtt_s",
                                     "engine_wait_s", "compute_s", "messaging_s"), 0.0)

    ready = 0.0  # the last end of this job's batches and updates on the devices' clock (0: not said)

    def collect(offset: int, attempt: int) -> None:
        key = f"nexus-rollout-{js.job_id}-{offset}" + (f"-r{attempt}" if attempt else "")
        task = _spawn(_batch_rollout(ctx, t, js, key, episodes=spec.episodes_per_batch,
                                     seed=t.spec.seed * 1_000_003, offset=offset, group_size=spec.group_size,
                                     split=ctx.batch_split(spec.split, spec.episodes_per_batch, t.spec.env),
                                     ready_at=ready))
        rollouts[task] = (offset, attempt)

    if spec.group_size > 1:  # whole groups: offsets stay multiples of the group size
        t.episodes = -(-t.episodes // spec.group_size) * spec.group_size

    def work(batch) -> RLWork | GRPOWork:
        return tally.rl_work(batch, spec, queued=len(items), ref_version=ref_version)

    try:
        while tally.updates < spec.updates:
            while (len(rollouts) < spec.collectors and tally.updates + len(items) + len(rollouts) < spec.updates
                   and ctx.queue.reserve(name)):
                collect(t.episodes, 0)
                t.episodes += spec.episodes_per_batch
            if not rollouts and not items:
                await ctx.dispatcher.until_freed(name)
                continue
            finished, _ = await asyncio.wait(set(rollouts) | items, return_when=asyncio.FIRST_COMPLETED)
            for f in finished:
                if f in rollouts:
                    offset, attempt = rollouts.pop(f)
                    try:
                        out = f.result()
                    except Exception as e:
                        if attempt + 1 >= ctx.rollout_attempts:
                            ctx.queue.cancel_reservation(name)
                            ctx.dispatcher.notify_freed(name)
                            raise JobFailed(f"rollout of episodes {offset}.. failed {attempt + 1} times: "
                                            f"{type(e).__name__}: {e}") from e
                        ctx.health.error(role, f"rollout {offset}: {type(e).__name__}: {e}", restarting=True)
                        collect(offset, attempt + 1)  # same episodes, same seeds; keeps its admission slot
                        continue
                    assert out.batch is not None  # an RL rollout stores its batch
                    ready = max(ready, out.batch.ended_at)
                    ctx.health.progress(role, episodes=episodes + out.stats["episodes"])
                    episodes += out.stats["episodes"]
                    env_steps += out.stats["steps"]
                    for k in producer_totals:
                        producer_totals[k] += float(out.stats.get(k, 0.0))
                    ctx.log(js, {"return": out.stats["mean_return"], "success_rate": out.stats["success_rate"],
                                 **reward_terms(out.stats), "episodes": episodes, "env_steps": env_steps,
                                 **producer_totals,
                                 "version": out.batch.policy_version}, env_steps, "rollout")
                    item = TrainingItem(tenant=name, kind="rl", policy_version=out.batch.policy_version,
                                        work=work(out.batch), job=js.job_id,
                                        sync=ctx.sync_rule(live_consumers=True))
                    items.add(_spawn(ctx.dispatcher.submit(item)))
                else:
                    items.discard(f)
                    res = f.result()
                    ready = max(ready, float(res.get("ended_at", 0.0)))
                    ctx.rl_item_done(js, res, tally)
    finally:
        open_rollouts = list(rollouts)
        await _cancel_all(open_rollouts + list(items))
        for _ in open_rollouts:  # their slots were never turned into items
            ctx.queue.cancel_reservation(name)
        if open_rollouts:
            ctx.dispatcher.notify_freed(name)
        ctx.health.remove(role)
    return {"version": t.version, "updates": tally.updates, "dropped_stale": tally.dropped, "episodes": episodes,
            "env_steps": env_steps, **producer_totals,
            **{k: js.progress[k] for k in ("return", "success_rate") if k in js.progress},
            **reward_terms(js.progress)}


async def _batch_rollout(ctx: FlowContext, t: TenantState, js: JobState, key: str, episodes: int, offset: int,
                         group_size: int, split: int, **req: Any) -> RolloutResult:
    """One RL batch: ``episodes`` from ``offset`` in one rollout task, or split by whole groups over ``split`` tasks
    at once (the same episodes and seeds as one task's) whose stored parts form one batch."""
    unit = max(group_size, 1)
    groups = episodes // unit
    k = max(1, min(split, groups))
    if k == 1:
        return await _rollout(ctx, t, js, key, episodes=episodes, offset=offset, group_size=group_size, **req)
    shares = [g * unit for g in even_shares(groups, k)]
    starts = [offset + sum(shares[:i]) for i in range(k)]
    outs = await asyncio.gather(*(_rollout(ctx, t, js, f"{key}-p{i}", episodes=n, offset=o, group_size=group_size,
                                           **req) for i, (n, o) in enumerate(zip(shares, starts, strict=True))),
                                return_exceptions=True)
    failed = next((o for o in outs if isinstance(o, BaseException)), None)
    if failed is not None:  # the whole batch is collected again (same episodes, same seeds)
        raise failed
    return join_rollouts(outs)  # type: ignore[arg-type]


def join_rollouts(outs: list[RolloutResult]) -> RolloutResult:
    """The parts of one split batch as one rollout: counts and times summed, means weighted by episodes."""
    stats: dict[str, Any] = {}
    for o in outs:
        for k, v in o.stats.items():
            if isinstance(v, int | float):
                stats[k] = stats.get(k, 0) + v
    n = sum(o.stats["episodes"] for o in outs)
    if n and all("mean_length" in o.stats for o in outs):  # a per-episode mean besides merge_stats' two
        stats["mean_length"] = sum(o.stats["mean_length"] * o.stats["episodes"] for o in outs) / n
    stats |= merge_stats([o.stats for o in outs])
    batch = BatchRef.joined([o.batch for o in outs if o.batch is not None])
    return RolloutResult(stats=stats, versions=sorted({v for o in outs for v in o.versions}), batch=batch)


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Episode statistics of several rollout tasks, weighted by their episode counts."""
    n = sum(p["episodes"] for p in parts)
    if n == 0:
        return {"episodes": 0, "steps": 0, "mean_return": 0.0, "success_rate": 0.0}
    # a tenant's own reward: each term's mean per episode ("reward/<term>", nexus.sim.reward), in every part
    terms = [k for k in parts[0] if k.startswith(REWARD_PREFIX) and all(k in p for p in parts)]
    return {"episodes": n, "steps": sum(p["steps"] for p in parts),
            "mean_return": sum(p["mean_return"] * p["episodes"] for p in parts) / n,
            "success_rate": sum(p["success_rate"] * p["episodes"] for p in parts) / n,
            **{k: sum(p[k] * p["episodes"] for p in parts) / n for k in terms}}


def reward_terms(stats: dict[str, Any]) -> dict[str, float]:
    """The per-term rewards of a rollout's statistics (a tenant with its own reward), for its metrics."""
    return {k: float(v) for k, v in stats.items() if k.startswith(REWARD_PREFIX)}


# Eval: pins a version on every engine (present and future), runs inference + simulators only.
async def run_eval(ctx: FlowContext, js: JobState, t: TenantState) -> dict[str, Any]:
    spec = js.spec
    version = t.version if spec.version is None else spec.version
    # retention keeps every evaluated version: mark it before anything can prune it (refused if already pruned)
    mark = asyncio.ensure_future(ctx.runtime.run(tasks.MARK_EVALUATION, t.output_dir, js.job_id, version,
                                                 key=f"nexus-evalmark-{js.job_id}", resources={"SIM": 1}))
    try:
        await asyncio.shield(mark)  # cancelled meanwhile: the marking is let end (or stopped) before the unmarking
        return await _evaluate(ctx, js, t, version)
    except BaseException as e:  # failed or cancelled: no report, so the version need not outlive retention
        if js.cancel_requested or not isinstance(e, asyncio.CancelledError):  # closing: the next boot unmarks
            await _marking_ended(mark)
            await _unmark(ctx, t, js)
        raise


MARK_SETTLE_S = 1.0  # how long an unmarking waits for its marking task still in flight (a file write, once it runs)


async def _marking_ended(mark: asyncio.Future) -> None:
    """The marking task, which may still be in flight (its marker written on the worker, its result not back), ends
    before the unmarking — or, still queued for a simulator slot after :data:`MARK_SETTLE_S`, is cancelled before it
    runs: no marker is written after the unmarking."""
    if not mark.done():
        await asyncio.wait([mark], timeout=MARK_SETTLE_S)
    if not mark.done():
        mark.cancel()  # cancels its Dask task (``DaskRuntime.run``)
        await asyncio.wait([mark], timeout=MARK_SETTLE_S)
    if mark.done() and not mark.cancelled():
        mark.exception()  # read: a refused marking is the job's error already, not an unread task's


async def _unmark(ctx: FlowContext, t: TenantState, js: JobState) -> None:
    """The job's retention marker goes (an evaluation without its report; a GRPO job's KL reference)."""
    try:  # a worker handler, not a SIM task: it never waits behind rollouts for a simulator
        await asyncio.wait_for(ctx.runtime.io("unmark_evaluation", output_dir=t.output_dir, job=js.job_id), 30)
    except Exception as err:
        logger.warning("job %s: its retention marker stays (%s)", js.job_id, err)


async def _evaluate(ctx: FlowContext, js: JobState, t: TenantState, version: int) -> dict[str, Any]:
    spec = js.spec
    role = producer_role(js.job_id)
    ctx.health.register(role, "rollout")
    js.progress.update(version=version, episodes=0)
    suite = spec.protocol == "suite"
    # the suite protocol: part i is task i, its episodes reset with seeds 0..n-1 (initial states 0..n-1), at most
    # eval_fanout tasks at once; otherwise the episodes split over eval_fanout parts in the tenant's env
    task_envs = [e.name for e in catalog.suite_tasks(t.spec.env or "")] if suite else []
    if suite:
        task_envs = [task_envs[i] for i in spec.tasks] if spec.tasks is not None else task_envs
    n_tasks = len(task_envs) if suite else min(spec.episodes, max(1, ctx.eval_fanout))
    shares = [spec.initial_states] * n_tasks if suite else even_shares(spec.episodes, n_tasks)
    fanout = asyncio.Semaphore(max(1, ctx.eval_fanout))

    async def chunk(i: int, offset: int, n: int) -> RolloutResult:
        where = {"env": task_envs[i], "seed": 0} if suite else {"seed": 7_000_003 * (1 + t.spec.seed)}
        for attempt in range(ctx.rollout_attempts):
            key = f"nexus-eval-{js.job_id}-{i}-{offset}" + (f"-r{attempt}" if attempt else "")
            try:
                out = await _rollout(ctx, t, js, key, episodes=n, **where,
                                     offset=offset, deterministic=spec.deterministic, version=version)
                ctx.health.progress(role)
                return out
            except Exception as e:
                if attempt + 1 >= ctx.rollout_attempts:
                    raise JobFailed(f"evaluation rollout {i} failed {attempt + 1} times: "
                                    f"{type(e).__name__}: {e}") from e
                ctx.health.error(role, f"eval rollout {i}: {type(e).__name__}: {e}", restarting=True)
        raise AssertionError("unreachable")

    async def part(i: int, n: int) -> list[RolloutResult]:
        """Part ``i``'s episodes in tasks of at most ``sim_task_episodes``, one after another: between two
        of them its SIM slot may go to another tenant (the fair share's preemption point)."""
        start, outs = 0 if suite else sum(shares[:i]), []
        async with fanout:
            for offset in range(start, start + n, ctx.sim_task_episodes):
                outs.append(await chunk(i, offset, min(ctx.sim_task_episodes, start + n - offset)))
                js.progress["episodes"] = js.progress.get("episodes", 0) + outs[-1].stats["episodes"]
        return outs

    await ctx.pool.pin(t.name, version, t.output_dir)
    parts = [_spawn(part(i, n)) for i, n in enumerate(shares)]
    try:
        by_part = await asyncio.gather(*parts)
    finally:
        await _cancel_all([p for p in parts if not p.done()])
        await ctx.pool.unpin(t.name, version)
        ctx.health.remove(role)
    outs = [o for part_outs in by_part for o in part_outs]
    stats = merge_stats([o.stats for o in outs])
    versions_seen = sorted({v for o in outs for v in o.versions})
    report = {"tenant": t.name, "job": js.job_id, "version": version, "versions_seen": versions_seen, **stats}
    if suite:  # the papers' table: success per task and the average over tasks
        report["protocol"] = "suite"
        entries = [catalog.env(name) for name in task_envs]
        report["tasks"] = [{"task": e.options.get("task"), "env": e.name, "instruction": e.schema.instruction,
                            "initial_states": list(range(spec.initial_states)),
                            "max_episode_steps": e.max_episode_steps, **merge_stats([o.stats for o in p])}
                           for e, p in zip(entries, by_part, strict=True)]
        report["average_success_rate"] = sum(x["success_rate"] for x in report["tasks"]) / len(report["tasks"])
    report["report_path"] = await ctx.runtime.run(tasks.WRITE_EVAL_REPORT, t.output_dir, report,
                                                  key=f"nexus-evalreport-{js.job_id}", resources={"SIM": 1})
    ctx.log(js, {"success_rate": stats["success_rate"], "return": stats["mean_return"],
                 "episodes": stats["episodes"], **reward_terms(stats)}, version, "eval")
    return report


async def run_op(ctx: FlowContext, t: TenantState, work: OpWork, data: Any) -> dict[str, Any]:
    """One low-level op (Tinker-style), ordered with the tenant's other training items."""
    await ctx.dispatcher.reserve(t.name)
    item = TrainingItem(tenant=t.name, kind="op", policy_version=t.version, work=work, data=data)
    return await ctx.dispatcher.submit(item)
