"""Who may create a tenant: off loopback only the operator, unless the operator opens registration on purpose.

A deployed gateway (Kubernetes, SLURM, `nexus gateway --host ADDR`) is reached by anyone on its network: with
registration open by default, anyone with the URL created tenants. `open_registration` unset (the default) means
open on a loopback gateway (the demo, `Nexus.local`, the tests: only this host's users reach it) and closed
elsewhere; `true` / `false` say so explicitly. Checked against one live service: its own gateway process with
registration closed, and gateways built on the same scheduler that listen (by their settings) off loopback.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from nexus.client.api import Nexus
from nexus.config.service import ServiceConfig
from nexus.deploy.tls import security
from nexus.gateway.app import create_app
from nexus.gateway.auth import TokenStore, read_operator_token
from nexus.gateway.backend import Backend
from nexus.spec import TenantSpec

PUSH = "maniskill/pushcube-state"
OFF_LOOPBACK = "192.0.2.10"  # TEST-NET-1: an address a deployed gateway could listen on


@pytest.mark.parametrize(("setting", "host", "open_"), [
    (None, "127.0.0.1", True), (None, "localhost", True), (None, "::1", True),
    (None, OFF_LOOPBACK, False), (None, "0.0.0.0", False), (None, "nexus-gateway", False),
    (True, OFF_LOOPBACK, True), (False, "127.0.0.1", False), (False, OFF_LOOPBACK, False),
])
def test_registration_is_open_on_loopback_and_explicit_elsewhere(tmp_path, setting, host, open_):
    cfg = ServiceConfig(root=str(tmp_path), **({} if setting is None else {"open_registration": setting}))
    assert cfg.registration_open(host) is open_


def test_the_default_stays_unset_in_a_saved_config(tmp_path):
    """service.json carries no decision the gateway's own address should make."""
    cfg = ServiceConfig(root=str(tmp_path))
    assert cfg.open_registration is None
    assert ServiceConfig.load(cfg.save(tmp_path / "service.json")).open_registration is None


def _spec(name: str) -> dict:
    return TenantSpec(name=name, env=PUSH, seed=1).model_dump(mode="json")


def _refused(r: httpx.Response, phrase: str) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["class"] == "Forbidden" and "operator token" in err["message"] and phrase in err["message"], err


@pytest.mark.cluster
def test_tenant_creation_needs_the_operator_token_unless_registration_is_open(tmp_path):
    with Nexus.local(tmp_path / "root", n_sim=1, open_registration=False) as nx:
        service = nx.service
        # the service's own gateway process (HTTP on loopback), registration closed by its settings
        with httpx.Client(base_url=service.gateway_url, timeout=120) as http:
            _refused(http.post("/v1/tenants", json=_spec("mallory")), "open_registration = false")
            r = http.post("/v1/tenants", json=_spec("mallory"), headers={"Authorization": "Bearer nxt_bad"})
            assert r.status_code == 401 and r.json()["error"]["message"] == "unknown token", r.text
            assert nx.status(tenant="mallory")["tenants"] == [], "a refused request created nothing"
            op = {"Authorization": f"Bearer {service.operator_token}"}
            r = http.post("/v1/tenants", json=_spec("alice"), headers=op)
            assert r.status_code == 201 and r.json()["token"], r.text

        def gateway(name: str, **settings) -> TestClient:
            cfg = service.config.model_copy(update={"open_registration": None, **settings})
            app = create_app(cfg, Backend(service.address, security(cfg)), TokenStore(tmp_path / name),
                             host=OFF_LOOPBACK)
            return TestClient(app, base_url=f"http://{OFF_LOOPBACK}:8000")

        # off loopback with the default: closed; the operator still creates tenants
        with gateway("default") as http:
            _refused(http.post("/v1/tenants", json=_spec("mallory")), f"listens on {OFF_LOOPBACK}, not loopback")
            assert nx.status(tenant="mallory")["tenants"] == []
            op = {"Authorization": f"Bearer {read_operator_token(tmp_path / 'default')}"}
            r = http.post("/v1/tenants", json=_spec("bob"), headers=op)
            assert r.status_code == 201 and r.json()["token"], r.text
        # off loopback, opened on purpose: anyone creates a tenant and gets its token
        with gateway("open", open_registration=True) as http:
            r = http.post("/v1/tenants", json=_spec("carol"))
            assert r.status_code == 201 and r.json()["token"].startswith("nxt_"), r.text
        assert nx.status(tenant="carol")["tenants"], "the opened gateway created the tenant in the service"
