"""Tokens of the gateway: one secret per tenant (only its hash is kept) and one operator token.

* ``create_tenant`` issues a tenant token (``nxt_…``, 256 random bits); the store keeps its SHA-256 (a
  fast hash is enough for a random 256-bit secret: there is nothing to guess) and the tenant's spec, in
  ``root/gateway/tokens.json`` (0600, written atomically).
* The operator token (``nxo_…``) is written to ``root/gateway/operator.token`` (0600) at every start:
  whoever can read the service's root is its operator.
* Every check hashes the presented token once and compares it with every stored hash with
  :func:`hmac.compare_digest` (no early exit), so the time does not depend on which token matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexus.config.paths import private_mkdir, private_write_bytes
from nexus.errors import Forbidden, Unauthorized, quote

TENANT_PREFIX, OPERATOR_PREFIX = "nxt_", "nxo_"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def new_token(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    """Who a request's token belongs to: the operator, or one tenant."""

    operator: bool = False
    tenant: str | None = None

    def may_act_on(self, tenant: str) -> None:
        """Raise unless this principal may read and write ``tenant``."""
        if self.operator or self.tenant == tenant:
            return
        raise Forbidden(f"this token does not give access to tenant {quote(tenant)}")

    def require_operator(self, what: str) -> None:
        if not self.operator:
            raise Forbidden(f"{what} needs the operator token")


class TokenStore:
    def __init__(self, directory: str | Path) -> None:
        self.dir = private_mkdir(directory)
        self.path = self.dir / "tokens.json"
        self._lock = threading.Lock()
        self._records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._records = json.loads(self.path.read_text()).get("tenants", {})
        self._operator = _digest(self._write_operator_token())

    def _write_operator_token(self) -> str:
        token = new_token(OPERATOR_PREFIX)
        private_write_bytes(self.dir / "operator.token", (token + "\n").encode())
        return token

    def _save(self) -> None:
        private_write_bytes(self.path, json.dumps({"tenants": self._records}, indent=2).encode())

    # -- tenants ---------------------------------------------------------------------------
    def __contains__(self, tenant: str) -> bool:
        return tenant in self._records

    def tenants(self) -> list[str]:
        return sorted(self._records)

    def spec(self, tenant: str) -> dict[str, Any] | None:
        rec = self._records.get(tenant)
        return dict(rec["spec"]) if rec else None

    def issue(self, tenant: str, spec: dict[str, Any]) -> str:
        """A new secret for ``tenant``; only its hash is stored."""
        token = new_token(TENANT_PREFIX)
        with self._lock:
            self._records[tenant] = {"sha256": _digest(token), "created": time.time(), "spec": spec}
            self._save()
        return token

    def revoke(self, tenant: str) -> None:
        with self._lock:
            if self._records.pop(tenant, None) is not None:
                self._save()

    # -- checks ----------------------------------------------------------------------------
    def identify(self, token: str | None) -> Principal:
        """The principal of a presented token; Unauthorized without one or for an unknown one."""
        if not token:
            raise Unauthorized("no token: send 'Authorization: Bearer <token>' (create_tenant hands one out)")
        h = _digest(token)
        operator = hmac.compare_digest(h, self._operator)
        tenant = None
        for name, rec in list(self._records.items()):  # every record, whatever matched first
            if hmac.compare_digest(h, rec["sha256"]):
                tenant = name
        if operator:
            return Principal(operator=True)
        if tenant is not None:
            return Principal(tenant=tenant)
        raise Unauthorized("unknown token")


def read_operator_token(gateway_dir: str | Path) -> str:
    return (Path(gateway_dir) / "operator.token").read_text().strip()


def read_gateway_url(gateway_dir: str | Path) -> str | None:
    """The running gateway's URL from ``gateway.json`` (None while it starts)."""
    try:
        return json.loads((Path(gateway_dir) / "gateway.json").read_text())["url"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return None
