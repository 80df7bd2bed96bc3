"""Master Service, validation part: turn a tenant's request into a checked spec and its schema.

Runs inside the scheduler process: pure Python, catalog files only (read once and cached).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pydantic import TypeAdapter, ValidationError

from nexus import catalog
from nexus.errors import SpecError
from nexus.features import TenantSchema
from nexus.spec import RL_ACTION_HEADS, JobSpec, TenantSpec

_JOB = TypeAdapter(JobSpec)

__all__ = ["SpecError", "schema_from_dict", "schema_to_dict", "validate_job", "validate_tenant"]


def _pydantic_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "spec"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def validate_tenant(raw: dict[str, Any] | TenantSpec) -> tuple[TenantSpec, TenantSchema]:
    """Check a tenant spec against the catalogs; returns the spec and the schema its data has."""
    try:
        spec = raw if isinstance(raw, TenantSpec) else TenantSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError(f"invalid tenant spec: {_pydantic_message(e)}") from None
    try:
        env = catalog.env(spec.env) if spec.env else None
        ds = catalog.dataset(spec.dataset) if spec.dataset else None
    except catalog.CatalogError as e:
        raise SpecError(f"invalid tenant spec {spec.name!r}: {e}") from None
    schema = env.schema if env else ds.schema  # type: ignore[union-attr]
    if env and ds:
        if (env.schema.proprio_dim, env.schema.action_dim) != (ds.schema.proprio_dim, ds.schema.action_dim):
            raise SpecError(f"invalid tenant spec {spec.name!r}: dataset {ds.name!r} "
                            f"(state {ds.schema.proprio_dim}, action {ds.schema.action_dim}) does not fit env "
                            f"{env.name!r} (state {env.schema.proprio_dim}, action {env.schema.action_dim})")
    if spec.action_dim is not None and spec.action_dim != schema.action_dim:
        src = spec.env or spec.dataset
        raise SpecError(f"invalid tenant spec {spec.name!r}: action_dim={spec.action_dim} but {src!r} "
                        f"has {schema.action_dim}-dim actions")
    return spec, schema


def validate_job(spec: TenantSpec, raw: dict[str, Any]) -> Any:
    """Check a job against its tenant: RL and eval need an env, SFT a dataset."""
    try:
        job = _JOB.validate_python(raw)
    except ValidationError as e:
        raise SpecError(f"invalid job: {_pydantic_message(e)}") from None
    if job.kind in ("rl", "eval") and not spec.env:
        raise SpecError(f"tenant {spec.name!r} has no env: a {job.kind} job needs one")
    if job.kind == "sft" and not spec.dataset:
        raise SpecError(f"tenant {spec.name!r} has no dataset: an sft job needs one")
    if job.kind == "rl" and spec.action_head not in RL_ACTION_HEADS:
        heads = ", ".join(sorted(RL_ACTION_HEADS))
        raise SpecError(f"tenant {spec.name!r}: RL needs a Gaussian action head ({heads}); "
                        f"{spec.action_head!r} is a flow-matching expert without action log-probabilities "
                        "(SFT and eval only)")
    if job.kind == "rl" and spec.chunk != 1:
        raise SpecError(f"tenant {spec.name!r}: RL trains one action per step, but chunk={spec.chunk}")
    return job


def schema_to_dict(schema: TenantSchema) -> dict[str, Any]:
    return asdict(schema)


def schema_from_dict(d: dict[str, Any]) -> TenantSchema:
    from nexus.features import CameraSpec

    return TenantSchema(proprio_dim=d["proprio_dim"], action_dim=d["action_dim"],
                        cameras=tuple(CameraSpec(**c) for c in d.get("cameras", ())),
                        instruction=d.get("instruction", ""))
