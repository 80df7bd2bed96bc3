"""The schedulers' catalog: ``schedulers/*.toml``, named overlays of the service's own settings.

A scheduler file sets the same keys a service file sets — the training queue's order
(``[dispatch] queue_order``), the actor's concurrency, the inference group's wait T and size B
(``infer_max_wait_s``, ``infer_max_batch``), the admission defaults of tenants that do not set their own
(``[limits] default_max_inflight``), the weight-sync rule (``[datapath] sync_mode``), whether tenants share
the service at all (``[dispatch] isolated``) — plus a ``description``. ``ServiceConfig.scheduler`` names the one
a service starts with: its settings apply over the defaults, and the ones the service file sets itself win;
switching a running service's scheduler (``nexus.control.dispatch.scheduler``) applies its settings over the
running ones. There is no second model of these knobs: :class:`nexus.config.service.Scheduler` (``Scheduler.load``)
validates a file's settings with ``ServiceConfig`` itself.

This module finds and reads the files (no validation of the settings, no import of the settings model). No
torch; :func:`read` reads one small TOML file (at service configuration, never on the scheduler's event
loop). A bad file is refused with a :class:`~nexus.errors.SpecError` that names the file.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from nexus.errors import SpecError

DEFAULT = "priority"  # the best median efficiency in experiments/multitenant/ (schedulers/priority.toml)


def catalog_dir() -> Path:
    """``schedulers/`` next to ``envs/`` and ``datasets/`` (``NEXUS_CATALOG_ROOT`` moves all three)."""
    return Path(os.environ.get("NEXUS_CATALOG_ROOT", Path(__file__).resolve().parents[2])) / "schedulers"


def names() -> list[str]:
    return sorted(f.stem for f in catalog_dir().glob("*.toml"))


def path_of(ref: str) -> Path:
    """A catalog name (``"fifo"`` → ``schedulers/fifo.toml``) or a path to a scheduler file."""
    if ref.endswith(".toml") or "/" in ref or os.sep in ref:
        return Path(ref).expanduser()
    path = catalog_dir() / f"{ref}.toml"
    if not path.is_file():
        raise SpecError(f"unknown scheduler {ref!r}; schedulers/ has: {', '.join(names()) or 'none'} "
                        "(or give a path to a .toml file)")
    return path


def parse(text: str, where: str, name: str) -> tuple[str, dict[str, Any]]:
    """A scheduler file's text -> (its description, its settings as a service file writes them)."""
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
    return description, raw


def read(ref: str) -> tuple[str, str, dict[str, Any], str]:
    """(name, description, settings, where) of the scheduler ``ref`` (a catalog name or a path)."""
    path = path_of(ref)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"scheduler file {path}: cannot be read ({e.strerror or e})") from None
    description, settings = parse(text, str(path), path.stem)
    return path.stem, description, settings, str(path)
