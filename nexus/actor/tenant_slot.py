"""One tenant's slot on the training (actor) side: its policy, its own DeepSpeed engine, its version.

The frozen backbone stays outside every engine (features come in precomputed); each tenant gets a
separate ZeRO engine around its small ``TenantPolicy`` (any action-module family: OFT, GR00T, π) so a
step of one tenant can never touch another tenant's parameters or optimizer state.

Constraints the caller must respect:

- DeepSpeed collectives (construction, ``forward_backward`` and ``optim_step``, ``save_checkpoint``,
  ``load_checkpoint``) must be issued by every rank for the same tenant in the same order; with one
  process (the default here) this is free. With N ranks each rank computes its shard of a batch and
  passes its ``share`` of the rows: losses are scaled so DeepSpeed's gradient average is the batch's mean,
  and the ranks compare outcomes before the backward, so an error on one rank is raised on all.
- A slot is not thread-safe: drive all slots of a process from one thread (e.g. one actor task at a time).
- Gradient accumulation is owned by the caller: the engine runs with
  ``managed_gradient_accumulation=false``, so any number of ``forward_backward`` calls *sum* their
  gradients and the next ``optim_step`` applies them (scale each loss by 1/k for a mean).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nexus.actor.process_group import (
    agreed_error,
    deepspeed,
    ensure_distributed,
    gather_objects,
    portable,
    weighted,
    world,
)
from nexus.actor.zero_memory import bucket_elements, drop_hp_links, slim_engine
from nexus.features import Observation, TenantSchema
from nexus.model.backbone_features import BackboneFeatures
from nexus.model.policy import TenantPolicy
from nexus.spec import TenantSpec

if TYPE_CHECKING:
    from nexus.model.framework import VLAFramework

__all__ = ["TenantSlot", "ensure_distributed", "grouped_forward_backward"]

LossFn = Callable[[TenantPolicy], tuple[torch.Tensor, dict[str, Any]]]
# a tenant's loss on its rows of a grouped forward: (policy, its features, its proprio) -> (loss, stats)
GroupLossFn = Callable[[TenantPolicy, BackboneFeatures, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


class TenantSlot:
    """A tenant's policy wrapped in its own DeepSpeed ZeRO engine (ZeRO-2 by default)."""

    def __init__(self, spec: TenantSpec, schema: TenantSchema, feat_dim: int, zero_stage: int = 2,
                 grad_clip: float = 1.0, chunk: int | None = None,
                 lora_shapes: dict[str, tuple[int, int]] | None = None,
                 init_state: dict[str, torch.Tensor] | None = None) -> None:
        """``chunk`` defaults to ``spec.chunk``. A LoRA tenant needs ``lora_shapes`` (the backbone's
        ``lora_shapes(spec.lora)``): its adapter is part of the policy, so the engine owns the adapter's
        parameters and optimizer state too. ``init_state`` (a policy state_dict, e.g. from an exported
        policy) is loaded before the engine is built, so the optimizer's master copy starts from it."""
        if zero_stage not in (0, 1, 2):
            # Stage 3 would partition the head's parameters between forwards, but TenantPolicy reads
            # log_std and the flow experts their position tables outside a submodule forward; heads are
            # small, stages 1-2 already shard optimizer state.
            raise ValueError(f"zero_stage must be 0, 1 or 2, got {zero_stage}")
        ensure_distributed()
        chunk = spec.chunk if chunk is None else chunk
        self.spec, self.schema, self.feat_dim, self.chunk = spec, schema, feat_dim, chunk
        policy = TenantPolicy.from_spec(spec, schema, feat_dim, chunk=chunk, lora_shapes=lora_shapes)
        if init_state is not None:
            policy.load_state_dict(init_state)
        bucket = bucket_elements(list(policy.parameters()))
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,  # nominal: we call backward/step ourselves
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,  # caller owns the boundary: k backward()s, then step()
            # buckets sized to this slot's parameters (one bucket, as with the defaults): zero_memory
            "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": bucket,
                                  "allgather_bucket_size": bucket},
            # torch_adam: torch.optim.AdamW inside DeepSpeed, no C++ op compilation.
            "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "weight_decay": spec.weight_decay,
                                                      "torch_adam": True}},
            "gradient_clipping": float(grad_clip),
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(model=policy, config=config,
                                                    model_parameters=list(policy.parameters()),
                                                    dist_init_required=False)
        # ZeRO's fp32 master a view of the fp32 weights, no per-parameter links, one parsed config: zero_memory
        slim_engine(self.engine)
        self.policy: TenantPolicy = self.engine.module
        self.rank, self.world_size = world()
        self.version: int = 0
        self.checkpoint_version: int | None = None  # the version of the last checkpoint saved or loaded
        self._pending_backward = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pending_backward(self) -> int:
        """``forward_backward`` calls whose gradients wait for the next ``optim_step``."""
        return self._pending_backward

    @property
    def device(self) -> torch.device:
        return self.policy.device

    # -- training -------------------------------------------------------------------------------------

    def forward_backward(self, loss_fn: LossFn, share: float = 1.0) -> dict[str, float]:
        """Run ``loss_fn(policy)`` and backpropagate its loss; gradients add up until ``optim_step``.

        ``share``: this rank's fraction of the batch's rows (``loss_fn`` sees only those; 0 for a rank that
        recomputes a stand-in row so that every rank runs the same graph). Returns the batch's stats (each
        rank's mean weighted by its share). A LoRA tenant's features (``DeferredFeatures``) are computed
        inside, through its adapter, so the backward reaches the adapter through the frozen backbone."""
        self.policy.train()
        if self.world_size == 1:
            loss, stats = loss_fn(self.policy)
            self.backward(loss)
            out = {k: float(v) for k, v in stats.items()}
            out["loss"] = float(loss.detach())
            return out
        error: Exception | None = None
        mine: dict[str, float] = {}
        try:
            loss, stats = loss_fn(self.policy)
            mine = {**{k: float(v) for k, v in stats.items()}, "loss": float(loss.detach())}
        except Exception as e:  # compared with the other ranks first: all raise, or none
            error = e
        outcomes = gather_objects((portable(error), mine, share))
        failed = agreed_error(error, [o[0] for o in outcomes])
        if failed is not None:
            raise failed
        # DeepSpeed averages gradients over the ranks: scaled by share * N, the average is the batch's mean
        self.backward(loss * (share * self.world_size))
        return weighted([(o[1], o[2]) for o in outcomes])

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` through this tenant's engine (gradients add up until ``optim_step``)."""
        self.engine.backward(loss)
        self._pending_backward += 1

    def optim_step(self, adam: dict[str, float | None] | None = None) -> dict[str, float]:
        """Apply the accumulated gradients (clipped to ``grad_clip``) and clear them. ``adam``: this step's Adam
        settings (``nexus.spec.AdamParams`` fields; unset ones keep the slot's own), restored after the step."""
        if self._pending_backward == 0:
            raise RuntimeError(f"tenant {self.name!r}: optim_step() without a forward_backward() "
                               "since the last step")
        groups = self.engine.optimizer.param_groups
        kept = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in groups]
        for g in groups if adam else ():
            beta1, beta2 = adam.get("beta1"), adam.get("beta2")  # type: ignore[union-attr]
            g["betas"] = (g["betas"][0] if beta1 is None else beta1, g["betas"][1] if beta2 is None else beta2)
            for ours, torchs in (("learning_rate", "lr"), ("eps", "eps"), ("weight_decay", "weight_decay")):
                if adam.get(ours) is not None:  # type: ignore[union-attr]
                    g[torchs] = adam[ours]  # type: ignore[index]
        lr = float(self.engine.get_lr()[0])  # this step's
        try:
            self.engine.step()
        finally:
            for g, k in zip(groups, kept, strict=True):
                g.update(k)
        self._pending_backward = 0
        grad_norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr,
                "optimizer_steps": float(self.engine.global_steps)}

    @contextmanager
    def lr_scaled(self, scale: float) -> Iterator[None]:
        """Steps inside the block run at ``scale`` x the slot's learning rate (an RL job's ``anneal_lr``); restored
        after."""
        groups = self.engine.optimizer.param_groups
        kept = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * scale
        try:
            yield
        finally:
            for g, lr in zip(groups, kept, strict=True):
                g["lr"] = lr

    def close(self) -> None:
        """Free the engine: DeepSpeed's gradient hooks live in autograd's C++ graph, where Python's garbage
        collector cannot see the cycle through them, so a dropped slot would otherwise never be freed."""
        self.engine.destroy()

    def train_step(self, loss_fn: LossFn, share: float = 1.0) -> dict[str, float]:
        return {**self.forward_backward(loss_fn, share), **self.optim_step()}

    def combine(self, stats: dict[str, float], share: float) -> dict[str, float]:
        """Stats of this rank's shard of a batch -> the batch's (a collective with N ranks)."""
        if self.world_size == 1:
            return stats
        return weighted(gather_objects((stats, share)))

    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state this rank holds for the tenant, measured from the tensors: AdamW's
        moments and ZeRO's fp32 master partition where it has storage of its own (ZeRO 1-2 partition both
        across the ranks; an fp32 head's master is a view of its weights, ``zero_memory.share_fp32_master``)."""
        zero = self.engine.optimizer
        inner = getattr(zero, "optimizer", zero)
        tensors = [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        weights = {p.untyped_storage().data_ptr() for p in self.policy.parameters()}
        tensors += [t for t in getattr(zero, "single_partition_of_fp32_groups", [])
                    if t.untyped_storage().data_ptr() not in weights]
        return sum(t.numel() * t.element_size() for t in tensors)

    def bump_version(self) -> int:
        self.version += 1
        return self.version

    # -- weights and checkpoints ---------------------------------------------------------------------

    def export_weights(self) -> bytes:
        """The full policy state_dict (ZeRO 0-2 keep full replicas in the module) as torch.save bytes."""
        state = {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()}
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def save_checkpoint(self, directory: str) -> str:
        """Params + optimizer state under tag ``v{version}`` (collective); returns the tag's directory."""
        tag = f"v{self.version}"
        self.engine.save_checkpoint(directory, tag=tag, client_state={"version": self.version})
        if self.engine.global_rank == 0:
            Path(directory, "version").write_text(f"{self.version}\n")
        self.checkpoint_version = self.version
        return os.path.join(directory, tag)

    def save_state(self, directory: str, name: str) -> None:
        """The training state (params, adapter, optimizer state) under ``name`` (collective); the version and the
        checkpoint bookkeeping stay as they are (a state is not a version)."""
        self.engine.save_checkpoint(directory, tag=name, client_state={"version": self.version}, save_latest=False)

    def load_state(self, directory: str, name: str) -> None:
        """Back to the training state saved as ``name`` (collective). The version counter does not move back
        (versions are never re-used): the next ``save_weights`` publishes the loaded weights as a new version."""
        path, _ = self.engine.load_checkpoint(directory, tag=name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        drop_hp_links(self.engine)  # the load re-creates them
        if path is None:
            raise FileNotFoundError(f"no saved state {name!r} in {directory!r}")

    def load_checkpoint(self, directory: str, tag: str | None = None) -> None:
        """Restore params, optimizer state and version (``tag=None``: DeepSpeed's ``latest``)."""
        path, client_state = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
        drop_hp_links(self.engine)  # the load re-creates them
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory!r} (tag={tag!r})")
        self.version = int((client_state or {}).get("version", 0))
        self.checkpoint_version = self.version
        self._pending_backward = 0


def _leaf(feats: BackboneFeatures) -> BackboneFeatures:
    """The same values cut from the backbone's graph, as leaves that collect the head's gradients."""
    pooled = feats.pooled.detach().requires_grad_(feats.pooled.requires_grad)
    if feats.tokens is None:
        return BackboneFeatures(pooled)
    tokens = feats.tokens.detach().requires_grad_(feats.tokens.requires_grad)
    return BackboneFeatures(pooled, tokens, feats.mask, feats.layers)


def grouped_forward_backward(framework: VLAFramework, work: Sequence[tuple[TenantSlot, list[Observation], GroupLossFn]]
                             ) -> list[dict[str, float]]:
    """Several tenants' batches through ONE grouped backbone forward (each row under its tenant's LoRA
    adapter, or none) and ONE backbone backward; each tenant's gradients land in its own engine.

    Each tenant's loss is computed on its features cut from the backbone's graph; the features'
    gradients of all LoRA tenants then go back through the shared backbone in one ``autograd.grad`` call,
    which yields every adapter's gradient (a row's gradient reaches only its own adapter). Each tenant's
    engine then runs one backward of its loss plus a linear surrogate whose gradient is exactly its
    adapter's, so DeepSpeed sees one ordinary backward per tenant. Gradients add up until each slot's
    ``optim_step``; slots must be registered in ``framework`` under their tenant names.
    """
    names = [slot.name for slot, _, _ in work]
    if len(set(names)) != len(names):
        raise ValueError(f"one batch per tenant in a grouped step, got {names}")
    requests, row_policies = [], []
    for slot, observations, _ in work:
        slot.policy.train()
        for f in framework.preprocessors[slot.name].batch(observations):
            requests.append((slot.name, f))
            row_policies.append(slot.policy)
    adapted = any(slot.policy.lora is not None for slot, _, _ in work)
    per_tenant = framework.group_features(requests, row_policies=row_policies, grad=adapted)
    losses, stats, cuts = [], [], []  # cuts: (work index, full feature tensor, its leaf copy)
    for k, (slot, _, loss_fn) in enumerate(work):
        idx, feats = per_tenant[slot.name]
        proprio = torch.from_numpy(np.stack([requests[i][1].proprio for i in idx]))
        leaf = _leaf(feats)
        loss, st = loss_fn(slot.policy, leaf, proprio)
        losses.append(loss)
        stats.append({**{k_: float(v) for k_, v in st.items()}, "loss": float(loss.detach())})
        if slot.policy.lora is not None:
            cuts += [(k, full, cut) for full, cut in ((feats.pooled, leaf.pooled), (feats.tokens, leaf.tokens))
                     if cut is not None and cut.requires_grad]
    surrogates: dict[int, torch.Tensor] = {}
    if cuts:
        owners = sorted({k for k, _, _ in cuts})
        feat_grads = torch.autograd.grad([losses[k] for k in owners], [c for _, _, c in cuts], retain_graph=True,
                                         allow_unused=True)
        used = [(k, full, g) for (k, full, _), g in zip(cuts, feat_grads, strict=True) if g is not None]
        params = {k: list(work[k][0].policy.lora.parameters()) for k in owners}  # type: ignore[union-attr]
        flat = [p for k in owners for p in params[k]]
        grads = torch.autograd.grad([f for _, f, _ in used], flat, [g for _, _, g in used], allow_unused=True) \
            if used else [None] * len(flat)
        j = 0
        for k in owners:
            gs = grads[j:j + len(params[k])]
            j += len(params[k])
            terms = [(p * g.detach()).sum() for p, g in zip(params[k], gs, strict=True) if g is not None]
            if terms:
                surrogates[k] = torch.stack(terms).sum()
    for k, (slot, _, _) in enumerate(work):
        slot.backward(losses[k] + surrogates[k] if k in surrogates else losses[k])
    return stats
