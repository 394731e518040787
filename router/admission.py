"""Admission: requests wait at the router, first come first served, while no worker has room.

A request is taken at once when nobody is waiting and the planner finds a worker with room (its
predicted prefill backlog under half the TTFT SLO: router.planner); the plan it gets is booked in
the same synchronous step, so the next request sees it. Otherwise it queues. Waiters are served in
arrival order, and only as capacity frees: `notify()` (a load report arrived, a request ended, a
worker appeared) offers the head waiter to the planner, again and again while plans come back.
A waiter keeps its request context, so nothing is hashed twice.

An offer that finds no room costs a whole plan, and a plan visits every worker (about 10 ms at
1,000 workers). While requests wait, every load report would offer the head again: tens of
thousands a second in a large fleet, more CPU than a replica has. So after an offer that found no
room, the next one comes no sooner than `RETRY_GAP` times that offer's planning CPU later (at
most a tenth of a core spent re-planning waiters); notifications inside the gap leave one offer
scheduled at its end.

The queue is bounded so that what waits here drains within half the TTFT SLO: `max_queue` when
set, else the fleet's measured completion rate times that time (at least `min_queue`). A request
beyond the bound gets 429 with Retry-After (the seconds the queue ahead needs to drain), and so
does one that waits longer than the timeout: at 5x overload the admitted requests keep their TTFT
near the SLO instead of all of them waiting minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from router.disagg import RoutePlan
from router.request_context import RequestContext

__all__ = ["RETRY_GAP", "Admission", "Overloaded", "Throughput"]

RETRY_GAP = 10.0
"""After an offer that found no room, the quiet time before the next, as a multiple of the CPU
that offer's planning took."""


class Overloaded(Exception):
    """Answered with 429; `retry_after_s` goes in the Retry-After header."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class Throughput:
    """Requests completed per second, an exponentially weighted rate over about `window_s`."""

    def __init__(self, clock: Callable[[], float], window_s: float = 10.0) -> None:
        self._clock = clock
        self._window_s = window_s
        self._rate = 0.0
        self._last = clock()

    def completed(self, n: int = 1) -> None:
        self._decay()
        self._rate += n / self._window_s

    def rate(self) -> float:
        self._decay()
        return self._rate

    def _decay(self) -> None:
        now = self._clock()
        dt = max(0.0, now - self._last)
        self._last = now
        self._rate *= math.exp(-dt / self._window_s)


@dataclass(eq=False, slots=True)
class _Waiter:
    ctx: RequestContext
    take: Callable[[RequestContext], RoutePlan | None]
    future: asyncio.Future[RoutePlan]
    since: float


class Admission:
    def __init__(
        self,
        *,
        max_wait_s: Callable[[], float],
        max_queue: Callable[[], int | None],
        throughput: Throughput,
        on_abandon: Callable[[RoutePlan], None],
        min_queue: int = 8,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """`max_wait_s()`: how long a request may wait here (half the TTFT SLO); `max_queue()`:
        the configured bound, None to derive it; `on_abandon(plan)`: release a plan whose waiter
        left (timed out or disconnected) in the instant it was granted. `cpu_clock` times an
        offer's planning: CPU, not wall time, so a plan preempted on a busy machine does not
        stretch the quiet time after it."""
        self._max_wait_s = max_wait_s
        self._max_queue = max_queue
        self.throughput = throughput
        self._on_abandon = on_abandon
        self.min_queue = min_queue
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._waiters: deque[_Waiter] = deque()
        self._quiet_until = -math.inf  # no offer to waiters before this (the clock's time)
        self._deferred: asyncio.TimerHandle | None = None  # the offer at the quiet time's end
        self.refused = 0
        self.timed_out = 0

    @property
    def depth(self) -> int:
        return len(self._waiters)

    def bound(self) -> int:
        configured = self._max_queue()
        if configured is not None:
            return configured
        return max(self.min_queue, math.ceil(self.throughput.rate() * self._max_wait_s()))

    def _retry_after(self) -> int:
        rate = self.throughput.rate()
        if rate <= 0:
            return max(1, math.ceil(self._max_wait_s()))
        return min(60, max(1, math.ceil((len(self._waiters) + 1) / rate)))

    async def admit(self, ctx: RequestContext, take: Callable[[RequestContext], RoutePlan | None]) -> RoutePlan:
        """A booked plan for `ctx`; Overloaded when the queue is full or the wait too long.
        `take(ctx)` plans and books when a worker has room, else returns None (router.planner)."""
        if not self._waiters:
            plan = take(ctx)
            if plan is not None:
                return plan
        if len(self._waiters) >= self.bound():
            self.refused += 1
            raise Overloaded(
                f"every worker is at capacity and {len(self._waiters)} requests are already waiting",
                self._retry_after(),
            )
        waiter = _Waiter(ctx, take, asyncio.get_running_loop().create_future(), self._clock())
        self._waiters.append(waiter)
        wait_s = self._max_wait_s()
        try:
            async with asyncio.timeout(wait_s):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            self._abandon(waiter)
            self.timed_out += 1
            raise Overloaded(f"no worker had room within {wait_s:.1f}s", self._retry_after()) from None
        except BaseException:  # the client left
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self._on_abandon(fut.result())  # granted in the very instant it gave up
        else:
            fut.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        self.notify()

    def notify(self) -> None:
        """Capacity may have freed: grant plans to waiters in arrival order while they come; inside
        the quiet time after an offer that found no room, leave one offer for its end instead."""
        waiters = self._waiters
        if not waiters:
            return
        now = self._clock()
        if now < self._quiet_until:
            if self._deferred is None:
                loop = asyncio.get_running_loop()
                self._deferred = loop.call_later(self._quiet_until - now, self._offer_deferred)
            return
        while waiters:
            head = waiters[0]
            if head.future.done():
                waiters.popleft()
                continue
            started = self._cpu_clock()
            try:
                plan = head.take(head.ctx)
            except Exception as exc:  # no worker at all any more: the waiter answers with it
                waiters.popleft()
                head.future.set_exception(exc)
                continue
            if plan is None:
                self._quiet_until = self._clock() + RETRY_GAP * (self._cpu_clock() - started)
                return
            waiters.popleft()
            head.future.set_result(plan)

    def _offer_deferred(self) -> None:
        self._deferred = None
        self._quiet_until = -math.inf  # this is the offer the quiet time kept back
        self.notify()
