"""State machines of the control plane's records (a tenant's phase, a job's state).

Each state enum has one table of the moves it allows (``TRANSITIONS`` next to the enum); every change of
state goes through :func:`move`, which refuses any other with :class:`IllegalTransition`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import TypeVar

S = TypeVar("S", bound=StrEnum)


class IllegalTransition(RuntimeError):
    """A state change its table does not allow: a bug in the control plane, never a caller's error."""


def move(what: str, old: S, new: S, allowed: Mapping[S, frozenset[S]]) -> S:
    """``new`` if ``old -> new`` is in ``allowed``; else :class:`IllegalTransition` naming ``what``."""
    if new not in allowed[old]:
        nexts = ", ".join(sorted(str(s) for s in allowed[old])) or "none, it is final"
        raise IllegalTransition(f"{what} cannot go from {old!s} to {new!s} (allowed from {old!s}: {nexts})")
    return new
