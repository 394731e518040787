"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS,
never in the clear when TLS is asked for: runtime.nats_connect), its connection errors said once
and then counted, a refusal of the credentials naming the credential flags
(runtime.nats_connect.error_reporter), not a traceback a try, and its end said once."""

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

    async def reconnected() -> None:
        # The outage was said (error_cb, once, then counted): its end is said too, once.
        log.info("NATS %s: connection re-established", ", ".join(servers))

    return await connect(**settings.connect_options(name), error_cb=errors, reconnected_cb=reconnected)
