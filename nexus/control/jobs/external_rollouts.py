"""External rollouts: an RL job trained on episodes the tenant uploads from its own environment or robot.

The tenant acts with the service's policy (``predict``: action, log-probability, value and the version they
came from), steps its own env, and uploads finished episodes; the gateway stores each upload in the tenant's
Arrow trajectory store (on a ``SIM`` worker) and hands the batch reference to the job here
(``nexus_feed_rollouts``). The job turns each upload into one training item with the batch's oldest policy
version, so the training queue's staleness filter (``max_staleness``) drops an upload that lags too far, as it
drops the service's own rollouts. An upload waits while the job already holds ``MAX_PENDING`` untrained ones
(back-pressure: the tenant's loop slows down instead of producing stale data).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nexus.control.dispatch.training_queue import TrainingItem
from nexus.control.jobs.flows import UpdateTally
from nexus.errors import Conflict
from nexus.wire.messages import BatchRef

if TYPE_CHECKING:
    from nexus.control.jobs.flows import FlowContext
    from nexus.control.jobs.state import JobState
    from nexus.control.tenants.registry import TenantState

MAX_PENDING = 2  # uploads a job holds before it trains them
FEED_WAIT_S = 300.0  # an upload waits this long for room, then is refused (Conflict: try again)


@dataclass
class _Inbox:
    tenant: str
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_PENDING))
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # the job ended: waiting uploads are refused


class ExternalRollouts:
    """The running RL jobs that take uploaded episodes, by job id."""

    def __init__(self) -> None:
        self.inboxes: dict[str, _Inbox] = {}

    async def feed(self, tenant: str, job: str, batch: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
        """Hand a stored upload to its job (waits while the job holds ``MAX_PENDING`` untrained uploads)."""
        box = self.inboxes.get(job)
        if box is None or box.tenant != tenant:
            raise Conflict(f"job {job[:80]!r} of tenant {tenant!r} takes no episodes now: it is not a running RL job "
                           "with rollouts='external' (finished, cancelled or still queued)")
        ref = BatchRef.from_dict(batch)
        if ref.tenant != tenant:
            raise Conflict(f"a batch of tenant {ref.tenant!r} fed to a job of tenant {tenant!r}")
        put = asyncio.ensure_future(box.queue.put((ref, dict(stats))))
        closed = asyncio.ensure_future(box.closed.wait())
        done, pending = await asyncio.wait({put, closed}, timeout=FEED_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        for f in pending:
            f.cancel()
        if put not in done:
            why = "ended" if closed in done else f"still holds {MAX_PENDING} untrained uploads after {FEED_WAIT_S:g} s"
            raise Conflict(f"job {job!r} {why}; the upload is stored in the trajectory store but not trained on")
        return {"job": job, "accepted": True, "rows": ref.rows, "episodes": ref.episodes,
                "policy_version": ref.policy_version, "pending": box.queue.qsize()}

    async def run(self, ctx: FlowContext, js: JobState, t: TenantState) -> dict[str, Any]:
        """The job's flow: each upload becomes a training item (PPO on the uploaded batch) until ``updates``
        updates are done; uploads dropped as stale count in ``dropped_stale``."""
        spec, name = js.spec, t.name
        box = self.inboxes[js.job_id] = _Inbox(name)
        tally, episodes, env_steps, uploads = UpdateTally(), 0, 0, 0
        items: set[asyncio.Task] = set()
        js.progress.update(updates=0, version=t.version, dropped_stale=0, episodes=0, uploads=0)
        get: asyncio.Task | None = None
        try:
            while tally.updates < spec.updates:
                if get is None and tally.updates + len(items) < spec.updates:
                    get = asyncio.get_running_loop().create_task(box.queue.get())
                waiting = items | ({get} if get is not None else set())
                finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if get in finished:
                    ref, stats = get.result()
                    get = None
                    uploads += 1
                    episodes += int(stats.get("episodes", ref.episodes))
                    env_steps += int(stats.get("steps", ref.rows))
                    ctx.log(js, {"return": stats.get("mean_return"), "success_rate": stats.get("success_rate"),
                                 "episodes": episodes, "env_steps": env_steps, "uploads": uploads,
                                 "version": ref.policy_version}, env_steps, "rollout")
                    await ctx.dispatcher.reserve(name)
                    item = TrainingItem(tenant=name, kind="rl", policy_version=ref.policy_version,
                                        work=tally.rl_work(ref, spec, queued=len(items)), job=js.job_id,
                                        sync=ctx.sync_rule(live_consumers=True))
                    items.add(asyncio.get_running_loop().create_task(ctx.dispatcher.submit(item)))
                for f in finished & items:
                    items.discard(f)
                    ctx.rl_item_done(js, f.result(), tally)
        finally:
            self.inboxes.pop(js.job_id, None)
            box.closed.set()
            pending = list(items) + ([get] if get is not None else [])
            for f in pending:
                f.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return {"version": t.version, "updates": tally.updates, "dropped_stale": tally.dropped, "episodes": episodes,
                "env_steps": env_steps, "uploads": uploads,
                **{k: js.progress[k] for k in ("return", "success_rate") if k in js.progress}}
