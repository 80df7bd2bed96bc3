"""How a batch is split between the ranks of the actor group.

Every rank computes the rows it owns, ``rank, rank + N, rank + 2N, ...`` (a deterministic stride: the
shards of a batch differ by at most one row), and weighs its mean loss by its share of the batch's rows, so
DeepSpeed's gradient average over the ranks is exactly the gradient of the whole batch's mean loss. A rank
that owns no row of a batch (a batch smaller than the group) recomputes a stand-in row with share 0: every
rank runs the same graph, so DeepSpeed's gradient hooks fire on every rank for the same parameters.

Anything drawn at random for a batch (flow-matching noise, minibatch order) is drawn for the whole batch on
every rank and then cut, so N ranks draw what one rank would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shard:
    """The rows of a batch of ``total`` rows that one rank computes, and its share of the batch."""

    rows: np.ndarray  # indices into the batch, never empty
    share: float  # len(own rows) / total; 0 for a stand-in row
    total: int

    @classmethod
    def whole(cls, total: int) -> Shard:
        return cls(np.arange(total), 1.0, total)


def shard(total: int, rank: int = 0, world_size: int = 1) -> Shard:
    """This rank's rows of a batch of ``total`` rows."""
    if world_size == 1:
        return Shard.whole(total)
    rows = np.arange(rank, total, world_size)
    if len(rows) == 0:
        return Shard(np.zeros(1, np.int64), 0.0, total)
    return Shard(rows, len(rows) / total, total)


def owned_in(minibatch: np.ndarray, rank: int, world_size: int) -> tuple[np.ndarray, float]:
    """The rows of ``minibatch`` (indices into a batch whose rows this rank owns by :func:`shard`'s stride)
    that are this rank's, as indices into its own rows, and its share of the minibatch."""
    if world_size == 1:
        return minibatch, 1.0
    mine = minibatch[minibatch % world_size == rank]
    if len(mine) == 0:
        return np.zeros(1, np.int64), 0.0
    return mine // world_size, len(mine) / len(minibatch)
