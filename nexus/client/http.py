"""HTTP transport of the Python API: every call goes to the tenant gateway with a bearer token.

``nexus.client.api.Nexus("http://host:port", token=...)`` uses it. It keeps one token per tenant
(handed out by ``create_tenant``) plus a default token (a tenant's, or the operator's); a call about
tenant X carries X's token when it holds one (so it sees what X sees: paths relative to X's output dir); the
status, which only reads, goes with the operator's token when the client holds it (``Nexus.local``, the CLI).
Errors come back as the gateway's :class:`nexus.errors.NexusError` subclass with the gateway's message.

Each operation is one method mapped to one route (:meth:`HttpTransport.submit` is ``POST
/v1/tenants/{tenant}/jobs``, …); the gateway is the client's only way into the service.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import numpy as np

from nexus.errors import NexusError, Overloaded, Unavailable, error_class
from nexus.features import Observation
from nexus.gateway.auth import OPERATOR_PREFIX
from nexus.spec import SESSION_HEADER
from nexus.wire.inputs import encode_array


def _wire(x: Any) -> Any:
    """JSON-ready: arrays in their exact wire form, observations as their fields."""
    if isinstance(x, Observation):
        return {"state": _wire(x.state), "images": {k: _wire(v) for k, v in x.images.items()},
                "instruction": x.instruction}
    if isinstance(x, np.ndarray):
        return encode_array(x)
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: _wire(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        if x and all(isinstance(v, np.ndarray) for v in x):
            try:
                return encode_array(np.stack(x))
            except ValueError:
                pass
        return [_wire(v) for v in x]
    return x


def json_bytes(x: Any) -> bytes:
    """A request body: ``x`` in JSON, arrays in their wire form."""
    return json.dumps(_wire(x)).encode()


def _q(s: str) -> str:
    return quote(str(s), safe="")


class Backoff:
    """When to send again a request the gateway refused with 429 (``Overloaded``: nothing was done): the
    gateway's hint (the body's ``retry_after_s``, else ``Retry-After``), doubled at each refusal in a row, at
    most ``max_s``, jittered (a random 50-100 %) so refused clients do not come back together; ``retries``
    refusals in a row, then the error is raised."""

    def __init__(self, retries: int = 6, max_s: float = 5.0, rng: random.Random | None = None) -> None:
        self.retries, self.max_s = retries, max_s
        self.rng = rng or random.Random()

    def delay(self, refusals: int, hint_s: float) -> float:
        return min(self.max_s, max(hint_s, 0.01) * 2 ** refusals) * self.rng.uniform(0.5, 1.0)

    @staticmethod
    def hint(r) -> float:
        """The refusal's retry hint in seconds (the body's finer one first)."""
        try:
            return float(r.json()["retry_after_s"])
        except (ValueError, KeyError, TypeError):
            pass
        try:
            return float(r.headers.get("retry-after", 1))
        except ValueError:
            return 1.0


class HttpTransport:
    def __init__(self, url: str, token: str | None = None, timeout: float = 120, ca: str | None = None,
                 backoff: Backoff | None = None) -> None:
        """``ca``: a CA certificate file (PEM) to verify an HTTPS gateway with (a service's ``root/tls/ca.pem``);
        without one the system's trust store is used. ``backoff``: how 429 refusals are retried."""
        import ssl

        import httpx

        self.backoff = backoff or Backoff()
        self.refused = 0  # 429 refusals seen (and retried, or raised once retries ran out)
        self.url = url.rstrip("/")
        self.token = token
        self.tokens: dict[str, str] = {}
        # a low-level call waits its turn on the shared actor: reads may take long, connecting may not
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        self.connect_s, self.read_s = min(timeout, 10), max(timeout, 600)
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=self.connect_s,
                                                                          read=self.read_s), verify=self.verify)

    def close(self) -> None:
        self.http.close()

    def probe(self, timeout: float) -> None:
        """Check within ``timeout`` seconds that a JoyNexus gateway answers at the URL and takes the token
        (:class:`Unavailable` if nothing or something else answers; the gateway's own error otherwise)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            r = self.http.get("/v1/status", headers=headers, timeout=httpx.Timeout(timeout))
        except httpx.TimeoutException:
            raise Unavailable(f"no answer from a gateway at {self.url} within {timeout:g} s") from None
        except httpx.TransportError as e:
            reason = " ".join(str(e).split()) or type(e).__name__
            raise Unavailable(f"could not reach a gateway at {self.url} within {timeout:g} s ({reason})") from None
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or (r.status_code >= 400 and "error" not in body):
            raise Unavailable(f"{self.url} answers HTTP {r.status_code} but is not a JoyNexus gateway")
        if r.status_code >= 400:
            raise self._error(r)

    # -- plumbing --------------------------------------------------------------------------
    def _token(self, tenant: str | None) -> str | None:
        return self.tokens.get(tenant, self.token) if tenant else self.token

    @property
    def operator(self) -> bool:
        """Whether the default token is the operator's (``Nexus.local``, the CLI)."""
        return (self.token or "").startswith(OPERATOR_PREFIX)

    def request(self, method: str, path: str, *, tenant: str | None = None, json_body: Any = None,
                params: dict[str, Any] | None = None, raw: bool = False, session: str | None = None) -> Any:
        import httpx

        token = self._token(tenant)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if session is not None:
            headers[SESSION_HEADER] = session
        content = None
        if json_body is not None:
            content = json_bytes(json_body)
            headers["Content-Type"] = "application/json"
        refusals = 0
        while True:
            try:
                r = self.http.request(method, path, headers=headers, params=params, content=content)
            except httpx.TransportError as e:
                raise Unavailable(f"the gateway at {self.url} is unreachable ({type(e).__name__}: {e})") from None
            if r.status_code == 429 and refusals < self.backoff.retries:  # nothing was done: send it again later
                self.refused += 1
                time.sleep(self.backoff.delay(refusals, self.backoff.hint(r)))
                refusals += 1
                continue
            if r.status_code >= 400:
                raise self._error(r)
            return r.content if raw else r.json()

    @staticmethod
    def _error(r) -> NexusError:
        try:
            err = r.json()["error"]
            cls, message = error_class(err["class"]), err["message"]
        except (ValueError, KeyError, TypeError):
            cls, message = NexusError, f"HTTP {r.status_code}: {r.text[:500]}"
        if r.status_code >= 500 and cls is NexusError:
            message = f"gateway error {r.status_code}: {message}"
        if cls is Overloaded:
            return Overloaded(message, Backoff.hint(r))
        return cls(message)

    # -- the API's operations: one method per route ---------------------------------------------
    def create_tenant(self, spec: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/tenants``; keeps the new tenant's token."""
        info = self.request("POST", "/v1/tenants", json_body=spec, tenant=spec.get("name"))
        if info.get("token"):
            self.tokens[info["tenant"]] = info["token"]
        return info

    def status(self, limit: int | None = None, cursor: str | None = None, tenant: str | None = None) -> dict[str, Any]:
        """``GET /v1/status`` (with the operator's token when the client holds it, else the tenant's)."""
        params = {k: v for k, v in (("limit", limit), ("cursor", cursor), ("tenant", tenant)) if v is not None}
        return self.request("GET", "/v1/status", params=params or None, tenant=None if self.operator else tenant)

    def submit(self, tenant: str, job: dict[str, Any]) -> str:
        """``POST /v1/tenants/{tenant}/jobs`` -> the job id."""
        return self.request("POST", f"/v1/tenants/{_q(tenant)}/jobs", json_body=job, tenant=tenant)["job"]

    def job(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        return self.request("GET", f"/v1/jobs/{_q(job_id)}", tenant=owner)

    def wait(self, job_id: str, timeout: float | None = None, owner: str | None = None) -> dict[str, Any]:
        """``GET /v1/jobs/{job}/result``: the job's view once it ended, or after ``timeout`` s (at most 60)."""
        return self.request("GET", f"/v1/jobs/{_q(job_id)}/result", tenant=owner,
                            params={"timeout": 30.0 if timeout is None else min(float(timeout), 60.0)})

    def cancel(self, job_id: str, owner: str | None = None) -> dict[str, Any]:
        return self.request("POST", f"/v1/jobs/{_q(job_id)}/cancel", tenant=owner)

    def op(self, tenant: str, verb: str, session: str | None = None, body: dict[str, Any] | None = None) -> Any:
        """``POST /v1/tenants/{tenant}/{verb}``: a low-level op (forward_backward, forward, optim_step,
        save_state, load_state, save_weights) in the connection's ``session``."""
        return self.request("POST", f"/v1/tenants/{_q(tenant)}/{_q(verb)}", tenant=tenant, session=session,
                            json_body=body)

    def tenant_log(self, tenant: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/tenants/{_q(tenant)}/logs", tenant=tenant)

    def export(self, tenant: str, version: int | None = None, path: str | None = None) -> dict[str, Any]:
        return self.request("POST", f"/v1/tenants/{_q(tenant)}/export", tenant=tenant,
                            json_body={"version": version, "path": path})

    def delete_tenant(self, tenant: str, keep_output: bool = True) -> dict[str, Any]:
        out = self.request("DELETE", f"/v1/tenants/{_q(tenant)}", tenant=tenant,
                           params={"purge": str(not keep_output).lower()})
        self.tokens.pop(tenant, None)
        return out

    def monitoring(self, since: float = 0.0) -> dict[str, Any]:
        """``GET /v1/admin/monitoring`` (operator): the status page with the tenants' signals since ``since``."""
        return self.request("GET", "/v1/admin/monitoring", params={"since": since})

    def flush(self) -> Any:
        return self.request("POST", "/v1/admin/flush")["flushed"]

    def scale_inference(self, engines: int) -> dict[str, Any]:
        return self.request("POST", "/v1/admin/scale", json_body={"engines": engines})

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        return self.request("GET", "/v1/admin/ready", params={"timeout": timeout})

    def forward_backward(self, tenant: str, batch: dict[str, Any], loss: str = "sft",
                         session: str | None = None) -> dict[str, Any]:
        return self.op(tenant, "forward_backward", session, {"batch": batch, "loss": loss})

    def predict(self, tenant: str, obs: Observation | dict[str, Any], version: int | None = None,
                deterministic: bool = True, seed: int | None = None, n: int = 1) -> dict[str, Any]:
        body = {"observation": obs, "version": version, "deterministic": deterministic}
        body |= {k: v for k, v in (("seed", seed), ("n", n)) if v not in (None, 1)}
        out = self.request("POST", f"/v1/tenants/{_q(tenant)}/predict", tenant=tenant, json_body=body)
        for k in ("action", "chunk", "actions"):
            if k in out and out[k] is not None:
                out[k] = np.asarray(out[k], dtype=np.float32)
        return out

    def stream(self, job_id: str, owner: str | None = None, poll_s: float = 0.5) -> Iterator[dict[str, Any]]:
        """The job's view each time it changes, until it ends (the gateway's NDJSON stream)."""
        import httpx

        token = self._token(owner)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with self.http.stream("GET", f"/v1/jobs/{_q(job_id)}/stream", params={"poll_s": poll_s},
                                  headers=headers, timeout=httpx.Timeout(None, connect=10)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise self._error(r)
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.TransportError as e:
            raise Unavailable(f"the gateway at {self.url} is unreachable ({type(e).__name__}: {e})") from None

    def files(self, tenant: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/v1/tenants/{_q(tenant)}/files", tenant=tenant)["files"]

    def read_file(self, tenant: str, path: str) -> bytes:
        return self.request("GET", f"/v1/tenants/{_q(tenant)}/files/{quote(path)}", tenant=tenant, raw=True)
