"""A TCP relay in front of a real server that records what the client sends: tests read the wire."""

from __future__ import annotations

import asyncio


async def recording_proxy(upstream_port: int, sent: bytearray, replies: asyncio.Event | None = None) -> asyncio.Server:
    """A TCP relay to the server that keeps, in order, every byte the client sends. With `replies`,
    what the server sends is relayed only while that is set, held in order meanwhile (a client
    slow to read: its backlog ahead of any PONG)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: bool) -> None:
        try:
            while data := await reader.read(65536):
                if record:
                    sent.extend(data)
                elif replies is not None:
                    await replies.wait()
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(client_r, server_w, True), pipe(server_r, client_w, False))

    return await asyncio.start_server(relay, "127.0.0.1", 0)
