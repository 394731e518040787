"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS,
never in the clear when TLS is asked for: runtime.nats_connect), its connection errors said once
and then counted (runtime.RepeatedErrors), not a traceback a try."""

from __future__ import annotations

import logging

from nats.aio.client import Client as Nats

from protocol.config import NatsSettings
from runtime import RepeatedErrors
from runtime.nats_connect import connect

__all__ = ["connect_nats"]

log = logging.getLogger("kvswitch.shim.nats")


async def connect_nats(settings: NatsSettings, name: str) -> Nats:
    errors = RepeatedErrors(log, f"NATS {', '.join(settings.servers)}", "check --nats-servers and the server")
    return await connect(**settings.connect_options(name), error_cb=errors.on_error)
