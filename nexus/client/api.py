"""The tenant's Python API.

``Nexus("http://host:port", token=...)`` talks to a service's tenant gateway (HTTP, bearer tokens;
``nexus.client.http``): the only way the client reaches the service. ``Nexus.local()`` starts a service and
hands back a gateway client holding the operator token and, as tenants are created, their tokens; the
service-internal Dask connection belongs to the process that started it (``nx.service``, a
:class:`~nexus.deploy.local.LocalService`: ``nx.service.internal(handler)``, ``nx.service.client``), never to the
client.

High level: connect to a service (or start a local one), create a tenant from a spec, submit an
SFT / RL / Eval job, stream its progress, wait for its result.

Low level, Tinker-style: ``forward_backward(batch, loss)``, ``forward(batch)`` (no gradient: log-probs of
given actions), ``optim_step(adam=AdamParams(...))``, ``save_weights()``, ``save_state(name)`` /
``load_state(name)`` (head, adapter and optimizer state) and ``predict_action(obs, version=..., deterministic=...,
seed=..., n=...)``, each returning a :class:`~nexus.client.futures.NexusFuture` (``.result()`` or ``await``).
A tenant's training calls run in the order they were made; each datum is self-contained (observations +
actions). Each ``Nexus`` instance is a session (``nx.session``, a uuid
unless given): the service groups its low-level ops in one MLflow run.

Everything can come from files too: ``Nexus.local(config="service.toml")``, ``nx.submit("tenant.toml",
"job.toml")``, ``nx.create_tenant("tenant.toml")``, ``tenant.submit("job.toml")`` (see ``nexus.config.service``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nexus.client import envs as service_envs
from nexus.client import rollouts
from nexus.client.futures import NexusFuture
from nexus.client.http import HttpTransport
from nexus.config.service import ServiceConfig, load_service_config, load_submission, read_toml
from nexus.deploy.local import LocalService
from nexus.errors import Conflict, Forbidden, JobFailed, NotFound, SpecError, describe_errors, quote
from nexus.export import files as policy_format
from nexus.features import Observation
from nexus.spec import AdamParams, EvalJob, RLJob, SFTJob, TenantSpec, check_session
from nexus.wire.history import JOB_COUNTERS, JOB_HEADLINE

PathLike = str | Path
TERMINAL = ("done", "failed", "cancelled")


class Nexus:
    """A connection to a JoyNexus service's gateway."""

    def __init__(self, address: str, *, token: str | None = None, service: LocalService | None = None,
                 timeout: float = 120, session: str | None = None, ca: PathLike | None = None) -> None:
        """``address``: the gateway URL (``http[s]://host:port``). ``ca``: the service's CA certificate
        (``root/tls/ca.pem``) to verify an ``https://`` gateway with."""
        if not address.startswith(("http://", "https://")):
            raise SpecError(f"Nexus({quote(address)}): give the gateway URL (http[s]://host:port, what `nexus up` "
                            "prints as 'gateway'); the service's Dask address is internal to it, not a client door")
        self.service = service
        # this connection's id, sent with every low-level op: a session's ops are one MLflow run
        self.session = check_session(session) if session is not None else uuid.uuid4().hex
        self.transport = HttpTransport(address, token=token, timeout=timeout, ca=str(ca) if ca else None)
        self._predicts: ThreadPoolExecutor | None = None

    @classmethod
    def local(cls, root: PathLike | None = None, n_sim: int | None = None, dashboard_address: str | None = None,
              n_infer: int | None = None, *, config: ServiceConfig | PathLike | None = None,
              overrides: Iterable[str] = (), service: Callable[[ServiceConfig], LocalService] | None = None,
              **fields: Any) -> Nexus:
        """Start the embedded default: a local Dask cluster running the Nexus service, and return a gateway
        client holding the operator token (``nx.service``: the started service, with its internal access).

        Settings: ``config`` (a :class:`ServiceConfig` or a TOML file, as ``nexus up --config``), then
        ``root`` and any ``ServiceConfig`` field as keyword arguments, then ``overrides`` (``"key.path=value"``,
        as ``--set``). Without any, the root is ``runs/local``. ``n_infer``: INFER workers (default:
        ``inference_engines``); spare ones let the pool grow. ``service``: builds the local service from the
        settings instead (a tool that lays the workers out its own way).
        """

        if isinstance(config, ServiceConfig):
            config = config.model_dump(exclude_unset=True)
            cfg = load_service_config(None, overrides, **{"root": "runs/local", **config, **_given(root=root),
                                                         **fields})
        else:
            defaults = {} if config is not None and "root" in read_toml(config) else {"root": "runs/local"}
            cfg = load_service_config(config, overrides, **{**defaults, **_given(root=root), **fields})
        local = (service(cfg) if service is not None
                 else LocalService(cfg, n_sim=n_sim, dashboard_address=dashboard_address, n_infer=n_infer))
        service = local.start()
        try:
            nx = cls(service.gateway_url, token=service.operator_token, service=service)
            nx._wait_for_workers(service.n_workers, timeout=180)
            nx.wait_ready()
        except BaseException:
            service.stop()
            raise
        return nx

    def wait_ready(self, timeout: float = 300) -> dict[str, Any]:
        """Wait until the actor group, an inference engine and the tracker serve (and a restarted
        service has rediscovered its tenants)."""
        return self.transport.wait_ready(timeout=min(timeout, 600.0))  # the gateway's longest wait

    def _wait_for_workers(self, n: int, timeout: float) -> None:
        deadline = time.time() + timeout
        while len(self.status().get("workers", [])) < n:
            if time.time() > deadline:
                raise TimeoutError(f"fewer than {n} workers joined the service within {timeout} s")
            time.sleep(0.2)

    @property
    def tokens(self) -> dict[str, str]:
        """The tenant tokens this client holds (from create_tenant)."""
        return dict(self.transport.tokens)

    def close(self) -> None:
        self.transport.close()
        if self._predicts is not None:
            self._predicts.shutdown(wait=False, cancel_futures=True)
        if self.service is not None:
            self.service.stop()

    def __enter__(self) -> Nexus:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- tenants and jobs ------------------------------------------------------------------
    def create_tenant(self, spec: TenantSpec | dict[str, Any] | PathLike, overrides: Iterable[str] = ()) -> Tenant:
        """Create (or re-attach to) a tenant from a spec, a dict or a TOML file (``overrides``: ``tenant.*``
        keys for a file)."""
        if isinstance(spec, str | Path):
            sub = load_submission([spec], overrides)
            if sub.tenant is None:
                raise SpecError(f"{spec}: no tenant in this file")
            raw = sub.tenant
        else:
            raw = spec.model_dump() if isinstance(spec, TenantSpec) else dict(spec)
        info = self.transport.create_tenant(raw)
        return Tenant(self, info["tenant"], info)

    def submit(self, *files: PathLike, overrides: Iterable[str] = (), tenant: str | None = None) -> list[Job]:
        """Tenant and job files (``nexus submit``): create the tenant they describe (or use ``tenant``,
        an existing one) and submit their jobs in file order."""
        sub = load_submission(files, overrides, tenant)
        t = self.create_tenant(sub.tenant) if sub.tenant is not None else self.tenant(sub.name)
        return [t.submit(j) for j in sub.jobs]

    def tenant(self, name: str, token: str | None = None) -> Tenant:
        """A handle on an existing tenant (``token``: its secret, when this client does not hold it yet)."""
        if token is not None:
            self.transport.tokens[name] = token
        for t in self.status(tenant=name)["tenants"]:
            if t["tenant"] == name:
                return Tenant(self, name, t)
        raise NotFound(f"unknown tenant {name!r}")

    def status(self, limit: int | None = None, cursor: str | None = None, tenant: str | None = None) -> dict[str, Any]:
        """One page of the service's status: at most ``limit`` tenants (by name) and jobs (newest first);
        ``status()["page"]["next_cursor"]`` gives the next page; ``tenant``: that tenant's view only."""
        return self.transport.status(limit, cursor, tenant)

    def pages(self, limit: int | None = None, tenant: str | None = None) -> Iterator[dict[str, Any]]:
        """Every page of the status, in order (``for page in nx.pages(): page["tenants"], page["jobs"]``)."""
        cursor = None
        while True:
            page = self.status(limit, cursor, tenant)
            yield page
            cursor = page.get("page", {}).get("next_cursor")
            if cursor is None:
                return

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def flush(self) -> None:
        """Wait until tracking (MLflow) has written everything sent so far (operator)."""
        self.transport.flush()

    def monitoring(self, since: float = 0.0) -> dict[str, Any]:
        """The status page with every tenant's signals (spans, metering, weight sync) since ``since`` (operator)."""
        return self.transport.monitoring(since)

    def tenant_log(self, name: str) -> dict[str, Any]:
        """Every job of tenant ``name`` with its metric history, and its utilization spans."""
        return self.transport.tenant_log(name)

    # -- lifecycle and elasticity --------------------------------------------------------------------
    def delete_tenant(self, name: str, keep_output: bool = True) -> dict[str, Any]:
        """Cancel the tenant's jobs, remove its slot, routes and queue entries; keep its output dir unless
        ``keep_output=False``."""
        return self.transport.delete_tenant(name, keep_output)

    def scale_inference(self, n: int) -> dict[str, Any]:
        """Grow or shrink the inference pool to ``n`` engines (synced before joining, drained before
        leaving; a scale-up that fails part way is rolled back). Returns the pool's view."""
        return self.transport.scale_inference(n)


def _given(**kw: Any) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in kw.items() if v is not None}


@dataclass(frozen=True)
class JobProgress:
    """One look at a job: ``print(p)`` gives a line such as
    ``pick-sft-sft-3  running  120/300 steps  v120  loss 0.083  heldout_action_mse 0.12  (41 s)``."""

    job: str
    tenant: str
    kind: str
    state: str
    done: int
    total: int
    version: int | None
    metrics: dict[str, float] = field(default_factory=dict)
    elapsed_s: float = 0.0
    error: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def unit(self) -> str:
        return JOB_COUNTERS.get(self.kind, "steps")

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> JobProgress:
        kind = info["kind"]
        p = {**info.get("progress", {}), **(info.get("result") or {})}
        unit = JOB_COUNTERS.get(kind, "steps")
        total = int(info.get("spec", {}).get(unit, 0))
        done = total if info["state"] == "done" and kind == "eval" else int(p.get(unit, 0) or 0)
        metrics = {k: float(p[k]) for k in JOB_HEADLINE.get(kind, ()) if isinstance(p.get(k), int | float)}
        end = info.get("t_end") or time.time()
        return cls(job=info["job"], tenant=info["tenant"], kind=kind, state=info["state"], done=done, total=total,
                   version=p.get("version"), metrics=metrics, elapsed_s=max(0.0, end - info.get("t_submit", end)),
                   error=info.get("error"), raw=info)

    def __str__(self) -> str:
        parts = [self.job, self.state, f"{self.done}/{self.total} {self.unit}"]
        if self.version is not None:
            parts.append(f"v{self.version}")
        parts += [f"{k} {v:.3g}" for k, v in self.metrics.items()]
        parts.append(f"({self.elapsed_s:.0f} s)")
        if self.error:
            parts.append(f"error: {self.error}")
        return "  ".join(parts)


class Job:
    def __init__(self, nexus: Nexus, job_id: str, tenant: str | None = None) -> None:
        self.nexus, self.id, self.tenant = nexus, job_id, tenant

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def info(self) -> dict[str, Any]:
        """The service's full view of the job (spec, state, progress, result, error, metering)."""
        return self.nexus.transport.job(self.id, self.tenant)

    def progress(self) -> JobProgress:
        return JobProgress.from_info(self.info())

    def stream(self, poll_s: float = 0.5) -> Iterator[JobProgress]:
        """Yield a :class:`JobProgress` each time the job's state or progress changes, until it ends."""
        for info in self.nexus.transport.stream(self.id, self.tenant, poll_s):  # a view at each change
            yield JobProgress.from_info(info)

    def upload(self, episodes: rollouts.EpisodeBuffer | dict[str, Any]) -> dict[str, Any]:
        """Whole episodes of the tenant's own env for this RL job (``rollouts="external"``), see
        :mod:`nexus.client.rollouts`."""
        if self.tenant is None:
            self.tenant = self.info()["tenant"]
        return rollouts.upload(Tenant(self.nexus, self.tenant, {}), self.id, episodes)

    def cancel(self) -> dict[str, Any]:
        """Stop the job and free everything it holds; returns its final info (state ``cancelled``)."""
        return self.nexus.transport.cancel(self.id, self.tenant)

    def follow(self, console: Any = None, poll_s: float = 0.5) -> dict[str, Any]:
        """Wait for the job with a progress bar (steps, updates or episodes); returns its result."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        first = self.progress()
        with Progress(TextColumn(f"{self.id} ({first.unit})"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[metric]}"), TimeElapsedColumn(), console=console) as bar:
            task = bar.add_task(self.id, total=first.total, metric="")
            for p in self.stream(poll_s):
                metric = "  ".join(f"{k} {v:.3f}" for k, v in p.metrics.items())
                bar.update(task, completed=p.done, metric=metric)
        return self.result()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.time() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.time())
            info = self.nexus.transport.wait(self.id, min(left or 30.0, 30.0), self.tenant)
            if info["state"] == "done":
                return info["result"]
            if info["state"] in TERMINAL:
                raise JobFailed(f"job {self.id} {info['state']}: {info['error']}")
            if deadline is not None and time.time() >= deadline:
                raise TimeoutError(f"job {self.id} still {info['state']} after {timeout} s")


class Tenant:
    def __init__(self, nexus: Nexus, name: str, info: dict[str, Any]) -> None:
        self.nexus, self.name, self.info = nexus, name, info
        self._ops = ThreadPoolExecutor(1, thread_name_prefix=f"nexus-{name}")  # keeps call order

    @property
    def version(self) -> int:
        return self.nexus.tenant(self.name).info["version"]

    @property
    def token(self) -> str | None:
        """This tenant's secret (gateway transport): keep it to reconnect, ``Nexus(url, token=...)``."""
        return self.nexus.tokens.get(self.name)

    def files(self) -> list[dict[str, Any]]:
        """The files of the tenant's output dir (path, bytes), through the gateway."""
        return self.nexus.transport.files(self.name)

    def read_file(self, path: str) -> bytes:
        """One file of the tenant's output dir (e.g. ``manifest.json``, ``weights/v000003.pt``)."""
        return self.nexus.transport.read_file(self.name, path)

    def __repr__(self) -> str:
        return f"Tenant({self.name!r})"

    def submit(self, job: SFTJob | RLJob | EvalJob | dict[str, Any] | PathLike, overrides: Iterable[str] = ()) -> Job:
        """Submit a job: a spec, a dict or a TOML job file (``overrides``: ``job.*`` keys for a file)."""
        if isinstance(job, str | Path):
            sub = load_submission([job], overrides, self.name)
            if len(sub.jobs) != 1 or sub.tenant is not None:
                raise SpecError(f"{job}: expected exactly one job and no tenant (nexus.submit takes several)")
            raw = sub.jobs[0]
        else:
            raw = job.model_dump() if not isinstance(job, dict) else job
        return Job(self.nexus, self.nexus.transport.submit(self.name, raw), self.name)

    def sft(self, **kw: Any) -> Job:
        return self.submit(SFTJob(**kw))

    def rl(self, **kw: Any) -> Job:
        return self.submit(RLJob(**kw))

    def evaluate(self, **kw: Any) -> Job:
        return self.submit(EvalJob(**kw))

    # -- low level (futures) ---------------------------------------------------------------
    def forward_backward(self, batch: dict[str, Any], loss: str = "sft") -> NexusFuture[dict[str, Any]]:
        """Accumulate gradients of ``loss`` on a self-contained batch.

        ``batch``: ``observations`` (list of :class:`Observation`), ``actions`` [N, A]; for
        ``loss="ppo"`` also ``logprobs``, ``advantages``, ``returns`` [N] and optional ``ppo``
        (``loss="grpo"``: see ``nexus.actor.ops.forward_backward`` and ``nexus.wire.inputs.check_batch`` for its fields)
        (a PPOConfig dict). The batch goes to a worker directly; the scheduler sees its name only.
        """
        return self._batch_op("forward_backward", batch, loss)

    def forward(self, batch: dict[str, Any]) -> NexusFuture[dict[str, Any]]:
        """Without a gradient, on the current weights (saved or not), in order with the training calls: each row's
        log-probability of its action, the policy's entropy and value there -> ``{"logprobs", "entropies",
        "values"}`` (lists of N floats). ``batch``: ``observations``, ``actions``; Gaussian (OFT) heads."""
        fut: NexusFuture[dict[str, Any]] = NexusFuture()
        self._batch_op("forward", batch).add_done_callback(
            lambda f: fut.set_exception(f.exception()) if f.exception() else fut.set_result(f.result()["outputs"]))
        return fut

    def _batch_op(self, verb: str, batch: dict[str, Any], loss: str = "sft") -> NexusFuture[dict[str, Any]]:
        body = {"batch": batch, "loss": loss} if verb == "forward_backward" else {"batch": batch}
        return self._op(verb, body)  # to the gateway, which sends it to the actor worker directly

    def _op(self, verb: str, body: dict[str, Any] | None = None) -> NexusFuture[dict[str, Any]]:
        """A low-level op, in order behind this tenant's earlier ones."""
        return NexusFuture.run(self._ops, self.nexus.transport.op, self.name, verb, self.nexus.session, body)

    def optim_step(self, adam: AdamParams | dict[str, Any] | None = None) -> NexusFuture[dict[str, Any]]:
        """Apply the accumulated gradients; ``adam``: this step's Adam settings (Tinker's ``AdamParams``:
        ``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``; unset ones keep the tenant's)."""
        extra = {}
        if adam is not None:
            try:
                params = adam if isinstance(adam, AdamParams) else AdamParams.model_validate(adam)
            except ValidationError as e:
                raise SpecError(f"adam: {describe_errors(e.errors(), root='adam')}") from None
            extra["adam"] = params.model_dump(exclude_none=True)
        return self._op("optim_step", extra or None)

    def save_state(self, name: str) -> NexusFuture[dict[str, Any]]:
        """Save the training state (head, adapter and optimizer state) as ``name`` (replacing one of that name);
        not a policy version. In order with the training calls."""
        return self._op("save_state", {"name": name})

    def load_state(self, name: str) -> NexusFuture[dict[str, Any]]:
        """Back to the training state saved as ``name``: weights, adapter and optimizer state. The version does not
        move back; ``save_weights()`` publishes the loaded weights as a new version."""
        return self._op("load_state", {"name": name})

    def save_weights(self) -> NexusFuture[int]:
        """Publish the current head as a new policy version; the future gives the version."""
        fut: NexusFuture[int] = NexusFuture()
        self._op("save_weights").add_done_callback(
            lambda f: fut.set_exception(f.exception()) if f.exception() else fut.set_result(f.result()["version"]))
        return fut

    def export(self, version: int | None = None, path: str | Path | None = None, *,
               server_path: str | None = None) -> dict[str, Any]:
        """Export policy version ``version`` (None: the current one) as a self-contained directory: head and
        adapter weights in safetensors, the backbone reference, preprocessor config, normalization stats and
        a JSON manifest. ``nexus.export.policy.load(dir)`` runs it without a service.

        The service writes it into the tenant's output dir (``exports/vNNNNNN/``, kept there; the
        gateway serves its files). ``path``: a local directory (missing or empty) to download it into,
        every file checked against the manifest's sha256. ``server_path``: write it there on the
        service's file system instead (tenant tokens: only inside their output dir). Returns the export's
        summary: ``path`` (on the service; through a tenant token relative to its output dir), ``relative_path``,
        ``version``, ``files`` and, when downloaded, ``local_path``."""
        local = None if path is None else Path(path).resolve()
        if local is not None and local.exists() and (not local.is_dir() or any(local.iterdir())):
            raise Conflict(f"export target {str(local)!r} exists and is not an empty directory")
        info = self.nexus.transport.export(self.name, version, server_path)
        if local is not None:
            if info.get("relative_path") is None:
                raise Forbidden(f"the export at {info['path']!r} lies outside the tenant's output dir: "
                                "the gateway cannot serve it")
            info["local_path"] = str(self._download(info["relative_path"], info["files"], local))
        return info

    def _download(self, folder: str, files: list[str], target: Path) -> Path:
        """The export's files from the gateway into ``target`` (atomically: a temporary sibling renamed)."""
        import shutil


        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.parent / f".{target.name}.download-{uuid.uuid4().hex[:8]}"
        try:
            for name in files:
                if name.startswith("/") or ".." in name.split("/"):
                    raise Forbidden(f"export file name {name!r} leaves the export directory")
                dest = tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(self.read_file(f"{folder}/{name}"))
            policy_format.read_manifest(tmp, verify_files=True)  # every file as the service wrote it
            if target.exists():
                target.rmdir()  # empty (checked before)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    def predict_action(self, obs: Observation, version: int | None = None, deterministic: bool = True,
                       seed: int | None = None, n: int = 1) -> NexusFuture[dict[str, Any]]:
        """An action from the tenant's inference engine (grouped with other tenants' requests); the future
        gives ``{"action": array, "logprob", "value", "version", ...}``. ``deterministic=False`` samples: with a
        ``seed`` reproducibly, and ``n`` > 1 samples also as ``actions`` [n, A] and ``logprobs`` [n] (sample j
        drawn with ``seed + j``). Not ordered behind this tenant's training calls."""
        if deterministic and (seed is not None or n > 1):
            raise SpecError("seed and n > 1 draw samples: pass deterministic=False")
        if self.nexus._predicts is None:
            self.nexus._predicts = ThreadPoolExecutor(4, thread_name_prefix="nexus-predict")
        return NexusFuture.run(self.nexus._predicts, self.nexus.transport.predict, self.name, obs, version,
                               deterministic, seed, n)

    # -- the tenant's own algorithms: the service's simulators, the tenant's own envs -------------------------
    def env(self, env: str, seed: int = 0) -> service_envs.ServiceEnv:
        """A ``gymnasium.Env`` on the service's simulators (one environment session; close it when done)."""
        return service_envs.ServiceEnv(self, env, seed)

    def vector_env(self, env: str, num_envs: int = 1, seed: int = 0) -> service_envs.ServiceVectorEnv:
        """``num_envs`` envs with gymnasium's ``VectorEnv`` API (same-step autoreset), one session."""
        return service_envs.ServiceVectorEnv(self, env, num_envs, seed)

    def predict_batch(self, observations: list[Observation | dict[str, Any]], version: int | None = None,
                      deterministic: bool = False) -> NexusFuture[list[dict[str, Any]]]:
        """Actions for several observations in one request, each with ``logprob``, ``value`` and ``version``
        (what an upload of external episodes needs)."""
        if self.nexus._predicts is None:
            self.nexus._predicts = ThreadPoolExecutor(4, thread_name_prefix="nexus-predict")
        return NexusFuture.run(self.nexus._predicts, rollouts.predict_batch, self, observations, version,
                               deterministic)

    def upload_episodes(self, job: Job | str, episodes: rollouts.EpisodeBuffer | dict[str, Any]) -> dict[str, Any]:
        """Whole episodes of this tenant's own env for its RL job with ``rollouts="external"``."""
        return rollouts.upload(self, job.id if isinstance(job, Job) else job, episodes)
