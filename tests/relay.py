"""A TCP relay between the test's clients and a real server (nats-server, etcd), for outages the
test orders: `accepting = False` refuses new connections (who comes back first after a restart is
the test's choice), `frozen` holds every connection open and relays nothing (a partition, not a
crash: the server is up for everyone else), `cut()` closes every connection open (a link that
drops: both ends see it closed), `delay_s` holds each chunk that long each way (a long link: a
connection made while it is set is relayed so for good)."""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.upstream_port = upstream_port
        self.accepting = True
        self.delay_s = 0.0
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
        pipe = self._late if self.delay_s else self._pipe
        try:
            await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
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

    async def _late(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """As `_pipe`, each chunk written `delay_s` after it was read, in order; reading goes on
        meanwhile, so the delay does not add up over the chunks."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            try:
                with contextlib.suppress(ConnectionError):
                    while data := await reader.read(65536):
                        chunks.put_nowait((loop.time() + self.delay_s, data))
            finally:
                chunks.put_nowait((0.0, b""))

        reading = asyncio.create_task(read())
        try:
            with contextlib.suppress(ConnectionError):
                while data := (chunk := await chunks.get())[1]:
                    if self.frozen.is_set():
                        await asyncio.Event().wait()  # held open, never relayed
                    await asyncio.sleep(chunk[0] - loop.time())
                    writer.write(data)
                    await writer.drain()
        finally:
            reading.cancel()
