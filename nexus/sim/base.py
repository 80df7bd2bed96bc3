"""The simulator-neutral types every back-end speaks: one env instance, one step's result, a policy output."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nexus.config.catalog import CatalogError, EnvEntry
from nexus.features import Observation, TenantSchema


class EnvSchemaError(CatalogError):
    """A simulator produced observations that do not match the catalog's tenant schema."""


@dataclass(frozen=True)
class StepResult:
    obs: Observation
    reward: float
    terminated: bool
    truncated: bool
    success: bool
    # the reward terms the env exposes after this step (nexus.sim.reward): success, env_reward, the catalog's own
    terms: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyOutput:
    """What a policy returns for one observation; logprob/value feed PPO, version the staleness check."""

    action: np.ndarray  # float32 [action_dim]
    logprob: float = 0.0
    value: float = 0.0
    version: int = 0


class CatalogEnv:
    """What every environment of a catalog entry exposes, single or batched."""

    entry: EnvEntry
    # the catalog-declared reward terms read after each step (None: all; a producer asks for its tenant's only,
    # since reading them costs simulator queries); success and env_reward are always there
    read_terms: frozenset[str] | None = None

    def want_terms(self, names: Collection[str] | None) -> None:
        """Read only these declared reward terms after each step from now on (None: all of them)."""
        self.read_terms = None if names is None else frozenset(names)

    @property
    def schema(self) -> TenantSchema:
        return self.entry.schema

    @property
    def max_episode_steps(self) -> int:
        return self.entry.max_episode_steps


class BatchedSimEnv(CatalogEnv):
    """Base of ``num_envs`` sub-environments driven together (``reset_some`` / ``step``)."""

    num_envs: int
    _low: np.ndarray
    _high: np.ndarray

    @property
    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return self._low, self._high


class SimEnv(CatalogEnv, ABC):
    """One simulator instance of a catalog env (one episode at a time); subclasses implement one simulator."""

    num_envs = 1

    def __init__(self, entry: EnvEntry) -> None:
        self.entry = entry

    @property
    def action_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-dimension action limits; the service's convention is [-1, 1]."""
        a = self.entry.schema.action_dim
        return -np.ones(a, np.float32), np.ones(a, np.float32)

    @abstractmethod
    def reset(self, seed: int | None = None) -> Observation:
        """Start an episode and return its first observation."""

    @abstractmethod
    def step(self, action: np.ndarray) -> StepResult:
        """Apply one action (already within ``action_bounds``)."""

    def close(self) -> None:  # noqa: B027 (optional hook: not every simulator holds resources)
        """Release the simulator; the instance is unusable afterwards."""

    def __enter__(self) -> SimEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_observation(entry: EnvEntry, obs: Observation, keys: tuple[str, ...] | None = None) -> None:
    """Raise :class:`EnvSchemaError` unless ``obs`` has exactly the catalog's state size and cameras."""
    schema, name = entry.schema, entry.name
    if obs.state.shape != (schema.proprio_dim,):
        detail = f" (keys {', '.join(keys)})" if keys else ""
        raise EnvSchemaError(f"env {name!r}: simulator state has {obs.state.shape[0]} dims{detail}, "
                             f"the catalog declares proprio_dim={schema.proprio_dim}")
    declared = {c.name: (c.height, c.width, 3) for c in schema.cameras}
    produced = {k: v.shape for k, v in obs.images.items()}
    if declared != produced:
        raise EnvSchemaError(f"env {name!r}: simulator cameras {produced} != catalog cameras {declared}")
    bad = [k for k, v in obs.images.items() if v.dtype != np.uint8]
    if bad:
        raise EnvSchemaError(f"env {name!r}: cameras {bad} are not uint8 RGB")


def leaf_keys(tree: Mapping[str, Any], groups: tuple[str, ...]) -> list[str]:
    """Slash-joined paths of all array leaves under ``groups``, in the simulator's key order."""

    def walk(node: Any, prefix: str) -> list[str]:
        if isinstance(node, Mapping):
            return [p for k, v in node.items() for p in walk(v, f"{prefix}/{k}")]
        return [prefix]

    return [p for g in groups if g in tree for p in walk(tree[g], g)]


def lookup(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("/"):
        node = node[part]
    return node
