"""Workers whose legs keep failing through their own fault: left out for a cooldown, then tried again
by one request (half-open), for router.eligibility's `prefill_failing` and `engine_failing`.

A worker's episode begins once `after` of its legs in a row have failed, the first of them within
`window_s` of the last; a leg that works in between starts the count again. It is left out while its
cooldown runs from its last failure, and past it the next request planned there is the trial
(`trial`), which holds it for its leg's time limit unless its verdict comes first. A failure is
reported with its own time (`ago_s`: an engine's 5xx, a prefill leg's too, is judged only once the
request's retry or fallback gave output, maybe past the cooldown). One of a leg that failed while a
trial was under way, or after it began, is the trial's: it doubles the cooldown, up to
`max_cooldown_s` (prefill_failing's does not double). Any other (a leg planned
before the cooldown began, or one sent while its whole pool is left out and serves all the same)
starts the cooldown again at its length from that failure, unless it is older than the one the
cooldown runs from or than a trial under way, whose verdict stands. A leg that works past the
cooldown ends the episode (one within it was planned before the failure, or sent for want of another
worker, and says less). Until 2026-12-07 any failure reported past the cooldown was the trial's: a
late one doubled the wait and dropped the trial under way, whose success then ended nothing.

Synchronous, with an injected clock; what is said of an episode is its owner's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Episode", "FailingWorkers"]


@dataclass(slots=True)
class Episode:
    """A worker's run of failed legs."""

    failed_at: float  # its last failed leg
    why: str  # ... and why it failed
    cooldown_s: float
    failures: int  # legs failed in a row, those before it began included
    serves_whole: bool = False  # a prefill worker that only gave no usable transfer handle
    trial_until: float = 0.0  # a trial holds it until then
    trial_at: float = 0.0  # ... begun then: a failure of a leg from then on is its own

    def cooling(self, now: float) -> bool:
        return now - self.failed_at < self.cooldown_s

    def out(self, now: float) -> bool:
        """Left out of routing now: cooling down, or its trial under way."""
        return self.cooling(now) or now < self.trial_until

    def explain(self, now: float) -> str:
        """Its `why` as an exclusion shows it."""
        ago = now - self.failed_at
        if self.cooling(now):
            return f"{self.why} ({ago:.1f}s ago; one request tries it again {self.cooldown_s:g}s after it)"
        return f"{self.why} ({ago:.1f}s ago; one request is trying it again)"


class FailingWorkers:
    def __init__(
        self,
        *,
        clock: Callable[[], float],
        cooldown_s: float,
        after: int = 1,
        window_s: float = math.inf,
        max_cooldown_s: float | None = None,
    ) -> None:
        self._clock = clock
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = cooldown_s if max_cooldown_s is None else max_cooldown_s
        self._after = after
        self._window_s = window_s
        self._episodes: dict[str, Episode] = {}
        # `worker`'s episode going on, left out now or not: the dict's own get, as statuses() reads
        # it per worker (a method of this class cost 1,000 workers' statuses about 15 %)
        self.get: Callable[[str], Episode | None] = self._episodes.get
        self._streaks: dict[str, tuple[int, float]] = {}  # worker -> (legs failed in a row, the first's time)

    def failed(self, worker: str, why: str, serves_whole: bool = False, ago_s: float = 0.0) -> Episode | None:
        """A leg on `worker` failed through its fault, `ago_s` before now: the episode it begins, if
        it begins one."""
        now = self._clock()
        at = now - ago_s
        held = self._episodes.get(worker)
        if held is not None:
            held.failures += 1
            trial = held.trial_until > 0.0
            if trial and at >= held.trial_at:  # the trial failed
                held.cooldown_s = min(2 * held.cooldown_s, self.max_cooldown_s)
            elif trial or at < held.failed_at:
                return None  # older than what the wait runs from, or than the trial under way
            held.failed_at, held.why, held.serves_whole, held.trial_until = at, why, serves_whole, 0.0
            return None
        count, first = self._streaks.get(worker, (0, now))
        if now - first > self._window_s:
            count, first = 0, now
        count += 1
        if count < self._after:
            self._streaks[worker] = (count, first)
            return None
        self._streaks.pop(worker, None)
        self._episodes[worker] = episode = Episode(at, why, self.cooldown_s, count, serves_whole)
        return episode

    def worked(self, worker: str) -> Episode | None:
        """A leg on `worker` worked: the episode it ends (past the cooldown), if it ends one."""
        if self._streaks:
            self._streaks.pop(worker, None)
        held = self._episodes.get(worker)
        if held is None or held.cooling(self._clock()):
            return None
        return self._episodes.pop(worker)

    def trial(self, worker: str, for_s: float) -> None:
        """A leg on `worker` was planned: past its cooldown, it is the trial, and no other request
        goes there for `for_s` (the leg's time limit) unless it reports first."""
        held = self._episodes.get(worker)
        if held is not None and not held.cooling(now := self._clock()):
            if now >= held.trial_until:  # else one under way (its pool all left out) goes on from its start
                held.trial_at = now
            held.trial_until = now + for_s

    def __contains__(self, worker: str) -> bool:
        return worker in self._episodes

    def forget(self, worker: str) -> None:
        self._episodes.pop(worker, None)
        self._streaks.pop(worker, None)
