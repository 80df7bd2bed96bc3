"""MLflow tracking: one experiment per service, one run per tenant job, owned by an actor on a worker.

Never runs in the scheduler process: the Master sends metric events to this actor without
waiting; the actor's calls run one after another in the worker's actor thread, so a slow tracking
store slows nobody else. Works the same with the default local sqlite store or a remote server.

What a run holds, faithfully:

* the experiment is tagged as a model-training experiment (``mlflow.experimentKind`` =
  ``custom_model_development``), so MLflow 3's UI shows runs and charts, not its GenAI view
* metric names say what they measure: ``train/…`` (one point per update, step = the version it
  produced), ``rollout/…`` (one point per RL batch, step = cumulative env steps; ``rollout/policy_version``
  says which policy collected it), ``eval/…`` (step = the evaluated version), ``queue/…`` and
  ``system/…`` (update and weight-sync times, metered device-seconds); steps only grow within a series
* start and end times are the job's own (submitted, ended), not when this actor got to them
* artifacts are the manifest and the weights of the version the job evaluated or produced
* evaluations are nested runs under the tenant's training run
* low-level ops are grouped in one run per client connection (kind ``ops``: ``nexus.control.jobs.op_runs``)
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from nexus.config.service import ServiceConfig
from nexus.export.mlflow_model import log_policy_models
from nexus.wire.history import SYSTEM, plot_curves, pyplot

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's classic (non-GenAI) experiment view
RUN_STATUS = {"done": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}  # a job's state -> its run's
MAX_METRICS_PER_WRITE = 1000  # MLflow's limit for one log_batch


def metric_name(kind: str, key: str) -> str:
    """The MLflow name of a history field of a row of ``kind`` (see ``nexus.wire.history``)."""
    if key in SYSTEM:
        return f"system/{key}"
    if kind == "rollout" and key == "version":
        return "rollout/policy_version"
    return f"{kind}/{key}"


class Tracker:
    def __init__(self, config: ServiceConfig | dict[str, Any]) -> None:
        self.config = config if isinstance(config, ServiceConfig) else ServiceConfig.restore(config)
        self._client = None
        self._experiment_id: str | None = None
        self.runs: dict[str, str] = {}  # job id -> MLflow run id
        self._last_step: dict[tuple[str, str], int] = {}  # (job, metric) -> last step logged
        self._adopted: set[str] = set()  # runs an earlier tracker logged to: their last steps are in MLflow
        self._connecting = threading.Lock()  # ``warm`` connects in the tracker's thread; a caller may ask at once

    def warm(self) -> None:
        """The tracker's one-time costs, paid at its start rather than inside the first job: importing MLflow
        (seconds of CPU on a busy host), its client and the experiment, and matplotlib (each job's curves are drawn
        at its end). A store that fails here is asked again by the first call that needs it."""
        self._mlflow()
        pyplot()

    def _mlflow(self):
        with self._connecting:
            if self._client is None:
                from mlflow.tracking import MlflowClient

                client = MlflowClient(tracking_uri=self.config.resolved_tracking_uri())
                name = self.config.resolved_experiment()
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    self._experiment_id = client.create_experiment(
                        name, artifact_location=self._artifact_location(), tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
                else:
                    self._experiment_id = exp.experiment_id
                    if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
                        client.set_experiment_tag(self._experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
                self._client = client  # kept once its experiment is known: a store that failed is asked again
        return self._client

    def _artifact_location(self) -> str | None:
        """A local store keeps its artifacts in the service root (MLflow's default, ``./mlruns``, would land
        in whatever directory the tracker process runs in); a tracking server keeps its own default."""
        uri = self.config.resolved_tracking_uri()
        if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
            return (Path(self.config.root).resolve() / "mlartifacts").as_uri()
        return None

    @property
    def experiment_id(self) -> str:
        self._mlflow()
        return self._experiment_id  # type: ignore[return-value]

    def start_run(self, job_id: str, tenant: str, kind: str, params: dict[str, Any],
                  parent_job: str | None = None, start_time: float | None = None, run_name: str | None = None,
                  tags: dict[str, str] | None = None) -> str:
        """``job_id``: the run's key (tag ``nexus.job``, default name); ``tags``: more of them (e.g. an ops
        run's ``nexus.session``)."""
        from mlflow.entities import Param

        if job_id in self.runs:  # a resent call (the tracker was restarted): the run exists
            return self.runs[job_id]
        client = self._mlflow()
        existing = self._find_run(job_id)
        if existing is not None:
            self.runs[job_id] = existing
            self._adopted.add(job_id)
            return existing
        tags = {**(tags or {}), "nexus.tenant": tenant, "nexus.job": job_id, "nexus.kind": kind,
                "nexus.root": self._root()}
        if parent_job in self.runs:
            tags["mlflow.parentRunId"] = self.runs[parent_job]
        run = client.create_run(self._experiment_id, run_name=run_name or job_id, tags=tags,
                                start_time=int((start_time or time.time()) * 1000))
        flat = {k: v for k, v in _flatten(params).items() if v is not None}
        client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])
        self.runs[job_id] = run.info.run_id
        return run.info.run_id

    def log_metrics(self, job_id: str, metrics: dict[str, Any], step: int, kind: str = "train") -> None:
        self.log_metrics_many([{"job_id": job_id, "metrics": metrics, "step": step, "kind": kind}])

    def log_metrics_many(self, rows: list[dict[str, Any]]) -> None:
        """Several ``log_metrics`` calls (keyword dicts, in order) in one MLflow write per run: each write
        is one store transaction (a sqlite commit costs ~6 ms of CPU, whatever its size), and a busy
        service logs tens of rows a second."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        by_run: dict[str, list[Metric]] = {}
        for row in rows:
            job_id, step, kind = row["job_id"], int(row["step"]), row.get("kind", "train")
            if job_id not in self.runs:
                continue
            for k, v in row["metrics"].items():
                if not isinstance(v, int | float) or not math.isfinite(float(v)):
                    continue
                if kind == "train" and k == "version":
                    continue  # the step already is the version
                name = metric_name(kind, k)
                last = self._last_step.get((job_id, name))
                if last is None and job_id in self._adopted:
                    last = self._logged_step(job_id, name)
                if last is not None and step <= last:
                    continue  # a repeated step would draw a zig-zag; the Master logs each series in step order
                self._last_step[(job_id, name)] = step
                by_run.setdefault(self.runs[job_id], []).append(Metric(name, float(v), ts, step))
        failed: Exception | None = None
        for run_id, ms in by_run.items():  # one run's failed write does not lose the others'
            try:
                for i in range(0, len(ms), MAX_METRICS_PER_WRITE):
                    self._mlflow().log_batch(run_id, metrics=ms[i:i + MAX_METRICS_PER_WRITE])
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def end_run(self, job_id: str, status: str, artifacts: list[str], result: dict[str, Any],
                history: list[dict[str, Any]] | None = None, metering: dict[str, float] | None = None,
                end_time: float | None = None) -> None:
        from mlflow.entities import Metric

        if job_id not in self.runs:
            return
        client, run_id = self._mlflow(), self.runs[job_id]
        ts = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(f"system/metered_{service}_s", float(seconds), ts, 0)
                                          for service, seconds in (metering or {}).items()])
        if isinstance(result.get("version"), int):
            client.set_tag(run_id, "nexus.version", str(result["version"]))

        for path in log_policy_models(run_id, artifacts, self.config.resolved_tracking_uri()):  # policies: the model
            if Path(path).exists():
                client.log_artifact(run_id, path, "weights" if path.endswith(".pt") else None)
        client.log_dict(run_id, result, "result.json")
        if history:
            with tempfile.TemporaryDirectory() as tmp:
                png = plot_curves(history, Path(tmp) / f"{job_id}-curves.png", title=job_id)
                if png is not None:
                    client.log_artifact(run_id, str(png), "plots")
        client.set_terminated(run_id, RUN_STATUS.get(status, "FAILED"), end_time=int((end_time or time.time()) * 1000))

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
        self._adopted |= set(runs) - set(self.runs)
        self.runs.update(runs)
        return len(self.runs)

    def _logged_step(self, job_id: str, name: str) -> int | None:
        """The last step of a series an earlier tracker logged (a resent batch must not repeat it)."""
        hist = self._mlflow().get_metric_history(self.runs[job_id], name)
        return max((m.step for m in hist), default=None)

    def fail_interrupted(self, before_ms: int, root: str, reason: str,
                         ended: dict[str, list[Any]] | None = None) -> list[str]:
        """Close every run of this service root still RUNNING from before ``before_ms`` (a crashed or killed
        service's): a job whose record says it ended (``ended``: job -> [state, t_end]) gets the record's state
        and end time, the others FAILED with ``reason``. Runs already ended are never touched. Returns the job
        ids marked FAILED."""
        client = self._mlflow()
        runs = client.search_runs([self._experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=10_000)
        mine = self._root()  # the root this tracker serves (``root`` is the caller's view of it)
        ended = ended or {}
        failed = []
        for r in runs:
            if r.info.start_time >= before_ms or r.data.tags.get("nexus.root", mine) not in (mine, root):
                continue
            job = r.data.tags.get("nexus.job", r.info.run_id)
            if job in ended:  # the job ended; only its run's end never arrived
                state, t_end = ended[job]
                client.set_tag(r.info.run_id, "nexus.closed_from_record", "true")
                client.set_terminated(r.info.run_id, RUN_STATUS.get(state, "FAILED"),
                                      int(t_end * 1000) if isinstance(t_end, int | float) else None)
                continue
            client.set_tag(r.info.run_id, "nexus.error", reason)
            client.set_terminated(r.info.run_id, "FAILED")
            failed.append(job)
        return failed


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
