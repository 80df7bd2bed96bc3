"""Pages of the service's views (status, monitoring, job lists): a view never grows with the number of tenants
or jobs ever run.

Tenants come in name order, jobs newest first (by job number). A page holds at most ``limit`` of each; its
``next_cursor`` (opaque, URL-safe) continues both lists where the page ended, None on the last page. One
tenant's view (``tenant=``) holds that tenant and its jobs only.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nexus.errors import SpecError
from nexus.wire.messages import job_number

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000


@dataclass(frozen=True)
class Page:
    limit: int = DEFAULT_LIMIT
    after_tenant: str | None = None  # tenants named after this one
    before_job: int | None = None  # jobs numbered below this one
    tenant: str | None = None  # one tenant's view

    @classmethod
    def parse(cls, limit: Any = None, cursor: Any = None, tenant: Any = None) -> Page:
        """A page from a request's parameters; a bad one is a SpecError that quotes at most a short prefix."""
        if limit is None:
            limit = DEFAULT_LIMIT
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            raise SpecError(f"limit: an integer from 1 to {MAX_LIMIT}, got {str(limit)[:40]!r}")
        if tenant is not None and not isinstance(tenant, str):
            raise SpecError(f"tenant: a tenant name, got {type(tenant).__name__}")
        if cursor is None:
            return cls(limit, tenant=tenant)
        try:
            raw = json.loads(base64.urlsafe_b64decode(str(cursor).encode() + b"==="))
            after, before = raw.get("t"), raw.get("j")
            if not (after is None or isinstance(after, str)) or not (before is None or isinstance(before, int)):
                raise ValueError
        except (ValueError, TypeError, AttributeError, binascii.Error):
            raise SpecError(f"cursor: not a cursor this service gave out ({str(cursor)[:40]!r})") from None
        return cls(limit, after, before, tenant)

    def cursor(self, last_tenant: str | None, last_job: int | None) -> str:
        doc = {"t": last_tenant, "j": last_job}
        return base64.urlsafe_b64encode(json.dumps(doc, separators=(",", ":")).encode()).decode().rstrip("=")

    def tenants(self, names: Iterable[str]) -> tuple[list[str], bool]:
        """This page's tenant names, and whether more follow."""
        if self.tenant is not None:
            return ([self.tenant] if self.tenant in set(names) else []), False
        rest = sorted(n for n in names if self.after_tenant is None or n > self.after_tenant)
        return rest[:self.limit], len(rest) > self.limit

    def jobs(self, jobs: Iterable[Any], tenant_of=lambda j: j.tenant) -> tuple[list[Any], bool]:
        """This page's jobs (newest first), and whether more follow; ``jobs`` in submission order."""
        out, more = [], False
        for js in reversed(list(jobs)):
            if self.tenant is not None and tenant_of(js) != self.tenant:
                continue
            if self.before_job is not None and job_number(js.job_id) >= self.before_job:
                continue
            if len(out) == self.limit:
                more = True
                break
            out.append(js)
        return out, more

    def info(self, tenants: list[str], more_tenants: bool, jobs: list[Any], more_jobs: bool,
             totals: dict[str, int]) -> dict[str, Any]:
        """The ``page`` entry of a view: the limit, the totals and the cursor of the next page."""
        nxt = None
        if more_tenants or more_jobs:
            nxt = self.cursor(tenants[-1] if more_tenants else "\U0010ffff",  # past every name: tenants done
                              job_number(jobs[-1].job_id) if more_jobs else 0)  # below every job: jobs done
        return {"limit": self.limit, **totals, "next_cursor": nxt}
