"""Per-worker log lines of one cause, capped for the fleet.

A cause the whole fleet shares (a NATS permission change, a router started without the fleet's
tokenizer, a fleet restart, a router an upgrade left behind) was one line per worker: 1,000 at
1,000 workers, and the cause lost among them (log-volume audit of 2026-12-06, docs/router.md).
A `FleetLines` is one such line. Within a window of `window_s` from the first line, the first
NAMED_AT_MOST workers (as many as /ready names: router.eligibility) are logged as before, by name;
the rest are held and counted, and one summary line per window, "and N more workers: <cause>", is
logged when the window ends (a timer on the running loop; `flush()` says it at once). A router's
parts make theirs in its `FleetLog`, which says every one's as it stops, when no timer of its loop
would: its own alone, as another router in the process (tests, the embedded local cluster) holds
its own. Nothing is lost: every worker held is in a summary. A named worker said again within its
window is named again (it is one of the few); a held one is counted once per window, its lines
beside it when they were more. The cause may be judged when the summary is said (a callable given
the count), e.g. whether the fleet shares it. A clock that steps back opens a new window: on a
running loop, a summary is said at most `window_s` after its first held line.

`FleetEpisodes` says episodes (a failure, then its recovery) on two FleetLines, one for their
starts and one for their ends, and names the end of every episode whose start was named: capped on
their own, the ends named the first NAMED_AT_MOST to end, and a fleet's episodes need not end in the
order they began, so a worker named failing could be counted recovering, its log ending on the
failure (review of 2026-12-06).

`LastSaid` is what was said of each worker, kept when its key goes: a worker back under its name
after a fleet restart, with the same thing to say, is not news.

`FirstSaid` is whether a sender's message dropped (or taken) as one kind is said at all: once per
registered worker and kind, and, of a sender with no record (anyone may publish on a subject of
any name), once in a while each for a bounded number at a time, so that names minted by the
thousand neither grow a router's memory nor silence the next stranger's line.

`FirstHeard` is when each sender with no record was first heard: a shim publishes its first load
reports before its registration's put lands, and "no usable record" was said at every worker's
(re)registration (log-quality audit of 2026-12-07); said only once its record has been missing
for RECORD_GRACE_S since, or at once while as many senders as FirstSaid keeps are in their grace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

__all__ = [
    "NAMED_AT_MOST",
    "RECORD_GRACE_S",
    "REMEMBERED",
    "UNREGISTERED_SAID",
    "UNREGISTERED_SAID_S",
    "WINDOW_S",
    "FirstHeard",
    "FirstSaid",
    "FleetEpisodes",
    "FleetLines",
    "FleetLog",
    "LastSaid",
]

# Workers named in a window; a no-worker 503 and /ready name as many (router.eligibility, which
# logs through a FleetLines too, so it is defined here, where nothing of the router is imported)
NAMED_AT_MOST = 8

WINDOW_S = 10.0
REMEMBERED = 16384  # workers whose last word LastSaid keeps (a bounded memory of ids that left)
UNREGISTERED_SAID = 1024  # senders with no record FirstSaid keeps said at once at most
UNREGISTERED_SAID_S = 600.0  # ... each for this long, then it may be said again
RECORD_GRACE_S = 2.0  # a sender's record may land this long after its first report


class FleetLines:
    def __init__(
        self,
        logger: logging.Logger,
        level: int,
        cause: str | Callable[[int], str],
        *,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        fleet_log: FleetLog | None = None,
        noun: str = "workers",
    ) -> None:
        """`fleet_log`: its router's, which says what it holds as the router stops; None where no
        router stops it (a part on its own: tests, benchmarks), its window's timer alone says it.
        `noun`: what the lines name, as the summary counts them ("and N more workers")."""
        self._log = logger
        self._noun = noun
        self._level = level
        self._cause = cause
        self.window_s = window_s
        self._clock = clock
        self._opened = -float("inf")  # when the current window began
        self._named: set[str] = set()  # this window's
        self._held: set[str] = set()  # since the last summary
        self._held_lines = 0
        self._timer: asyncio.TimerHandle | None = None
        if fleet_log is not None:
            fleet_log.add(self)

    def say(
        self, worker: str, msg: str, *args: object, stacklevel: int = 2, exc_info: BaseException | None = None
    ) -> bool:
        """Log `msg % args`, a line naming `worker`, unless NAMED_AT_MOST others were named in this
        window: then count it for the summary. Whether it was logged. `stacklevel`: the caller the
        line is put down to (2: say's own caller); `exc_info`: a traceback to log with the line."""
        now = self._clock()
        # A clock stepped back (time.time under an NTP correction) opens one too: the window it
        # left would hold every line, and its summary, for as long as the step.
        if now - self._opened >= self.window_s or now < self._opened:
            self.flush()
            self._opened = now
            self._named.clear()
        if worker in self._named or len(self._named) < NAMED_AT_MOST:
            self._named.add(worker)
            self._log.log(self._level, msg, *args, stacklevel=stacklevel, exc_info=exc_info)
            return True
        self._held.add(worker)
        self._held_lines += 1
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): the next line or flush() says it
                return False
            # in (0, window_s]: the window opened at or before now, and has not ended
            self._timer = loop.call_later(self._opened + self.window_s - now, self._due)
        return False

    def held(self) -> int:
        """Workers held since the last summary."""
        return len(self._held)

    def flush(self) -> None:
        """Say the summary of the workers held, if any, now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        workers, lines = len(self._held), self._held_lines
        self._held.clear()
        self._held_lines = 0
        cause = self._cause(workers) if callable(self._cause) else self._cause
        more = f" ({lines} lines)" if lines > workers else ""
        self._log.log(self._level, "and %d more %s%s: %s", workers, self._noun, more, cause)

    def _due(self) -> None:
        self._timer = None
        self.flush()


# An episode's key: its worker, or a tuple of its worker and what else tells it apart (a pair)
Episode = str | tuple[str, str]


class FleetEpisodes:
    """Episodes said on `start_lines` as they begin and `end_lines` as they end, the end of one
    whose start was named named beside the end lines' own few."""

    def __init__(self, start_lines: FleetLines, end_lines: FleetLines) -> None:
        self._start, self._end = start_lines, end_lines
        self._named: set[Episode] = set()  # episodes going on whose start was named

    def began(self, key: Episode, msg: str, *args: object) -> None:
        """Say that episode `key` began (or goes on: named once, its end is named)."""
        if self._start.say(_worker(key), msg, *args, stacklevel=3):
            self._named.add(key)

    def ended(self, key: Episode, msg: str, *args: object) -> None:
        """Say that episode `key` ended: by name if its start was named, else on the end lines."""
        if key in self._named:
            self._named.discard(key)
            self._end._log.log(self._end._level, msg, *args, stacklevel=2)
        else:
            self._end.say(_worker(key), msg, *args, stacklevel=3)

    def forget(self, key: Episode) -> None:
        """Episode `key` is gone unsaid (its worker left)."""
        self._named.discard(key)


def _worker(key: Episode) -> str:
    return key if isinstance(key, str) else key[0]


class FleetLog:
    """One router's FleetLines, each made with it: said together as the router stops."""

    def __init__(self) -> None:
        self._lines: list[FleetLines] = []

    def add(self, lines: FleetLines) -> None:
        self._lines.append(lines)

    def flush(self) -> None:
        """Say every held summary now: a stopping router's timers would never fire."""
        for lines in self._lines:
            lines.flush()


class LastSaid:
    """What was last said of each worker, for the REMEMBERED workers said of last."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        self._limit = limit
        self._said: dict[str, object] = {}  # insertion-ordered: oldest first

    def news(self, worker: str, what: object) -> bool:
        """Whether `what` differs from what was last said of `worker`; it is what was said now."""
        if self._said.get(worker, _NOTHING) == what:
            return False
        self._said.pop(worker, None)
        self._said[worker] = what
        if len(self._said) > self._limit:
            del self._said[next(iter(self._said))]
        return True

    def clear(self, worker: str) -> None:
        """`worker` is back to what needs no saying: saying it again is news."""
        self._said.pop(worker, None)


_NOTHING = object()


class FirstSaid:
    """Whether to say a message of `worker` dropped (or taken) as `kind`: the first one of a worker
    `registered` says has a record, until `forget(worker)` (it left); of a sender with none, the
    first one within `every_s`, for up to `limit` such senders and kinds at a time, oldest first.
    Kept together and for good, 1,024 ids with no record had silenced a router's warnings for
    every worker, registered ones too, for the process's life; kept in one shared entry, every
    sender with no record but the first went unnamed (logonce audit of 2026-12-07, finding 8)."""

    def __init__(
        self,
        registered: Callable[[str], bool],
        *,
        limit: int = UNREGISTERED_SAID,
        every_s: float = UNREGISTERED_SAID_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registered = registered
        self.limit = limit
        self.every_s = every_s
        self._clock = clock
        self._said: dict[str, set[str]] = {}  # registered worker -> the kinds said
        self._strangers: dict[tuple[str, str], float] = {}  # insertion-ordered: by when said

    def __call__(self, kind: str, worker: str) -> bool:
        if self._registered(worker):
            kinds = self._said.setdefault(worker, set())
            if kind in kinds:
                return False
            kinds.add(kind)
            return True
        key = (kind, worker)
        said, now = self._strangers, self._clock()
        while said and now - next(iter(said.values())) > self.every_s:
            del said[next(iter(said))]
        if key in said or len(said) >= self.limit:
            return False
        said[key] = now
        return True

    def forget(self, worker: str) -> None:
        """`worker` left: back under its name, it is said again."""
        self._said.pop(worker, None)


class FirstHeard:
    """When each sender with no record was first heard, for up to `limit` senders at a time, each
    kept `keep_s` at most (anyone may publish under any name). A sender heard while the table is
    full is past its grace at once (FirstSaid caps what is said): evicted oldest first, more than
    `limit` senders reporting in turn each left before its next report, and none was ever said
    (review of 2026-12-07)."""

    def __init__(
        self,
        grace_s: float = RECORD_GRACE_S,
        *,
        limit: int = UNREGISTERED_SAID,
        keep_s: float = UNREGISTERED_SAID_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace_s = grace_s
        self.limit = limit
        self.keep_s = keep_s
        self._clock = clock
        self._heard: dict[str, float] = {}  # insertion-ordered: oldest first

    def past_grace(self, sender: str) -> bool:
        """`sender` is heard now with no record: whether it has had none for `grace_s` since first heard."""
        now, heard = self._clock(), self._heard
        # names minted once must not fill the table for good, leaving every later sender no grace
        while heard and now - next(iter(heard.values())) > self.keep_s:
            del heard[next(iter(heard))]
        first = heard.get(sender)
        if first is None:
            if len(heard) >= self.limit:
                return True
            heard[sender] = first = now
        return now - first >= self.grace_s

    def forget(self, sender: str) -> None:
        """`sender`'s record landed, or went: its next report without one starts the grace again."""
        self._heard.pop(sender, None)
