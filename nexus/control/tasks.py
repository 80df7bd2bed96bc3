"""Every worker task of the control plane, named by import path.

The scheduler never imports the service modules (they import torch, simulators, MLflow): a
:class:`TaskRef` pickles as its path, and the worker resolves the function when it runs the task.
A task of a role gets that role's host object as its first argument — the worker's state for the role
(``nexus.worker.plugin.host_for``): the actor rank's slots, the simulator pool, or the plugin
itself for tasks that place a role.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, Literal

Role = Literal["plugin", "actor", "sim"]
HOSTS = "nexus.worker.plugin"  # host_for(role): the calling worker's host of a role


@dataclass(frozen=True)
class TaskRef:
    """A worker function by import path, ``"package.module:function"``; calling it runs the function,
    with the worker's host of ``role`` first when the task has one."""

    path: str
    role: Role | None = None

    def __post_init__(self) -> None:
        module, sep, name = self.path.partition(":")
        if not (module and sep and name):
            raise ValueError(f"task path {self.path!r} is not 'module:function'")

    @property
    def __name__(self) -> str:  # Dask names tasks after their function
        return self.path.rpartition(":")[2]

    def resolve(self):
        module, _, name = self.path.partition(":")
        return getattr(import_module(module), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.role is None:
            return self.resolve()(*args, **kwargs)
        host = import_module(HOSTS).host_for(self.role)
        # a host may run a task itself (a modelled actor rank: nexus.wire.devices), same arguments
        fn = getattr(host, "tasks", {}).get(self.path) or self.resolve()
        return fn(host, *args, **kwargs)


_A = "nexus.actor.tasks"
_S = "nexus.sim.tasks"
_D = "nexus.data.tenant_dirs"
_W = "nexus.worker.plugin"

# actor ranks (resource ACTOR): tenant slots and their durable state
OPEN_RENDEZVOUS = TaskRef(f"{_W}:open_rendezvous", "plugin")  # on rank 0's worker, before START_ACTOR
START_ACTOR = TaskRef(f"{_W}:start_actor", "plugin")
INIT_TENANT = TaskRef(f"{_A}:init_tenant", "actor")
REBUILD_SLOTS = TaskRef(f"{_A}:rebuild_slots", "actor")
RUN_UPDATE = TaskRef(f"{_A}:run_update", "actor")
FINISH_JOB = TaskRef(f"{_A}:finish_job", "actor")
DROP_TENANT = TaskRef(f"{_A}:drop_tenant", "actor")
OFFLOAD_SLOTS = TaskRef(f"{_A}:offload_slots", "actor")  # idle tenants' slots to disk (restored on demand)
EXPORT_VERSION = TaskRef(f"{_A}:export_version", "actor")  # the backbone the policy ran on is resident
# a tenant's output dirs (any worker that sees the service root; run on an actor rank)
PURGE_OUTPUT = TaskRef(f"{_D}:purge_output")
DISCOVER = TaskRef(f"{_D}:discover")
MARK_INTERRUPTED = TaskRef(f"{_D}:mark_interrupted")
# simulators (resource SIM): rollout producers
RUN_ROLLOUT = TaskRef(f"{_S}:run_rollout", "sim")
PREWARM = TaskRef(f"{_S}:prewarm", "sim")  # a producer's envs built ahead (benchmarks)
WRITE_EVAL_REPORT = TaskRef(f"{_D}:write_eval_report")
MARK_EVALUATION = TaskRef("nexus.data.output_dir:mark_evaluation")  # retention keeps an evaluated version (its
# marker goes through the worker handler nexus_io "unmark_evaluation": never queued behind rollouts)
# any worker: host a role in the worker's plugin (installs the plugin when the worker lacks it)
START_ENGINE = TaskRef(f"{_W}:start_engine", "plugin")
START_TRACKER = TaskRef(f"{_W}:start_tracker", "plugin")
