"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS)."""

from __future__ import annotations

import ssl
from typing import Any

import nats
from nats.aio.client import Client as Nats

from protocol.config import NatsSettings

__all__ = ["connect_nats"]


async def connect_nats(settings: NatsSettings, name: str) -> Nats:
    opts: dict[str, Any] = {
        "servers": settings.servers,
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
    }
    if settings.user is not None:
        opts["user"], opts["password"] = settings.user, settings.password
    if settings.token is not None:
        opts["token"] = settings.token
    if settings.creds_file is not None:
        opts["user_credentials"] = settings.creds_file
    if settings.nkey_file is not None:
        opts["nkeys_seed"] = settings.nkey_file
    if settings.tls_ca or settings.tls_cert:
        ctx = ssl.create_default_context(cafile=settings.tls_ca)
        if settings.tls_cert and settings.tls_key:
            ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
        opts["tls"] = ctx
    return await nats.connect(**opts)
