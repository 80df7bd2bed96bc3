"""Service-wide settings, shared by the scheduler plugin and every worker through one JSON file.

The file's path travels in the environment variable ``NEXUS_SERVICE_CONFIG`` (set by
``nexus.cluster`` for the processes it starts, or by an operator for CLI-started workers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

ENV_VAR = "NEXUS_SERVICE_CONFIG"


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


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="service folder: tenants' output dirs, MLflow store, logs")
    backbone: BackboneSettings = BackboneSettings()
    infer_max_wait_s: float = Field(0.005, ge=0, description="inference queue: max wait T")
    infer_max_batch: int = Field(8, ge=1, description="inference queue: target group size B")
    tracking_uri: str | None = Field(None, description="MLflow URI; default sqlite in root")
    experiment: str | None = Field(None, description="MLflow experiment; default: one per service root")
    checkpoint_every: int = Field(1, ge=0, description="DeepSpeed checkpoint every N versions, saved before the "
                                  "version is published (0: at job end only)")
    keep_checkpoints: int = Field(2, ge=1, description="DeepSpeed checkpoint tags kept per tenant (older are pruned)")
    inference_engines: int = Field(1, ge=1, description="inference engines at start (Nexus.scale_inference changes it)")
    actor_ranks: int = Field(1, ge=1, description="ranks of the actor group (workers with resource ACTOR)")
    health: HealthSettings = HealthSettings()
    dispatch: DispatchSettings = DispatchSettings()

    @property
    def tenants_dir(self) -> Path:
        return Path(self.root) / "tenants"

    def resolved_tracking_uri(self) -> str:
        return self.tracking_uri or f"sqlite:///{Path(self.root).resolve() / 'mlflow.db'}"

    def resolved_experiment(self) -> str:
        return self.experiment or f"joynexus-{Path(self.root).resolve().name}"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path | None = None) -> ServiceConfig:
        path = path or os.environ.get(ENV_VAR)
        if not path:
            raise RuntimeError(f"no service config: set {ENV_VAR} to the JSON file written by nexus.cluster")
        return cls.model_validate(json.loads(Path(path).read_text()))
