"""What a consumer of a watch says of the records it refuses (a value that does not parse,
`Snapshot.skipped` and `Deleted.why`, or one the consumer finds impossible): a line when a key's
record is first refused; none while it is refused again for the same reason (a watch made again
lists it anew, an identical value put again); and, when the reason changes, at most one line per
key per `window_s`: a change within the window of the key's last line is held, counted, and said
as the window ends (on a timer of the running loop; `flush()` says it at once) with how many
times it changed since. The consumer counts every refusal itself, each time one is read.

Until 2026-12-07 the routers watch logged a WARNING per malformed put, in every router and every
shim, and the worker registry an ERROR per put whose reason differed from the last: 1,000 puts
cycling four bad values on one key were 999 lines (logonce audit of 2026-12-07, findings 2 and 5).

`say(name, msg, *args)` logs the line; a consumer that may see many keys at once caps them
across keys (router.fleet_lines.FleetLines.say, a shim's throttle).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, KeysView
from dataclasses import dataclass

__all__ = ["REMEMBERED", "WINDOW_S", "RefusedRecords"]

WINDOW_S = 10.0  # as router.fleet_lines'
REMEMBERED = 16384  # keys refused at once whose last line is kept; the oldest goes first


@dataclass(slots=True)
class _Key:
    why: str  # why it is refused now
    said_at: float  # when its last line was said
    changes: int = 0  # reasons it was refused for since then
    timer: asyncio.TimerHandle | None = None


class RefusedRecords:
    def __init__(
        self,
        say: Callable[..., object],
        line: str,
        *,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        limit: int = REMEMBERED,
    ) -> None:
        """`line`: the message, with two %-placeholders for the key's name and why."""
        self._say = say
        self._line = line
        self.window_s = window_s
        self._clock = clock
        self._limit = limit
        self._keys: dict[str, _Key] = {}  # refused now, insertion-ordered: oldest first

    def refused(self, name: str, why: str) -> None:
        """The record under `name` was read, and refused for `why`."""
        now = self._clock()
        key = self._keys.get(name)
        if key is None:
            self._keys[name] = _Key(why, now)
            if len(self._keys) > self._limit:
                self._drop(next(iter(self._keys)))
            self._say(name, self._line, name, why)
            return
        if why == key.why:
            return
        key.why = why
        key.changes += 1
        # a clock stepped back opens a window too, as FleetLines' does
        if now - key.said_at >= self.window_s or now < key.said_at:
            self._said_again(name, key)
        elif key.timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): the next refusal or flush() says it
                return
            key.timer = loop.call_later(key.said_at + self.window_s - now, self._due, name)

    def accepted(self, name: str) -> None:
        """The key `name` holds a record taken again, or is gone: refused anew, it is said anew."""
        self._drop(name)

    def names(self) -> KeysView[str]:
        """The keys whose record is refused now."""
        return self._keys.keys()

    def flush(self) -> None:
        """Say every change held now."""
        for name, key in list(self._keys.items()):
            if key.changes:
                self._said_again(name, key)

    def _said_again(self, name: str, key: _Key) -> None:
        if key.timer is not None:
            key.timer.cancel()
            key.timer = None
        self._say(name, self._line + " (changes of its reason since it was last said: %d)", name, key.why, key.changes)
        key.said_at, key.changes = self._clock(), 0

    def _due(self, name: str) -> None:
        key = self._keys.get(name)
        if key is not None:
            key.timer = None
            if key.changes:
                self._said_again(name, key)

    def _drop(self, name: str) -> None:
        key = self._keys.pop(name, None)
        if key is not None and key.timer is not None:
            key.timer.cancel()
