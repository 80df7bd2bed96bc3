"""Typed messages between the control plane (scheduler) and the workers.

Plain dataclasses, no torch, no I/O: the scheduler imports them, and so do the workers. A spec is
validated once where it enters the control plane (:mod:`nexus.config.validation`); from then on it travels as
the typed object, never as a dict to be parsed again.

* Task arguments and results travel pickled (Dask tasks), so they are the dataclasses themselves,
  holding ``TenantSpec`` / ``TenantSchema`` / ``BatchRef`` objects.
* The control plane's calls to a worker's roles carry the same objects pickled (``to_serialize``).
* What a worker reports to the scheduler (heartbeats, events) travels as msgpack — the scheduler never
  unpickles worker data — so those messages have ``to_dict`` / ``from_dict`` and hold only plain values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from nexus.features import TenantSchema
from nexus.spec import TenantSpec

if TYPE_CHECKING:
    from nexus.algorithms.grpo import GRPOConfig
    from nexus.algorithms.ppo import PPOConfig
    from nexus.config.service import DataPathSettings

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
    """What a role needs to host a tenant: its validated spec and schema, where its durable state lives,
    and the version it is at."""

    name: str
    spec: TenantSpec
    schema: TenantSchema
    output_dir: str
    version: int = 0


@dataclass(frozen=True)
class BatchRef(_Plain):
    """A handle to one stored trajectory batch (``nexus.data.trajectory_store``).

    ``policy_version`` is the *oldest* version that produced a row of the batch (conservative for
    the staleness check when a batch straddles a weight update).
    """

    path: str
    rows: int
    episodes: int
    policy_version: int
    tenant: str
    parts: tuple[str, ...] = ()  # more files of the same batch (its episodes were split over rollout tasks)
    # when its last episode ended on the devices' clock (wall clock; 0: not said): the batch's update may start
    # from then, whatever the messages took on the host (nexus.wire.devices)
    ended_at: float = 0.0

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path, *self.parts)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchRef:
        return cls(path=str(d["path"]), rows=int(d["rows"]), episodes=int(d["episodes"]),
                   policy_version=int(d["policy_version"]), tenant=str(d["tenant"]),
                   parts=tuple(str(p) for p in d.get("parts") or ()), ended_at=float(d.get("ended_at") or 0.0))

    @classmethod
    def joined(cls, refs: list[BatchRef]) -> BatchRef:
        """One batch of several stored ones (of one tenant): rows and episodes summed, the oldest version."""
        if not refs or len({r.tenant for r in refs}) != 1:
            raise ValueError("a joined batch needs batches of one tenant")
        paths = [p for r in refs for p in r.paths]
        return cls(path=paths[0], rows=sum(r.rows for r in refs), episodes=sum(r.episodes for r in refs),
                   policy_version=min(r.policy_version for r in refs), tenant=refs[0].tenant,
                   parts=tuple(paths[1:]), ended_at=max(r.ended_at for r in refs))


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one incarnation (``epoch``) of the actor group meet: the TCP store that rank 0 serves
    on ``host:port``, from a socket its worker bound (on its own address) before the group starts."""

    host: str
    port: int
    world_size: int
    epoch: int


@dataclass(frozen=True)
class SlotInfo:
    """A tenant slot built on an actor rank from the tenant's durable state."""

    tenant: str
    version: int  # the slot's version: never below the highest version ever published
    restored: bool  # a DeepSpeed checkpoint was loaded
    checkpoint_version: int | None = None  # the checkpoint's version (None: fresh weights)
    published_version: int = 0  # highest version found in the output dir
    job_seq: int = 0  # highest job number found in the tenant's job records


# -- training-queue work (what one update does) --------------------------------------------------------
@dataclass(frozen=True)
class SyncRule:
    """Lazy weight sync: when a new version goes to inference (decided on the actor, per version).

    ``policy`` "eager" pushes every version; "lazy" only when something reads the tenant's live head now
    (``live_consumers``: an RL job's rollouts) or every ``every`` versions (0: never). Pinned evaluations
    load their version from the tenant's output dir, so they never need a push; a job's end pushes its
    last version."""

    policy: Literal["lazy", "eager"] = "eager"
    every: int = 0
    live_consumers: bool = False

    def should_push(self, version: int) -> bool:
        if self.policy == "eager":
            return True
        return self.live_consumers or (self.every > 0 and version % self.every == 0)


EAGER = SyncRule()


@dataclass(frozen=True)
class SFTWork:
    """One SFT step: a batch of ``batch_size`` rows of dataset ``dataset`` drawn for step ``step``."""

    dataset: str
    step: int
    batch_size: int
    eval_heldout: bool = False  # also report the held-out action error


@dataclass(frozen=True)
class RLWork:
    """One RL update on a stored trajectory batch, with the algorithm's hyper-parameters."""

    batch: BatchRef
    config: PPOConfig
    use_cached_features: bool = True  # read the rollout's backbone features instead of recomputing them
    lr_scale: float = 1.0  # this update's share of the tenant's learning rate (``AnnealedLR.anneal_lr``)


@dataclass(frozen=True)
class GRPOWork:
    """One GRPO update on a stored batch of whole groups (episode ``e`` in group ``e // group_size``);
    ``ref_version``: the reference policy of the KL penalty (the version the job started from), when
    ``config.kl_coef`` > 0."""

    batch: BatchRef
    config: GRPOConfig
    ref_version: int | None = None
    use_cached_features: bool = True
    lr_scale: float = 1.0  # this update's share of the tenant's learning rate (``AnnealedLR.anneal_lr``)


@dataclass(frozen=True)
class OpWork:
    """A Tinker-style low-level op; a ``forward_backward`` / ``forward`` batch travels as its own task argument.
    ``adam``: an ``optim_step``'s Adam settings (``nexus.spec.AdamParams`` fields); ``name``: a saved state's."""

    op: Literal["forward_backward", "forward", "optim_step", "save_weights", "save_state", "load_state"]
    loss: str = "sft"
    adam: dict[str, float] | None = None
    name: str | None = None


Work = SFTWork | RLWork | GRPOWork | OpWork


@dataclass(frozen=True)
class UpdateRequest:
    """One training-queue item for an actor rank, with the engines its new weights go to."""

    item_id: str
    job: str | None
    work: Work
    tenant: TenantSetup
    engines: tuple[EngineEndpoint, ...]
    sync: SyncRule = EAGER
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class UpdateResult:
    version: int
    metrics: dict[str, float]
    pushed_to: tuple[str, ...] = ()  # engines that acknowledged the new weights
    push_errors: tuple[str, ...] = ()
    outputs: dict[str, Any] | None = None  # a ``forward``'s per-row results (log-probs, values, entropies)
    ended_at: float = 0.0  # when it ended on the actor devices' clock (wall clock; 0: not said)


# -- simulators -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RolloutRequest:
    """A rollout producer's work: ``episodes`` episodes from id ``offset`` (a re-run repeats the same ids and
    reset seeds); ``version`` pins an evaluation's policy (then nothing is stored)."""

    tenant: TenantSetup
    env: str
    episodes: int
    seed: int
    offset: int
    datapath: DataPathSettings  # K envs, waves, feature cache
    deterministic: bool = False
    version: int | None = None
    job: str | None = None
    route: EngineEndpoint | None = None
    group_size: int = 1  # GRPO: episode e is reset with seed + e // group_size (a group shares its start)
    # when the control plane could have started it on the devices' clock: the end of the batch or update that let
    # it start (wall clock; 0: at its arrival)
    ready_at: float = 0.0


@dataclass(frozen=True)
class RolloutResult:
    """What a rollout task returns: episode statistics, the policy versions that acted, and the stored batch
    (RL; None for an evaluation)."""

    stats: dict[str, float]
    versions: list[int]
    batch: BatchRef | None = None


# -- what workers report (msgpack) ------------------------------------------------------------------------
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
    sessions: list[dict[str, Any]] = field(default_factory=list)  # environment sessions hosted here


def job_number(job_id: str) -> int:
    """The ``n`` of a job id ``<tenant>-<kind>-<n>`` (0 if it has none)."""
    tail = job_id.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
