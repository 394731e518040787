"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS,
never in the clear when TLS is asked for: runtime.nats_connect), its connection errors said once
and then counted, a refusal of the credentials naming the credential flags
(runtime.nats_connect.error_reporter), not a traceback a try, and its end said once (the server
joined named), as is a server left for answering no PING (runtime.nats_connect.connect)."""

from __future__ import annotations

import logging

from nats.aio.client import Client as Nats

from protocol.config import NatsSettings
from runtime.nats_connect import connect, error_reporter

__all__ = ["connect_nats"]

log = logging.getLogger("kvswitch.shim.nats")


async def connect_nats(settings: NatsSettings, name: str) -> Nats:
    servers = settings.shown_servers()
    errors = error_reporter(log, servers, settings.credential_flags(), "--worker-name and --namespace")
    # The outage was said (error_cb, once, then counted): `connect` says its end, once, and which
    # server it joined.
    return await connect(log, **settings.connect_options(name), error_cb=errors)
