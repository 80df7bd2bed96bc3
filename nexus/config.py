"""Service-wide settings, shared by the scheduler plugin and every worker through one JSON file.

The file's path travels in the environment variable ``NEXUS_SERVICE_CONFIG`` (set by
``nexus.cluster`` for the processes it starts, or by an operator for CLI-started workers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

ENV_VAR = "NEXUS_SERVICE_CONFIG"
# Hugging Face ``model_type`` of each backbone family's checkpoints (config.json)
CHECKPOINT_MODEL_TYPES = {"qwen3vl": ("qwen3_vl",), "paligemma": ("paligemma",)}


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
