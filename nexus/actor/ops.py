"""Low-level, Tinker-style ops on a tenant's slot: ``forward_backward`` (loss ``sft``, ``ppo`` or ``grpo``
on a self-contained batch: observations + actions [+ the RL fields]), ``forward`` (no gradient: the log-probs,
entropies and values of given actions), ``optim_step`` (with one step's ``AdamParams``), ``save_weights``,
``save_state`` / ``load_state`` (head, adapter and optimizer state under a name, in the tenant's ``states/``).

The batch is checked (``nexus.wire.inputs.check_batch``) before it touches the slot, and a loss that is not
finite is refused before its backward: a bad batch is a ``SpecError`` and the slot's gradients and version
stay as they were.
"""

from __future__ import annotations

from typing import Any

import torch

from nexus.actor.host import ActorHost
from nexus.actor.tenant_slot import TenantSlot
from nexus.algorithms.grpo import GRPOConfig, grpo_loss
from nexus.algorithms.learner import LossFn
from nexus.algorithms.ppo import PPOConfig, normalized_advantages, ppo_loss
from nexus.algorithms.sft import sft_loss
from nexus.algorithms.shards import shard
from nexus.data.output_dir import TenantOutputDir
from nexus.errors import Conflict, NotFound, SpecError
from nexus.spec import check_state_name
from nexus.wire.engine_client import EngineSet
from nexus.wire.inputs import check_batch
from nexus.wire.messages import OpWork

STATES = "states"  # a tenant's saved training states: <output dir>/states/<name>/ (DeepSpeed checkpoint tags)


def _finite(loss_fn: LossFn, loss: str) -> LossFn:
    """Refuse before backward: gradients of a NaN loss would poison the slot."""
    def run(policy):
        value, stats = loss_fn(policy)
        if not bool(torch.isfinite(value)):
            raise SpecError(f"batch: the {loss} loss is {float(value)} on this batch; nothing was accumulated")
        return value, stats
    return run


def forward_backward(actor: ActorHost, slot: TenantSlot, loss: str, batch: Any) -> dict[str, float]:
    """The loss of a client's batch backpropagated into the slot (gradients wait for ``optim_step``): every rank
    checks the whole batch, then computes its shard of it (``nexus.algorithms.shards``)."""
    limits = actor.config.limits_for(slot.name)
    data = check_batch(batch, slot.schema, loss, chunk=slot.chunk,
                       max_rows=limits.max_batch_rows, max_instruction_chars=limits.max_instruction_chars)
    part = shard(len(data["observations"]), slot.rank, slot.world_size)
    rows = torch.as_tensor(part.rows)
    feats, proprio = actor.features(slot.name, [data["observations"][i] for i in part.rows])
    actions = torch.as_tensor(data["actions"])[rows]
    t = {k: torch.as_tensor(v) for k, v in data.items() if k in ("logprobs", "advantages", "returns", "ref_logprobs")}
    gcfg = GRPOConfig(**data.get("grpo", {})) if loss == "grpo" else None
    cfg = PPOConfig(**data.get("ppo", {})) if loss == "ppo" else None
    if cfg is not None:  # normalized over the whole batch, whichever rank computes a row
        t["advantages"], cfg = normalized_advantages(t["advantages"].float(), cfg)
    t = {k: v[rows] for k, v in t.items()}

    def fn(policy):
        if loss == "sft":
            return sft_loss(policy, feats, proprio, actions)
        if loss == "grpo":  # advantages: group-relative (nexus.algorithms.grpo.group_advantages)
            return grpo_loss(policy, feats, proprio, actions, t["logprobs"], t["advantages"], gcfg,
                             t.get("ref_logprobs"))
        return ppo_loss(policy, feats, proprio, actions, t["logprobs"], t["advantages"], t["returns"], cfg)

    return {k: float(v) for k, v in slot.forward_backward(_finite(fn, loss), part.share).items()}


def forward(actor: ActorHost, slot: TenantSlot, batch: Any) -> dict[str, Any]:
    """Without gradients, on the slot's current weights (saved or not): each row's log-probability of its given
    action, the policy's entropy and value there. Every rank computes the whole (small) batch."""
    limits = actor.config.limits_for(slot.name)
    data = check_batch(batch, slot.schema, "sft", chunk=slot.chunk, max_rows=limits.max_batch_rows,
                       max_instruction_chars=limits.max_instruction_chars)
    feats, proprio = actor.features(slot.name, list(data["observations"]))
    slot.policy.eval()
    with torch.no_grad():
        logprob, entropy, value = slot.policy.evaluate(feats, proprio, torch.as_tensor(data["actions"]))
    return {"logprobs": logprob.float().tolist(), "entropies": entropy.float().tolist(),
            "values": value.float().tolist()}  # plain lists: the answer travels on to the gateway as msgpack


def run_op(actor: ActorHost, slot: TenantSlot, work: OpWork, batch: Any, out: TenantOutputDir,
           engines: EngineSet) -> tuple[int, dict[str, float], dict[str, Any] | None]:
    """One op -> (the slot's version, metrics, per-row outputs of a ``forward``). ``save_weights`` publishes a
    version (always pushed); ``load_state`` changes the slot's weights without one (``save_weights`` publishes)."""
    if work.op == "forward_backward":
        return slot.version, forward_backward(actor, slot, work.loss, batch), None
    if work.op == "forward":
        rows = forward(actor, slot, batch)
        stats = {"rows": float(len(rows["logprobs"])), "mean_logprob": sum(rows["logprobs"]) / len(rows["logprobs"])}
        return slot.version, stats, rows
    if work.op == "optim_step":
        if slot.pending_backward == 0:
            raise Conflict(f"tenant {slot.name!r}: optim_step without a forward_backward since the last step")
        return slot.version, {k: float(v) for k, v in slot.optim_step(work.adam).items()}, None
    if work.op in ("save_state", "load_state"):
        return slot.version, state_op(slot, work.op, check_state_name(work.name), out), None
    version, metrics = actor.publish(slot, out, engines, "save_weights")  # explicit: always pushed
    return version, metrics, None


def state_op(slot: TenantSlot, op: str, name: str, out: TenantOutputDir) -> dict[str, float]:
    """Save or load the slot's training state ``name`` (every rank: its optimizer partition)."""
    directory = out.path / STATES
    if op == "save_state":
        slot.save_state(str(directory), name)
        return {"state_bytes": float(sum(p.stat().st_size for p in (directory / name).rglob("*") if p.is_file()))}
    if not (directory / name).is_dir():
        raise NotFound(f"tenant {slot.name!r} has no saved state {name!r} (save_state names one)")
    if slot.pending_backward:
        raise Conflict(f"tenant {slot.name!r}: {slot.pending_backward} forward_backward call(s) wait for an "
                       "optim_step; step (or save them as a state) before load_state")
    slot.load_state(str(directory), name)
    return {"loaded": 1.0}
