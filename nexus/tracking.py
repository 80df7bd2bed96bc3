"""MLflow tracking: one run per tenant job, owned by an actor on a worker.

Never runs in the scheduler process: the Master sends metric events to this actor without
waiting; the actor's calls run one after another in the worker's actor thread, so a slow tracking
store slows nobody else. Works the same with the default local sqlite store or a remote server.
"""

from __future__ import annotations

import math
import time
from typing import Any

from nexus.config import ServiceConfig


class Tracker:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = ServiceConfig.model_validate(config)
        self._client = None
        self._experiment_id: str | None = None
        self.runs: dict[str, str] = {}  # job id -> MLflow run id

    def _mlflow(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.config.resolved_tracking_uri())
            exp = self._client.get_experiment_by_name(self.config.experiment)
            self._experiment_id = (exp.experiment_id if exp else
                                   self._client.create_experiment(self.config.experiment))
        return self._client

    def start_run(self, job_id: str, tenant: str, kind: str, params: dict[str, Any]) -> str:
        from mlflow.entities import Param

        client = self._mlflow()
        run = client.create_run(self._experiment_id, run_name=job_id,
                                tags={"nexus.tenant": tenant, "nexus.job": job_id, "nexus.kind": kind})
        flat = {k: v for k, v in _flatten(params).items() if v is not None}
        client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])
        self.runs[job_id] = run.info.run_id
        return run.info.run_id

    def log_metrics(self, job_id: str, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()
              if isinstance(v, int | float) and math.isfinite(float(v))]
        if ms and job_id in self.runs:
            self._mlflow().log_batch(self.runs[job_id], metrics=ms)

    def end_run(self, job_id: str, status: str, artifacts: list[str], result: dict[str, Any]) -> None:
        if job_id not in self.runs:
            return
        client, run_id = self._mlflow(), self.runs[job_id]
        for path in artifacts:
            client.log_artifact(run_id, path)
        client.log_dict(run_id, result, "result.json")
        client.set_terminated(run_id, "FINISHED" if status == "done" else "FAILED")

    def flush(self) -> bool:
        return True


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
