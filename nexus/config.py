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


class ServiceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="service folder: tenants' output dirs, MLflow store, logs")
    backbone: BackboneSettings = BackboneSettings()
    infer_max_wait_s: float = Field(0.005, ge=0, description="inference queue: max wait T")
    infer_max_batch: int = Field(8, ge=1, description="inference queue: target group size B")
    tracking_uri: str | None = Field(None, description="MLflow URI; default sqlite in root")
    experiment: str | None = Field(None, description="MLflow experiment; default: one per service root")
    checkpoint_every: int = Field(0, ge=0, description="DeepSpeed checkpoint every N versions (0: job end)")

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
