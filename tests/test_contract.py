"""The gateway's API contract, checked from its own OpenAPI document (schemathesis) against a live service.

* The document: every route that takes a token lists every error status with the error body's schema and the
  bearer scheme (``nexus.gateway.contract``).
* Generated requests (schemathesis, from the document the gateway serves, valid and invalid data), as a tenant
  and as the operator, all on 127.0.0.1 and bounded in count: no 5xx, no status the document does not list, no
  answer off its documented content type or schema. The tenant's own name fills the ``tenant`` of most of its
  requests, so they reach the service (jobs, low-level ops, exports, files) instead of stopping at a 403; its
  quotas keep any job the generator submits tiny. Not generated: deleting the tenant itself (its token would
  go), and the operator's writes on a real tenant or the inference pool's size (an export to any server path,
  starting inference engines): those run with random names (404) or as the tenant (403).
* The findings of the first contract run, each a test: ``"dataset": ""`` is a 422 (was a 500), a tenant sees paths
  relative to its own output dir, an error quotes a short prefix of a bad value (a 50 MB name is not sent back).
"""

from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from nexus.client.api import Nexus
from nexus.gateway.contract import ERRORS
from nexus.spec import TenantSpec

pytestmark = pytest.mark.cluster

PUSH = "maniskill/pushcube-state"
OWNER = "contract-owner-q7"  # a name the generator will not hit by chance
TINY = {"max_rl_updates": 1, "max_episodes_per_batch": 1, "max_collectors": 1, "max_update_epochs": 1,
        "max_eval_episodes": 1, "max_concurrent_evals": 1, "max_sft_steps": 1, "max_batch_size": 2}
EXAMPLES = 14  # per operation, generation mode and principal: >= 1000 requests in all
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    with Nexus.local(root, n_sim=1, limits={"max_request_bytes": 2**20}, tenant_limits={OWNER: TINY}) as nx:
        owner = nx.create_tenant(TenantSpec(name=OWNER, env=PUSH, hidden_dim=16, seed=1))
        yield {"nx": nx, "url": nx.service.gateway_url, "root": str(nx.service.config.root),
               "tokens": {"tenant": owner.token, "operator": nx.service.operator_token}}


def test_every_route_documents_its_errors_with_their_body_and_the_bearer_scheme(service):
    doc = httpx.get(service["url"] + "/openapi.json", timeout=30).json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["HTTPBearer"][
            "description"]}
    body = doc["components"]["schemas"]["ErrorBody"]
    assert body["required"] == ["error"]
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"class", "code", "message"}
    routes = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if path == "/health":
                assert "security" not in op and set(op["responses"]) == {"200"}
                continue
            routes += 1
            assert op["security"] == [{"HTTPBearer": []}], (method, path)
            for status in ERRORS:
                entry = op["responses"][str(status)]
                assert entry["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert routes >= 23
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # FastAPI's own 422 body is not what we send


def _generated(service, principal: str) -> tuple[int, collections.Counter, list[str]]:
    """Generated requests to every operation as ``principal`` -> (requests, statuses, failures)."""
    schema = schemathesis.openapi.from_url(service["url"] + "/openapi.json", timeout=30)
    auth = {"Authorization": f"Bearer {service['tokens'][principal]}"}
    counts: collections.Counter = collections.Counter()
    failures: list[str] = []
    for result in schema.get_all_operations():
        op = result.ok()
        fixed = {}
        if "tenant" in {p.name for p in op.path_parameters}:
            own = principal == "tenant" and op.method.upper() != "DELETE"
            if own or (principal == "operator" and op.method.upper() == "GET"):
                fixed["tenant"] = OWNER
        if principal == "operator" and op.path == "/v1/admin/scale":
            continue  # would start inference engines; generated as the tenant (403)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(op, mode, fixed, f"{op.method.upper()} {op.path} [{principal}, {mode.value}]", service["url"], auth,
                  counts, failures)
    return sum(counts.values()), counts, failures


def _fuzz(op, mode, fixed: dict, label: str, url: str, auth: dict, counts: collections.Counter,
          failures: list[str]) -> None:
    """``EXAMPLES`` generated requests of one operation, each answer checked against the document."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode, path_parameters=fixed or None))
    def run(case) -> None:
        # the principal's token, whatever Authorization header the generator made up (any case)
        headers = {**{k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}, **auth}
        response = case.call(base_url=url, headers=headers, timeout=120)  # loopback: this module's service
        counts[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except (Exception, BaseExceptionGroup) as e:  # every finding reported, not just the first
            failures.append(f"{label} -> {response.status_code}: {str(e)[:400]}")

    try:
        run()
    except Unsatisfiable:  # no invalid request exists for an operation without inputs (e.g. GET /health)
        assert mode == GenerationMode.NEGATIVE, label


def test_generated_requests_meet_the_contract_as_a_tenant_and_as_the_operator(service):
    total, statuses, failures = 0, collections.Counter(), []
    for principal in ("tenant", "operator"):
        n, counts, found = _generated(service, principal)
        total += n
        statuses.update(counts)
        failures += found
        print(f"{principal}: {n} requests, statuses {dict(sorted(counts.items()))}")
    assert not failures, f"{len(failures)} contract failures in {total} requests:\n" + "\n".join(failures[:30])
    assert total >= 1000, total
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses[200] + statuses[201] > 50, statuses  # the tenant's requests reached the service too


def test_contract_findings(service):
    """The first contract run's findings: a 500 on an empty dataset name, absolute server paths shown to a tenant,
    a 50 MB env name echoed whole in the error."""
    url, tokens = service["url"], service["tokens"]
    tenant = {"Authorization": f"Bearer {tokens['tenant']}"}
    operator = {"Authorization": f"Bearer {tokens['operator']}"}
    r = httpx.post(url + "/v1/tenants", json={"name": "empty-ds", "dataset": ""}, headers=operator, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["class"] == "SpecError", r.text
    assert "unknown dataset ''" in r.json()["error"]["message"]
    huge = "m" * (8 * 2**20)  # over the gateway's max_request_bytes (1 MiB here): refused by size
    r = httpx.post(url + "/v1/tenants", json={"name": "huge", "env": huge}, headers=operator, timeout=60)
    assert r.status_code == 413 and len(r.content) < 1000
    long_name = "maniskill/" + "x" * 100_000  # within the body limit: the message quotes a prefix only
    r = httpx.post(url + "/v1/tenants", json={"name": "long", "env": long_name}, headers=operator, timeout=60)
    assert r.status_code == 422 and len(r.content) < 2500, len(r.content)
    r = httpx.post(url + f"/v1/tenants/{OWNER}/forward_backward", headers=tenant, timeout=60,
                   json={"batch": {"observations": [], "actions": [], "x" * 50_000: 1}})
    assert r.status_code == 422 and len(r.content) < 2500, len(r.content)

    root = service["root"]
    view = httpx.get(url + f"/v1/tenants/{OWNER}", headers=tenant, timeout=60).json()
    assert view["output_dir"] == "."
    job = httpx.post(url + f"/v1/tenants/{OWNER}/jobs", json={"kind": "eval", "episodes": 1}, headers=tenant,
                     timeout=60)
    if job.status_code == 201:  # (an evaluation of the generated requests may still hold the one slot)
        done = httpx.get(url + f"/v1/jobs/{job.json()['job']}/result", params={"timeout": 60}, headers=tenant,
                         timeout=120).json()
        assert done["state"] == "done" and not done["result"]["report_path"].startswith("/"), done["result"]
    for route in (f"/v1/tenants/{OWNER}", f"/v1/tenants/{OWNER}/logs", "/v1/status", f"/v1/tenants/{OWNER}/jobs"):
        text = httpx.get(url + route, headers=tenant, timeout=60).text
        assert root not in text, route
    assert root in httpx.get(url + f"/v1/tenants/{OWNER}", headers=operator, timeout=60).text  # the operator's view
