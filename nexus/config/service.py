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
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from nexus.config import scheduling
from nexus.config.paths import private_write_bytes
from nexus.errors import SpecError, describe_errors

ENV_VAR = "NEXUS_SERVICE_CONFIG"
# Hugging Face ``model_type`` of each backbone family's checkpoints (config.json)
CHECKPOINT_MODEL_TYPES = {"qwen3vl": ("qwen3_vl",), "paligemma": ("paligemma",)}

DEFAULT_SCHEDULER = scheduling.DEFAULT
# the validation context of a config whose scheduler is already applied (a saved config, a switch's result)
APPLIED = {"scheduler_applied": True}
# when ``dispatch.rollout_split`` applies: while simulator places are free now, or to every RL batch
SplitRule = Literal["free", "always"]
SimOrder = Literal["fair", "critical"]
BACKBONE_FAMILIES = ("qwen3vl", "paligemma")
BACKBONE_DTYPES = ("float32", "bfloat16", "float16")


class BackboneConfig(BaseModel):
    """The shared backbone: which one to build and the processor settings that shape its inputs.

    The one type of both the service's ``[backbone]`` settings and the model side
    (``nexus.model.backbone.SharedBackbone``); checks that need the family's code (its offline presets, its
    image patch size) run where the model is built (``nexus.model.backbone.check``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    family: str = Field("qwen3vl", description=f"backbone family: {' | '.join(BACKBONE_FAMILIES)}")
    size: str = Field("tiny", description="offline preset (random weights under a fixed seed), ignored when "
                      "local_path is set")
    local_path: str | None = Field(None, description="a Hugging Face checkpoint directory (from_pretrained); the "
                                   "service resolves it to an absolute path, since its processes run elsewhere")
    image_size: int = Field(64, ge=16, description="square side every camera image is resized to")
    dtype: str = Field("float32", description="float32 on CPU (bfloat16 is 3-4x slower there), bfloat16 on GPU")
    device: str = Field("cpu", description="torch device of the backbone")

    @model_validator(mode="after")
    def _known(self) -> BackboneConfig:
        if self.family not in BACKBONE_FAMILIES:
            raise ValueError(f"unknown backbone family {self.family!r} (supported: {sorted(BACKBONE_FAMILIES)})")
        if self.dtype not in BACKBONE_DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (one of {sorted(BACKBONE_DTYPES)})")
        return self

    def model_key(self) -> str:
        """Names the weights and numerics (not the input settings): one resident model per model key."""
        return f"{self.family}:{self.local_path or self.size}:{self.dtype}"

    def compat_key(self) -> str:
        """Requests with equal keys may share one backbone forward (``nexus.model.backbone.compatible``)."""
        return f"{self.model_key()}@{self.image_size}px"


def checkpoint_dir(backbone: BackboneConfig) -> BackboneConfig:
    """The service's backbone with its checkpoint directory checked and made absolute: it must exist and hold
    a model of the family (never a hub name)."""
    if backbone.local_path is None:
        return backbone
    path = Path(backbone.local_path).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"backbone local_path {backbone.local_path!r} is not a Hugging Face checkpoint "
                         "directory (no config.json there)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    expected = CHECKPOINT_MODEL_TYPES.get(backbone.family)
    if expected is not None and model_type not in expected:
        fits = [f for f, types in CHECKPOINT_MODEL_TYPES.items() if model_type in types]
        raise ValueError(f"backbone checkpoint {str(path)!r} is a {model_type!r} model, not a {backbone.family!r} "
                         "backbone" + (f" (use family {fits[0]!r})" if fits else ""))
    return backbone.model_copy(update={"local_path": str(path)})


class HealthSettings(BaseModel):
    """Timeouts and restart budgets of the health manager (``nexus.control.health.manager``).

    Every worker sends a heartbeat each ``nexus.wire.messages.HEARTBEAT_S`` (1 s) listing the roles it hosts."""

    model_config = ConfigDict(extra="forbid")
    suspect_after_s: float = Field(10.0, gt=0, description="no heartbeat this long: the role is suspect")
    fail_after_s: float = Field(60.0, gt=0, description="no heartbeat this long: failed, its worker is restarted")
    producer_stall_s: float = Field(300.0, gt=0, description="a rollout/dataset producer without progress: suspect")
    restart_budget: int = Field(5, ge=0, description="in-place restarts of one role allowed within budget_window_s")
    budget_window_s: float = Field(600.0, gt=0, description="the window restart_budget counts restarts in")

    @model_validator(mode="after")
    def _suspect_before_failed(self) -> HealthSettings:
        if not 0 < self.suspect_after_s < self.fail_after_s:
            raise ValueError(f"need 0 < suspect_after_s < fail_after_s, got suspect_after_s={self.suspect_after_s:g}, "
                             f"fail_after_s={self.fail_after_s:g}")
        return self


class DispatchSettings(BaseModel):
    """How training items, jobs and simulator places are dispatched (``nexus.control.dispatch.dispatcher``, the training
    queue, admission and the flows); the schedulers (``schedulers/*.toml``) set most of them."""

    model_config = ConfigDict(extra="forbid")
    max_concurrent_updates: int = Field(1, ge=1, description="training items running at once on the actor group")
    item_attempts: int = Field(2, ge=1, description="runs of an update that raises before its job fails")
    rollout_attempts: int = Field(3, ge=1, description="runs of a failing rollout (same episodes) before its job fails")
    queue_order: Literal["fifo", "priority", "critical"] = Field(
        "priority", description="training queue: 'priority' (highest TenantSpec.priority first, FIFO within "
        "one), 'fifo' (submission order, priorities ignored) or 'critical' (items that unblock a producer — "
        "RL — before filler, then the job with the most remaining work: its measured item time x items left)")
    isolated: bool = Field(False, description="the isolated baseline: a job waits 'queued' until no other "
                           "tenant's job runs (tenants one after another, FIFO by submission)")
    eval_fanout: int = Field(2, ge=1, description="rollout tasks an evaluation job splits its episodes over")
    rollout_split: int = Field(1, ge=1, description="an RL batch is split over up to this many rollout tasks at "
                               "once (one wave of a producer's envs each; when: rollout_split_rule); 1: each job's "
                               "own RLJob.split only")
    rollout_split_rule: SplitRule = Field(
        "free", description="when rollout_split applies: 'free' (only while that many simulator places are free "
        "that no tenant waits for: the split follows the moment's free places) or 'always' (every RL batch, the "
        "parts queueing for places like any rollout task: the split does not depend on timing)")
    sim_order: SimOrder = Field(
        "fair", description="who gets a freed simulator place: 'fair' (the tenant holding the fewest: max-min fair "
        "share) or 'critical' (the tenant whose running RL jobs have the most simulator work left — its updates "
        "left x its simulator seconds per update so far —, so the job on the critical path is not the one left "
        "alone at the end; a job's parts in flight stay bounded by its max_inflight x split)")


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
    max_sft_steps: int = Field(100_000, ge=1, description="steps of one SFT job")
    max_batch_size: int = Field(1024, ge=1, description="SFT batch size")
    max_rl_updates: int = Field(10_000, ge=1, description="updates of one RL job")
    max_episodes_per_batch: int = Field(64, ge=1, description="episodes of one RL batch")
    max_collectors: int = Field(8, ge=1, description="rollout collectors of one RL job")
    max_eval_episodes: int = Field(500, ge=1, description="episodes of one evaluation job")
    max_update_epochs: int = Field(32, ge=1, description="PPO epochs over one RL batch")
    max_concurrent_evals: int = Field(2, ge=1, description="evaluation jobs of one tenant queued or running")
    max_priority: int = Field(10, ge=0, description="|TenantSpec.priority| (priorities share one actor)")
    max_seed: int = Field(600, ge=0, description="episode seeds derived from it stay below 2**32 (simulators)")
    max_inflight: int = Field(8, ge=1, description="cap of TenantSpec.max_inflight")
    default_max_inflight: int = Field(2, ge=1, description="TenantSpec.max_inflight of a tenant that leaves it "
                                      "unset (training items admitted at once; at most max_inflight)")
    default_max_staleness: int = Field(128, ge=0, description="TenantSpec.max_staleness of a tenant that leaves "
                                       "it unset")
    max_queued_ops: int = Field(8, ge=1, description="low-level calls of one tenant waiting at the gateway")
    max_inflight_predicts: int = Field(8, ge=1, description="predicts of one tenant queued or running at the "
                                       "gateway at once; past it 429 with Retry-After (qos.max_gateway_predicts "
                                       "bounds all tenants together)")
    max_batch_rows: int = Field(4096, ge=1, description="samples in one forward_backward batch")
    max_instruction_chars: int = Field(2000, ge=1, description="characters of one instruction")
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
    inference engine, the update), so a scheduler can set any of them.
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
    sync_mode: Literal["lazy", "eager"] = Field(
        "lazy", description="weight sync to inference. lazy: a new head goes to inference only when something "
        "will use it (an RL job's rollouts, every sync_every versions, the job's end); eager: every version")
    sync_every: int = Field(0, ge=0, description="lazy sync: also push every N versions (0: never)")


class QosSettings(BaseModel):
    """Serving predicts at QoS: the gateway's predict budgets, gathering and fair share.

    Predicts past a budget are refused at once with 429 (``nexus.errors.Overloaded``) instead of waiting
    without bound; admitted ones wait in per-tenant queues that the gateway serves round-robin, gathered
    into one call per engine."""

    model_config = ConfigDict(extra="forbid")
    max_gateway_predicts: int = Field(64, ge=1, description="predicts of all tenants queued or running at "
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


class GatewaySettings(BaseModel):
    """The gateway's HTTP server (``nexus.gateway``)."""

    model_config = ConfigDict(extra="forbid")
    http_parser: Literal["httptools", "h11"] = Field("httptools", description="the gateway's HTTP/1.1 parser "
                                                     "(uvicorn's; httptools: C, h11: pure Python)")
    event_loop: Literal["uvloop", "asyncio"] = Field("uvloop", description="the gateway's event loop "
                                                     "(uvloop: libuv's, asyncio: the standard library's)")
    predict_fast_path: bool = Field(True, description="the gateway serves a predict without FastAPI's routing and "
                                    "dependencies (the same answers; nexus.gateway.fast_predict)")
    engine_stream: bool = Field(True, description="the gateway sends its predicts to the engine's worker over a "
                                "direct stream (asyncio, the cluster's TLS) instead of Dask's comm "
                                "(nexus.wire.engine_stream; experiments/serving)")


class GcSettings(BaseModel):
    """Python's garbage collector in the gateway and the inference engines' workers (``nexus.deploy.gc_tuning``)."""

    model_config = ConfigDict(extra="forbid")
    freeze: bool = Field(True, description="the gateway and each inference engine's worker freeze the objects "
                         "alive after start-up (gc.freeze): full collections no longer walk them")
    gen0_threshold: int = Field(10_000, ge=0, description="the young generation's collection threshold in the "
                                "gateway and the engines' workers (0: Python's, 700); a request's objects are "
                                "mostly freed by reference counting, so collections become rare")


class SimulatorSettings(BaseModel):
    """How tenants' rollout and evaluation tasks share the simulator places (``nexus.control.dispatch.sim_share``)."""

    model_config = ConfigDict(extra="forbid")
    fair_share: bool = Field(True, description="when several tenants wait, a freed simulator place goes by "
                             "dispatch.sim_order (False: Dask's order, first come first served)")
    task_episodes: int = Field(8, ge=1, description="an evaluation's rollout tasks run at most this many "
                               "episodes each, so simulator places can change hands between them")


class CacheSettings(BaseModel):
    """The inference engines' caches (``nexus.model.prefix_cache``, ``nexus.model.head_bank``)."""

    model_config = ConfigDict(extra="forbid")
    prefix_cache_mb: float = Field(64.0, ge=0, description="an inference engine keeps the backbone features of "
                                   "image-free prefixes (a state-only tenant's instruction) up to this size, so "
                                   "their predicts run the tenant's head only (0: off)")
    head_bank_tenants: int = Field(64, ge=0, description="an inference engine stacks the Gaussian OFT heads of up "
                                   "to this many tenants per head shape and runs a group's rows of several of them "
                                   "as one batched forward (0: off, one head call per tenant)")


class OpenpiSettings(BaseModel):
    """The gateway's openpi-compatible policy endpoint (``nexus.gateway.openpi``): robots running
    ``openpi-client`` drive their tenant's policy over a WebSocket, the tenant's token as the API key."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="serve the openpi WebSocket endpoint from the gateway process")
    bind_address: str | None = Field(None, description="address the endpoint binds (default: the gateway's, "
                                     "loopback by default)")
    port: int = Field(0, ge=0, le=65535, description="its own port (0: any free port; written to gateway.json)")
    keys: dict[str, dict[str, str]] = Field(default_factory=dict, description="per tenant: openpi observation key "
                                            "-> the tenant's field ('state', 'instruction', 'images.<camera>'); "
                                            "unset: observation/image, observation/wrist_image -> the first two "
                                            "cameras, observation/state -> state, prompt -> instruction")
    max_batch: int = Field(8, ge=1, le=64, description="observations of one batch frame")
    max_connections: int = Field(16, ge=1, description="open connections of one tenant (past it the handshake is "
                                 "refused with 429)")
    overload_wait_s: float = Field(10.0, ge=0, description="a frame refused for a budget or the fair share "
                                   "(what HTTP answers 429) is tried again after retry_after_s for up to this long "
                                   "before its error frame: a robot waits its turn instead of losing its connection")
    send_timeout_s: float = Field(30.0, gt=0, description="a reply the client does not take within this long "
                                  "closes its connection (a robot that stopped reading holds nothing else)")


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
        "default: no (the tracker goes on an INFER worker, as in the paper's layout)")
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


# settings that moved (old dotted key -> where it lives now): a file that still uses one is refused naming the new
# key, never silently ignored or rewritten
MOVED: dict[str, str] = {
    "retention": "limits.max_versions_kept and limits.max_checkpoints_kept",
    "retention.keep_last": "limits.max_versions_kept", "retention.keep_checkpoints": "limits.max_checkpoints_kept",
    "datapath.sync_policy": "datapath.sync_mode",
    "dispatch.default_max_inflight": "limits.default_max_inflight",
    "dispatch.default_max_staleness": "limits.default_max_staleness",
    "qos.max_inflight_predicts": "qos.max_gateway_predicts",
    "qos.gc_freeze": "gc.freeze", "qos.gc_gen0_threshold": "gc.gen0_threshold",
    "qos.sim_fair_share": "simulators.fair_share", "qos.sim_task_episodes": "simulators.task_episodes",
    "qos.prefix_cache_mb": "caches.prefix_cache_mb", "qos.head_bank_tenants": "caches.head_bank_tenants",
    "qos.gateway_http": "gateway.http_parser", "qos.gateway_loop": "gateway.event_loop",
    "qos.predict_fast_path": "gateway.predict_fast_path",
}


def moved_keys(doc: Mapping[str, Any]) -> list[str]:
    """``old -> new`` for every moved key (:data:`MOVED`) that ``doc`` (a service file's data) still uses."""
    found = []
    for old, new in MOVED.items():
        section, _, key = old.rpartition(".")
        table = doc.get(section) if section else doc
        if isinstance(table, Mapping) and key in table:
            found.append(f"{old} is now {new}")
    return found


def is_loopback(host: str) -> bool:
    """``host`` names this machine's loopback interface (only local users reach what listens there)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServiceConfig(BaseModel):
    """The service's settings: one home per setting (``tests/test_settings_homes.py``).

    A scheduler (``schedulers/<name>.toml``, :mod:`nexus.config.scheduling`) is a named overlay of these same keys:
    the one ``scheduler`` names applies over the defaults, and the settings this config sets itself win."""

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
    limits: ServiceLimits = Field(ServiceLimits(), description="quotas and limits of one tenant")
    tenant_limits: dict[str, dict[str, int | float]] = Field(default_factory=dict,
                                                       description="per-tenant overrides of `limits`")
    backbone: BackboneConfig = Field(BackboneConfig(), description="the shared backbone")
    infer_max_wait_s: float = Field(0.005, ge=0, description="inference group: max wait T (s)")
    infer_max_batch: int = Field(8, ge=1, description="inference group: target size B (rows)")
    routing: Literal["static", "load"] = Field(
        "static", description="tenants to inference engines: 'static' (spread by count, moved only when the "
        "pool changes) or 'load' (re-balanced every few seconds by each tenant's measured inference load)")
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
    health: HealthSettings = Field(HealthSettings(), description="the health manager")
    dispatch: DispatchSettings = Field(DispatchSettings(), description="training dispatch and admission")
    datapath: DataPathSettings = Field(DataPathSettings(), description="the data path")
    qos: QosSettings = Field(QosSettings(), description="serving predicts at QoS")
    gateway: GatewaySettings = Field(GatewaySettings(), description="the gateway's HTTP server")
    gc: GcSettings = Field(GcSettings(), description="garbage collection in the gateway and engines")
    simulators: SimulatorSettings = Field(SimulatorSettings(), description="sharing the simulator places")
    openpi: OpenpiSettings = Field(OpenpiSettings(), description="the openpi-compatible robot endpoint")
    caches: CacheSettings = Field(CacheSettings(), description="the inference engines' caches")
    cluster: ClusterSettings = Field(ClusterSettings(), description="the embedded local deployment")

    scheduler: str = Field(DEFAULT_SCHEDULER, description="the scheduler: a schedulers/ catalog name or a path "
                           "to a scheduler .toml, whose settings apply over the defaults; the settings this config "
                           "sets itself win over the file's")

    @model_validator(mode="before")
    @classmethod
    def _apply_scheduler(cls, data: Any, info: ValidationInfo) -> Any:
        """Refuse moved keys; lay the scheduler's settings under the ones given (a saved config, or a switch's
        result, already holds them: :data:`APPLIED`)."""
        if not isinstance(data, dict):
            return data
        moved = moved_keys(data)
        if moved:
            raise ValueError("; ".join(moved))
        if (info.context or {}).get("scheduler_applied"):
            return data
        sched = Scheduler.load(str(data.get("scheduler", DEFAULT_SCHEDULER)))
        return _under(data, sched.settings)

    @model_validator(mode="after")
    def _checks(self) -> ServiceConfig:
        """The admission default within its cap; the backbone's checkpoint directory checked, made absolute."""
        if self.limits.default_max_inflight > self.limits.max_inflight:
            raise ValueError(f"limits.default_max_inflight {self.limits.default_max_inflight} exceeds "
                             f"limits.max_inflight {self.limits.max_inflight}")
        self.backbone = checkpoint_dir(self.backbone)
        return self

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> ServiceConfig:
        """A saved config (``model_dump``): its sections already hold its scheduler's settings, so the
        scheduler's file is not read again (a worker may not have it)."""
        return cls.model_validate(data, context=APPLIED)

    def with_scheduler(self, sched: Scheduler) -> ServiceConfig:
        """This config under another scheduler: its settings applied over this config's (the rest unchanged),
        ``scheduler`` naming it. Raises :class:`SpecError` (nothing changed) when the result is invalid, e.g. its
        admission default exceeds this service's limits."""
        doc = _merge(self.model_dump(), sched.settings)
        doc["scheduler"] = sched.name
        try:
            return ServiceConfig.restore(doc)
        except ValidationError as e:
            raise SpecError(f"scheduler {sched.name!r}: {describe_validation_error(e)}") from None

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
        """Whether the tracker has a worker of its own (``cluster.tracker_worker``; default: no)."""
        return bool(self.cluster.tracker_worker)

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
                               "written by nexus.deploy.local / nexus scheduler")
        return cls.restore(json.loads(Path(path).read_text()))


class Scheduler(BaseModel):
    """A scheduler: a named overlay of the service's own settings (one ``schedulers/<name>.toml``,
    :mod:`nexus.config.scheduling`), checked by ``ServiceConfig`` itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the catalog name (the file's stem)")
    description: str = Field("", description="one line on what the scheduler does")
    settings: dict[str, Any] = Field(default_factory=dict, description="service settings, as a service file "
                                     "writes them: top-level keys and [section] tables")

    @classmethod
    def load(cls, ref: str) -> Scheduler:
        """A catalog name (``"fifo"`` → ``schedulers/fifo.toml``) or a path to a scheduler file, checked."""
        name, description, settings, where = scheduling.read(ref)
        return cls(name=name, description=description, settings=settings).checked(f"scheduler file {where}")

    def checked(self, where: str) -> Scheduler:
        """This scheduler if its settings are valid service settings; else a :class:`SpecError` naming ``where``
        and each bad field (unknown keys included: a typo is refused, not ignored)."""
        bad = [k for k in ("root", "scheduler") if k in self.settings]  # where the service lives, what it runs
        if bad:
            raise SpecError(f"{where}: field {bad[0]!r} is not a scheduler setting")
        try:
            ServiceConfig.model_validate({"root": ".", **self.settings}, context=APPLIED)
        except ValidationError as e:
            raise SpecError(f"{where}: {describe_validation_error(e, field_words=True)}") from None
        return self

    def with_settings(self, extra: Mapping[str, Any], name: str | None = None) -> Scheduler:
        """This scheduler with more settings (``extra`` wins; tables merged key by key), checked."""
        name = name or self.name
        return Scheduler(name=name, description=self.description,
                         settings=_merge(self.settings, extra)).checked(f"scheduler {name!r}")

    def value(self, dotted: str) -> Any:
        """The value this scheduler sets for ``section.key`` (``KeyError`` if it sets none)."""
        node: Any = self.settings
        for part in dotted.split("."):
            node = node[part]
        return node

    def setting(self, name: str) -> Any:
        """The value this scheduler sets for the setting ``name`` (its one home), e.g. ``"queue_order"``."""
        (path,) = setting_homes()[name]
        return self.value(path)


def setting_homes(model: type[BaseModel] = ServiceConfig, prefix: str = "") -> dict[str, list[str]]:
    """Every setting's name -> the dotted paths that hold it (one each: ``tests/test_settings_homes.py``)."""
    homes: dict[str, list[str]] = {}
    for name, f in model.model_fields.items():
        sections = [a for a in (f.annotation, *get_args(f.annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        for section in sections:
            for key, paths in setting_homes(section, f"{prefix}{name}.").items():
                homes.setdefault(key, []).extend(paths)
        if not sections:
            homes.setdefault(name, []).append(prefix + name)
    return homes


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Settings named by their names alone (``{"queue_order": "critical"}``, each name has one home) as a
    service file writes them (``{"dispatch": {"queue_order": "critical"}}``)."""
    homes = setting_homes()
    out: dict[str, Any] = {}
    for name, value in flat.items():
        paths = homes.get(name, [])
        if len(paths) != 1:
            raise SpecError(f"setting {name!r}: " + (f"in several places {paths}" if paths else "no such setting"))
        *sections, key = paths[0].split(".")
        node = out
        for sec in sections:
            node = node.setdefault(sec, {})
        node[key] = value
    return out


# ------------------------------------------------------------------------------------------------ files
def describe_validation_error(e: ValidationError, **how: Any) -> str:
    """A pydantic error as one line: ``field.path: message; ...`` (``how``: :func:`describe_errors`'s options)."""
    return describe_errors(e.errors(), **how)


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


def _under(top: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` with ``base``'s settings where ``top`` has none (tables merged key by key; a section given as a
    model counts its explicitly set fields)."""
    out = dict(top)
    for k, v in base.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, Mapping):
            mine = out[k].model_dump(exclude_unset=True) if isinstance(out[k], BaseModel) else out[k]
            if isinstance(mine, Mapping):
                out[k] = _under(mine, v)
    return out


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
