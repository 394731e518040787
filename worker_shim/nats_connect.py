"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS),
its connection errors said once and then counted (runtime.RepeatedErrors), not a traceback a try;
and flushing without putting the connection at risk (`flush`)."""

from __future__ import annotations

import asyncio
import logging

import nats
from nats.aio.client import Client as Nats
from nats.errors import FlushTimeoutError

from protocol.config import NatsSettings
from runtime import RepeatedErrors

__all__ = ["connect_nats", "flush"]

log = logging.getLogger("kvswitch.shim.nats")


async def connect_nats(settings: NatsSettings, name: str) -> Nats:
    errors = RepeatedErrors(log, f"NATS {', '.join(settings.servers)}", "check --nats-servers and the server")
    return await nats.connect(**settings.connect_options(name), error_cb=errors.on_error)


async def flush(nc: Nats, timeout: int = 10) -> None:
    """`nc.flush()` that neither a cancelled caller nor a timeout can turn against the connection.
    nats-py (2.16) leaves an abandoned flush's future in its PONG queue, and the PONG, when it comes,
    raises in the connection's read loop, which stops: nothing more is read, so no request reaches
    this shim again until the server drops the connection. Shielded, the flush outlives a cancelled
    caller; one that times out has its future taken out of that queue."""
    flushing = asyncio.ensure_future(nc.flush(timeout))
    try:
        await asyncio.shield(flushing)
    except FlushTimeoutError:
        pongs = getattr(nc, "_pongs", None)  # private: no-op should a nats-py release rename it
        if isinstance(pongs, list):
            pongs[:] = [f for f in pongs if not f.cancelled()]
        raise
