"""Connecting to NATS with every setting of `protocol.config.NatsSettings` (auth, creds, nkey, TLS)."""

from __future__ import annotations

import nats
from nats.aio.client import Client as Nats

from protocol.config import NatsSettings

__all__ = ["connect_nats"]


async def connect_nats(settings: NatsSettings, name: str) -> Nats:
    return await nats.connect(**settings.connect_options(name))
