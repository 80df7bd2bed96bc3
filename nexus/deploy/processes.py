"""The command line of each service process, by role: one definition for every deployment.

The embedded default (:mod:`nexus.deploy.local`, ``nexus up``) and the separate-host commands
(:mod:`nexus.deploy.hosts`: ``nexus scheduler``, ``nexus gateway``, ``nexus worker``) start the same programs
with the same options; only where they run, and the addresses they bind, differ.

* scheduler: ``dask scheduler --preload nexus.control.plugin --nexus-config ROOT/service.json``
  (the config path is the plugin's own preload argument)
* worker of a role: ``dask worker --resources SIM=1|ACTOR=1|INFER=1|TRACK=1 --preload nexus.worker.plugin``
  (the worker finds the scheduler in ``ROOT/scheduler.json``; ``TRACK``: the MLflow tracker's own worker, with
  ``cluster.tracker_worker``)
* gateway: ``python -m nexus.gateway --config ROOT/service.json``

Every list returned here is the arguments after ``python -m``.
"""

from __future__ import annotations

import os
from pathlib import Path

from nexus.config.service import ServiceConfig
from nexus.deploy.tls import TLSFiles

# role -> its Dask resource: the control plane places every role by resource (nexus.control.health.supervisor)
ROLE_RESOURCES = {"sim": "SIM", "actor": "ACTOR", "infer": "INFER", "tracker": "TRACK"}
DEVICES_RESOURCE = "DEVICES"  # the devices a worker holds, each a slot of its service (a count no task asks for)

# the tracker's own worker (resource TRACK) runs this much nicer than the devices' workers: the OS gives them the
# cores first, and its MLflow writes and plots the time they leave
TRACKER_NICE = 10

# a torch.distributed set-up of the calling process (its rendezvous port) must not leak into the actor
DIST_VARS = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


def service_env(config: ServiceConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a service process: one torch thread, offline hubs, Dask's own settings."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in DIST_VARS}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                "MLFLOW_ENABLE_ASYNC_LOGGING": "false"})
    env.update(config.cluster.dask_env())  # Dask's own way to configure a child process
    return env


def role_env(role: str) -> dict[str, str]:
    """Per-role additions: simulator workers may run vector envs with a process per sub-env, which Dask's
    daemonic worker processes could not start."""
    return {"DASK_DISTRIBUTED__WORKER__DAEMON": "False"} if role == "sim" else {}


def role_of(resources: str) -> str:
    """``SIM=1`` -> ``sim`` (the embedded deployment names workers' resources)."""
    name = resources.split("=", 1)[0]
    for role, resource in ROLE_RESOURCES.items():
        if resource == name:
            return role
    raise ValueError(f"no role has the resource {name!r} (roles: {ROLE_RESOURCES})")


def scheduler_command(config_path: Path, scheduler_file: Path, host: str, port: int, dashboard_address: str,
                      tls: TLSFiles | None) -> list[str]:
    protocol = ["--protocol", "tls"] if tls else []
    return ["distributed.cli.dask_scheduler", "--host", host, "--port", str(port), *protocol,
            *(tls.cli_args() if tls else []), "--dashboard-address", dashboard_address,
            "--scheduler-file", str(scheduler_file),
            "--preload", "nexus.control.plugin", "--nexus-config", str(config_path)]


def worker_command(scheduler_file: Path, name: str, role: str, host: str, memory_limit: str,
                   tls: TLSFiles | None, scratch: Path | None = None, death_timeout_s: int = 60,
                   slots: int = 1, devices: int = 1, preload: tuple[str, ...] = ()) -> list[str]:
    """A nannied ``dask worker`` of ``role``. ``--host``: the nanny and the worker's comm port;
    ``--dashboard-address``: the worker's HTTP server (/health, /metrics), which would otherwise listen on
    every interface. ``scratch``: Dask's local directory (spill, locks) on this host's own disk.
    ``slots``: its role's resource count and threads (tasks of the role it runs at once); ``devices``: the devices
    it holds (resource ``DEVICES``, said when more than one); ``preload``: more modules each worker preloads, after
    its plugin's (Dask's ``--preload``: e.g. one that installs a model of the devices, ``nexus.wire.devices``)."""
    local = ["--local-directory", str(scratch)] if scratch is not None else []
    held = f",{DEVICES_RESOURCE}={devices}" if devices > 1 else ""
    return ["distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file), "--name", name,
            "--nthreads", str(slots), "--resources", f"{ROLE_RESOURCES[role]}={slots}{held}", "--no-dashboard",
            "--host", host, "--dashboard-address", f"{host}:0", *(tls.cli_args() if tls else []),
            "--memory-limit", memory_limit, "--death-timeout", str(death_timeout_s), *local,
            "--preload", "nexus.worker.plugin", *(a for m in preload for a in ("--preload", m))]


def gateway_command(config_path: Path, host: str | None = None, port: int | None = None,
                    cert: tuple[Path, Path] | None = None, advertise: str | None = None) -> list[str]:
    """``cert``: (certificate, key) to serve HTTPS; ``advertise``: the host name written into its URL."""
    args = ["nexus.gateway", "--config", str(config_path)]
    if host is not None:
        args += ["--host", host]
    if port is not None:
        args += ["--port", str(port)]
    if cert is not None:
        args += ["--certfile", str(cert[0]), "--keyfile", str(cert[1])]
    if advertise is not None:
        args += ["--advertise", advertise]
    return args
