"""Admission: requests wait at the router, by priority then first come first served per model, while
no worker has room.

A request is taken at once when nobody waits for its model and the planner finds a worker with
room (its predicted prefill backlog under half the TTFT SLO: router.planner); the plan it gets is
booked in the same synchronous step, so the next request sees it. Otherwise it queues. Each model
(the name a request resolved to: a model, one of its other names, a LoRA adapter) has its own
line, so one model's overload never holds another's requests: its waiters are served in vLLM's
`priority` order (lower first; the request's X-Vllm-Priority over its body's, as vLLM reads them:
the order a `--scheduling-policy priority` engine serves them in), arrival order among equals, as
capacity frees: `notify()` (a load report arrived, a request ended, a worker appeared
or left, and every `REOFFER_S` while any line waits) offers each line's head waiter to the
planner, again and again while plans come back, one per line in turn, the most urgent head first,
then the oldest. A waiter keeps its request context, so nothing is hashed twice.

Names that share workers (a model, its other names, its adapters) are not one queue: a newcomer
under a name with no waiters is planned at once, so capacity that frees during another line's
quiet time (below) can go to it first. Kept on purpose (2026-12-08): lines grouped by base model
let an adapter whose few workers were full hold back its base model's requests with room.

An offer that finds no room costs a whole plan, and a plan visits every worker (about 10 ms at
1,000 workers). While requests wait, every load report would offer the head again: tens of
thousands a second in a large fleet, more CPU than a replica has. So after an offer that found no
room, the line's next one comes no sooner than `RETRY_GAP` times that offer's planning CPU times
the number of lines later (at most a tenth of a core re-planning all the heads); notifications inside the gap
leave one offer scheduled at its end. Some changes come with no notification: a worker turns
silent (no load report for 3 periods) or ends a cooldown through time alone. So while any line
waits, `notify()` also runs every `REOFFER_S` (at most one plan that finds no room per line a
second, the oldest head first, and never inside a line's quiet time): a waiter whose model lost its
last worker gets that error within about a second of the planner seeing it, not a 429 at the end
of its wait.

Each line is bounded so that what waits there drains within half the TTFT SLO: `max_queue` when
set, else the model's measured completion rate times that time (at least `min_queue`). A request
beyond the bound gets 429 with Retry-After (the seconds its line needs to drain at that rate, at
most that half SLO, by when every waiter has been served or refused), unless it is more
urgent than the line's last waiter, which then gets that 429 in its place; and so does one that
waits longer than the timeout: at 5x overload the admitted requests keep their TTFT near the
SLO instead of all of them waiting minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.disagg import RoutePlan
from router.request_context import RequestContext

__all__ = ["KEPT_RATES", "REOFFER_S", "RETRY_GAP", "Admission", "Overloaded", "Throughput"]

RETRY_GAP = 10.0
"""After an offer that found no room, the quiet time before the next, as a multiple of the CPU
that offer's planning took."""

REOFFER_S = 1.0
"""While a line has waiters, its head is offered at least this often (wall seconds), notified or not."""

KEPT_RATES = 64
"""Completion rates held before those decayed to about zero (a LoRA adapter used once and
unloaded) are dropped: such a rate reads the same as none."""


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
    n: int  # arrival order, across every line

    @property
    def order(self) -> tuple[int, int]:
        return self.ctx.shape.priority, self.n


@dataclass(eq=False, slots=True)
class _Line:
    """One model's waiters, the next to serve first, and the pacing of the offers to them."""

    model: str
    waiters: deque[_Waiter] = field(default_factory=deque)
    quiet_until: float = -math.inf  # no offer to these waiters before this (the clock's time)
    deferred: asyncio.TimerHandle | None = None  # the offer at the quiet time's end


def _enqueue(waiters: deque[_Waiter], waiter: _Waiter) -> None:
    """Behind every waiter as urgent or more (equal priorities: arrival order). Most lines hold one
    priority, so this is an append."""
    i = len(waiters)
    while i and waiters[i - 1].order > waiter.order:
        i -= 1
    waiters.insert(i, waiter)


class Admission:
    def __init__(
        self,
        *,
        max_wait_s: Callable[[], float],
        max_queue: Callable[[], int | None],
        on_abandon: Callable[[RoutePlan], None],
        min_queue: int = 8,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
        reoffer_s: float = REOFFER_S,
    ) -> None:
        """`max_wait_s()`: how long a request may wait here (half the TTFT SLO); `max_queue()`:
        the configured bound of each model's line, None to derive it; `on_abandon(plan)`: release
        a plan whose waiter left (timed out or disconnected) in the instant it was granted.
        `cpu_clock` times an offer's planning: CPU, not wall time, so a plan preempted on a busy
        machine does not stretch the quiet time after it. `reoffer_s`: how often a line's head is
        offered while it waits, notified or not (on the event loop's timer)."""
        self._max_wait_s = max_wait_s
        self._max_queue = max_queue
        self._on_abandon = on_abandon
        self.min_queue = min_queue
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._reoffer_s = reoffer_s
        self._lines: dict[str, _Line] = {}  # the models with waiters, and only those
        self._nudge: asyncio.TimerHandle | None = None  # the next notify() every REOFFER_S while lines wait
        self._rates: dict[str, Throughput] = {}  # each model's completions
        self._rates_pruned_at = KEPT_RATES  # more rates than this: drop the idle ones
        self._arrivals = itertools.count()
        self.refused = 0
        self.timed_out = 0

    @property
    def depth(self) -> int:
        """Requests waiting, every model's together."""
        return sum(len(line.waiters) for line in self._lines.values())

    def throughput(self, model: str) -> Throughput:
        """The model's completed requests per second."""
        rate = self._rates.get(model)
        if rate is None:
            rate = self._rates[model] = Throughput(self._clock)
        return rate

    def completed(self, model: str, n: int = 1) -> None:
        """`n` requests for `model` ended: its line drains at that rate."""
        self.throughput(model).completed(n)
        if len(self._rates) > self._rates_pruned_at:
            for idle in [m for m, r in self._rates.items() if m not in self._lines and r.rate() < 1e-9]:
                del self._rates[idle]
            self._rates_pruned_at = max(KEPT_RATES, 2 * len(self._rates))  # amortized: not a scan per completion

    def bound(self, model: str) -> int:
        """How many requests for `model` may wait."""
        configured = self._max_queue()
        if configured is not None:
            return configured
        return max(self.min_queue, math.ceil(self.throughput(model).rate() * self._max_wait_s()))

    def _retry_after(self, model: str, waiting: int) -> int:
        """The seconds the line ahead of a refused request needs: `waiting` + 1 at the model's
        completion rate, and never more than the wait a waiter is allowed, by when every request in
        the line now has been served or refused. The rate decays while the model is idle, so the
        first burst after a quiet spell reads it near zero: until 2026-12-07 that said 60 s (the
        cap then) where the line drained in about 2 (client-fault audit)."""
        wait_s = self._max_wait_s()
        rate = self.throughput(model).rate()
        drain_s = (waiting + 1) / rate if rate > 0 else wait_s
        return max(1, math.ceil(min(drain_s, wait_s)))

    async def admit(self, ctx: RequestContext, take: Callable[[RequestContext], RoutePlan | None]) -> RoutePlan:
        """A booked plan for `ctx`; Overloaded when its model's line is full or the wait too long.
        `take(ctx)` plans and books when a worker has room, else returns None (router.planner)."""
        model = ctx.model
        line = self._lines.get(model)
        if line is None:
            plan = take(ctx)
            if plan is not None:
                return plan
        waiting = len(line.waiters) if line is not None else 0
        waiter = _Waiter(ctx, take, asyncio.get_running_loop().create_future(), next(self._arrivals))
        if waiting >= self.bound(model):
            self.refused += 1
            full = Overloaded(
                f"every worker of {model} is at capacity and {waiting} requests for it are already waiting",
                self._retry_after(model, waiting),
            )
            last = line.waiters[-1] if line is not None and line.waiters else None
            if last is None or last.order < waiter.order:
                raise full
            # More urgent than the last in line: that one leaves with the 429 instead.
            line.waiters.pop()  # type: ignore[union-attr]
            last.future.set_exception(full)
        if line is None:
            line = self._lines[model] = _Line(model)
            if self._nudge is None:
                self._nudge = asyncio.get_running_loop().call_later(self._reoffer_s, self._nudge_all)
        _enqueue(line.waiters, waiter)
        wait_s = self._max_wait_s()
        try:
            async with asyncio.timeout(wait_s):
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            self._abandon(line, waiter)
            self.timed_out += 1
            raise Overloaded(
                f"no worker had room within {wait_s:g}s", self._retry_after(model, len(line.waiters))
            ) from None
        except BaseException:  # the client left
            self._abandon(line, waiter)
            raise

    def _abandon(self, line: _Line, waiter: _Waiter) -> None:
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self._on_abandon(fut.result())  # granted in the very instant it gave up
        else:
            fut.cancel()
        with contextlib.suppress(ValueError):
            line.waiters.remove(waiter)
        self.notify()  # the next head's turn, and what an abandoned plan held is free

    def notify(self) -> None:
        """Capacity may have freed: grant plans to each model's waiters in arrival order while they
        come, one line after another in turn; inside the quiet time after an offer that found no
        room, leave one offer for its end instead."""
        if not self._lines:  # every load report calls this
            return
        lines = list(self._lines.values())
        while lines:
            # The most urgent head first, then the oldest: names that share workers (a model, its
            # aliases, its adapters) take what frees at this notification in that order.
            lines.sort(key=lambda line: line.waiters[0].order if line.waiters else (-math.inf, -1))
            lines = [line for line in lines if self._offer(line)]

    def _offer(self, line: _Line) -> bool:
        """Offer the line's head waiter a plan; True when one was answered and another waits."""
        waiters = line.waiters
        while waiters and waiters[0].future.done():
            waiters.popleft()
        if not waiters:
            self._close(line)
            return False
        now = self._clock()
        if now < line.quiet_until:
            if line.deferred is None:
                loop = asyncio.get_running_loop()
                line.deferred = loop.call_later(line.quiet_until - now, self._offer_deferred, line)
            return False
        head = waiters[0]
        started = self._cpu_clock()
        try:
            plan = head.take(head.ctx)
        except Exception as exc:  # no worker at all any more: the waiter answers with it
            waiters.popleft()
            head.future.set_exception(exc)
            return self._open(line)
        if plan is None:
            # Times the lines: all of them together re-plan within RETRY_GAP's share of a core.
            line.quiet_until = self._clock() + RETRY_GAP * len(self._lines) * (self._cpu_clock() - started)
            return False
        waiters.popleft()
        head.future.set_result(plan)
        return self._open(line)

    def _open(self, line: _Line) -> bool:
        """Whether the line still has waiters; an empty one is closed, so the model's next request
        is planned at once again."""
        if line.waiters:
            return True
        self._close(line)
        return False

    def _close(self, line: _Line) -> None:
        if self._lines.get(line.model) is line:
            del self._lines[line.model]
        if line.deferred is not None:
            line.deferred.cancel()
            line.deferred = None
        if not self._lines and self._nudge is not None:
            self._nudge.cancel()
            self._nudge = None

    def _nudge_all(self) -> None:
        """The periodic offer, as a notification: every line's head, the oldest first."""
        self._nudge = asyncio.get_running_loop().call_later(self._reoffer_s, self._nudge_all)
        self.notify()  # an offer that empties the last line cancels the timer in _close

    def _offer_deferred(self, line: _Line) -> None:
        line.deferred = None
        line.quiet_until = -math.inf  # this is the offer the quiet time kept back
        if self._lines.get(line.model) is line:
            while self._offer(line):
                pass
