"""Dask's message streams of the control plane, sent promptly.

A Dask stream (``distributed.batched.BatchedSend``) sends at most one batch of messages per interval: 10 ms for a
client's stream to the scheduler, 5 ms for the scheduler's to each worker, 2 ms for a worker's to the scheduler and
for the scheduler's to a client. That suits user code submitting thousands of tasks; the control plane submits one
task at a time, each on the path of a job's next step (a rollout after the batch or update that let it start, an
update after its rollout), at ~100 messages a second, so a message often waited for the interval of the one before:
~7 of a rollout's ~24 ms from its submission to its start on a loaded 2-core host (the tasks' Dask stories,
``experiments/paper_scale`` README). Dask has no setting for these intervals; the streams are told after they open
(a client that reconnects opens new ones, with Dask's intervals again: slower, not wrong).
"""

from __future__ import annotations

from typing import Any

PROMPT_S = 0.001  # at most 1000 batches a second per stream: still one write for a burst of messages


def send_promptly(stream: Any) -> None:
    """Let a ``BatchedSend`` (or None: no stream yet) send within :data:`PROMPT_S` of the batch before."""
    if stream is not None:
        stream.interval = PROMPT_S
