"""The environment and dataset catalogs: declarative TOML files in ``envs/`` and ``datasets/``.

No torch and no simulator imports: the scheduler validates tenant specs against the catalog.
Adding a task or a dataset means editing a TOML file, never code. A task that would need an asset
download (or a whole suite that does, e.g. LIBERO's scenes) is listed under ``[refused]`` and is
refused here, at spec validation, with the reason; nothing is ever prompted or downloaded.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from nexus.errors import quote
from nexus.features import CameraSpec, TenantSchema

SIMULATORS = ("maniskill", "robosuite", "libero")
DATASET_FORMATS = ("arrow", "lerobot")
# per simulator: where the success flag comes from (the catalog's ``success`` field)
SUCCESS_CRITERIA = {"maniskill": ("evaluate",), "robosuite": ("check_success",), "libero": ("check_success",)}


# Reward terms every env exposes (a tenant's ``reward``, nexus.spec.RewardTerm): the task's success flag (0/1) and
# the env's own reward (in the entry's reward_mode). An entry adds its own with ``reward_terms`` / ``info_terms``.
BUILTIN_REWARD_TERMS = ("success", "env_reward")
REWARD_SOURCES = ("distance", "contact", "grasp")  # what a catalog reward term measures
_POINT = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*")  # an object / key path: no private names


class CatalogError(ValueError):
    """A name that the catalog does not know, or a task that cannot run here."""


def catalog_root() -> Path:
    """The folder holding ``envs/`` and ``datasets/`` (the repository root by default)."""
    return Path(os.environ.get("NEXUS_CATALOG_ROOT", Path(__file__).resolve().parents[2]))


@dataclass(frozen=True)
class RewardSource:
    """A reward term an env entry declares, read from the simulator after every step by the back-end's fixed code.

    ``distance`` [a, b]: the Euclidean distance between two objects' positions (``axes`` "xy": on the table's
    plane); ``contact`` [a, b]: whether they touch (ManiSkill: the contact force between them, in N; robosuite: 0/1);
    ``grasp`` [a]: whether the robot grasps the object (0/1); ``info``: the simulator's step info value of that
    key. Objects are named as the back-end knows them: ManiSkill task attributes ("obj", "agent.tcp"), robosuite
    observation keys for positions ("cube_pos") and model attributes for contacts ("cube")."""

    kind: str  # REWARD_SOURCES or "info"
    args: tuple[str, ...]
    axes: str = "xyz"


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
    options: dict[str, Any] = field(default_factory=dict)  # extra simulator keyword arguments
    proprio_keys: tuple[str, ...] | None = None  # observation keys concatenated into Observation.state
    success: str = "evaluate"  # the simulator's success criterion (SUCCESS_CRITERIA)
    terminate_on_success: bool = True  # an episode ends at its first successful step
    num_envs: int = 1  # sub-environments per rollout task (gymnasium vector env when > 1)
    vector_mode: str = "async"  # "async" (one process each, forkserver) or "sync" (in-process)
    description: str = ""
    reward_terms: dict[str, RewardSource] = field(default_factory=dict)  # besides BUILTIN_REWARD_TERMS

    @property
    def reward_term_names(self) -> tuple[str, ...]:
        """The terms a tenant's reward may use in this env."""
        return (*BUILTIN_REWARD_TERMS, *self.reward_terms)


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    format: str  # "arrow" | "lerobot"
    path: Path  # absolute
    env: str | None  # the catalog env the episodes were recorded in, if any
    schema: TenantSchema
    generator: str = ""
    # lerobot: feature names -> our columns ({"state": [...], "action": "...", "cameras": {cam: key}})
    features: dict[str, Any] = field(default_factory=dict)
    # arrow: row filter over tenant / policy version ({"tenant": "...", "min_version": 3, "max_version": 9})
    filter: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)


def _schema(d: dict[str, Any], where: str) -> TenantSchema:
    try:
        cams = tuple(CameraSpec(str(c["name"]), int(c["height"]), int(c["width"])) for c in d.get("cameras", []))
        return TenantSchema(proprio_dim=int(d["proprio_dim"]), action_dim=int(d["action_dim"]),
                            cameras=cams, instruction=str(d.get("instruction", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise CatalogError(f"{where}: bad schema ({type(e).__name__}: {e})") from None


def _reward_sources(t: dict[str, Any], where: str) -> dict[str, RewardSource]:
    """An entry's ``reward_terms`` ({name = {distance = [a, b], axes = "xy"}}, {contact = [a, b]}, {grasp = a})
    and ``info_terms`` (simulator info keys, exposed as ``info.<key>``)."""
    out: dict[str, RewardSource] = {}
    for name, d in dict(t.get("reward_terms", {})).items():
        kinds = [k for k in REWARD_SOURCES if isinstance(d, dict) and k in d]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", name) or name in BUILTIN_REWARD_TERMS or len(kinds) != 1:
            raise CatalogError(f"{where}: reward term {name!r}: a plain name (not {BUILTIN_REWARD_TERMS}) with one "
                               f"of {REWARD_SOURCES}")
        args = d[kinds[0]]
        args = (args,) if isinstance(args, str) else tuple(args)
        axes = str(d.get("axes", "xyz"))
        if len(args) != (1 if kinds[0] == "grasp" else 2) or not all(isinstance(a, str) and _POINT.fullmatch(a)
                                                                       for a in args) or axes not in ("xyz", "xy"):
            raise CatalogError(f"{where}: reward term {name!r}: {kinds[0]} takes "
                               f"{'one object' if kinds[0] == 'grasp' else 'two objects'} (dotted names) and axes "
                               f"'xyz' | 'xy', got {d}")
        out[name] = RewardSource(kinds[0], args, axes)
    for key in t.get("info_terms", []):
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key):
            raise CatalogError(f"{where}: info_terms: {key!r} is not a plain key")
        out[f"info.{key}"] = RewardSource("info", (key,))
    return out


def _env_entry(suite: str, task: str, simulator: str, t: dict[str, Any], where: str) -> EnvEntry:
    try:
        options = dict(t.get("options", {}))
        keys = t.get("proprio_keys", options.pop("proprio_keys", None))
        entry = EnvEntry(
            name=f"{suite}/{task}", simulator=simulator, env_id=str(t["env_id"]),
            obs_mode=str(t.get("obs_mode", "state")), control_mode=str(t["control_mode"]),
            reward_mode=str(t.get("reward_mode", "dense")), max_episode_steps=int(t["max_episode_steps"]),
            schema=_schema(t, where), options=options, proprio_keys=tuple(keys) if keys is not None else None,
            success=str(t.get("success", SUCCESS_CRITERIA.get(simulator, ("",))[0])),
            terminate_on_success=bool(t.get("terminate_on_success", True)), num_envs=int(t.get("num_envs", 1)),
            vector_mode=str(t.get("vector_mode", "async")), description=str(t.get("description", "")),
            reward_terms=_reward_sources(t, f"{where}: task {task!r}"))
    except KeyError as e:
        raise CatalogError(f"{where}: task {task!r} lacks {e.args[0]!r}") from None
    if entry.success not in SUCCESS_CRITERIA[simulator]:
        raise CatalogError(f"{where}: task {task!r}: success {entry.success!r} is not one of "
                           f"{SUCCESS_CRITERIA[simulator]}")
    if entry.num_envs < 1 or entry.vector_mode not in ("async", "sync") or entry.max_episode_steps < 1:
        raise CatalogError(f"{where}: task {task!r}: num_envs >= 1, max_episode_steps >= 1 and "
                           "vector_mode 'async' | 'sync' are required")
    if (entry.obs_mode == "state") != (not entry.schema.cameras):
        raise CatalogError(f"{where}: task {task!r}: obs_mode {entry.obs_mode!r} and cameras "
                           f"{[c.name for c in entry.schema.cameras]} disagree (state: none, camera modes: some)")
    return entry


def _task_variants(entry: EnvEntry, task_list: Any, where: str) -> dict[str, EnvEntry]:
    """A suite entry's tasks (``task_list``: [name, instruction] pairs): ``<suite>/<task>/<i>`` and
    ``<suite>/<task>/<name>``, each with its own instruction and ``options["task"] = i``."""
    try:
        pairs = [(str(n), str(lang)) for n, lang in task_list]
    except (TypeError, ValueError):
        raise CatalogError(f"{where}: {entry.name!r}: task_list must be [name, instruction] pairs") from None
    out: dict[str, EnvEntry] = {}
    for i, (task, lang) in enumerate(pairs):
        schema = TenantSchema(entry.schema.proprio_dim, entry.schema.action_dim, entry.schema.cameras, lang)
        one = replace(entry, name=f"{entry.name}/{i}", schema=schema, options={**entry.options, "task": i},
                      description=f"{entry.description}; task {i}: {task}")
        out[one.name] = out[f"{entry.name}/{task}"] = one
    return out


@lru_cache(maxsize=4)
def _load(root: Path) -> tuple[dict[str, EnvEntry], dict[str, str], dict[str, DatasetEntry], dict[str, EnvEntry]]:
    envs: dict[str, EnvEntry] = {}
    tasks: dict[str, EnvEntry] = {}  # the tasks of suite entries (task_list), by index and by name
    refused: dict[str, str] = {}  # lower-case env id, "<suite>/<task>" or "<suite>/*" -> reason
    suites = [(f, tomllib.loads(f.read_text())) for f in sorted((root / "envs").glob("*.toml"))]
    for f, suite in suites:  # refusals first: they apply to the tasks of every suite
        for env_id, why in suite.get("refused", {}).items():
            refused[env_id.lower()] = str(why)
        if "refuse_all" in suite:  # a whole suite that cannot run here (e.g. its assets need a download)
            refused[f"{f.stem}/*"] = str(suite["refuse_all"])
    for f, suite in suites:
        sname, defaults, where = f.stem, suite.get("defaults", {}), f"envs/{f.name}"
        if "refuse_all" in suite:
            continue
        simulator = suite.get("simulator")
        if simulator not in SIMULATORS:
            raise CatalogError(f"{where}: simulator {simulator!r} is not one of {SIMULATORS}")
        for task, raw in suite.get("tasks", {}).items():
            entry = _env_entry(sname, task, simulator, {**defaults, **raw}, where)
            why = refused.get(entry.env_id.lower())
            if why:  # a catalog task may not smuggle in a refused simulator task
                refused[entry.name.lower()] = why
            else:
                envs[entry.name] = entry
                if "task_list" in raw:  # a suite: the entry is its first task; every task has its own name
                    tasks.update(_task_variants(entry, raw["task_list"], where))
    datasets: dict[str, DatasetEntry] = {}
    for f in sorted((root / "datasets").glob("*.toml")):
        d, where = tomllib.loads(f.read_text()), f"datasets/{f.name}"
        fmt = d.get("format", "arrow")
        if fmt not in DATASET_FORMATS:
            raise CatalogError(f"{where}: format {fmt!r} is not one of {DATASET_FORMATS}")
        path = Path(os.path.expandvars(os.path.expanduser(str(d["path"]))))
        datasets[d["name"]] = DatasetEntry(
            name=d["name"], format=fmt, path=(f.parent / path).resolve(), env=d.get("env"),
            schema=_schema(d.get("schema", {}), where), generator=d.get("generator", ""),
            features=dict(d.get("features", {})), filter=dict(d.get("filter", {})), stats=dict(d.get("stats", {})))
    return envs, refused, datasets, tasks


def envs() -> dict[str, EnvEntry]:
    return _load(catalog_root())[0]


def datasets() -> dict[str, DatasetEntry]:
    return _load(catalog_root())[2]


def refused() -> dict[str, str]:
    """Refused names (simulator env ids, catalog names, ``<suite>/*``) and why."""
    return dict(_load(catalog_root())[1])


def suite_tasks(name: str) -> list[EnvEntry]:
    """The tasks of a suite entry (``task_list``) in order, from its name or one of its tasks' ('' if none)."""
    tasks = _load(catalog_root())[3]
    base = tasks[name].name.rpartition("/")[0] if name in tasks else name
    out, i = [], 0
    while f"{base}/{i}" in tasks:
        out.append(tasks[f"{base}/{i}"])
        i += 1
    return out


def env(name: str) -> EnvEntry:
    all_envs, refused_, _, tasks = _load(catalog_root())
    if name in all_envs:
        return all_envs[name]
    if name in tasks:
        return tasks[name]
    suite, _, task = name.lower().rpartition("/")
    for key in (name.lower(), f"{suite}/*", task, f"{task}-v1"):
        if key in refused_:
            raise CatalogError(f"env {quote(name)} is refused: {refused_[key]}")
    raise CatalogError(f"unknown env {quote(name)}; the catalog has: {', '.join(sorted(all_envs))}")


def dataset(name: str) -> DatasetEntry:
    all_ds = datasets()
    if name not in all_ds:
        raise CatalogError(f"unknown dataset {quote(name)}; the catalog has: {', '.join(sorted(all_ds)) or 'none'}")
    return all_ds[name]
