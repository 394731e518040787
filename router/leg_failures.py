"""Legs that fail before their first output, said once per episode of a worker and failure kind.

A dead engine whose worker stays registered (engine_unhealthy, a worker then used while none other
of its pool is routable: router.eligibility) failed every request sent to it until its shim left,
about 2 s later: two WARNING lines a request, 281 in 2 s with 8 clients, each with aiohttp's whole
ConnectionKey (log-quality audit of 2026-12-07). A `LegFailures` says the first failure of an
episode, a (worker, failure kind) pair, as its caller said every one before, the request named; the
rest are counted (each said at DEBUG) and their count said at most every EVERY_S with the last of
them, its request and cause: a kind's cause may change while its legs keep failing (connection
refused, then an engine's 503), and until 2026-12-07 the change was at DEBUG alone, a client's
error tied to no cause at WARNING; one line a period still, whatever the causes. The episode's end
is said at INFO with its count: when a leg on the worker gives output (one of the type whose failures
a `LegFailures` counts: Dispatcher.leg_failures), when the worker leaves, when
the router stops, or once EVERY_S have passed since its last such failure (a late timer, a stalled
loop's, ended an episode whose count a failure had just said: review of 2026-12-07).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["EVERY_S", "LegFailures"]

EVERY_S = 30.0


@dataclass
class _Episode:
    began: float
    said: float  # when its last line was said
    last_at: float  # when its last leg failed
    failed: int = 1  # legs in all
    unsaid: int = 0  # since its last line
    last: tuple[str, tuple[object, ...]] = ("", ())  # the last failure counted: its line's msg and args
    timer: asyncio.TimerHandle | None = None


class LegFailures:
    """Episodes of legs failing before their first output, by worker and kind, said on `logger`."""

    def __init__(
        self, logger: logging.Logger, *, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self.every_s = every_s
        self._clock = clock
        self._episodes: dict[str, dict[str, _Episode]] = {}  # worker -> kind -> its episode

    def failed(self, worker: str, kind: str, rid: str, msg: str, *args: object) -> None:
        """Request `rid`'s leg on `worker` failed with `kind`, `msg % args` its line: said at WARNING
        if it begins an episode, else at DEBUG and counted."""
        extra = {"request_id": rid}
        now = self._clock()
        kinds = self._episodes.setdefault(worker, {})
        ep = kinds.get(kind)
        if ep is None:
            kinds[kind] = ep = _Episode(now, now, now)
            self._log.warning(
                msg + "; further %s failures on worker %s are counted (said every %gs at most) until it serves again",
                *args,
                kind,
                worker,
                self.every_s,
                extra=extra,
                stacklevel=2,
            )
            self._arm(worker, kind, ep, self.every_s)
            return
        ep.failed += 1
        ep.unsaid += 1
        ep.last_at, ep.last = now, (msg, args)
        self._log.debug(msg, *args, extra=extra, stacklevel=2)
        if now - ep.said >= self.every_s:  # its timer is late (a stalled loop) or there is no loop
            self._count(worker, kind, ep, now)

    def served(self, worker: str) -> None:
        """A leg on `worker` of the type whose failures these are gave output (a token, or a
        utility call's answer: Dispatcher.leg_failures keeps the two apart): its episodes end."""
        if self._episodes:
            self._end(worker, "serves again")

    def forget(self, worker: str) -> None:
        """`worker` left: its episodes end."""
        if self._episodes:
            self._end(worker, "left")

    def close(self) -> None:
        """The router stops: every episode ends, said."""
        for worker in list(self._episodes):
            self._end(worker, "is left as the router stops")

    def _arm(self, worker: str, kind: str, ep: _Episode, delay_s: float) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller: the next failure says the count
            return
        ep.timer = loop.call_later(delay_s, self._due, worker, kind)

    def _due(self, worker: str, kind: str) -> None:
        ep = self._episodes[worker][kind]
        ep.timer = None
        now = self._clock()
        if ep.unsaid and (since := now - ep.said) < self.every_s:  # failed() said a count since
            self._arm(worker, kind, ep, self.every_s - since)
        elif ep.unsaid:
            self._count(worker, kind, ep, now)
            self._arm(worker, kind, ep, self.every_s)
        elif (quiet := now - ep.last_at) < self.every_s:  # a late timer: failed() said the count since
            self._arm(worker, kind, ep, self.every_s - quiet)
        else:
            self._end(worker, f"had no {kind} failure for {self.every_s:g}s", only=kind)

    def _count(self, worker: str, kind: str, ep: _Episode, now: float) -> None:
        msg, args = ep.last
        self._log.warning(
            "worker %s: %d more legs failed with %s before their first output in the last %.0fs (%d since %.0fs "
            "ago), the last: " + msg,
            worker,
            ep.unsaid,
            kind,
            now - ep.said,
            ep.failed,
            now - ep.began,
            *args,
        )
        ep.unsaid, ep.said = 0, now

    def _end(self, worker: str, how: str, *, only: str | None = None) -> None:
        kinds = self._episodes.get(worker, {})
        for kind in [only] if only is not None else list(kinds):
            ep = kinds.pop(kind)
            if ep.timer is not None:
                ep.timer.cancel()
            self._log.info(
                "worker %s %s: %d of its legs failed with %s before their first output over %.1fs",
                worker,
                how,
                ep.failed,
                kind,
                self._clock() - ep.began,
            )
        if not kinds:
            self._episodes.pop(worker, None)
