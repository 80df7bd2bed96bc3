"""Tenant registry of the control plane: every tenant's spec, schema, output dir and policy version.

A plain object (no Dask, no I/O). Versions only move forward: :meth:`TenantRegistry.publish` keeps
the highest version ever reported for a tenant, so a late or repeated report can never move a
tenant back to a version that was superseded. A tenant's phase moves ``creating`` → ``ready`` →
``deleting`` (:data:`TRANSITIONS`; :meth:`TenantState.move` refuses any other move).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from nexus.control.transitions import move
from nexus.errors import NotFound, quote
from nexus.features import TenantSchema
from nexus.spec import TenantSpec
from nexus.wire.messages import TenantSetup


class TenantPhase(StrEnum):
    CREATING = "creating"  # validated, its slot being built (or restored) on the actor
    READY = "ready"  # a rebuilt actor or a joining engine includes it; jobs may be submitted
    DELETING = "deleting"  # leaving the service: unknown to every handler


TRANSITIONS: dict[TenantPhase, frozenset[TenantPhase]] = {
    TenantPhase.CREATING: frozenset({TenantPhase.READY}),  # a failed creation leaves the registry instead
    TenantPhase.READY: frozenset({TenantPhase.DELETING}),
    TenantPhase.DELETING: frozenset(),
}


@dataclass
class TenantState:
    spec: TenantSpec
    schema: TenantSchema
    output_dir: str
    version: int = 0
    phase: TenantPhase = TenantPhase.CREATING
    training_job: str | None = None  # at most one SFT/RL job at a time; evals run beside it
    episodes: int = 0  # RL episodes started so far: ids and reset seeds never repeat
    jobs: list[str] = field(default_factory=list)
    restored: bool = False
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        if self.spec.dataset:
            return "sft"
        return "rl" if self.spec.env or self.spec.external else "eval"

    def move(self, new: TenantPhase) -> None:
        """Change phase (only as :data:`TRANSITIONS` allows)."""
        self.phase = move(f"tenant {self.name!r}", self.phase, TenantPhase(new), TRANSITIONS)

    def setup(self) -> TenantSetup:
        return TenantSetup(name=self.name, spec=self.spec, schema=self.schema, output_dir=self.output_dir,
                           version=self.version)

    def view(self) -> dict[str, Any]:
        return {"tenant": self.name, "kind": self.kind, "version": self.version, "phase": str(self.phase),
                "env": self.spec.env, "dataset": self.spec.dataset, "output_dir": self.output_dir,
                "training_job": self.training_job, "jobs": list(self.jobs), "restored": self.restored}


class TenantRegistry:
    def __init__(self) -> None:
        self._tenants: dict[str, TenantState] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._tenants

    def __iter__(self):
        return iter(list(self._tenants.values()))

    def __len__(self) -> int:
        return len(self._tenants)

    def add(self, state: TenantState) -> TenantState:
        if state.name in self._tenants:
            raise ValueError(f"tenant {state.name!r} is already registered")
        self._tenants[state.name] = state
        return state

    def get(self, name: str) -> TenantState:
        t = self._tenants.get(name)
        if t is None or t.phase == TenantPhase.DELETING:
            raise NotFound(f"unknown tenant {quote(name)}")
        return t

    def find(self, name: str) -> TenantState | None:
        return self._tenants.get(name)

    def remove(self, name: str) -> TenantState | None:
        return self._tenants.pop(name, None)

    def names(self) -> list[str]:
        return list(self._tenants)

    def ready(self) -> list[TenantState]:
        return [t for t in self._tenants.values() if t.phase == TenantPhase.READY]

    def versions(self) -> dict[str, int]:
        return {n: t.version for n, t in self._tenants.items()}

    def version_view(self) -> Mapping[str, int]:
        """Every tenant's version as a live mapping: a lookup costs O(1), whatever the number of tenants
        (the dispatcher asks it at every decision)."""
        return _Versions(self._tenants)

    def publish(self, name: str, version: int) -> int:
        """Record that ``version`` of a tenant exists; returns the tenant's (never decreasing) version."""
        t = self._tenants.get(name)
        if t is None:
            return version
        t.version = max(t.version, int(version))
        return t.version


class _Versions(Mapping):
    def __init__(self, tenants: dict[str, TenantState]) -> None:
        self._tenants = tenants

    def __getitem__(self, name: str) -> int:
        return self._tenants[name].version

    def __iter__(self):
        return iter(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)
