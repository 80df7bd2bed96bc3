"""Scheduling policies: the catalog of ``schedulers/*.toml`` (validated here, applied by ``ServiceConfig``).

A policy file names every dispatch knob of the service in one place: the actor's concurrency, the
inference group's wait T and target size B, the admission defaults of tenants that do not set their own
(in-flight cap, staleness bound), the evaluation fan-out, the weight-sync rule, the training queue's
order, and whether tenants share the service at all (``isolated``: one tenant's jobs after another's).

No torch, no I/O at import; :func:`load` reads one small TOML file (at service configuration, never on
the scheduler's event loop). A bad file is refused with a :class:`~nexus.errors.SpecError` that names the
file and the field.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nexus.errors import SpecError, describe_errors

DEFAULT = "priority"  # the default: the best median efficiency in experiments/multitenant/ (priority.toml)


# when a policy's rollout_split applies: while simulator places are free now, or to every RL batch
SplitRule = Literal["free", "always"]
SimOrder = Literal["fair", "critical"]


class SchedulerPolicy(BaseModel):
    """One ``schedulers/<name>.toml`` file (flat keys; unknown keys are refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    name: str = Field(DEFAULT, description="the catalog name (the file's stem); set by the loader")
    description: str = ""
    queue_order: Literal["fifo", "priority", "critical"] = Field(
        "priority", description="training queue: 'priority' (highest TenantSpec.priority first, FIFO within "
        "one), 'fifo' (submission order, priorities ignored) or 'critical' (items that unblock a producer — "
        "RL — before filler, then the job with the most remaining work: its measured item time x items left)")
    routing: Literal["static", "load"] = Field(
        "static", description="tenants to inference engines: 'static' (spread by count, moved only when the "
        "pool changes) or 'load' (re-balanced every few seconds by each tenant's measured inference load)")
    isolated: bool = Field(False, description="the isolated baseline: a job waits 'queued' until no other "
                           "tenant's job runs (tenants one after another, FIFO by submission)")
    max_concurrent_updates: int = Field(1, ge=1, description="training items running at once on the actor group")
    infer_max_wait_s: float = Field(0.005, ge=0, description="inference group: max wait T (s)")
    infer_max_batch: int = Field(8, ge=1, description="inference group: target size B (rows)")
    default_max_inflight: int = Field(2, ge=1, description="TenantSpec.max_inflight of tenants that leave it unset")
    default_max_staleness: int = Field(128, ge=0, description="TenantSpec.max_staleness of tenants that leave it "
                                       "unset")
    eval_fanout: int = Field(2, ge=1, description="rollout tasks an evaluation job splits its episodes over")
    rollout_split: int = Field(1, ge=1, description="an RL batch is split over up to this many rollout tasks at "
                               "once (one wave of a producer's envs each; when: rollout_split_rule); 1: each job's "
                               "own RLJob.split only")
    rollout_split_rule: SplitRule = Field(
        "free", description="when rollout_split applies: 'free' (only while that many simulator places are free "
        "that no tenant waits for: the split follows the moment's free places) or 'always' (every RL batch, the "
        "parts queueing for places like any rollout task: the split does not depend on timing)")
    sim_order: SimOrder = Field(
        "fair", description="who gets a freed simulator place: 'fair' (the tenant holding the fewest: max-min fair "
        "share) or 'critical' (the tenant whose running RL jobs have the most simulator work left — its updates "
        "left x its simulator seconds per update so far —, so the job on the critical path is not the one left "
        "alone at the end; a job's parts in flight stay bounded by its max_inflight x split)")
    sync_policy: Literal["lazy", "eager"] = Field("lazy", description="weight sync to inference (DataPathSettings)")
    sync_every: int = Field(0, ge=0, description="lazy sync: also push every N versions (0: never)")


def catalog_dir() -> Path:
    """``schedulers/`` next to ``envs/`` and ``datasets/`` (``NEXUS_CATALOG_ROOT`` moves all three)."""
    return Path(os.environ.get("NEXUS_CATALOG_ROOT", Path(__file__).resolve().parents[1])) / "schedulers"


def names() -> list[str]:
    return sorted(f.stem for f in catalog_dir().glob("*.toml"))


def _path(ref: str) -> Path:
    if ref.endswith(".toml") or "/" in ref or os.sep in ref:
        return Path(ref).expanduser()
    path = catalog_dir() / f"{ref}.toml"
    if not path.is_file():
        raise SpecError(f"unknown scheduler {ref!r}; schedulers/ has: {', '.join(names()) or 'none'} "
                        "(or give a path to a .toml file)")
    return path


def parse(text: str, where: str, name: str) -> SchedulerPolicy:
    """A policy from TOML text; ``where`` names the file in errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"scheduler file {where}: not valid TOML ({e})") from None
    if "name" in raw and raw["name"] != name:
        raise SpecError(f"scheduler file {where}: field 'name' = {raw['name']!r} differs from the file's "
                        f"stem {name!r}")
    try:
        return SchedulerPolicy.model_validate({**raw, "name": name})
    except ValidationError as e:
        errs = describe_errors(e.errors(), root="?", field_words=True, show_input=True)
        raise SpecError(f"scheduler file {where}: {errs}") from None


def load(ref: str) -> SchedulerPolicy:
    """A catalog name (``"fifo"`` → ``schedulers/fifo.toml``) or a path to a policy file."""
    path = _path(ref)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"scheduler file {path}: cannot be read ({e.strerror or e})") from None
    return parse(text, str(path), path.stem)
