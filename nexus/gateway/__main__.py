"""``python -m nexus.gateway --config ROOT/service.json``: run the tenant gateway of a service.

Binds ``ServiceConfig.host:gateway_port`` (127.0.0.1, any free port by default), connects its own Dask
client to the scheduler (``ROOT/scheduler.json``; TLS when the service uses it), writes a fresh operator
token and, once it serves, its URL to ``ROOT/gateway/gateway.json`` (0600).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path

from nexus.config import ServiceConfig
from nexus.gateway.app import create_app
from nexus.gateway.auth import TokenStore
from nexus.gateway.backend import Backend
from nexus.paths import harden_process, private_write_bytes
from nexus.tls import security


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nexus.gateway", description=__doc__)
    p.add_argument("--config", required=True, help="the service's service.json")
    p.add_argument("--scheduler-file", default=None, help="default: scheduler.json in the service root")
    a = p.parse_args(argv)

    import uvicorn


    harden_process()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ServiceConfig.load(a.config)
    scheduler_file = Path(a.scheduler_file or Path(config.root) / "scheduler.json")
    address = json.loads(scheduler_file.read_text())["address"]
    tokens = TokenStore(config.gateway_dir)
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.gateway_port))
    port = sock.getsockname()[1]
    host = f"[{config.host}]" if family == socket.AF_INET6 else config.host
    url = f"http://{host}:{port}"

    def ready() -> None:
        private_write_bytes(config.gateway_dir / "gateway.json",
                            json.dumps({"url": url, "pid": os.getpid(), "scheduler": address}).encode())
        logging.getLogger("nexus.gateway").info("gateway serving on %s (docs: %s/docs)", url, url)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.should_exit:  # listening now: the URL may be handed out
                ready()

    app = create_app(config, Backend(address, security(config)), tokens)
    server = Server(uvicorn.Config(app, loop="asyncio", log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
