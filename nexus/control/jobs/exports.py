"""Export of a tenant's policy version as a self-contained directory (``nexus.export.policy``), from the control
plane: the checks here, the writing on actor rank 0 (``tasks.EXPORT_VERSION``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from nexus.control import tasks
from nexus.errors import NotFound, SpecError

if TYPE_CHECKING:
    from nexus.control.health.actor_group import ActorGroup
    from nexus.control.tenants.registry import TenantRegistry


async def export_version(registry: TenantRegistry, actors: ActorGroup, tenant: str, path: str | None = None,
                         version: int | None = None) -> dict[str, Any]:
    """Write a tenant's policy version (default: current) as a self-contained directory (``nexus.export.policy``).

    ``path`` None: the tenant's own ``<output dir>/exports/vNNNNNN/`` (written once, reused after), which
    the gateway serves as the tenant's files; else an absolute path on the service's file system (the
    gateway lets tenant tokens name only paths inside their output dir). Runs on actor rank 0 (the
    backbone the policy ran on is resident there) from that version's durable weights file, so training
    may go on meanwhile."""
    t = registry.get(tenant)
    version = t.version if version is None else int(version)
    if not 0 <= version <= t.version:
        raise NotFound(f"tenant {tenant!r} has no version {version} (current {t.version})")
    if path is not None and (not isinstance(path, str) or "\x00" in path or not os.path.isabs(path)):
        raise SpecError(f"export path {path!r}: give an absolute path on the service's file system")
    setup = t.setup()
    return await actors.run(
        tasks.EXPORT_VERSION, lambda r: (setup, version, path),
        key=f"nexus-export-{tenant}-v{version}", retry_lost=True, timeout=600, first_only=True)
