"""One kept-alive HTTP/1.1 connection for an environment session's resets and steps (issue 22).

A vector step is one small request; httpx spent ~1 ms of client CPU on each (URL merging, header models,
cookies, the connection pool), more than the rest of the client's work on the answer. ``http.client`` on
one connection does the same request for a fraction of it. Everything else of the transport stays: the
tenant's token, TLS with the transport's CA, its timeouts, its 429 backoff and its error mapping.
"""

from __future__ import annotations

import http.client
import select
import ssl
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from nexus.errors import Unavailable


class Answer:
    """What :meth:`nexus.client.http.HttpTransport._error` and ``Backoff.hint`` read of a response."""

    def __init__(self, status: int, headers: http.client.HTTPMessage, content: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, content

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        import json

        return json.loads(self.content)


class KeepAlive:
    """POSTs of JSON bodies to the gateway of ``transport`` on one reused connection (thread-safe)."""

    def __init__(self, transport) -> None:
        self.transport = transport
        u = urlsplit(transport.url)
        self.https = u.scheme == "https"
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        self.connect_s, self.read_s = transport.connect_s, transport.read_s
        self.context: ssl.SSLContext | None = None
        if self.https:
            v = transport.verify
            self.context = v if isinstance(v, ssl.SSLContext) else ssl.create_default_context()
        self.conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        c = self.conn
        if c is not None and c.sock is not None and select.select([c.sock], [], [], 0)[0]:
            c.close()  # readable while idle: the gateway closed it (its keep-alive timeout); nothing was sent
            c = None
        if c is None or c.sock is None:
            c = (http.client.HTTPSConnection(self.host, self.port, timeout=self.connect_s, context=self.context)
                 if self.https else http.client.HTTPConnection(self.host, self.port, timeout=self.connect_s))
            c.connect()
            c.sock.settimeout(self.read_s)
            self.conn = c
        return c

    def post(self, path: str, body: bytes, token: str | None) -> Answer:
        headers = {"Content-Type": "application/json", "Connection": "keep-alive"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        with self._lock:
            try:
                c = self._connection()
                c.request("POST", self.prefix + path, body=body, headers=headers)
                r = c.getresponse()
                answer = Answer(r.status, r.headers, r.read())
                if r.will_close:
                    c.close()
                return answer
            except (OSError, http.client.HTTPException) as e:
                self.close_locked()
                raise Unavailable(f"the gateway at {self.transport.url} is unreachable ({type(e).__name__}: "
                                  f"{e})") from None

    def close_locked(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


def post_json(transport, keep: KeepAlive, path: str, tenant: str | None, body: bytes) -> Any:
    """The transport's ``request("POST", ...)`` over ``keep``: 429 refusals sent again after the transport's
    backoff, other errors raised as the gateway's :class:`~nexus.errors.NexusError`."""
    token = transport._token(tenant)
    refusals = 0
    while True:
        r = keep.post(path, body, token)
        if r.status_code == 429 and refusals < transport.backoff.retries:  # nothing was done: send it again
            transport.refused += 1
            time.sleep(transport.backoff.delay(refusals, transport.backoff.hint(r)))
            refusals += 1
            continue
        if r.status_code >= 400:
            raise transport._error(r)
        return r.json()
