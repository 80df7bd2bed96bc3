"""QoS pieces without a cluster: the gateway's socket, admission budgets, fair queueing, latency histograms."""

from __future__ import annotations

import asyncio
import socket

from nexus.gateway.__main__ import listen_socket


def test_gateway_connections_have_no_nagle_delay():
    """asyncio sets TCP_NODELAY on each accepted connection only for a socket whose proto is TCP: the
    gateway's replies (headers and body: two writes) must not wait for the client's delayed ACK."""
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            s = writer.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            w.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
