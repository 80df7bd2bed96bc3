"""Near-equal contiguous shares of a count (a session's envs over workers, a batch's or an evaluation's episodes
over rollout tasks)."""

from __future__ import annotations


def even_shares(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal shares, the larger ones first (5 in 2: 3 + 2)."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]
