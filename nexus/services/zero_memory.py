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
"""

from __future__ import annotations

from typing import Any

import torch

from nexus.services.process_group import deepspeed

__all__ = ["bucket_elements", "share_fp32_master"]


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
        # DeepSpeed's per-parameter links into the master (views) would keep the old copy alive: re-link them
        zero._link_all_hp_params()
    return freed
