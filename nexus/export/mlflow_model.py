"""An exported policy directory as an MLflow model (``mlflow.pyfunc``), the job's model in its MLflow run.

:class:`PolicyModel` wraps ``nexus.export.policy.load``: the policy directory travels as the model's artifact
and the ``nexus`` package as its code, so ``mlflow.pyfunc.load_model`` and ``mlflow models predict /
serve`` run it in any environment with the pinned requirements (torch, transformers, peft, safetensors).

Model input, one row per observation: a dict of arrays (``state`` [N, P]; ``image.<camera>`` uint8
[N, H, W, 3]; optional ``instruction`` [N]), a pandas DataFrame with those columns, or a list of
observation dicts (``{"state", "images", "instruction"}``). Output: float32 [N, action_dim], the first
action of each chunk as the service's inference engine answers (params ``{"chunk": true}``: the whole
flat chunk; ``{"deterministic": false}``: a sample).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import mlflow
import numpy as np

import nexus
from nexus.export.policy import is_policy_dir, load

ARTIFACT = "policy"
# what the wrapper imports (pinned as in setup.cfg): the model never needs the service's stack
REQUIREMENTS = ["torch==2.13.0", "transformers==5.24.0", "peft==0.21.2", "safetensors==0.8.0", "numpy==2.4.6",
                "pillow==13.0.0", "pydantic==2.14.4", "tokenizers==0.23.3", "pandas"]


class PolicyModel(mlflow.pyfunc.PythonModel):
    """``mlflow.pyfunc`` face of a ``nexus.export.policy`` directory."""

    # no type hints on the pyfunc methods: MLflow would turn them into a (wrong) input schema
    def load_context(self, context):

        self.policy = load(context.artifacts[ARTIFACT])

    def predict(self, context, model_input, params=None):
        params = params or {}
        obs = observations_from_input(model_input, [c.name for c in self.policy.schema.cameras])
        outs = self.policy.predict_actions(obs, deterministic=bool(params.get("deterministic", True)))
        key = "chunk" if params.get("chunk") and self.policy.policy.chunk > 1 else "action"
        return np.stack([o[key] for o in outs]).astype(np.float32)


def observations_from_input(model_input: Any, cameras: list[str]) -> list[dict[str, Any]]:
    """Observation dicts from a pyfunc input (dict of arrays, DataFrame or list of dicts)."""
    if isinstance(model_input, list):
        return [dict(o) for o in model_input]
    if hasattr(model_input, "columns"):  # pandas DataFrame: one row per observation
        columns = {str(c): [np.asarray(v) for v in model_input[c]] for c in model_input.columns}
    elif isinstance(model_input, dict):
        columns = {k: np.asarray(v) for k, v in model_input.items()}
        if "state" in columns and columns["state"].ndim == 1:  # a single observation
            columns = {k: v[None] for k, v in columns.items()}
    else:
        raise TypeError(f"unsupported model input {type(model_input).__name__}: a dict of arrays, a DataFrame or "
                        "a list of observation dicts")
    missing = sorted({"state", *(f"image.{c}" for c in cameras)} - set(columns))
    if missing:
        raise ValueError(f"model input lacks {missing} (got {sorted(columns)})")
    return [{"state": np.asarray(columns["state"][i], np.float32),
             "images": {c: np.asarray(columns[f"image.{c}"][i], np.uint8) for c in cameras},
             "instruction": str(columns["instruction"][i]) if "instruction" in columns else ""}
            for i in range(len(columns["state"]))]


def _code_paths() -> list[str]:
    return [str(Path(nexus.__file__).resolve().parent)]


def save_policy_model(policy_dir: str | Path, path: str | Path) -> str:
    """Save a policy directory as a standalone MLflow model folder at ``path`` (no tracking store)."""
    mlflow.pyfunc.save_model(str(path), python_model=PolicyModel(), artifacts={ARTIFACT: str(policy_dir)},
                             code_paths=_code_paths(), pip_requirements=REQUIREMENTS)
    return str(path)


def log_policy_model(run_id: str, policy_dir: str | Path, tracking_uri: str, name: str = ARTIFACT) -> str:
    """Log a policy directory as the MLflow model of run ``run_id``; returns its ``runs:/`` URI."""
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):  # resumes the job's run; the caller sets its final status after
        mlflow.pyfunc.log_model(name=name, python_model=PolicyModel(), artifacts={ARTIFACT: str(policy_dir)},
                                code_paths=_code_paths(), pip_requirements=REQUIREMENTS)
    return f"runs:/{run_id}/{name}"


def log_policy_models(run_id: str, paths: list[str], tracking_uri: str) -> list[str]:
    """Log the exported policy directories among a job's artifact ``paths`` as its model; returns the others."""
    rest = []
    for p in paths:
        if not is_policy_dir(p):
            rest.append(p)
            continue
        try:
            log_policy_model(run_id, p, tracking_uri)
        except Exception:  # the run still gets the directory, as a plain artifact, and its final status
            logging.getLogger("nexus.tracking").exception("could not log %s as an MLflow model", p)
            rest.append(p)
    return rest
