"""The fingerprints of the router's tokenizer a worker's engine may have taken: one per day.

A chat template may write today's date (Llama 3.2's and 3.3's `Today Date:`, through
`strftime_now`, which transformers, and so vLLM, answers from `datetime.now()`: the engine's local
date), and the fingerprint probes go through the template (protocol.fingerprint), so a shim
advertises its tokenizer's fingerprint on the day, in the time zone, its engine rendered them. Every
zone's date is within a day of the UTC date; so `FingerprintDays` takes for this router's the
fingerprints of its tokenizer on each day from the UTC day before its start to the UTC day after
today: a worker probed at any moment since the router started, in any zone, matches (a rolling
restart across midnight among them), and a worker of another tokenizer matches on no day. A day is
added as each UTC day begins (`follow`; those told by `on_added`, the router's FingerprintWatch,
look again at the workers they refused), none is dropped (a shim probes once a session: one probed
on Monday advertises Monday's fingerprint for as long as it runs), and the BACK_DAYS days before
that are added as the router starts (`backfill`), for workers probed before it started. One probed
longer ago is refused, and told the date is why (`note`). Until 2026-12-07 the router took its
fingerprint on the day it started alone, so a worker started on another day got no text prompt.

Whether the template writes the date (`dated`) is judged from every day taken: one that writes the
month or the year alone (strftime_now('%B %Y')) renders alike on adjacent days, so the back days
are taken whatever the template (some 70 ms, on a thread), where they were taken only when the
first three days differed and a worker probed last month was refused with advice that named no
date (review of 2026-12-07). A template that writes no date has one fingerprint on every day.

The fingerprints are computed by `on(day)` (router.tokenization.fingerprints_on: the template's
clock pinned to that day): the first days as the router is built, as before, and the others on a
thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Iterable

__all__ = ["BACK_DAYS", "FingerprintDays"]

BACK_DAYS = 30  # the days before its start a router takes, for a template that writes the date
_LOOK_EVERY_S = 3600.0  # a sleep to the next UTC day, cut short so a stepped wall clock is seen within it
_DAY = datetime.timedelta(days=1)

# (current, legacy): a tokenizer's fingerprint under the probes, and under those of before
# protocol.fingerprint.PROBES_SINCE (router.tokenization.Fingerprints)
Pair = tuple[str, str | None]


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class FingerprintDays:
    """The router tokenizer's fingerprints by day. `current`: its fingerprint on the router's local
    date as it started, what /ready shows; `accepts` and `is_legacy` take any day's. Read and
    changed on the event loop only."""

    def __init__(self, on: Callable[[datetime.date], Pair] | None, *, now: Callable[[], datetime.datetime] = _utc_now):
        """`on(day)`: the fingerprints on `day`; None: a fixed pair, given to `fixed` (no day to add).
        `now`: the time, zone-aware."""
        self._on = on
        self._now = now
        self._by_day: dict[datetime.date, Pair] = {}
        self._accepted: set[str] = set()
        self._legacy: set[str] = set()
        self._hearers: list[Callable[[], None]] = []
        self.current = ""
        if on is not None:
            started = now()
            today = started.astimezone(datetime.UTC).date()
            for day in (today - _DAY, today, today + _DAY):
                self._add(day, on(day))
            # the router's own requests render with its local date, within a day of UTC's
            self.current = self._by_day[started.astimezone().date()][0]

    @classmethod
    def fixed(cls, current: str, legacy: str | None = None) -> FingerprintDays:
        """One pair for every day (a template that writes no date, or a test's)."""
        days = cls(None)
        days._accepted.add(current)
        days._legacy.update([legacy] if legacy is not None else [])
        days.current = current
        return days

    def on_added(self, hear: Callable[[], None]) -> None:
        """Call `hear()` after each batch of days added (a fingerprint refused may be accepted now)."""
        self._hearers.append(hear)

    @property
    def dated(self) -> bool:
        """The template writes the date: the days taken differ (after `backfill`, over a month or more)."""
        return len(self._accepted) > 1

    @property
    def span(self) -> tuple[datetime.date, datetime.date]:
        """The first and the last day taken (UTC)."""
        if not self._by_day:
            raise ValueError("fixed fingerprints take no days")
        return min(self._by_day), max(self._by_day)

    def accepts(self, fp: str) -> bool:
        """`fp` is this router's tokenizer's on one of its days."""
        return fp in self._accepted

    def is_legacy(self, fp: str) -> bool:
        """`fp` is this router's tokenizer's under the old probes on one of its days."""
        return fp in self._legacy

    def note(self) -> str:
        """Why a worker of the same tokenizer may still differ, for a template that writes the date;
        "" for one that does not."""
        if not self.dated:
            return ""
        first, last = self.span
        return (
            f"this router's chat template writes today's date (strftime_now), and it takes its tokenizer's "
            f"fingerprint on each day from {first} to {last} (UTC, a day either side for time zones): a worker whose "
            f"shim probed its engine before {first}, or whose engine's clock is off by days, advertises another "
            "day's; restart that worker's shim, which probes again"
        )

    async def backfill(self) -> None:
        """The BACK_DAYS days before the first (on a thread), whatever the template: only then is
        `dated` judged over a month and more."""
        if self._by_day:
            first = min(self._by_day)
            await self._fill(first - _DAY * n for n in range(1, BACK_DAYS + 1))

    async def follow(self) -> None:
        """Add each UTC day's next as it begins, for the life of the router (its owner cancels it)."""
        while True:
            now = self._now().astimezone(datetime.UTC)
            next_day = datetime.datetime.combine(now.date() + _DAY, datetime.time(), datetime.UTC)
            await asyncio.sleep(min((next_day - now).total_seconds(), _LOOK_EVERY_S))
            await self.catch_up()

    async def catch_up(self) -> None:
        """Every day from the last one taken to the one after today (UTC)."""
        tomorrow = self._now().astimezone(datetime.UTC).date() + _DAY
        last = max(self._by_day, default=tomorrow)
        await self._fill(last + _DAY * n for n in range(1, (tomorrow - last).days + 1))

    async def _fill(self, days: Iterable[datetime.date]) -> None:
        on = self._on
        if on is None:
            return
        added = False
        for day in days:
            if day not in self._by_day:
                self._add(day, await asyncio.to_thread(on, day))
                added = True
        if added:
            for hear in self._hearers:
                hear()

    def _add(self, day: datetime.date, pair: Pair) -> None:
        self._by_day[day] = pair
        self._accepted.add(pair[0])
        if pair[1] is not None:
            self._legacy.add(pair[1])
