"""``python -m nexus.gateway --config ROOT/service.json``: run the tenant gateway of a service.

Binds ``ServiceConfig.host:gateway_port`` (127.0.0.1, any free port by default; ``--host``/``--port``: this
host's own address when the gateway runs on a host of its own), connects its own Dask client to the
scheduler (``ROOT/scheduler.json``; TLS when the service uses it), writes a fresh operator token and, once
it serves, its URL to ``ROOT/gateway/gateway.json`` (0600). ``--certfile``/``--keyfile``: serve HTTPS
(``nexus gateway`` issues them from the service CA on a non-loopback address); ``--advertise``: the host
name clients use, written into the URL instead of the bound address.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

from nexus.config.paths import harden_process, private_write_bytes
from nexus.config.service import ServiceConfig
from nexus.deploy.gc_tuning import apply as apply_gc
from nexus.deploy.gc_tuning import pauses as gc_pauses
from nexus.deploy.tls import security
from nexus.gateway.app import create_app
from nexus.gateway.auth import TokenStore
from nexus.gateway.backend import Backend


def listen_socket(bind: str, port: int) -> socket.socket:
    """The gateway's bound TCP socket, its connections without Nagle's delay.

    ``IPPROTO_TCP`` is named because asyncio sets ``TCP_NODELAY`` on a connection only when its socket's
    ``proto`` says TCP (a plain ``socket(AF_INET, SOCK_STREAM)`` has proto 0); without it a reply's headers
    and body (two writes) waited ~40 ms for the client's delayed ACK: every call cost 40 ms more."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # accepted connections inherit it (Linux)
    sock.bind((bind, port))
    return sock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nexus.gateway", description=__doc__)
    p.add_argument("--config", required=True, help="the service's service.json")
    p.add_argument("--scheduler-file", default=None, help="default: scheduler.json in the service root")
    p.add_argument("--host", default=None, help="address to bind (default: the config's host)")
    p.add_argument("--port", type=int, default=None, help="port to bind (default: the config's gateway_port)")
    p.add_argument("--certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--keyfile", default=None, help="the certificate's key (PEM)")
    p.add_argument("--advertise", default=None, help="host name written into the gateway's URL")
    a = p.parse_args(argv)
    if (a.certfile is None) != (a.keyfile is None):
        p.error("--certfile and --keyfile go together")

    import uvicorn

    harden_process()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServiceConfig.load(a.config)
    scheduler_file = Path(a.scheduler_file or Path(config.root) / "scheduler.json")
    address = json.loads(scheduler_file.read_text())["address"]
    tokens = TokenStore(config.gateway_dir)
    bind = a.host or config.host
    sock = listen_socket(bind, config.gateway_port if a.port is None else a.port)
    port = sock.getsockname()[1]
    name = a.advertise or bind
    host = f"[{name}]" if ":" in name else name
    url = f"{'https' if a.certfile else 'http'}://{host}:{port}"

    def ready(extra: dict) -> None:
        info = {"url": url, "pid": os.getpid(), "scheduler": address, **extra}
        if app.state.gateway.openpi is not None:  # the robots' WebSocket endpoint (nexus.gateway.openpi)
            info["openpi_url"] = f"{'wss' if a.certfile else 'ws'}://{host}:{app.state.gateway.openpi.port}"
        private_write_bytes(config.gateway_dir / "gateway.json", json.dumps(info).encode())
        logging.getLogger("nexus.gateway").info("gateway serving on %s (docs: %s/docs)", url, url)

    class Server(uvicorn.Server):
        grpc = None  # the gRPC robot API's server (config.grpc_port)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:  # listening now: the URL may be handed out
                extra = {}
                if config.grpc_port is not None:  # the robot API, in this process and event loop
                    from nexus.gateway import grpc_api

                    self.grpc, grpc_port = await grpc_api.start(
                        app.state.gateway, app.state.envs, bind, config.grpc_port, config.limits.max_request_bytes,
                        a.certfile, a.keyfile)
                    extra["grpc"] = f"{host}:{grpc_port}"
                ready(extra)
                gc_pauses()  # counted from now on (GET /v1/admin/qos)
                logging.getLogger("nexus.gateway").info(
                    "gc after start-up: %s", apply_gc(config.gc.freeze, config.gc.gen0_threshold))

        async def shutdown(self, sockets=None) -> None:
            if self.grpc is not None:
                await self.grpc.stop(2)
            await super().shutdown(sockets)

    openpi_ssl = None
    if a.certfile:
        import ssl

        openpi_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        openpi_ssl.load_cert_chain(a.certfile, a.keyfile)
    backend = Backend(address, security(config), engine_stream=config.gateway.engine_stream)
    app = create_app(config, backend, tokens, host=bind, openpi_host=bind, openpi_ssl=openpi_ssl)
    server = Server(uvicorn.Config(app, loop=config.gateway.event_loop, http=config.gateway.http_parser,
                                   log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                   ssl_certfile=a.certfile, ssl_keyfile=a.keyfile))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
