"""Low-level (Tinker-style) routes: forward_backward, forward, optim_step, save/load_state, save_weights."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field

from nexus.gateway.contract import OVERLOADED_RESPONSE
from nexus.gateway.routes.common import GW, OpSession, Who
from nexus.gateway.state import StrictBody
from nexus.spec import AdamParams, check_state_name
from nexus.wire.inputs import check_batch


class ForwardBackwardBody(StrictBody):
    batch: dict[str, Any] = Field(description="observations (list), actions [N, A]; ppo: logprobs, advantages, "
                                              "returns (+ ppo config); grpo: logprobs, advantages (+ ref_logprobs, "
                                              "grpo config). Arrays as nested lists or {dtype, shape, b64}")
    loss: Literal["sft", "ppo", "grpo"] = "sft"


class ForwardBody(StrictBody):
    batch: dict[str, Any] = Field(description="observations (list), actions [N, A]: their log-probabilities, the "
                                              "policy's entropies and values, on the current weights, no gradient")


class OptimStepBody(StrictBody):
    adam: AdamParams | None = Field(None, description="this step's Adam settings; unset: the tenant's own")


class StateBody(StrictBody):
    name: str = Field(min_length=1, max_length=64, description="the saved state's name (letters, digits, . - _)")


router = APIRouter()


@router.post("/v1/tenants/{tenant}/forward_backward", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def forward_backward(tenant: str, body: ForwardBackwardBody, who: Who, gw: GW,
                           session: OpSession) -> dict[str, Any]:
    """Accumulate gradients of ``loss`` on a self-contained batch (goes to the actor worker directly)."""
    who.may_act_on(tenant)
    spec, schema = await gw.spec_schema(tenant)
    lim = gw.limits(tenant)
    if spec is not None:
        batch = await asyncio.to_thread(check_batch, body.batch, schema, body.loss, chunk=spec.chunk,
                                        max_rows=lim.max_batch_rows,
                                        max_instruction_chars=lim.max_instruction_chars)
    else:  # the actor checks it against the slot
        batch = body.batch
    async with gw.queued(tenant):
        return await gw.backend.op(tenant, "forward_backward", batch, body.loss, session)


@router.post("/v1/tenants/{tenant}/forward", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def forward(tenant: str, body: ForwardBody, who: Who, gw: GW, session: OpSession) -> dict[str, Any]:
    """Without a gradient, ordered with the tenant's training calls: each row's log-probability of its action
    (``outputs.logprobs``), the policy's entropy and value there."""
    who.may_act_on(tenant)
    spec, schema = await gw.spec_schema(tenant)
    lim = gw.limits(tenant)
    batch = body.batch
    if spec is not None:
        batch = await asyncio.to_thread(check_batch, body.batch, schema, "sft", chunk=spec.chunk,
                                        max_rows=lim.max_batch_rows,
                                        max_instruction_chars=lim.max_instruction_chars)
    async with gw.queued(tenant):
        return await gw.backend.op(tenant, "forward", batch, session=session)


@router.post("/v1/tenants/{tenant}/optim_step", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def optim_step(tenant: str, who: Who, gw: GW, session: OpSession, body: OptimStepBody | None = None
                     ) -> dict[str, Any]:
    """Apply the accumulated gradients; ``adam``: this step's Adam settings (Tinker's ``AdamParams``)."""
    who.may_act_on(tenant)
    adam = body.adam.model_dump(exclude_none=True) if body is not None and body.adam is not None else None
    async with gw.queued(tenant):
        return await gw.backend.op(tenant, "optim_step", session=session, **({"adam": adam} if adam else {}))


@router.post("/v1/tenants/{tenant}/save_state", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def save_state(tenant: str, body: StateBody, who: Who, gw: GW, session: OpSession) -> dict[str, Any]:
    """Save the training state (head, adapter, optimizer state) under ``name`` in the tenant's ``states/``
    (a state of that name is replaced); it is not a policy version."""
    who.may_act_on(tenant)
    name = check_state_name(body.name)
    await gw.check_storage(tenant, await gw.output_dir(tenant))
    async with gw.queued(tenant):
        return await gw.backend.op(tenant, "save_state", session=session, name=name)


@router.post("/v1/tenants/{tenant}/load_state", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def load_state(tenant: str, body: StateBody, who: Who, gw: GW, session: OpSession) -> dict[str, Any]:
    """Back to a saved training state; the version does not move back (``save_weights`` publishes the loaded
    weights as a new version)."""
    who.may_act_on(tenant)
    name = check_state_name(body.name)
    async with gw.queued(tenant):
        return await gw.backend.op(tenant, "load_state", session=session, name=name)


@router.post("/v1/tenants/{tenant}/save_weights", tags=["low level"], responses={429: OVERLOADED_RESPONSE})
async def save_weights(tenant: str, who: Who, gw: GW, session: OpSession) -> dict[str, Any]:
    """Publish the current head as a new policy version."""
    who.may_act_on(tenant)
    await gw.check_storage(tenant, (await gw.backend.tenant_view(tenant))["output_dir"])
    async with gw.queued(tenant):
        return await gw.backend.op(tenant, "save_weights", session=session)
