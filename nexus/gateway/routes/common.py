"""What the gateway's routers share: who calls (the bearer token's :class:`~nexus.gateway.auth.Principal`), the
gateway's state (:class:`~nexus.gateway.state.Gateway`), a low-level op's session header and the page parameters.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Header, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nexus.gateway.auth import Principal
from nexus.gateway.state import Gateway
from nexus.gateway.timing import spans_of
from nexus.spec import SESSION_HEADER, check_session
from nexus.wire.paging import MAX_LIMIT as MAX_PAGE

MAX_WAIT_S = 60.0  # one result / stream poll holds a request at most this long
PageLimit = Annotated[int | None, Query(ge=1, le=MAX_PAGE, description="tenants (and jobs) per page")]
PageCursor = Annotated[str | None, Query(max_length=512, description="page.next_cursor of the previous page")]
FILE_CHUNK = 1 << 20  # bytes per chunk when a file is streamed to a client

# module level: with postponed annotations FastAPI resolves these names in the module's globals
bearer = HTTPBearer(auto_error=False, description="a tenant token (from create_tenant) or the operator token")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


async def principal(request: Request, cred: Credentials) -> Principal:
    t0 = time.perf_counter()
    who = request.app.state.gateway.tokens.identify(cred.credentials if cred else None)
    if (spans := spans_of(request.scope)) is not None:
        spans["auth"] = time.perf_counter() - t0
    return who


async def optional_principal(request: Request, cred: Credentials) -> Principal | None:
    return request.app.state.gateway.tokens.identify(cred.credentials) if cred else None


Who = Annotated[Principal, Depends(principal)]
MaybeWho = Annotated[Principal | None, Depends(optional_principal)]


async def op_session(session: Annotated[str | None, Header(alias=SESSION_HEADER, description=(
        "the client connection's id: its low-level ops are one MLflow run (default: the tenant's default "
        "session)"))] = None) -> str:
    return check_session(session)  # a bad one: SpecError, 422


OpSession = Annotated[str, Depends(op_session)]


async def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GW = Annotated[Gateway, Depends(gateway)]

