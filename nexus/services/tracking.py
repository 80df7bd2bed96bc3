"""MLflow tracking: one experiment per service, one run per tenant job, owned by an actor on a worker.

Never runs in the scheduler process: the Master sends metric events to this actor without
waiting; the actor's calls run one after another in the worker's actor thread, so a slow tracking
store slows nobody else. Works the same with the default local sqlite store or a remote server.
Metric steps are policy versions; evaluations are nested runs under the tenant's training run.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

from nexus.config import ServiceConfig

PLOTTED = ("loss", "heldout_action_mse", "return", "success_rate", "v_loss", "approx_kl")


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
            name = self.config.resolved_experiment()
            exp = self._client.get_experiment_by_name(name)
            self._experiment_id = exp.experiment_id if exp else self._client.create_experiment(name)
        return self._client

    def start_run(self, job_id: str, tenant: str, kind: str, params: dict[str, Any],
                  parent_job: str | None = None) -> str:
        from mlflow.entities import Param

        if job_id in self.runs:  # a resent call (the tracker was restarted): the run exists
            return self.runs[job_id]
        client = self._mlflow()
        existing = self._find_run(job_id)
        if existing is not None:
            self.runs[job_id] = existing
            return existing
        tags = {"nexus.tenant": tenant, "nexus.job": job_id, "nexus.kind": kind, "nexus.root": self._root()}
        if parent_job in self.runs:
            tags["mlflow.parentRunId"] = self.runs[parent_job]
        run = client.create_run(self._experiment_id, run_name=job_id, tags=tags)
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

    def end_run(self, job_id: str, status: str, artifacts: list[str], result: dict[str, Any],
                history: list[dict[str, Any]] | None = None, metering: dict[str, float] | None = None) -> None:
        if job_id not in self.runs:
            return
        client, run_id = self._mlflow(), self.runs[job_id]
        for service, seconds in (metering or {}).items():
            client.log_metric(run_id, f"metered_{service}_s", float(seconds))
        from nexus.services.model_registry import log_policy_models

        for path in log_policy_models(run_id, artifacts, self.config.resolved_tracking_uri()):  # policies: the model
            if Path(path).exists():
                client.log_artifact(run_id, path)
        client.log_dict(run_id, result, "result.json")
        if history:
            with tempfile.TemporaryDirectory() as tmp:
                png = plot_history(history, Path(tmp) / f"{job_id}-curves.png", title=job_id)
                if png is not None:
                    client.log_artifact(run_id, str(png), "plots")
        client.set_terminated(run_id, "FINISHED" if status == "done" else "FAILED")

    def flush(self) -> bool:
        return True

    # -- recovery (a restarted tracker, a restarted service) ----------------------------------------
    def _root(self) -> str:
        return str(Path(self.config.root).resolve())

    def _find_run(self, job_id: str) -> str | None:
        client = self._mlflow()
        found = client.search_runs([self._experiment_id], filter_string=f"tags.`nexus.job` = '{job_id}'",
                                   max_results=1)
        return found[0].info.run_id if found else None

    def reopen(self, runs: dict[str, str]) -> int:
        """Continue the given runs (job id -> run id) after this tracker replaced a lost one."""
        self._mlflow()
        self.runs.update(runs)
        return len(self.runs)

    def fail_interrupted(self, before_ms: int, root: str, reason: str) -> list[str]:
        """Mark FAILED every run of this service root still RUNNING from before ``before_ms`` (a crashed
        service's jobs); returns their job ids."""
        client = self._mlflow()
        runs = client.search_runs([self._experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=10_000)
        mine = self._root()  # the root this tracker serves (``root`` is the caller's view of it)
        failed = []
        for r in runs:
            if r.info.start_time < before_ms and r.data.tags.get("nexus.root", mine) in (mine, root):
                client.set_tag(r.info.run_id, "nexus.error", reason)
                client.set_terminated(r.info.run_id, "FAILED")
                failed.append(r.data.tags.get("nexus.job", r.info.run_id))
        return failed


def plot_history(history: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Learning curves (vs policy version) of the metrics a job logged; None if it logged none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in PLOTTED if any(k in h for h in history)]
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
    for ax, k in zip(axes[0], keys, strict=True):
        pts = [(h["step"], h[k]) for h in history if k in h]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_xlabel("policy version")
        ax.set_title(k)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
