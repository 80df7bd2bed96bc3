"""A restarted actor rank rebuilds every tenant's slot; a tenant that fails does not stop the others.

Shared by the real actor (:mod:`nexus.actor.tasks`) and a modelled one; no torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nexus.wire.messages import SlotInfo, TenantSetup


def rebuild_each(setups: list[TenantSetup], init: Callable[[TenantSetup], SlotInfo]) -> dict[str, Any]:
    """``{"slots": [SlotInfo, ...], "errors": {tenant: "Type: message"}}``."""
    slots, errors = [], {}
    for s in setups:
        try:
            slots.append(init(s))
        except Exception as e:
            errors[s.name] = f"{type(e).__name__}: {e}"
    return {"slots": slots, "errors": errors}
