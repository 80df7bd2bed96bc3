"""The client's contract with the service, without a service: the Python client reaches it only over the gateway's
HTTP API, each of its operations one route of the gateway's OpenAPI document (a real HTTP server records what
the client sends; the routes come from the real gateway app)."""

from __future__ import annotations

import http.server
import json
import re
import threading

import numpy as np
import pytest

from nexus.client.api import Nexus
from nexus.client.http import HttpTransport
from nexus.config.service import ServiceConfig
from nexus.errors import SpecError
from nexus.features import Observation
from nexus.gateway.app import create_app
from nexus.gateway.auth import TokenStore
from nexus.gateway.backend import Backend

ANSWER = {"tenant": "t", "token": None, "job": "t-sft-1", "flushed": True, "files": []}


@pytest.fixture
def recorder():
    """A real HTTP server on 127.0.0.1 that answers every request with ``ANSWER`` and records (method, path)."""
    seen: list[tuple[str, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                json.loads(self.rfile.read(length))  # the client sends JSON, arrays in their wire form
            seen.append((self.command, self.path.split("?")[0]))
            body = json.dumps(ANSWER).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args) -> None:  # quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def _routes(tmp_path) -> list[tuple[str, re.Pattern]]:
    root = str(tmp_path)
    app = create_app(ServiceConfig(root=root), Backend("tcp://127.0.0.1:9"), TokenStore(root + "/gateway"))
    out = []
    for path, ops in app.openapi()["paths"].items():
        # a path parameter is one segment, but the file route's {path} takes slashes
        pattern = re.compile("^" + re.sub(r"\{(\w+)\}", lambda m: ".+" if m[1] == "path" else "[^/]+", path) + "$")
        out += [(method.upper(), pattern) for method in ops]
    return out


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:8786", "tls://10.0.0.1:8786", "127.0.0.1:8000"])
def test_the_client_takes_the_gateway_url_only(address):
    with pytest.raises(SpecError, match=r"give the gateway URL \(http\[s\]://host:port"):
        Nexus(address)


def test_every_client_operation_is_one_gateway_route(recorder, tmp_path):
    url, seen = recorder
    routes = _routes(tmp_path)
    t = HttpTransport(url, token="op-x")
    obs = Observation(state=np.zeros(3, np.float32))
    calls = {
        "create_tenant": lambda: t.create_tenant({"name": "t", "env": "maniskill/pushcube-state"}),
        "status": lambda: t.status(limit=5),
        "submit": lambda: t.submit("t", {"kind": "sft", "steps": 1}),
        "job": lambda: t.job("t-sft-1"),
        "wait": lambda: t.wait("t-sft-1", 1.0),
        "cancel": lambda: t.cancel("t-sft-1"),
        "forward_backward": lambda: t.forward_backward("t", {"observations": [obs], "actions": np.zeros((1, 2))}),
        "forward": lambda: t.op("t", "forward", "s", {"batch": {}}),
        "optim_step": lambda: t.op("t", "optim_step", "s"),
        "save_state": lambda: t.op("t", "save_state", "s", {"name": "a"}),
        "load_state": lambda: t.op("t", "load_state", "s", {"name": "a"}),
        "save_weights": lambda: t.op("t", "save_weights", "s"),
        "predict": lambda: t.predict("t", obs),
        "tenant_log": lambda: t.tenant_log("t"),
        "export": lambda: t.export("t", 1),
        "files": lambda: t.files("t"),
        "read_file": lambda: t.read_file("t", "exports/v1/manifest.json"),
        "delete_tenant": lambda: t.delete_tenant("t"),
        "monitoring": lambda: t.monitoring(0.0),
        "flush": lambda: t.flush(),
        "scale_inference": lambda: t.scale_inference(2),
        "wait_ready": lambda: t.wait_ready(1.0),
    }
    try:
        for name, call in calls.items():
            before = len(seen)
            call()
            assert len(seen) == before + 1, name  # one operation, one request
            method, path = seen[-1]
            matched = [p.pattern for m, p in routes if m == method and p.match(path)]
            assert len(matched) == 1, (name, method, path, matched)  # exactly one route of the OpenAPI document
    finally:
        t.close()
    assert not hasattr(HttpTransport, "call")  # no handler-name dispatch: typed methods only
