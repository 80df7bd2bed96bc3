"""Low-level, Tinker-style operations (``forward_backward``, ``forward``, ``optim_step``, ``save_weights``,
``save_state``, ``load_state``), ordered through the training queue like every update.

``data`` names a dataset the client published on the cluster (its payload never passes through the
scheduler); ``session`` is the calling client's connection id (``Nexus.session``; None: the tenant's
default session). A session's ops are one MLflow run (:mod:`nexus.control.jobs.op_runs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from nexus.control.jobs import flows
from nexus.control.tenants.registry import TenantPhase
from nexus.data.output_dir import TenantOutputDir
from nexus.errors import SpecError, describe_errors, quote
from nexus.spec import OPS, AdamParams, check_session, check_state_name
from nexus.wire.messages import OpWork

if TYPE_CHECKING:
    from nexus.control.jobs.op_runs import OpRuns
    from nexus.control.runtime import DaskRuntime
    from nexus.control.tenants.registry import TenantRegistry


class LowLevelOps:
    def __init__(self, registry: TenantRegistry, runtime: DaskRuntime, ctx: flows.FlowContext, op_runs: OpRuns) -> None:
        self.registry = registry
        self.runtime = runtime
        self.ctx = ctx
        self.op_runs = op_runs

    async def run(self, tenant: str, verb: str, data: str | None = None, loss: str = "sft",
                  session: str | None = None, adam: dict[str, Any] | None = None,
                  name: str | None = None) -> dict[str, Any]:
        """``adam``: an ``optim_step``'s Adam settings (:class:`nexus.spec.AdamParams`); ``name``: the state of a
        ``save_state`` / ``load_state``."""
        work = op_work(verb, loss, adam, name)
        session = check_session(session)
        t = self.registry.get(tenant)
        client = await self.runtime.client()
        fut = None
        if verb in ("forward_backward", "forward"):
            if data is None:
                raise SpecError(f"{verb} needs a batch")
            fut = await client.get_dataset(data)
        token, res = self.op_runs.begin(tenant, session), None
        try:
            res = await flows.run_op(self.ctx, t, work, fut)
        finally:  # a deleted tenant's op is not recorded
            alive = self.registry.find(tenant) is t and t.phase != TenantPhase.DELETING
            self.op_runs.finish(token, verb, res if alive else None, lambda: t.spec.model_dump(),
                                lambda v: str(TenantOutputDir(t.output_dir).weights_path(v)))
        if data is not None:
            await client.unpublish_dataset(data)
        return res


def op_work(verb: str, loss: str = "sft", adam: dict[str, Any] | None = None, name: str | None = None) -> OpWork:
    """A checked op: its verb, the loss of a ``forward_backward``, an ``optim_step``'s Adam settings, a state's
    name (a bad one is a SpecError)."""
    if verb not in OPS:
        raise SpecError(f"unknown op {quote(verb)}: one of {', '.join(OPS)}")
    if verb == "forward_backward" and loss not in ("sft", "ppo", "grpo"):
        raise SpecError(f"unknown loss {quote(loss)}: 'sft', 'ppo' or 'grpo'")
    if adam is not None:
        if verb != "optim_step":
            raise SpecError(f"adam: only optim_step takes Adam settings, not {verb}")
        try:
            adam = AdamParams.model_validate(adam).model_dump(exclude_none=True)
        except ValidationError as e:
            raise SpecError(f"adam: {describe_errors(e.errors(), root='adam')}") from None
    if verb in ("save_state", "load_state"):
        name = check_state_name(name)
    return OpWork(verb, loss, adam or None, name)  # type: ignore[arg-type]
