"""The inference queue's firing rule, applied next to the model (in the inference engine).

Collect requests FIFO and fire a group when the oldest request has waited ``max_wait_s`` (T) or the
group reached ``max_batch`` (B). Plain data: no torch, no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupBatcher:
    """Firing rule of the inference queue: max wait T (seconds) and target batch B."""

    max_wait_s: float = 0.005
    max_batch: int = 8
    _pending: list[tuple[float, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_wait_s < 0 or self.max_batch < 1:
            raise ValueError("max_wait_s >= 0 and max_batch >= 1 required")

    def add(self, request: Any, now: float | None = None) -> None:
        self._pending.append((time.monotonic() if now is None else now, request))

    def __len__(self) -> int:
        return len(self._pending)

    def due_in(self, now: float | None = None) -> float | None:
        """Seconds until the group must fire (0 = now); None when nothing is pending."""
        if not self._pending:
            return None
        if len(self._pending) >= self.max_batch:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, self._pending[0][0] + self.max_wait_s - now)

    def take(self) -> list[Any]:
        """The next group, oldest first, at most B requests."""
        group, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
        return [r for _, r in group]
