"""Live router settings at /{ns}/config/router.

A change is validated like a startup flag; a valid one replaces the current settings at once, an
invalid one is refused, logged with the reason, and the last valid settings stay. Deleting the key
returns to the settings the process started with.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from discovery.session import Discovery
from discovery.watch import Deleted, Put, Snapshot
from protocol import ConfigError, subjects
from protocol.config import RouterSettings, resolve

__all__ = ["ConfigWatcher", "put_config"]

log = logging.getLogger(__name__)


async def put_config(discovery: Discovery, overrides: dict[str, object]) -> None:
    """Write flat overrides (flag names, e.g. {"eff_isl_threshold": 1024}) as the live config."""
    await discovery.put_raw(subjects.config_key(discovery.ns), json.dumps(overrides).encode())


class ConfigWatcher:
    """Yields the effective RouterSettings: at start, then after every accepted change.

    `base` holds the flags, environment and file layers; a live value overrides them field by field
    (flat flag names, like a config file). `rejected` counts refused changes; `last_error` says why.
    """

    def __init__(self, discovery: Discovery, base_cli: dict[str, object], base_file: dict[str, object]) -> None:
        self._discovery = discovery
        self._base_cli = base_cli
        self._base_file = base_file
        self.current = resolve(RouterSettings, cli=base_cli, file=base_file)
        self.rejected = 0
        self.last_error = ""

    def _apply(self, raw: bytes | None) -> bool:
        overrides: dict[str, object] = {}
        try:
            if raw is not None:
                parsed = json.loads(raw)
                if not isinstance(parsed, dict):
                    raise ConfigError("config", parsed, "the live config must be a JSON object")
                overrides = parsed
            settings = resolve(RouterSettings, cli={**self._base_cli, **overrides}, file=self._base_file)
        except (ConfigError, ValueError) as exc:
            self.rejected += 1
            self.last_error = str(exc)
            log.error("live config refused, keeping the previous one: %s", exc)
            return False
        changed = settings != self.current
        self.current = settings
        if changed:
            log.info("live config applied: %s", overrides)
        return changed

    async def __aiter__(self) -> AsyncIterator[RouterSettings]:
        key = subjects.config_key(self._discovery.ns)
        async for event in self._discovery.watch_raw(key):
            match event:
                case Snapshot(items=items):
                    self._apply(items.get(""))
                    yield self.current
                case Put(value=value):
                    if self._apply(value):
                        yield self.current
                case Deleted():
                    if self._apply(None):
                        yield self.current
