"""The contract's validation: a tenant's request becomes a checked spec and its schema, a job request a
checked job, both against the catalogs and the tenant's quotas.

The control plane calls it once, where a spec enters (``nexus.control.tenants.lifecycle``,
``nexus.control.jobs.manager``); after that the spec travels as a typed object. The CLI and the gateway call
the same functions for their pre-checks. Pure Python, catalog files only (read once and cached): no torch, so
the scheduler imports it.
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from nexus.config import catalog
from nexus.config.service import ServiceLimits
from nexus.errors import LimitExceeded, NotFound, SpecError, describe_errors
from nexus.features import CameraSpec, TenantSchema
from nexus.spec import ExternalEnv, JobSpec, TenantSpec

_JOB = TypeAdapter(JobSpec)

__all__ = ["SpecError", "check_eval_version", "check_job_limits", "check_new_tenant", "check_reward",
           "check_tenant_limits", "validate_job", "validate_tenant"]

# Episode seeds are derived from a tenant's seed (RL: seed * 1_000_003 + episode, eval: 7_000_003 * (1 + seed)
# + episode) and simulators take seeds in [0, 2**32): ServiceLimits.max_seed keeps both formulas in range.
SIM_SEED_RANGE = 2**32


def _over(what: str, value: Any, limit_name: str, limit: Any) -> LimitExceeded:
    return LimitExceeded(f"{what}={value} is over the limit {limit_name}={limit}")


def check_tenant_limits(spec: TenantSpec, limits: ServiceLimits) -> None:
    """A tenant spec against its quotas (the head's width, its admission cap, priority, seed)."""
    if spec.hidden_dim > limits.max_hidden_dim:
        raise _over("hidden_dim", spec.hidden_dim, "max_hidden_dim", limits.max_hidden_dim)
    if spec.max_inflight is not None and spec.max_inflight > limits.max_inflight:
        raise _over("max_inflight", spec.max_inflight, "max_inflight", limits.max_inflight)
    if abs(spec.priority) > limits.max_priority:
        raise _over("|priority|", abs(spec.priority), "max_priority", limits.max_priority)
    if spec.seed > limits.max_seed:
        raise LimitExceeded(f"seed={spec.seed} is over the limit max_seed={limits.max_seed} (episode seeds "
                            f"derived from it must stay in the simulators' range [0, 2**32))")
    if 7_000_003 * (1 + spec.seed) + limits.max_eval_episodes >= SIM_SEED_RANGE:
        raise LimitExceeded(f"seed={spec.seed}: the service's max_seed={limits.max_seed} lets evaluation seeds "
                            "leave the simulators' range; an operator must lower it")


def check_new_tenant(n_tenants: int, limits: ServiceLimits) -> None:
    if n_tenants >= limits.max_tenants:
        raise LimitExceeded(f"tenants={n_tenants + 1} is over the limit max_tenants={limits.max_tenants}")


def check_job_limits(job: Any, limits: ServiceLimits, active_evals: int = 0) -> None:
    """A job's size against the tenant's quotas; ``active_evals``: its evaluations queued or running."""
    if job.kind == "sft":
        if job.steps > limits.max_sft_steps:
            raise _over("steps", job.steps, "max_sft_steps", limits.max_sft_steps)
        if job.batch_size > limits.max_batch_size:
            raise _over("batch_size", job.batch_size, "max_batch_size", limits.max_batch_size)
    elif job.kind == "rl":
        if job.updates > limits.max_rl_updates:
            raise _over("updates", job.updates, "max_rl_updates", limits.max_rl_updates)
        if job.episodes_per_batch > limits.max_episodes_per_batch:
            raise _over("episodes_per_batch", job.episodes_per_batch, "max_episodes_per_batch",
                        limits.max_episodes_per_batch)
        if job.collectors > limits.max_collectors:
            raise _over("collectors", job.collectors, "max_collectors", limits.max_collectors)
        if job.update_epochs > limits.max_update_epochs:
            raise _over(f"{job.algorithm}.update_epochs", job.update_epochs, "max_update_epochs",
                        limits.max_update_epochs)
    else:
        if job.episodes > limits.max_eval_episodes:
            raise _over("episodes", job.episodes, "max_eval_episodes", limits.max_eval_episodes)
        if active_evals >= limits.max_concurrent_evals:
            raise LimitExceeded(f"evaluations={active_evals + 1} at once is over the limit "
                                f"max_concurrent_evals={limits.max_concurrent_evals}")


def check_eval_version(tenant: str, version: int | None, current: int, limits: ServiceLimits) -> None:
    """An evaluation's pinned version must exist and its weights must still be kept."""
    if version is None:
        return
    if version > current:
        raise NotFound(f"tenant {tenant!r} has no version {version} yet (current {current})")
    if limits.max_versions_kept == 0 or version == 0:  # keep all; the initial version is always kept
        return
    oldest = max(0, current - limits.max_versions_kept + 1)
    if version < oldest:
        raise NotFound(f"version {version} of tenant {tenant!r} was pruned: only the last "
                       f"max_versions_kept={limits.max_versions_kept} versions and the initial one are kept "
                       f"(oldest {oldest})")


def validate_tenant(raw: dict[str, Any] | TenantSpec,
                    limits: ServiceLimits | None = None) -> tuple[TenantSpec, TenantSchema]:
    """Check a tenant spec against the catalogs (and its quotas, given ``limits``); returns the spec and
    the schema its data has."""
    if not isinstance(raw, dict | TenantSpec):
        raise SpecError(f"invalid tenant spec: expected a JSON object, got {type(raw).__name__}")
    try:
        spec = raw if isinstance(raw, TenantSpec) else TenantSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"invalid tenant spec: {describe_errors(e.errors())}") from None
    if limits is not None:
        check_tenant_limits(spec, limits)
    try:
        env = catalog.env(spec.env) if spec.env is not None else None  # "" is an unknown name, not none
        ds = catalog.dataset(spec.dataset) if spec.dataset is not None else None
    except catalog.CatalogError as e:
        raise SpecError(f"invalid tenant spec {spec.name!r}: {e}") from None
    if env is not None and spec.reward is not None:
        check_reward(spec.name, env, spec.reward)
    own = external_schema(spec.external) if spec.external is not None else None
    schema = env.schema if env else own if own else ds.schema  # type: ignore[union-attr]
    source = env.schema if env else own
    if source and ds:
        if (source.proprio_dim, source.action_dim) != (ds.schema.proprio_dim, ds.schema.action_dim):
            what = f"env {env.name!r}" if env else "the external env"
            raise SpecError(f"invalid tenant spec {spec.name!r}: dataset {ds.name!r} "
                            f"(state {ds.schema.proprio_dim}, action {ds.schema.action_dim}) does not fit {what} "
                            f"(state {source.proprio_dim}, action {source.action_dim})")
    if spec.action_dim is not None and spec.action_dim != schema.action_dim:
        src = spec.env or ("external" if own else spec.dataset)
        raise SpecError(f"invalid tenant spec {spec.name!r}: action_dim={spec.action_dim} but {src!r} "
                        f"has {schema.action_dim}-dim actions")
    return spec, schema


def check_reward(tenant: str, env: catalog.EnvEntry, terms: Any) -> None:
    """Every term of a tenant's reward must be one its env exposes: a SpecError names the unknown ones and lists
    the known ones."""
    known = env.reward_term_names
    unknown = [t.term for t in terms if t.term not in known]
    if unknown:
        raise SpecError(f"invalid tenant spec {tenant!r}: reward term{'s' * (len(unknown) > 1)} "
                        f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not exposed by env "
                        f"{env.name!r}; it exposes: {', '.join(known)}")


def schema_of(spec: TenantSpec) -> TenantSchema:
    """The observation schema of a validated spec's data: its env's, its own env's, else its dataset's."""
    if spec.env is not None:
        return catalog.env(spec.env).schema
    if spec.external is not None:
        return external_schema(spec.external)
    return catalog.dataset(spec.dataset).schema  # type: ignore[arg-type]


def external_schema(ext: ExternalEnv) -> TenantSchema:
    """The observation schema of a tenant's own environment."""
    return TenantSchema(proprio_dim=ext.proprio_dim, action_dim=ext.action_dim,
                        cameras=tuple(CameraSpec(c.name, c.height, c.width) for c in ext.cameras),
                        instruction=ext.instruction)


def _check_suite_eval(spec: TenantSpec, job: Any, limits: ServiceLimits | None) -> None:
    """A suite evaluation needs a suite env (a catalog entry with a task list), known task indices, and its
    episodes (tasks x initial states) within the tenant's evaluation quota."""
    tasks = catalog.suite_tasks(spec.env or "")
    if not tasks:
        raise SpecError(f"tenant {spec.name!r}: protocol='suite' needs an env of a suite (e.g. 'libero/spatial'); "
                        f"{spec.env!r} has no task list")
    bad = [i for i in job.tasks or () if not 0 <= i < len(tasks)]
    if bad:
        raise SpecError(f"tasks {bad}: the suite of {spec.env!r} has tasks 0..{len(tasks) - 1}")
    n = len(job.tasks or tasks) * job.initial_states
    if limits is not None and n > limits.max_eval_episodes:
        raise _over("tasks x initial_states", n, "max_eval_episodes", limits.max_eval_episodes)


def validate_job(spec: TenantSpec, raw: dict[str, Any], limits: ServiceLimits | None = None,
                 active_evals: int = 0) -> Any:
    """Check a job against its tenant: RL and eval need an env, SFT a dataset (and, given ``limits``,
    against the tenant's quotas)."""
    if not isinstance(raw, dict):
        raise SpecError(f"invalid job: expected a JSON object, got {type(raw).__name__}")
    try:
        job = _JOB.validate_python(raw)
    except ValidationError as e:
        raise SpecError(f"invalid job: {describe_errors(e.errors())}") from None
    if limits is not None:
        check_job_limits(job, limits, active_evals)
    external = job.kind == "rl" and job.rollouts == "external"
    if job.kind in ("rl", "eval") and not spec.env and not (external and spec.external is not None):
        if external:
            raise SpecError(f"tenant {spec.name!r} has no env: an RL job on uploaded episodes needs a catalog env "
                            "or an external env")
        raise SpecError(f"tenant {spec.name!r} has no env: a {job.kind} job needs one"
                        + (" (its external env's episodes train an RLJob with rollouts='external')"
                           if spec.external is not None else ""))
    if job.kind == "sft" and not spec.dataset:
        raise SpecError(f"tenant {spec.name!r} has no dataset: an sft job needs one")
    if job.kind == "eval" and job.protocol == "suite":
        _check_suite_eval(spec, job, limits)
    if job.kind == "rl" and spec.chunk != 1:
        raise SpecError(f"tenant {spec.name!r}: RL trains one action per step, but chunk={spec.chunk}")
    if job.kind == "rl" and job.algorithm == "grpo" and job.grpo.kl_coef > 0 and spec.lora is not None:
        raise SpecError(f"tenant {spec.name!r}: grpo.kl_coef needs a heads-only tenant (the reference policy is "
                        "a stored head; a LoRA tenant's features move with its adapter)")
    return job
