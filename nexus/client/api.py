"""The tenant's Python API.

High level: connect to a service (or start a local one), create a tenant from a spec, submit an
SFT / RL / Eval job, stream its progress, wait for its result.

Low level, Tinker-style: ``forward_backward(batch, loss)``, ``optim_step()``, ``save_weights()``
and ``predict_action(obs, version=...)``, each returning a future. A tenant's low-level calls run
in the order they were made; each datum is self-contained (observations + actions).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nexus.config import ServiceConfig
from nexus.errors import JobFailed, NotFound
from nexus.features import Observation
from nexus.spec import EvalJob, RLJob, SFTJob, TenantSpec


class Nexus:
    """A connection to a JoyNexus service."""

    def __init__(self, address: str, *, service: Any = None, timeout: float = 120) -> None:
        from distributed import Client

        self.service = service
        self.client = Client(address, timeout=timeout, set_as_default=False)
        self._engine = None

    @classmethod
    def local(cls, root: str | Path = "runs/local", n_sim: int = 2, dashboard_address: str = "127.0.0.1:0",
              **config: Any) -> Nexus:
        """Start the embedded default: a local Dask cluster running the Nexus service."""
        from nexus.cluster import LocalService

        service = LocalService(ServiceConfig(root=str(Path(root).resolve()), **config), n_sim=n_sim,
                               dashboard_address=dashboard_address).start()
        try:
            nx = cls(service.address, service=service)
            nx.client.wait_for_workers(service.n_workers, timeout=180)
        except BaseException:
            service.stop()
            raise
        return nx

    # -- plumbing --------------------------------------------------------------------------
    def call(self, handler: str, **kwargs: Any) -> Any:
        """Call a Nexus handler on the scheduler (its errors are raised here)."""
        return self.client.sync(getattr(self.client.scheduler, handler), **kwargs)

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    def close(self) -> None:
        self.client.close()
        if self.service is not None:
            self.service.stop()

    def __enter__(self) -> Nexus:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- tenants and jobs ------------------------------------------------------------------
    def create_tenant(self, spec: TenantSpec | dict[str, Any]) -> Tenant:
        raw = spec.model_dump() if isinstance(spec, TenantSpec) else dict(spec)
        info = self.call("nexus_create_tenant", spec=raw)
        return Tenant(self, info["tenant"], info)

    def tenant(self, name: str) -> Tenant:
        for t in self.status()["tenants"]:
            if t["tenant"] == name:
                return Tenant(self, name, t)
        raise NotFound(f"unknown tenant {name!r}")

    def status(self) -> dict[str, Any]:
        return self.call("nexus_status")

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def flush(self) -> None:
        """Wait until tracking (MLflow) has written everything sent so far."""
        self.call("nexus_flush")

    def engine(self):
        """The inference engine actor (for direct, low-latency action requests)."""
        if self._engine is None:
            from distributed.actor import Actor

            published = self.client.get_dataset("nexus-inference-engine").result()
            with self.client.as_current():  # the proxy binds to this connection, not a global client
                self._engine = Actor(published._cls, published._address, published.key)
        return self._engine


class Job:
    def __init__(self, nexus: Nexus, job_id: str) -> None:
        self.nexus, self.id = nexus, job_id

    def info(self) -> dict[str, Any]:
        return self.nexus.call("nexus_job", job_id=self.id)

    def stream(self, poll_s: float = 0.5) -> Iterator[dict[str, Any]]:
        """Yield the job's state each time its progress changes, until it ends."""
        last = None
        while True:
            info = self.info()
            key = (info["state"], repr(sorted(info["progress"].items())))
            if key != last:
                last = key
                yield info
            if info["state"] in ("done", "failed"):
                return
            time.sleep(poll_s)

    def follow(self, console: Any = None, poll_s: float = 0.5) -> dict[str, Any]:
        """Wait for the job with a progress bar (steps, updates or episodes); returns its result."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        info = self.info()
        counter = {"sft": "steps", "rl": "updates", "eval": "episodes"}[info["kind"]]
        total = info["spec"][counter]
        with Progress(TextColumn(f"{self.id} ({counter})"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[metric]}"), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task(self.id, total=total, metric="")
            for info in self.stream(poll_s):
                p = {**info["progress"], **(info["result"] or {})}
                metric = next((f"{k} {p[k]:.3f}" for k in ("loss", "return", "success_rate") if k in p), "")
                done = total if info["state"] == "done" and counter == "episodes" else p.get(counter, 0)
                bar.update(task, completed=done, metric=metric)
        return self.result()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.time() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.time())
            info = self.nexus.call("nexus_wait", job_id=self.id, timeout=min(left or 30.0, 30.0))
            if info["state"] == "done":
                return info["result"]
            if info["state"] == "failed":
                raise JobFailed(f"job {self.id} failed: {info['error']}")
            if deadline is not None and time.time() >= deadline:
                raise TimeoutError(f"job {self.id} still {info['state']} after {timeout} s")


class Tenant:
    def __init__(self, nexus: Nexus, name: str, info: dict[str, Any]) -> None:
        self.nexus, self.name, self.info = nexus, name, info
        self._ops = ThreadPoolExecutor(1, thread_name_prefix=f"nexus-{name}")  # keeps call order

    @property
    def version(self) -> int:
        return self.nexus.tenant(self.name).info["version"]

    def submit(self, job: SFTJob | RLJob | EvalJob | dict[str, Any]) -> Job:
        raw = job.model_dump() if not isinstance(job, dict) else job
        return Job(self.nexus, self.nexus.call("nexus_submit", tenant=self.name, job=raw))

    def sft(self, **kw: Any) -> Job:
        return self.submit(SFTJob(**kw))

    def rl(self, **kw: Any) -> Job:
        return self.submit(RLJob(**kw))

    def evaluate(self, **kw: Any) -> Job:
        return self.submit(EvalJob(**kw))

    # -- low level (futures) ---------------------------------------------------------------
    def forward_backward(self, batch: dict[str, Any], loss: str = "sft") -> Future:
        """Accumulate gradients of ``loss`` on a self-contained batch.

        ``batch``: ``observations`` (list of :class:`Observation`), ``actions`` [N, A]; for
        ``loss="ppo"`` also ``logprobs``, ``advantages``, ``returns`` [N] and optional ``ppo``
        (``loss="grpo"``: see ``nexus.services.training._run_op`` for its fields)
        (a PPOConfig dict). The batch goes to a worker directly; the scheduler sees its name only.
        """
        def run() -> dict[str, Any]:
            client = self.nexus.client
            name = f"nexus-op-{self.name}-{uuid.uuid4().hex[:12]}"
            # a list, so the whole dict is one datum under a fresh key (a dict would scatter per key)
            (fut,) = client.scatter([batch], direct=False, hash=False)
            client.publish_dataset(fut, name=name)
            try:
                return self.nexus.call("nexus_op", tenant=self.name, verb="forward_backward", data=name,
                                      loss=loss)
            finally:
                if name in client.list_datasets():
                    client.unpublish_dataset(name)

        return self._ops.submit(run)

    def optim_step(self) -> Future:
        return self._ops.submit(self.nexus.call, "nexus_op", tenant=self.name, verb="optim_step")

    def save_weights(self) -> Future:
        """Publish the current head as a new policy version; the future gives the version."""
        return self._ops.submit(lambda: self.nexus.call("nexus_op", tenant=self.name, verb="save_weights")["version"])

    def export(self, version: int | None, path: str | Path) -> dict[str, Any]:
        """Write policy version ``version`` (None: the current one) as a self-contained directory at ``path``
        (on the service's file system): head and adapter weights in safetensors, the backbone reference,
        preprocessor config, normalization stats and a JSON manifest. ``nexus.policy.load(path)`` runs it
        without a service. Returns the export's summary (path, version, files)."""
        return self.nexus.call("nexus_export", tenant=self.name, path=str(Path(path).resolve()), version=version)

    def predict_action(self, obs: Observation, version: int | None = None, deterministic: bool = True):
        """An action from the inference engine (grouped with other tenants' requests)."""
        return self.nexus.engine().predict(self.name, obs, version, deterministic)
