"""Schedulers: named overlays of the service's own settings, the catalog of ``schedulers/*.toml``.

A scheduler file sets the same keys a service file sets — the training queue's order
(``[dispatch] queue_order``), the actor's concurrency, the inference group's wait T and size B
(``infer_max_wait_s``, ``infer_max_batch``), the admission defaults of tenants that do not set their own
(``[limits] default_max_inflight``), the weight-sync rule (``[datapath] sync_mode``), whether tenants share
the service at all (``[dispatch] isolated``) — plus a ``description``. ``ServiceConfig.scheduler`` names the one
a service starts with: its settings apply over the defaults, and the ones the service file sets itself win;
switching a running service's scheduler (``nexus.control.policy_control``) applies its settings over the
running ones. There is no second model of these knobs: a file is validated by ``ServiceConfig`` itself.

No torch; :func:`load` reads one small TOML file (at service configuration, never on the scheduler's event
loop). A bad file is refused with a :class:`~nexus.errors.SpecError` that names the file and the field.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from nexus.config import APPLIED, DEFAULT_SCHEDULER, ServiceConfig, _merge, describe_validation_error
from nexus.errors import SpecError

DEFAULT = DEFAULT_SCHEDULER
# service keys a scheduler may not set: where the service lives, and which scheduler it runs
NOT_SCHEDULER_KEYS = ("root", "scheduler")


class Scheduler(BaseModel):
    """One ``schedulers/<name>.toml``: a name, a description and the service settings it applies."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(description="the catalog name (the file's stem)")
    description: str = Field("", description="one line on what the scheduler does")
    settings: dict[str, Any] = Field(default_factory=dict, description="service settings, as a service file "
                                     "writes them: top-level keys and [section] tables")

    def with_settings(self, extra: dict[str, Any], name: str | None = None) -> Scheduler:
        """This scheduler with more settings (``extra`` wins; tables merged key by key), checked like a file."""
        return checked(Scheduler(name=name or self.name, description=self.description,
                                 settings=_merge(self.settings, extra)), f"scheduler {name or self.name!r}")

    def value(self, dotted: str) -> Any:
        """The value this scheduler sets for ``section.key`` (``KeyError`` if it sets none)."""
        node: Any = self.settings
        for part in dotted.split("."):
            node = node[part]
        return node


def checked(sched: Scheduler, where: str) -> Scheduler:
    """``sched`` if its settings are valid service settings; else a :class:`SpecError` naming ``where`` and each
    bad field (unknown keys included: a typo is refused, not ignored)."""
    bad = [k for k in NOT_SCHEDULER_KEYS if k in sched.settings]
    if bad:
        raise SpecError(f"{where}: field {bad[0]!r} is not a scheduler setting")
    try:
        ServiceConfig.model_validate({"root": ".", **sched.settings}, context=APPLIED)
    except ValidationError as e:
        raise SpecError(f"{where}: {describe_validation_error(e, field_words=True)}") from None
    except ValueError as e:  # a moved key
        raise SpecError(f"{where}: {e}") from None
    return sched


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


def parse(text: str, where: str, name: str) -> Scheduler:
    """A scheduler from TOML text; ``where`` names the file in errors."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"scheduler file {where}: not valid TOML ({e})") from None
    if "name" in raw:
        raise SpecError(f"scheduler file {where}: field 'name' is not a setting (the name is the file's stem, "
                        f"{name!r})")
    description = raw.pop("description", "")
    if not isinstance(description, str):
        raise SpecError(f"scheduler file {where}: field 'description' must be a string")
    return checked(Scheduler(name=name, description=description, settings=raw), f"scheduler file {where}")


def load(ref: str) -> Scheduler:
    """A catalog name (``"fifo"`` → ``schedulers/fifo.toml``) or a path to a scheduler file."""
    path = _path(ref)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"scheduler file {path}: cannot be read ({e.strerror or e})") from None
    return parse(text, str(path), path.stem)
