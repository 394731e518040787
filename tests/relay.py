"""A TCP relay between the test's clients and a real server (nats-server, etcd), for outages the
test orders: `accepting = False` refuses new connections (who comes back first after a restart is
the test's choice), `frozen` holds every connection open and relays nothing (a partition, not a
crash: the server is up for everyone else), `cut()` closes every connection open (a link that
drops: both ends see it closed)."""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.accepting = True
        self.frozen = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, self.host, 0)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def cut(self) -> None:
        """Close every connection relayed now; new ones follow `accepting`."""
        for writer in list(self._open):
            writer.close()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if not self.accepting:
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        self._open |= {client_w, server_w}
        try:
            await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))
        finally:
            self._open -= {client_w, server_w}
            client_w.close()
            server_w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if self.frozen.is_set():
                    await asyncio.Event().wait()  # held open, never relayed
                writer.write(data)
                await writer.drain()
