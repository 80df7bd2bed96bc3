"""Typed messages between the control plane (scheduler) and the workers.

Plain dataclasses, no torch, no I/O: the scheduler imports them, and so do the workers.

* Task arguments and results travel pickled (Dask tasks), so they are the dataclasses themselves.
* Worker RPC and Dask events travel as msgpack (the scheduler never unpickles worker data): those
  messages have ``to_dict`` / ``from_dict`` and hold only plain values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

HEARTBEAT_S = 1.0  # every worker's plugin reports its roles this often (topic HEALTH_TOPIC)
HEALTH_TOPIC = "nexus-health"


class _Plain:
    """msgpack-able dataclass: ``to_dict`` / ``from_dict`` (unknown keys are ignored, for newer senders)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class EngineEndpoint(_Plain):
    """One inference engine incarnation: ``engine`` is ``engine-<slot>.<epoch>``, hosted at ``address``."""

    engine: str
    address: str


@dataclass(frozen=True)
class TenantSetup:
    """What a role needs to host a tenant: the validated spec and schema (as dicts), where its durable
    state lives, and the version it is at."""

    name: str
    spec: dict[str, Any]
    schema: dict[str, Any]
    output_dir: str
    version: int = 0


@dataclass(frozen=True)
class SlotInfo:
    """A tenant slot built on an actor rank from the tenant's durable state."""

    tenant: str
    version: int  # the slot's version: never below the highest version ever published
    restored: bool  # a DeepSpeed checkpoint was loaded
    checkpoint_version: int | None = None  # the checkpoint's version (None: fresh weights)
    published_version: int = 0  # highest version found in the output dir
    job_seq: int = 0  # highest job number found in the tenant's job records


@dataclass(frozen=True)
class UpdateRequest:
    """One training-queue item for the actor group, with the engines its new weights go to."""

    item: dict[str, Any]
    tenant: TenantSetup
    engines: tuple[EngineEndpoint, ...]
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class UpdateResult:
    version: int
    metrics: dict[str, float]
    pushed_to: tuple[str, ...] = ()  # engines that acknowledged the new weights
    push_errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class RolloutRequest:
    """A rollout producer's work: ``episodes`` episodes from id ``offset`` (a re-run repeats the same ids and
    reset seeds); ``version`` pins an evaluation's policy (then nothing is stored)."""

    tenant: TenantSetup
    env: str
    episodes: int
    seed: int
    offset: int
    deterministic: bool = False
    version: int | None = None
    job: str | None = None
    route: EngineEndpoint | None = None
    datapath: dict[str, Any] | None = None  # nexus.config.DataPathSettings fields (K envs, waves, feature cache)


@dataclass(frozen=True)
class EngineReport(_Plain):
    engine: str
    tenants: int = 0
    inflight: int = 0
    served: int = 0
    draining: bool = False


@dataclass(frozen=True)
class ProducerReport(_Plain):
    job: str
    tenant: str
    kind: str  # "rollout" | "eval"
    requests: int = 0
    t_progress: float = 0.0


@dataclass(frozen=True)
class Heartbeat(_Plain):
    """A worker's periodic report of the roles it hosts (sent as a Dask event, topic ``HEALTH_TOPIC``)."""

    worker: str
    address: str
    t: float
    training: bool = False  # hosts a training model service (actor rank)
    slots: int = 0
    tracker: bool = False
    engines: list[dict[str, Any]] = field(default_factory=list)  # EngineReport dicts
    producers: list[dict[str, Any]] = field(default_factory=list)  # ProducerReport dicts
    executing: list[str] = field(default_factory=list)  # task keys running in this process


def job_number(job_id: str) -> int:
    """The ``n`` of a job id ``<tenant>-<kind>-<n>`` (0 if it has none)."""
    tail = job_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
