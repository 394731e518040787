"""Live router settings at /{ns}/config/router.

A change is validated like a startup flag; a valid one replaces the current settings at once, an
invalid one is refused, logged with the reason, and the last valid settings stay. Refused: a value
that is not a JSON object, a key that is no setting (a typo must not pass for applied) or is given
twice, a value of the wrong type or range, NaN and infinities, JSON nested too deep to read, a
value too large for one read (the watch reads it as absent, saying why). The
owner (the router) may refuse what passed here too: `refuse()` then goes back to the settings it
kept, so the same value stored again is judged again; `refused_now` says whether the stored value
stands refused. Deleting the key
returns to the settings the process started with. Exactly that key (DESIGN.md's contract): it is
watched alone, so `/{ns}/config/router-canary` and the like are other keys, never read here (until
2026-12-07 the watch took it as a prefix and read them too: three 1.4 MB such keys made a read
larger than gRPC takes, and a new router never read its config). `reading` says while reading it
fails, the last settings serving meanwhile.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from discovery.session import Discovery
from discovery.watch import Deleted, Put, ReadHealth, Snapshot
from protocol import subjects
from protocol.config import RouterSettings, flat_names, resolve

__all__ = ["ConfigWatcher", "put_config"]

log = logging.getLogger(__name__)
_SETTINGS = frozenset(flat_names(RouterSettings))


async def put_config(discovery: Discovery, overrides: dict[str, object]) -> None:
    """Write flat overrides (flag names, e.g. {"eff_isl_threshold": 1024}) as the live config."""
    await discovery.put_raw(subjects.config_key(discovery.ns), json.dumps(overrides).encode())


def _once_each(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are each given once: json.loads takes the last of a key given twice
    without a word, where a config file's twice-given key is refused."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} is given twice: give it once")
        out[key] = value
    return out


class ConfigWatcher:
    """Yields the effective RouterSettings: at start, then after every accepted change.

    `base` holds the flags, environment and file layers; a live value overrides them field by field
    (flat flag names, like a config file), a `null` too: it clears an Optional setting (the decode
    guard off, prefill_busy_threshold inheriting queue_threshold again) whichever layer set it, and
    is refused for any other. `rejected` counts refused changes; `last_error` says why.
    """

    def __init__(self, discovery: Discovery, base_cli: dict[str, object], base_file: dict[str, object]) -> None:
        self._discovery = discovery
        self._base_cli = base_cli
        self._base_file = base_file
        self.current = resolve(RouterSettings, cli=base_cli, file=base_file)
        self._before = self.current  # what the last settings yielded replaced
        self.rejected = 0
        self.last_error = ""
        self.refused_now = False  # the value stored at the key is refused: the last good settings serve
        self.reading = ReadHealth()

    def refuse(self, why: str) -> None:
        """The owner could not apply the last settings yielded: count and log it like our own refusals,
        and go back to the settings it kept, so that the same value stored again is judged again
        (taken as current, it passed unseen: neither logged nor counted)."""
        self.current = self._before
        self._refused(why)

    def _refused(self, why: str) -> None:
        self.rejected += 1
        self.last_error = why
        self.refused_now = True
        log.error("live config at %s refused, keeping the previous one: %s", self._key, why)

    @property
    def _key(self) -> str:
        return subjects.config_key(self._discovery.ns)

    def _apply(self, raw: bytes | None) -> bool:
        overrides: dict[str, object] = {}
        try:
            if raw is not None:
                try:
                    parsed = json.loads(raw, object_pairs_hook=_once_each)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"it is not JSON ({exc}): it holds a JSON object of flag names") from None
                if not isinstance(parsed, dict):
                    raise ValueError(f"it holds a {type(parsed).__name__}, not a JSON object of flag names")
                unknown = sorted(set(parsed) - _SETTINGS)
                if unknown:
                    raise ValueError(
                        f"{unknown[0]!r} is not a router setting (the live config takes the flags' flat names, "
                        f"a nested section none): {', '.join(sorted(_SETTINGS))}"
                    )
                overrides = parsed
            settings = resolve(RouterSettings, cli=self._base_cli, file=self._base_file, live=overrides)
        except Exception as exc:  # not only ValueError: a value nested too deep raises RecursionError
            self._refused(str(exc) or type(exc).__name__)
            return False
        self.refused_now = False  # judged again by the owner when yielded
        changed = settings != self.current
        self._before, self.current = self.current, settings
        if changed:
            log.debug("live config read: %s", overrides)  # the owner says whether it applied it
        return changed

    async def __aiter__(self) -> AsyncIterator[RouterSettings]:
        async for event in self._discovery.watch_key(self._key, self.reading):
            match event:
                # A value that cannot be read (too large for one read) is there, not deleted: it is
                # refused, the last settings kept (until a review of 2026-12-08 the base came back).
                case Snapshot(skipped={"": why}):
                    self._refused(why)
                    yield self.current
                case Snapshot(items=items):
                    self._apply(items.get(""))
                    yield self.current
                case Put(name="", value=value):
                    if self._apply(value):
                        yield self.current
                # Defensive: watch_key's parser takes any bytes, and a value too large to read
                # breaks the stream (a re-read, a Snapshot skipping it), so none comes today.
                case Deleted(name="", why=why) if why:
                    self._refused(why)
                case Deleted(name=""):
                    if self._apply(None):
                        yield self.current
