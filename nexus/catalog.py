"""The environment and dataset catalogs: declarative TOML files in ``envs/`` and ``datasets/``.

No torch and no simulator imports: the scheduler validates tenant specs against the catalog.
Adding a task or a dataset means editing a TOML file, never code.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from nexus.features import CameraSpec, TenantSchema


class CatalogError(ValueError):
    """A name that the catalog does not know, or a task that cannot run here."""


def catalog_root() -> Path:
    """The folder holding ``envs/`` and ``datasets/`` (the repository root by default)."""
    return Path(os.environ.get("NEXUS_CATALOG_ROOT", Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class EnvEntry:
    name: str  # "<suite>/<task>"
    simulator: str
    env_id: str
    obs_mode: str
    control_mode: str
    reward_mode: str
    max_episode_steps: int
    schema: TenantSchema
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    format: str  # "arrow"
    path: Path  # absolute
    env: str | None  # the catalog env the episodes were recorded in, if any
    schema: TenantSchema
    generator: str = ""


def _schema(d: dict[str, Any]) -> TenantSchema:
    cams = tuple(CameraSpec(c["name"], int(c["height"]), int(c["width"])) for c in d.get("cameras", []))
    return TenantSchema(proprio_dim=int(d["proprio_dim"]), action_dim=int(d["action_dim"]),
                        cameras=cams, instruction=d.get("instruction", ""))


@lru_cache(maxsize=4)
def _load(root: Path) -> tuple[dict[str, EnvEntry], dict[str, str], dict[str, DatasetEntry]]:
    envs: dict[str, EnvEntry] = {}
    refused: dict[str, str] = {}
    for f in sorted((root / "envs").glob("*.toml")):
        suite = tomllib.loads(f.read_text())
        sname, defaults = f.stem, suite.get("defaults", {})
        for task, raw in suite.get("tasks", {}).items():
            t = {**defaults, **raw}
            envs[f"{sname}/{task}"] = EnvEntry(
                name=f"{sname}/{task}", simulator=suite["simulator"], env_id=t["env_id"],
                obs_mode=t.get("obs_mode", "state"), control_mode=t["control_mode"],
                reward_mode=t.get("reward_mode", "dense"), max_episode_steps=int(t["max_episode_steps"]),
                schema=_schema(t), options=dict(t.get("options", {})))
        for env_id, why in suite.get("refused", {}).items():
            refused[env_id] = why
    datasets: dict[str, DatasetEntry] = {}
    for f in sorted((root / "datasets").glob("*.toml")):
        d = tomllib.loads(f.read_text())
        datasets[d["name"]] = DatasetEntry(name=d["name"], format=d.get("format", "arrow"),
                                           path=(f.parent / d["path"]).resolve(), env=d.get("env"),
                                           schema=_schema(d["schema"]), generator=d.get("generator", ""))
    return envs, refused, datasets


def envs() -> dict[str, EnvEntry]:
    return _load(catalog_root())[0]


def datasets() -> dict[str, DatasetEntry]:
    return _load(catalog_root())[2]


def env(name: str) -> EnvEntry:
    all_envs, refused, _ = _load(catalog_root())
    if name in all_envs:
        return all_envs[name]
    task = name.split("/")[-1]
    for env_id, why in refused.items():
        if task.lower() in (env_id.lower(), env_id.lower().removesuffix("-v1")):
            raise CatalogError(f"env {name!r} is refused: {why}")
    raise CatalogError(f"unknown env {name!r}; the catalog has: {', '.join(sorted(all_envs))}")


def dataset(name: str) -> DatasetEntry:
    all_ds = datasets()
    if name not in all_ds:
        raise CatalogError(f"unknown dataset {name!r}; the catalog has: {', '.join(sorted(all_ds)) or 'none'}")
    return all_ds[name]
