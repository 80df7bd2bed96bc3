"""The contract's pieces without a service: the one error table documented on every route that takes a token (a
new status is one row), what a tenant sees of server paths, how much of a bad value an error quotes."""

from __future__ import annotations

from fastapi.testclient import TestClient

from nexus.config.service import ServiceConfig
from nexus.errors import QUOTE_CHARS, SpecError, quote
from nexus.gateway import contract
from nexus.gateway.app import MAX_MESSAGE, create_app, error_body
from nexus.gateway.auth import TokenStore, read_operator_token
from nexus.gateway.backend import Backend


def _app(root: str):
    # never connected: the lifespan (which connects the backend) does not run without a context manager
    return create_app(ServiceConfig(root=root), Backend("tcp://127.0.0.1:9"), TokenStore(root + "/gateway")), root


def test_a_new_error_row_is_documented_on_every_route_that_takes_a_token(monkeypatch, tmp_path):
    retry = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    monkeypatch.setitem(contract.ERRORS, 429, contract.ErrorResponse("Too many requests", retry))
    app, _ = _app(str(tmp_path))
    doc = app.openapi()
    secured = [(p, op) for p, ops in doc["paths"].items() for op in ops.values() if op.get("security")]
    assert len(secured) >= 23
    for path, op in secured:
        assert op["responses"]["429"]["headers"] == retry, path
        assert set(map(str, contract.ERRORS)) <= set(op["responses"]), path
    assert "security" not in doc["paths"]["/health"]["get"]


def test_a_tenant_sees_paths_relative_to_its_own_dir_and_never_the_root():
    own, root = "/srv/nexus/tenants/a", "/srv/nexus"
    view = {"output_dir": own, "result": {"report_path": own + "/eval/j-v000003.json", "n": 3},
            "files": [own + "/exports/v1", "/srv/nexus/tenants/b/x"], "msg": f"wrote {own}/weights/v1.pt"}
    assert contract.relative_paths(view, own, root) == {
        "output_dir": ".", "result": {"report_path": "eval/j-v000003.json", "n": 3},
        "files": ["exports/v1", "<root>/tenants/b/x"], "msg": "wrote weights/v1.pt"}


def test_errors_quote_a_short_prefix_of_a_bad_value():
    assert quote("abc") == "'abc'"
    long = quote("x" * 10**6)
    assert long.startswith("'" + "x" * QUOTE_CHARS + "'") and "(1000000 characters)" in long and len(long) < 150
    assert len(quote(list(range(10**4)))) < 150
    body = error_body(SpecError("y" * 10**5))
    assert len(body["error"]["message"]) < MAX_MESSAGE + 100


def test_an_empty_dataset_name_and_a_body_that_is_not_json_are_422_not_500(tmp_path):
    app, root = _app(str(tmp_path))
    client = TestClient(app)
    auth = {"Authorization": f"Bearer {read_operator_token(root + '/gateway')}"}
    r = client.post("/v1/tenants", json={"name": "e", "dataset": ""}, headers=auth)
    assert r.status_code == 422 and "unknown dataset ''" in r.json()["error"]["message"]
    for bad in (b'{"name": ', b"$\xe17`=\xf3\x00\x19"):  # cut JSON; bytes that are not UTF-8 (FastAPI: a 400)
        r = client.post("/v1/tenants", content=bad, headers={**auth, "Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["error"]["class"] == "SpecError", r.text
    r = client.post("/v1/tenants", json={"name": "l", "env": "maniskill/" + "x" * 100_000}, headers=auth)
    assert r.status_code == 422 and len(r.content) < 300
