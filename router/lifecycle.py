"""The status every long-running part of a replica reports (the KV ingest, the worker registry,
replica sync): created, started, stopped. `stop()` is idempotent and a stopped part stays stopped.
The service itself has more states (router.service.RouterStatus) because it starts and drains in
steps that `/health` shows."""

from __future__ import annotations

import enum

__all__ = ["PartStatus"]


class PartStatus(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"
