"""What a tenant's ZeRO engine holds beyond its weights and AdamW's moments, cut where it is only a copy.

A thousand tenants share one actor, so every byte an engine keeps per tenant counts
(``experiments/scale/slot_memory.py`` measures each component):

* **fp32 master partition.** ZeRO 1-2 keep a "master" copy of this rank's partition of the weights for the
  optimizer, because it expects bf16/fp16 training weights. A tenant's head trains in fp32, so the master is a
  bit-for-bit duplicate of the partition of the flat parameter buffer (the step copies it back there after
  every optimizer step). :func:`share_fp32_master` makes it a view of that partition instead: the optimizer
  updates the module's weights in place, the copy back becomes a copy onto itself, every update's result is
  the same, and a quarter of an active tenant's memory is gone.
* **Gradient buckets.** ZeRO-2's defaults (``reduce_bucket_size``, ``allgather_bucket_size``: 5e8 elements) are
  sized for billion-parameter models: every backward maps a 1.9 GB gradient bucket (virtual; only what the
  gradients fill is touched). :func:`bucket_elements` sizes both to the slot's own parameters: one bucket holds
  all of them, as before, so the reduction and the all-gather run exactly as with the defaults.
* **Per-parameter links into the master** (``param._hp_mapping``: views of the weights, of the master and of
  AdamW's moments per parameter, each view holding an autograd node, + five bound methods per parameter).
  They serve DeepSpeed's ``safe_get_full_*`` accessors and loading a *universal* checkpoint, neither of which a
  slot uses; no step reads them (each use is guarded by ``_hp_mapping is not None``) and the checkpoint's
  parameter slice map is computed once at construction, before they are dropped. :func:`drop_hp_links`
  drops them after construction and after every checkpoint load (which re-creates them).
* **The parsed configuration.** Every engine parses its config dict into its own ``DeepSpeedConfig`` (a tree of
  pydantic models) and a ``MonitorMaster`` from it; engines built from equal dicts share one of each
  (:func:`share_config`; the monitor while it is disabled, the service's case). A slot never calls the
  engine's setters that write into the config (``set_train_batch_size``, ``communication_data_type``).

:func:`slim_engine` applies all of them to a new engine; ``experiments/scale/slot_memory.py`` measures each.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import torch

from nexus.actor.process_group import deepspeed

__all__ = ["bucket_elements", "drop_hp_links", "share_config", "share_fp32_master", "slim_engine"]

# one parsed config per distinct config dict, alive while an engine uses it
_CONFIGS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_MONITORS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # disabled ones, likewise
# what DeepSpeed's link_hp_params / enable_universal_checkpoint bind on every parameter
_HP_METHODS = ("get_full_hp_param", "get_full_hp_grad", "set_full_hp_param", "set_full_hp_grad",
               "load_hp_checkpoint_state")


def bucket_elements(params: list[torch.nn.Parameter]) -> int:
    """ZeRO's gradient and all-gather bucket size for a slot: all its trainable parameters in one bucket
    (rounded up to a multiple of 128 elements: ZeRO wants the all-gather bucket aligned)."""
    n = sum(p.numel() for p in params if p.requires_grad)
    return max(1, -(-n // 128)) * 128


def share_fp32_master(engine: Any) -> int:
    """Make the engine's fp32 master partitions views of the parameters' partitions when both are fp32 (ZeRO
    1-2; no CPU offload). Call right after ``deepspeed.initialize``, before any step. Returns the bytes freed."""
    zero = engine.optimizer
    if not isinstance(zero, deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer) or zero.cpu_offload:
        return 0
    freed = 0
    for i, master in enumerate(zero.single_partition_of_fp32_groups):
        own = zero.parallel_partitioned_bit16_groups[i][torch.distributed.get_rank(zero.real_dp_process_group[i])]
        if own.dtype != master.dtype or own.shape != master.shape or own.device != master.device:
            continue  # bf16/fp16 weights: the master is a real higher-precision copy
        if master.untyped_storage().data_ptr() == own.untyped_storage().data_ptr():
            continue
        torch.testing.assert_close(master, own, rtol=0, atol=0)  # a clone of it, untouched so far
        freed += master.untyped_storage().nbytes()
        # the optimizer keeps the same tensor object (its param groups and state are keyed by it), now a view
        master.data = own.data
    if freed:
        # DeepSpeed's per-parameter links into the master (views) would keep the old copy alive
        drop_hp_links(engine)
    return freed


def drop_hp_links(engine: Any) -> int:
    """Drop ZeRO 1-2's per-parameter links into the master and the optimizer state (``_hp_mapping`` and the
    methods bound with it). Call after construction and after every ``load_checkpoint``. Returns the number of
    parameters unlinked."""
    zero = engine.optimizer
    if not isinstance(zero, deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer):
        return 0
    n = 0
    for group in zero.bit16_groups:
        for p in group:
            if getattr(p, "_hp_mapping", None) is not None:
                n += 1
            p._hp_mapping = None  # DeepSpeed's own "not linked" (a parameter outside this rank's partition)
            for name in _HP_METHODS:
                p.__dict__.pop(name, None)
    return n


def share_config(engine: Any) -> bool:
    """Let ``engine`` use the parsed config (and the disabled monitor) of an engine built from an equal config
    dict, if there is one alive (its own are freed). Returns whether it now shares the config."""
    own = engine._config
    key = json.dumps(own._param_dict, sort_keys=True, default=repr)
    shared = _CONFIGS.setdefault(key, own)
    engine._config = shared
    if not engine.monitor.enabled:  # built from the config, holds nothing else while disabled: share it too
        engine.monitor = _MONITORS.setdefault(key, engine.monitor)
    return shared is not own


def slim_engine(engine: Any) -> None:
    """Every cut of this module on a freshly built tenant engine (before any step)."""
    share_fp32_master(engine)
    drop_hp_links(engine)
    share_config(engine)
