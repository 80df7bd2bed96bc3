"""Service-wide settings, shared by the scheduler plugin and every worker through one JSON file.

The file's path is passed explicitly: the scheduler plugin's preload argument
(``dask scheduler --preload nexus.control.plugin --nexus-config ROOT/service.json``), the gateway's
``--config``; workers get the config from the control plane. ``NEXUS_SERVICE_CONFIG`` is read only when a
scheduler started by hand gives no ``--nexus-config``.

Users write the same settings as TOML (``nexus up --config service.toml``, ``Nexus.local(config=...)``),
and tenants and jobs as TOML too (``nexus submit``, ``Nexus.submit``); ``--set key=value`` overrides any
field by its dotted path. Every file error is a :class:`nexus.errors.SpecError` naming the file and field,
the same error class and messages the API raises for the same spec given as a dict.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nexus import scheduling
from nexus.emulation import EmulationSettings
from nexus.errors import SpecError, describe_errors
from nexus.paths import private_write_bytes
from nexus.scheduling import SchedulerPolicy, SimOrder, SplitRule

ENV_VAR = "NEXUS_SERVICE_CONFIG"
# Hugging Face ``model_type`` of each backbone family's checkpoints (config.json)
CHECKPOINT_MODEL_TYPES = {"qwen3vl": ("qwen3_vl",), "paligemma": ("paligemma",)}

# policy field -> (ServiceConfig section or None for a top-level field, field there)
POLICY_FIELDS: dict[str, tuple[str | None, str]] = {
    "queue_order": ("dispatch", "queue_order"), "isolated": ("dispatch", "isolated"),
    "max_concurrent_updates": ("dispatch", "max_concurrent_updates"), "eval_fanout": ("dispatch", "eval_fanout"),
    "rollout_split": ("dispatch", "rollout_split"), "rollout_split_rule": ("dispatch", "rollout_split_rule"),
    "sim_order": ("dispatch", "sim_order"),
    "default_max_inflight": ("dispatch", "default_max_inflight"),
    "default_max_staleness": ("dispatch", "default_max_staleness"),
    "infer_max_wait_s": (None, "infer_max_wait_s"), "infer_max_batch": (None, "infer_max_batch"),
    "sync_policy": ("datapath", "sync_policy"), "sync_every": ("datapath", "sync_every"),
}


def policy_settings(policy: SchedulerPolicy, section: str | None) -> dict[str, Any]:
    """The policy's knobs that live in one ``ServiceConfig`` section (None: its top-level fields), by the
    section's field names (:data:`POLICY_FIELDS`)."""
    return {name: getattr(policy, pf) for pf, (sec, name) in POLICY_FIELDS.items() if sec == section}


class BackboneSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    family: str = "qwen3vl"
    size: str = "tiny"
    local_path: str | None = Field(None, description="a Hugging Face checkpoint directory (from_pretrained); "
                                   "resolved to an absolute path, since service processes run elsewhere")
    image_size: int = Field(64, ge=16)
    dtype: str = "float32"
    device: str = "cpu"

    @model_validator(mode="after")
    def _checkpoint_dir(self) -> BackboneSettings:
        """A checkpoint directory must exist and hold a model of the family (never a hub name)."""
        if self.local_path is None:
            return self
        path = Path(self.local_path).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise ValueError(f"backbone local_path {self.local_path!r} is not a Hugging Face checkpoint "
                             "directory (no config.json there)")
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        expected = CHECKPOINT_MODEL_TYPES.get(self.family)
        if expected is not None and model_type not in expected:
            fits = [f for f, types in CHECKPOINT_MODEL_TYPES.items() if model_type in types]
            raise ValueError(f"backbone checkpoint {str(path)!r} is a {model_type!r} model, not a {self.family!r} "
                             "backbone" + (f" (use family {fits[0]!r})" if fits else ""))
        self.local_path = str(path)
        return self


class HealthSettings(BaseModel):
    """Timeouts and restart budgets of the health manager (``nexus.control.health``).

    Every worker sends a heartbeat each ``nexus.messages.HEARTBEAT_S`` (1 s) listing the roles it hosts."""

    model_config = ConfigDict(extra="forbid")
    suspect_after_s: float = Field(10.0, gt=0, description="no heartbeat this long: the role is suspect")
    fail_after_s: float = Field(60.0, gt=0, description="no heartbeat this long: failed, its worker is restarted")
    producer_stall_s: float = Field(300.0, gt=0, description="a rollout/dataset producer without progress: suspect")
    restart_budget: int = Field(5, ge=0, description="in-place restarts of one role allowed within budget_window_s")
    budget_window_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _suspect_before_failed(self) -> HealthSettings:
        if not 0 < self.suspect_after_s < self.fail_after_s:
            raise ValueError(f"need 0 < suspect_after_s < fail_after_s, got suspect_after_s={self.suspect_after_s:g}, "
                             f"fail_after_s={self.fail_after_s:g}")
        return self


class DispatchSettings(BaseModel):
    """The training-queue dispatcher's settings (``nexus.control.dispatcher.Dispatcher`` reads
    ``max_concurrent_updates`` and ``item_attempts``) and the admission defaults of the scheduling policy."""

    model_config = ConfigDict(extra="forbid")
    max_concurrent_updates: int = Field(1, ge=1, description="training items running at once on the actor group")
    item_attempts: int = Field(2, ge=1, description="runs of an update that raises before its job fails")
    rollout_attempts: int = Field(3, ge=1, description="runs of a failing rollout (same episodes) before its job fails")
    # set by the scheduling policy (schedulers/*.toml) unless given here
    queue_order: Literal["fifo", "priority", "critical"] = Field("priority", description="training queue order")
    isolated: bool = Field(False, description="isolated baseline: tenants' jobs one after another")
    eval_fanout: int = Field(2, ge=1, description="rollout tasks per evaluation job")
    rollout_split: int = Field(1, ge=1, description="an RL batch over up to this many rollout tasks (1: the job's "
                               "own split)")
    rollout_split_rule: SplitRule = Field("free", description="'free': split only over simulator places free now; "
                                          "'always': every RL batch")
    sim_order: SimOrder = Field("fair", description="a freed simulator place to the tenant holding the fewest "
                                "('fair') or with the most simulator work left ('critical')")
    default_max_inflight: int = Field(2, ge=1, description="TenantSpec.max_inflight when a tenant leaves it unset")
    default_max_staleness: int = Field(128, ge=0, description="TenantSpec.max_staleness when a tenant leaves it "
                                       "unset")


class ServiceLimits(BaseModel):
    """Quotas and limits of one tenant (service-wide defaults; ``ServiceConfig.tenant_limits`` overrides).

    A request over one of them is refused with :class:`nexus.errors.LimitExceeded` naming the field and
    the value; nothing is allocated before the check.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_tenants: int = Field(1024, ge=1, description="tenants of the whole service (one backbone for all)")
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
    max_inflight_predicts: int = Field(8, ge=1, description="predicts of one tenant queued or running at the "
                                       "gateway at once; past it 429 with Retry-After (qos.max_inflight_predicts "
                                       "bounds all tenants together)")
    max_batch_rows: int = Field(4096, ge=1, description="samples in one forward_backward batch")
    max_instruction_chars: int = Field(2000, ge=1)
    max_versions_kept: int = Field(50, ge=0, description="newest policy versions whose weights stay on disk "
                                   "(0: all; the initial and every evaluated version are kept too)")
    max_checkpoints_kept: int = Field(3, ge=1, description="DeepSpeed checkpoints kept per tenant")
    max_storage_bytes: int = Field(8 * 2**30, ge=1, description="bytes of a tenant's output dir")
    max_request_bytes: int = Field(64 * 2**20, ge=1024, description="body of one gateway request")
    # environment sessions (a tenant's own algorithm stepping the service's simulators, nexus.client.envs)
    max_env_sessions: int = Field(4, ge=0, description="environment sessions of one tenant open at once")
    max_envs_per_session: int = Field(16, ge=1, description="envs of one environment session")
    env_session_idle_s: float = Field(300.0, gt=0, description="an environment session without a call this "
                                      "long is closed (its envs go back to the simulator worker's pool)")
    env_session_workers: int = Field(2, ge=1, description="a vector session (autoreset) of several envs is spread "
                                     "over up to this many simulator workers, which step their shares of its envs at "
                                     "once; 1: every session on one worker")
    env_session_inline_s: float = Field(0.0, ge=0, le=0.1, description="a session call whose previous call took "
                                        "less than this runs on the simulator worker's event loop (two thread "
                                        "hand-offs fewer) instead of its session thread; 0: always the thread")


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


class QosSettings(BaseModel):
    """Serving at QoS: the gateway's predict budgets and fast path, and the simulators' fair share.

    Predicts past a budget are refused at once with 429 (``nexus.errors.Overloaded``) instead of waiting
    without bound; admitted ones wait in per-tenant queues that the gateway serves round-robin, gathered
    into one call per engine. Simulator slots are shared fairly between tenants' rollout and evaluation
    tasks (``nexus.control.sim_slots``)."""

    model_config = ConfigDict(extra="forbid")
    max_inflight_predicts: int = Field(64, ge=1, description="predicts of all tenants queued or running at "
                                       "one gateway at once (each tenant: limits.max_inflight_predicts)")
    retry_after_s: float = Field(0.1, gt=0, le=3600, description="the wait a refused predict is told to "
                                 "back off (body retry_after_s; the Retry-After header rounds it up to whole s)")
    gather_max_requests: int = Field(64, ge=1, description="predicts of several HTTP clients in one call to an "
                                     "engine (each then joins the engine's groups)")
    engine_calls_in_flight: int = Field(2, ge=1, description="calls the gateway keeps running on one engine; "
                                        "requests arriving meanwhile gather into the next call")
    report_every_s: float = Field(2.0, gt=0, description="the gateway sends its per-tenant latency histograms "
                                  "to the control plane this often (/metrics, /nexus)")
    fair_share_factor: float = Field(2.0, ge=0, description="while other tenants' predicts are in flight, "
                                     "a tenant admitting more than this many times the active tenants' mean rate is "
                                     "refused (429 + Retry-After; 0: off; nexus.gateway.fair_share)")
    fair_share_window_s: float = Field(1.0, gt=0, description="the time constant of each tenant's admitted "
                                       "predict rate (qos.fair_share_factor)")
    gc_freeze: bool = Field(True, description="the gateway and each inference engine's worker freeze the "
                            "objects alive after start-up (gc.freeze): full collections no longer walk them "
                            "(nexus.gc_tuning)")
    gc_gen0_threshold: int = Field(10_000, ge=0, description="the young generation's collection threshold in the "
                                   "gateway and the engines' workers (0: Python's, 700); a request's objects are "
                                   "mostly freed by reference counting, so collections become rare")
    sim_fair_share: bool = Field(True, description="simulator slots go to the tenant holding the fewest when "
                                 "several wait (False: Dask's order, first come first served)")
    sim_task_episodes: int = Field(8, ge=1, description="an evaluation's rollout tasks run at most this many "
                                   "episodes each, so simulator slots can change hands between them")
    prefix_cache_mb: float = Field(64.0, ge=0, description="an inference engine keeps the backbone features of "
                                   "image-free prefixes (a state-only tenant's instruction) up to this size, so "
                                   "their predicts run the tenant's head only (0: off; nexus.model.prefix_cache)")
    head_bank_tenants: int = Field(64, ge=0, description="an inference engine stacks the Gaussian OFT heads of up "
                                   "to this many tenants per head shape and runs a group's rows of several of them "
                                   "as one batched forward (0: off, one head call per tenant; nexus.model.head_bank)")
    gateway_http: Literal["httptools", "h11"] = Field("httptools", description="the gateway's HTTP/1.1 parser "
                                                      "(uvicorn's; httptools: C, h11: pure Python)")
    predict_fast_path: bool = Field(True, description="the gateway serves a predict without FastAPI's routing and "
                                    "dependencies (the same answers; nexus.gateway.fast_predict)")
    gateway_loop: Literal["uvloop", "asyncio"] = Field("uvloop", description="the gateway's event loop "
                                                     "(uvloop: libuv's, asyncio: the standard library's)")


# Dask settings of the embedded deployment's processes (scheduler, nannies, workers, gateway), under
# ClusterSettings.dask_config. Dask's defaults cost an idle 2-SIM service 25 % of a core (measured, 2
# cores): each worker samples its threads' stacks every 10 ms for the dashboard's Profile tab, every
# process checks its event loop every 20 ms, each nanny polls its worker's memory every 100 ms. These
# bring it to 4 %; the service's own health checks (heartbeats, /nexus) do not use any of them.
DaskValue = str | bool | int | float | dict[str, str | bool | int | float | None]
DASK_DEFAULTS: dict[str, DaskValue] = {
    "distributed.worker.profile.enabled": False,  # the dashboard's Profile tab stays empty
    "distributed.admin.tick.interval": "500ms",  # "event loop unresponsive" warnings: 0.5 s resolution
    "distributed.admin.system-monitor.interval": "2s",  # dashboard System tab: a point every 2 s
    "distributed.worker.memory.monitor-interval": "1s",  # the nanny's memory-limit check
    # Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, which also fixes glibc's mmap threshold at
    # 128 KiB: every tensor or frame buffer above it is a fresh mmap whose pages fault in again, +42 % CPU
    # for a training step (experiments/overhead/malloc.py). None unsets it: glibc's adaptive thresholds.
    "distributed.nanny.pre-spawn-environ": {"MALLOC_TRIM_THRESHOLD_": None},
}


class ClusterSettings(BaseModel):
    """The embedded local deployment (``nexus up``, ``Nexus.local``): worker processes on this machine."""

    model_config = ConfigDict(extra="forbid")
    sim_workers: int = Field(2, ge=1, description="simulator workers (resource SIM=1 each)")
    dashboard_address: str | None = Field(
        None, description="Dask dashboard host:port; default: 127.0.0.1:8787 for `nexus up`, a free port otherwise")
    memory_limit: str = Field("6GiB", description="per worker process (Dask's --memory-limit)")
    tracker_worker: bool | None = Field(
        None, description="the MLflow tracker in a worker process of its own (resource TRACK=1, `tracker-0`), run "
        "at a lower CPU priority, so that its writes and plots never hold the interpreter lock of a device's worker; "
        "default: for an emulated service (there that host time would land on the emulated devices), not for a real "
        "one (the tracker goes on an INFER worker, as in the paper's layout)")
    dask_config: dict[str, DaskValue] = Field(
        default_factory=dict, description="Dask settings for the service's processes, dotted keys "
        "(\"distributed.admin.tick.interval\" = \"20ms\"), over DASK_DEFAULTS; a table value (e.g. "
        "\"distributed.nanny.pre-spawn-environ\" = {MALLOC_TRIM_THRESHOLD_ = 65536}) adds to the default's")

    @model_validator(mode="after")
    def _dask_keys(self) -> ClusterSettings:
        for key in self.dask_config:
            if not all(p and p.replace("-", "").replace("_", "").isalnum() for p in key.split(".")):
                raise ValueError(f"cluster.dask_config: {key!r} is not a dotted Dask setting "
                                 "(e.g. 'distributed.admin.tick.interval')")
        return self

    def dask_env(self) -> dict[str, str]:
        """The Dask settings as the environment variables Dask reads at import in a child process
        (``DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL=500ms``)."""
        merged = dict(DASK_DEFAULTS)
        for k, v in self.dask_config.items():
            base = merged.get(k)
            merged[k] = {**base, **v} if isinstance(base, dict) and isinstance(v, dict) else v
        # a table is a Python literal, which Dask parses (``ast.literal_eval``) keeping its keys' case
        return {"DASK_" + "__".join(p.upper().replace("-", "_") for p in k.split(".")): str(v)
                for k, v in merged.items()}


class RetentionSettings(BaseModel):
    """Which policy versions keep their weights file (``weights/vNNNNNN.pt``) in a tenant's output dir.

    The user-facing spelling of two service-wide limits (one mechanism: ``TenantOutputDir.prune``):
    ``keep_last`` is ``limits.max_versions_kept`` and ``keep_checkpoints`` is ``limits.max_checkpoints_kept``;
    ``tenant_limits`` still override them per tenant."""

    model_config = ConfigDict(extra="forbid")
    keep_last: int = Field(50, ge=0, description="the newest N versions (0: keep every version)")
    keep_checkpoints: int = Field(3, ge=1, description="the newest N DeepSpeed checkpoints")
    # always kept besides the newest N: the initial version and every version an evaluation pinned (from the
    # moment it starts), so reports and MLflow runs stay reproducible


def is_loopback(host: str) -> bool:
    """``host`` names this machine's loopback interface (only local users reach what listens there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="service folder: tenants' output dirs, MLflow store, logs")
    host: str = Field("127.0.0.1", description="address every service process listens on (Dask, gateway, "
                                               "torch.distributed); loopback unless the service spans hosts")
    tls: bool = Field(False, description="Dask comms over mutual TLS, certificates generated under root/tls")
    gateway_port: int = Field(0, ge=0, le=65535, description="tenant gateway port (0: any free port)")
    grpc_port: int | None = Field(None, ge=0, le=65535, description="the gateway's gRPC robot API "
                                  "(nexus.gateway.grpc_api) on the gateway's address: this port (0: any free port); "
                                  "unset: no gRPC listener")
    open_registration: bool | None = Field(None, description="who may create a tenant: true: anyone reaching the "
                                           "gateway; false: the operator token is needed; unset: anyone while the "
                                           "gateway listens on loopback, the operator token off loopback")
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
    ops_idle_s: float = Field(120.0, gt=0, description="a client session's low-level ops are one MLflow run; it "
                                                       "ends after this long without an op")
    offload_idle_s: float = Field(600.0, ge=0, description="a tenant idle this long (nothing running or queued) "
                                  "has its actor slot offloaded to disk and restored at its next item (0: never)")
    checkpoint_every: int = Field(1, ge=0, description="DeepSpeed checkpoint every N versions, saved before the "
                                  "version is published (0: at job end only)")
    inference_engines: int = Field(1, ge=1, description="inference engines at start (Nexus.scale_inference changes it)")
    actor_ranks: int = Field(1, ge=1, description="ranks of the actor group: ACTOR workers forming one "
                             "torch.distributed group (gloo on CPU, nccl on CUDA), each batch split between them")
    health: HealthSettings = HealthSettings()
    dispatch: DispatchSettings = DispatchSettings()
    datapath: DataPathSettings = DataPathSettings()
    qos: QosSettings = QosSettings()
    cluster: ClusterSettings = ClusterSettings()
    emulation: EmulationSettings | None = Field(None, description="emulated devices: updates, forwards and "
                                                "simulator steps take calibrated time (nexus.emulation); "
                                                "everything else is the real service")

    @model_validator(mode="after")
    def _emulated_devices(self) -> ServiceConfig:
        """An emulated service has one worker per service holding its devices: one actor rank, one engine per
        inference device."""
        emu = self.emulation
        if emu is None:
            return self
        if self.actor_ranks != 1:
            raise ValueError(f"emulation: actor_ranks must be 1 (its worker holds devices.actor = "
                             f"{emu.devices.actor} devices), got {self.actor_ranks}")
        if "inference_engines" in self.model_fields_set and self.inference_engines != emu.devices.inference:
            raise ValueError(f"emulation: inference_engines {self.inference_engines} differs from "
                             f"devices.inference {emu.devices.inference}")
        self.inference_engines = emu.devices.inference
        return self

    @model_validator(mode="before")
    @classmethod
    def _retention_sets_limits(cls, data: Any) -> Any:
        """``[retention]`` is written into ``limits`` (the one place retention is read from)."""
        if not isinstance(data, dict) or "retention" not in data:
            return data
        data = dict(data)
        raw = data.pop("retention")
        try:
            r = RetentionSettings.model_validate(raw)
        except ValidationError as e:
            raise ValueError(describe_errors(e.errors(), prefix="retention.")) from None
        limits = data.get("limits")
        limits = limits.model_dump() if isinstance(limits, ServiceLimits) else dict(limits or {})
        for key, name in (("max_versions_kept", "keep_last"), ("max_checkpoints_kept", "keep_checkpoints")):
            if name not in r.model_fields_set:
                continue
            if key in limits and limits[key] != getattr(r, name):
                raise ValueError(f"retention.{name}={getattr(r, name)} and limits.{key}={limits[key]} "
                                 "disagree (they are one setting); set one of them")
            limits[key] = getattr(r, name)
        data["limits"] = limits
        return data

    @property
    def retention(self) -> RetentionSettings:
        return RetentionSettings(keep_last=self.limits.max_versions_kept,
                                 keep_checkpoints=self.limits.max_checkpoints_kept)
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
        for pf, (section, name) in POLICY_FIELDS.items():
            holder = self if section is None else getattr(self, section)
            if name in holder.model_fields_set:  # explicit: it wins
                effective[pf] = getattr(holder, name)
            else:
                effective[pf] = getattr(policy, pf)
                if section is None:
                    setattr(self, name, effective[pf])
                else:
                    setattr(self, section, holder.model_copy(update={name: effective[pf]}))
        if self.dispatch.default_max_inflight > self.limits.max_inflight:
            raise ValueError(f"scheduler {policy.name!r}: default_max_inflight {self.dispatch.default_max_inflight} "
                             f"exceeds limits.max_inflight {self.limits.max_inflight}")
        self.scheduler_policy = policy.model_copy(update=effective)
        return self

    def with_policy(self, policy: SchedulerPolicy) -> ServiceConfig:
        """This config under another scheduling policy: every policy knob (:data:`POLICY_FIELDS`) set from
        ``policy``, which becomes the effective one. Raises :class:`SpecError` when its admission default
        exceeds this service's limits."""
        if policy.default_max_inflight > self.limits.max_inflight:
            raise SpecError(f"scheduler {policy.name!r}: default_max_inflight {policy.default_max_inflight} exceeds "
                            f"limits.max_inflight {self.limits.max_inflight}")
        sections = {sec for sec, _ in POLICY_FIELDS.values() if sec is not None}
        update: dict[str, Any] = {sec: getattr(self, sec).model_copy(update=policy_settings(policy, sec))
                                  for sec in sections}
        return self.model_copy(update={**update, **policy_settings(policy, None), "scheduler": policy.name,
                                       "scheduler_policy": policy})

    @model_validator(mode="after")
    def _overrides_name_limits(self) -> ServiceConfig:
        for over in self.tenant_limits.values():
            ServiceLimits(**{**self.limits.model_dump(), **over})  # unknown or invalid fields fail here
        return self

    def registration_open(self, host: str) -> bool:
        """Whether a gateway listening on ``host`` lets a caller without the operator token create tenants:
        ``open_registration`` when the operator set it, else only on loopback (only this host's users reach it)."""
        return self.open_registration if self.open_registration is not None else is_loopback(host)

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

    def resolved_tracker_worker(self) -> bool:
        """Whether the tracker has a worker of its own (``cluster.tracker_worker``; default: when emulated)."""
        own = self.cluster.tracker_worker
        return self.emulation is not None if own is None else own

    def resolved_tracking_uri(self) -> str:
        return self.tracking_uri or f"sqlite:///{Path(self.root).resolve() / 'mlflow.db'}"

    def resolved_experiment(self) -> str:
        return self.experiment or f"joynexus-{Path(self.root).resolve().name}"

    def save(self, path: str | Path) -> Path:
        path = Path(path)

        private_write_bytes(path, self.model_dump_json(indent=2).encode())
        return path

    @classmethod
    def load(cls, path: str | Path | None = None) -> ServiceConfig:
        path = path or os.environ.get(ENV_VAR)
        if not path:
            raise RuntimeError(f"no service config: pass --nexus-config (or set {ENV_VAR}) to the service.json "
                               "written by nexus.cluster / nexus scheduler")
        return cls.model_validate(json.loads(Path(path).read_text()))


# ------------------------------------------------------------------------------------------------ files
def describe_validation_error(e: ValidationError) -> str:
    """A pydantic error as one line: ``field.path: message; ...``."""
    return describe_errors(e.errors())


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{path}: invalid TOML: {e}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as a TOML value (numbers, booleans, strings
    in quotes, arrays), and as a plain string when it is not one (``root=runs/x``)."""
    key, sep, value = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise SpecError(f"--set {text!r}: expected key=value, e.g. backbone.family=paligemma")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return path, parsed


def apply_overrides(doc: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``doc`` with every ``key.path=value`` set (tables created as needed)."""
    out = json.loads(json.dumps(doc))  # deep copy of plain TOML data
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecError(f"--set {text!r}: {'.'.join(path[:i + 1])} is a value, not a table")
        node[path[-1]] = value
    return out


def load_service_config(path: str | Path | None = None, overrides: Iterable[str] = (),
                        **fields: Any) -> ServiceConfig:
    """Service settings: defaults < the TOML file < ``fields`` (keyword arguments) < ``--set`` overrides.

    A relative ``root`` is taken from the current directory and made absolute.
    """
    doc = read_toml(path) if path is not None else {}
    doc = _merge(doc, {k: v for k, v in fields.items() if v is not None})
    doc = apply_overrides(doc, overrides)
    doc.setdefault("root", "runs/service")
    where = f"{path}: " if path is not None else ""
    try:
        cfg = ServiceConfig.model_validate(doc)
    except ValidationError as e:
        raise SpecError(f"{where}invalid service config: {describe_validation_error(e)}") from None
    return cfg.model_copy(update={"root": str(Path(cfg.root).expanduser().resolve())})


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif isinstance(v, BaseModel):
            out[k] = _merge(out.get(k, {}) if isinstance(out.get(k), dict) else {}, v.model_dump(exclude_unset=True))
        else:
            out[k] = v
    return out


@dataclass
class Submission:
    """What ``nexus submit FILE...`` sends: at most one tenant spec and the jobs to run on it, as the raw dicts
    the API sends (validated by the service's own validation, so files and API fail alike)."""

    tenant: dict[str, Any] | None = None
    tenant_name: str | None = None  # a job-only submission names an existing tenant
    jobs: list[dict[str, Any]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    @property
    def name(self) -> str | None:
        return self.tenant.get("name") if self.tenant else self.tenant_name


def load_submission(paths: Iterable[str | Path], overrides: Iterable[str] = (),
                    tenant: str | None = None) -> Submission:
    """Tenant and job files -> one :class:`Submission`.

    A file holds a tenant (``TenantSpec`` fields at top level, or a ``[tenant]`` table), a job (``kind = ...``
    at top level, or a ``[job]`` table), several jobs (``[[jobs]]``), or a tenant with its jobs. A job-only
    file may name its tenant with a top-level ``tenant = "name"``, or the caller with ``tenant`` (an existing
    tenant). Overrides address ``tenant.<field>`` and ``job.<field>`` (every job of the submission).
    """
    sub = Submission(tenant_name=tenant)
    for path in paths:
        doc = read_toml(path)
        sub.sources.append(str(path))
        tenant = doc.pop("tenant", None)
        if isinstance(tenant, str):
            sub.tenant_name, tenant = sub.tenant_name or tenant, None
        jobs = []
        if "job" in doc:
            jobs.append(_table(doc.pop("job"), path, "job"))
        if "jobs" in doc:
            value = doc.pop("jobs")
            if not isinstance(value, list):
                raise SpecError(f"{path}: 'jobs' must be an array of tables ([[jobs]])")
            jobs += [_table(j, path, "jobs") for j in value]
        if doc:  # top-level fields: a job if it says its kind, else a tenant
            if "kind" in doc:
                jobs.insert(0, doc)
            elif tenant is None:
                tenant = doc
            else:
                raise SpecError(f"{path}: fields {sorted(doc)} outside the [tenant] table")
        if tenant is not None:
            if sub.tenant is not None:
                raise SpecError(f"{path}: a second tenant (the first came from {sub.sources[0]}); submit one "
                                "tenant at a time")
            sub.tenant = _table(tenant, path, "tenant")
        sub.jobs += jobs
    overrides = list(overrides)
    for text in overrides:
        if not text.startswith(("tenant.", "job.")):
            raise SpecError(f"--set {text!r}: a submission's overrides start with 'tenant.' or 'job.'")
    for_tenant = [o for o in overrides if o.startswith("tenant.")]
    for_jobs = [o for o in overrides if o.startswith("job.")]
    if for_tenant:
        if sub.tenant is None:
            raise SpecError(f"--set {for_tenant[0]!r}: the submission has no tenant file")
        sub.tenant = apply_overrides({"tenant": sub.tenant}, for_tenant)["tenant"]
    if for_jobs:
        if not sub.jobs:
            raise SpecError(f"--set {for_jobs[0]!r}: the submission has no job")
        sub.jobs = [apply_overrides({"job": j}, for_jobs)["job"] for j in sub.jobs]
    if sub.name is None:
        raise SpecError("no tenant: give a tenant file, or a job file with tenant = \"name\" (or --tenant)")
    return sub


def _table(value: Any, path: str | Path, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{path}: {key!r} must be a table")
    return value
