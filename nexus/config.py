"""Service-wide settings, shared by the scheduler plugin and every worker through one JSON file.

The file's path travels in the environment variable ``NEXUS_SERVICE_CONFIG`` (set by
``nexus.cluster`` for the processes it starts, or by an operator for CLI-started workers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

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
    backbone: BackboneSettings = BackboneSettings()
    infer_max_wait_s: float = Field(0.005, ge=0, description="inference queue: max wait T")
    infer_max_batch: int = Field(8, ge=1, description="inference queue: target group size B")
    tracking_uri: str | None = Field(None, description="MLflow URI; default sqlite in root")
    experiment: str | None = Field(None, description="MLflow experiment; default: one per service root")
    checkpoint_every: int = Field(0, ge=0, description="DeepSpeed checkpoint every N versions (0: job end)")
    datapath: DataPathSettings = DataPathSettings()

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
