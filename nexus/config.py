"""Service-wide settings, shared by the scheduler plugin and every worker through one JSON file.

The file's path travels in the environment variable ``NEXUS_SERVICE_CONFIG`` (set by
``nexus.cluster`` for the processes it starts, or by an operator for CLI-started workers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nexus import scheduling
from nexus.scheduling import SchedulerPolicy

ENV_VAR = "NEXUS_SERVICE_CONFIG"

# policy field -> (ServiceConfig section or None for a top-level field, field there)
POLICY_FIELDS: dict[str, tuple[str | None, str]] = {
    "queue_order": ("dispatch", "queue_order"), "isolated": ("dispatch", "isolated"),
    "max_concurrent_updates": ("dispatch", "max_concurrent_updates"), "eval_fanout": ("dispatch", "eval_fanout"),
    "default_max_inflight": ("dispatch", "default_max_inflight"),
    "default_max_staleness": ("dispatch", "default_max_staleness"),
    "infer_max_wait_s": (None, "infer_max_wait_s"), "infer_max_batch": (None, "infer_max_batch"),
    "sync_policy": ("datapath", "sync_policy"), "sync_every": ("datapath", "sync_every"),
}


class BackboneSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    family: str = "qwen3vl"
    size: str = "tiny"
    local_path: str | None = None
    image_size: int = Field(64, ge=16)
    dtype: str = "float32"
    device: str = "cpu"


class HealthSettings(BaseModel):
    """Timeouts and restart budgets of the health manager (``nexus.control.health``).

    Every worker sends a heartbeat each ``nexus.messages.HEARTBEAT_S`` (1 s) listing the roles it hosts."""

    model_config = ConfigDict(extra="forbid")
    suspect_after_s: float = Field(10.0, gt=0, description="no heartbeat this long: the role is suspect")
    fail_after_s: float = Field(60.0, gt=0, description="no heartbeat this long: failed, its worker is restarted")
    producer_stall_s: float = Field(300.0, gt=0, description="a rollout/dataset producer without progress: suspect")
    restart_budget: int = Field(5, ge=0, description="in-place restarts of one role allowed within budget_window_s")
    budget_window_s: float = Field(600.0, gt=0)


class DispatchSettings(BaseModel):
    """The training-queue dispatcher's policy (``nexus.control.dispatcher.DispatchPolicy``)."""

    model_config = ConfigDict(extra="forbid")
    max_concurrent_updates: int = Field(1, ge=1, description="training items running at once on the actor group")
    item_attempts: int = Field(2, ge=1, description="runs of an update that raises before its job fails")
    rollout_attempts: int = Field(3, ge=1, description="runs of a failing rollout (same episodes) before its job fails")
    # set by the scheduling policy (schedulers/*.toml) unless given here
    queue_order: Literal["fifo", "priority"] = Field("priority", description="training queue order")
    isolated: bool = Field(False, description="isolated baseline: tenants' jobs one after another")
    eval_fanout: int = Field(2, ge=1, description="rollout tasks per evaluation job")
    default_max_inflight: int = Field(2, ge=1, description="TenantSpec.max_inflight when a tenant leaves it unset")
    default_max_staleness: int = Field(128, ge=0, description="TenantSpec.max_staleness when a tenant leaves it "
                                       "unset")


class ServiceLimits(BaseModel):
    """Quotas and limits of one tenant (service-wide defaults; ``ServiceConfig.tenant_limits`` overrides).

    A request over one of them is refused with :class:`nexus.errors.LimitExceeded` naming the field and
    the value; nothing is allocated before the check.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tenants: int = Field(32, ge=1, description="tenants of the whole service")
    max_hidden_dim: int = Field(4096, ge=8, description="width of a tenant's action module")
    max_head_bytes: int = Field(2 * 2**30, ge=1, description="actor memory estimate of one tenant's slot")
    actor_memory_fraction: float = Field(0.7, gt=0, le=0.95,
                                         description="share of the actor worker's memory limit slots may use "
                                                     "(Dask restarts a worker at 0.95)")
    max_sft_steps: int = Field(100_000, ge=1)
    max_batch_size: int = Field(1024, ge=1, description="SFT batch size")
    max_rl_updates: int = Field(10_000, ge=1)
    max_episodes_per_batch: int = Field(64, ge=1)
    max_collectors: int = Field(8, ge=1)
    max_eval_episodes: int = Field(500, ge=1)
    max_update_epochs: int = Field(32, ge=1, description="PPO epochs over one RL batch")
    max_concurrent_evals: int = Field(2, ge=1, description="evaluation jobs of one tenant queued or running")
    max_priority: int = Field(10, ge=0, description="|TenantSpec.priority| (priorities share one actor)")
    max_seed: int = Field(600, ge=0, description="episode seeds derived from it stay below 2**32 (simulators)")
    max_inflight: int = Field(8, ge=1, description="cap of TenantSpec.max_inflight")
    max_queued_ops: int = Field(8, ge=1, description="low-level calls of one tenant waiting at the gateway")
    max_batch_rows: int = Field(4096, ge=1, description="samples in one forward_backward batch")
    max_instruction_chars: int = Field(2000, ge=1)
    max_versions_kept: int = Field(50, ge=1, description="policy versions whose weights stay on disk")
    max_checkpoints_kept: int = Field(3, ge=1, description="DeepSpeed checkpoints kept per tenant")
    max_storage_bytes: int = Field(8 * 2**30, ge=1, description="bytes of a tenant's output dir")
    max_request_bytes: int = Field(64 * 2**20, ge=1024, description="body of one gateway request")


class DataPathSettings(BaseModel):
    """Knobs of the data path (producers, inference grouping, feature cache, weight sync).

    Every knob is passed explicitly to the worker-side code that uses it (rollout producers, the
    inference engine, the update), so a scheduling policy can set any of them.
    """

    model_config = ConfigDict(extra="forbid")
    envs_per_producer: int = Field(4, ge=1, description="K: envs one rollout task steps together (at most "
                                   "its episodes; a catalog env's num_envs is a minimum)")
    producer_waves: int = Field(1, ge=1, description="requests a producer keeps in flight: its K envs in this "
                                "many lockstep waves, one stepping while another waits for actions (1: all "
                                "K actions in one request)")
    producer_vector_mode: Literal["lockstep", "async"] = Field(
        "lockstep", description="lockstep: K envs in the task's process; async: a gymnasium AsyncVectorEnv per "
        "wave (a process per env)")
    fire_when_all_waiting: bool = Field(True, description="fire a group once every live producer is waiting "
                                        "for actions (no wait T when nobody else could join)")
    producer_lease_s: float = Field(5.0, gt=0, description="a producer silent this long no longer holds "
                                    "groups back")
    expect_arrivals: bool = Field(True, description="with fire_when_all_waiting: a producer not expected back "
                                  "within T (its usual answer -> next request gap) does not hold a group back")
    cache_features: bool = Field(True, description="store the rollout's pooled backbone features with the "
                                 "trajectory; the PPO update reads them instead of re-running the backbone")
    feature_cache_max_dim: int = Field(16384, ge=0, description="pooled features wider than this are "
                                       "recomputed, not stored (bounds the store's size per step)")
    sync_policy: Literal["lazy", "eager"] = Field(
        "lazy", description="lazy: a new head goes to inference only when something will use it (an RL "
        "job's rollouts, every sync_every versions, the job's end); eager: every version")
    sync_every: int = Field(0, ge=0, description="lazy sync: also push every N versions (0: never)")


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="service folder: tenants' output dirs, MLflow store, logs")
    host: str = Field("127.0.0.1", description="address every service process listens on (Dask, gateway, "
                                               "torch.distributed); loopback unless the service spans hosts")
    tls: bool = Field(False, description="Dask comms over mutual TLS, certificates generated under root/tls")
    gateway_port: int = Field(0, ge=0, le=65535, description="tenant gateway port (0: any free port)")
    open_registration: bool = Field(True, description="anyone reaching the gateway may create a tenant "
                                                      "(False: the operator token is needed)")
    output_base: str | None = Field(None, description="folder inside which a spec's output_dir may point; "
                                                      "unset: every tenant lives in root/tenants/<name>")
    limits: ServiceLimits = ServiceLimits()
    tenant_limits: dict[str, dict[str, int | float]] = Field(default_factory=dict,
                                                       description="per-tenant overrides of `limits`")
    backbone: BackboneSettings = BackboneSettings()
    infer_max_wait_s: float = Field(0.005, ge=0, description="inference queue: max wait T")
    infer_max_batch: int = Field(8, ge=1, description="inference queue: target group size B")
    tracking_uri: str | None = Field(None, description="MLflow URI; default sqlite in root")
    experiment: str | None = Field(None, description="MLflow experiment; default: one per service root")
    checkpoint_every: int = Field(1, ge=0, description="DeepSpeed checkpoint every N versions, saved before the "
                                  "version is published (0: at job end only)")
    inference_engines: int = Field(1, ge=1, description="inference engines at start (Nexus.scale_inference changes it)")
    actor_ranks: int = Field(1, ge=1, description="ranks of the actor group (workers with resource ACTOR)")
    health: HealthSettings = HealthSettings()
    dispatch: DispatchSettings = DispatchSettings()
    datapath: DataPathSettings = DataPathSettings()
    scheduler: str = Field(scheduling.DEFAULT, description="scheduling policy: a schedulers/ catalog name or a "
                           "path to a policy .toml; fields given explicitly in this config win over the file's")
    scheduler_policy: SchedulerPolicy | None = Field(None, description="the effective policy (filled in from "
                                                     "`scheduler` and the explicit fields; kept so workers "
                                                     "never re-read the file)")

    @model_validator(mode="after")
    def _apply_scheduler(self) -> ServiceConfig:
        """Fill every policy knob the caller did not set from the policy file; record the effective policy."""
        if self.scheduler_policy is not None:  # a saved config: its fields already hold the policy
            return self
        policy = scheduling.load(self.scheduler)
        effective = {}
        for pf, (section, field) in POLICY_FIELDS.items():
            holder = self if section is None else getattr(self, section)
            if field in holder.model_fields_set:  # explicit: it wins
                effective[pf] = getattr(holder, field)
            else:
                effective[pf] = getattr(policy, pf)
                if section is None:
                    setattr(self, field, effective[pf])
                else:
                    setattr(self, section, holder.model_copy(update={field: effective[pf]}))
        if self.dispatch.default_max_inflight > self.limits.max_inflight:
            raise ValueError(f"scheduler {policy.name!r}: default_max_inflight {self.dispatch.default_max_inflight} "
                             f"exceeds limits.max_inflight {self.limits.max_inflight}")
        self.scheduler_policy = policy.model_copy(update=effective)
        return self

    @model_validator(mode="after")
    def _overrides_name_limits(self) -> ServiceConfig:
        for over in self.tenant_limits.values():
            ServiceLimits(**{**self.limits.model_dump(), **over})  # unknown or invalid fields fail here
        return self

    def limits_for(self, tenant: str) -> ServiceLimits:
        over = self.tenant_limits.get(tenant)
        return ServiceLimits(**{**self.limits.model_dump(), **over}) if over else self.limits

    @property
    def tenants_dir(self) -> Path:
        return Path(self.root) / "tenants"

    @property
    def tls_dir(self) -> Path:
        return Path(self.root) / "tls"

    @property
    def gateway_dir(self) -> Path:
        """Gateway-owned state: token hashes, the operator token, the gateway's URL (all 0600)."""
        return Path(self.root) / "gateway"

    def resolved_tracking_uri(self) -> str:
        return self.tracking_uri or f"sqlite:///{Path(self.root).resolve() / 'mlflow.db'}"

    def resolved_experiment(self) -> str:
        return self.experiment or f"joynexus-{Path(self.root).resolve().name}"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        from nexus.paths import private_write_bytes

        private_write_bytes(path, self.model_dump_json(indent=2).encode())
        return path

    @classmethod
    def load(cls, path: str | Path | None = None) -> ServiceConfig:
        path = path or os.environ.get(ENV_VAR)
        if not path:
            raise RuntimeError(f"no service config: set {ENV_VAR} to the JSON file written by nexus.cluster")
        return cls.model_validate(json.loads(Path(path).read_text()))
