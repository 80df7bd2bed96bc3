"""Every worker task of the control plane, named by import path.

The scheduler never imports the service modules (they import torch, simulators, MLflow): a
:class:`TaskRef` pickles as its path, and the worker resolves the function when it runs the task.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True)
class TaskRef:
    """A worker function by import path, ``"package.module:function"``; calling it runs the function."""

    path: str

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
        return self.resolve()(*args, **kwargs)


_R = "nexus.services.recovery"
_W = "nexus.services.worker_plugin"

# actor ranks (resource ACTOR): tenant slots and their durable state
INIT_TENANT = TaskRef(f"{_R}:init_tenant")
REBUILD_SLOTS = TaskRef(f"{_R}:rebuild_slots")
RUN_UPDATE = TaskRef(f"{_R}:run_update")
FINISH_JOB = TaskRef(f"{_R}:finish_job")
DROP_TENANT = TaskRef(f"{_R}:drop_tenant")
PURGE_OUTPUT = TaskRef(f"{_R}:purge_output")
DISCOVER = TaskRef(f"{_R}:discover")
EXPORT_VERSION = TaskRef("nexus.services.export:export_version")  # the backbone the policy ran on is resident
MARK_INTERRUPTED = TaskRef(f"{_R}:mark_interrupted")
# simulators (resource SIM): rollout producers
RUN_ROLLOUT = TaskRef(f"{_R}:run_rollout")
WRITE_EVAL_REPORT = TaskRef("nexus.services.rollout:write_eval_report")
MARK_EVALUATION = TaskRef("nexus.data.output_dir:mark_evaluation")  # retention keeps an evaluated version
UNMARK_EVALUATION = TaskRef("nexus.data.output_dir:unmark_evaluation")  # ... unless it ended without a report
# any worker: host a role in the worker's plugin (installs the plugin when the worker lacks it)
START_ENGINE = TaskRef(f"{_W}:start_engine")
START_TRACKER = TaskRef(f"{_W}:start_tracker")
