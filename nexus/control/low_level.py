"""Low-level, Tinker-style operations (``forward_backward``, ``optim_step``, ``save_weights``), ordered
through the training queue like every update.

``data`` names a dataset the client published on the cluster (its payload never passes through the
scheduler); ``session`` is the calling client's connection id (``Nexus.session``; None: the tenant's
default session). A session's ops are one MLflow run (:mod:`nexus.control.op_runs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nexus.control import flows
from nexus.control.tenants import TenantPhase
from nexus.data.output_dir import TenantOutputDir
from nexus.errors import SpecError
from nexus.spec import check_session

if TYPE_CHECKING:
    from nexus.control.op_runs import OpRuns
    from nexus.control.runtime import DaskRuntime
    from nexus.control.tenants import TenantRegistry


class LowLevelOps:
    def __init__(self, registry: TenantRegistry, runtime: DaskRuntime, ctx: flows.FlowContext, op_runs: OpRuns) -> None:
        self.registry = registry
        self.runtime = runtime
        self.ctx = ctx
        self.op_runs = op_runs

    async def run(self, tenant: str, verb: str, data: str | None = None, loss: str = "sft",
                  session: str | None = None) -> dict[str, Any]:
        if verb not in ("forward_backward", "optim_step", "save_weights"):
            raise SpecError(f"unknown op {verb!r}: forward_backward, optim_step or save_weights")
        if verb == "forward_backward" and loss not in ("sft", "ppo", "grpo"):
            raise SpecError(f"unknown loss {loss!r}: 'sft', 'ppo' or 'grpo'")
        session = check_session(session)
        t = self.registry.get(tenant)
        client = await self.runtime.client()
        fut = None
        if verb == "forward_backward":
            if data is None:
                raise SpecError("forward_backward needs a batch")
            fut = await client.get_dataset(data)
        token, res = self.op_runs.begin(tenant, session), None
        try:
            res = await flows.run_op(self.ctx, t, verb, loss, fut)
        finally:  # a deleted tenant's op is not recorded
            alive = self.registry.find(tenant) is t and t.phase != TenantPhase.DELETING
            self.op_runs.finish(token, verb, res if alive else None, lambda: t.spec.model_dump(),
                                lambda v: str(TenantOutputDir(t.output_dir).weights_path(v)))
        if data is not None:
            await client.unpublish_dataset(data)
        return res
