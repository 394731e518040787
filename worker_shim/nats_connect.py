"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS,
never in the clear when TLS is asked for: runtime.nats_connect), its connection errors said once
and then counted, a refusal of the credentials naming the credential flags
(runtime.nats_connect.error_reporter), not a traceback a try."""

from __future__ import annotations

import logging

from nats.aio.client import Client as Nats

from protocol.config import NatsSettings
from runtime.nats_connect import connect, error_reporter

__all__ = ["connect_nats"]

log = logging.getLogger("kvswitch.shim.nats")


async def connect_nats(settings: NatsSettings, name: str) -> Nats:
    errors = error_reporter(log, settings.shown_servers(), settings.credential_flags())
    return await connect(**settings.connect_options(name), error_cb=errors)
