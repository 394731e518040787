"""The bytes a replica holds for its clients, under one budget for all of them (--client-buffer-mib):
each streamed leg's chunks its client has not taken yet (router.leg, `Leg.queued`), and each whole
answer while its handler writes it (router.http_api). One stream is bounded on its own too
(router.dispatch.MAX_QUEUED_BYTES), but until 2026-12-07 nothing bounded them all but the fleet's
engine slots: 100 streaming clients that stopped reading held 8.2 MB each, 30 whole answers 818 MB
until their deadline, and an OOM kill would end every stream on the replica (slow-consumer audit).

Over budget, the holder of the most bytes is ended until the total is within it: a stream is cut
as a slow reader (its 408 error event, counted as the per-stream limit's), a whole answer's
connection is aborted by its writer. A client that keeps up holds about one chunk, so it goes last.
A whole answer about to be written is not ended to make room for the others (its client may read
it at once); one larger than the whole budget is refused before its head goes out.

`held` is kept by an integer add or subtract per chunk; the holders are scanned only when over.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.leg import Leg

__all__ = ["CLIENT_BUFFER_MIB", "CLIENT_BUFFER_MIB_RANGE", "ClientBuffers", "HeldAnswer"]

CLIENT_BUFFER_MIB = 512
# The least is one stream's own limit (MAX_QUEUED_BYTES); the most only catches a typo's extra digits.
CLIENT_BUFFER_MIB_RANGE = (8, 1 << 20)


@dataclass(eq=False, slots=True)
class HeldAnswer:
    """A whole answer being written to its client: `end` makes its write's timer (`watch`) go off
    now, and its writer aborts the connection (router.http_api)."""

    size: int
    ended: bool = False  # ended over budget
    _timer: asyncio.Timeout | None = None

    def watch(self, timer: asyncio.Timeout) -> None:
        """Its write begins under `timer`: ended already, it goes off at once."""
        self._timer = timer
        if self.ended:
            timer.reschedule(0)  # any time before now: at the write's next wait

    def end(self) -> None:
        self.ended = True
        if self._timer is not None:
            self._timer.reschedule(0)


class ClientBuffers:
    """`streams`: the legs whose queues `held` counts; `cut`: ends one as a slow reader over budget
    (router.dispatch), its queue subtracted by then (Leg.drop)."""

    def __init__(
        self, budget: int, streams: Callable[[], Iterable[Leg]], cut: Callable[[Leg], Awaitable[None]]
    ) -> None:
        self.budget = budget
        self.held = 0
        self.cuts: Counter[str] = Counter()  # holders ended over budget: "stream", "answer"
        self._answers: set[HeldAnswer] = set()
        self._streams = streams
        self._cut = cut

    def fits(self, size: int) -> bool:
        """A whole answer of `size` bytes can be held at all."""
        return size <= self.budget

    async def hold(self, size: int) -> HeldAnswer:
        """Count a whole answer (`fits` it) from now until `release`, ending others to make room."""
        answer = HeldAnswer(size)
        self._answers.add(answer)
        self.held += size
        await self.make_room(spare=answer)
        return answer

    def release(self, answer: HeldAnswer) -> None:
        """Its write is over (idempotent: an answer ended over budget was released then)."""
        if answer in self._answers:
            self._answers.remove(answer)
            self.held -= answer.size

    async def make_room(self, spare: HeldAnswer | None = None) -> None:
        """End the holders of the most bytes, never `spare`, until `held` is within budget."""
        while self.held > self.budget:
            leg = max(self._streams(), key=_queued, default=None)
            answer = max((a for a in self._answers if a is not spare), key=_size, default=None)
            if answer is not None and (leg is None or answer.size >= leg.queued):
                self.release(answer)
                answer.ended = True
                self.cuts["answer"] += 1
                answer.end()
            elif leg is not None and leg.queued > 0:
                self.cuts["stream"] += 1
                await self._cut(leg)
            else:
                return  # `spare` alone, which fits


def _queued(leg: Leg) -> int:
    return leg.queued


def _size(answer: HeldAnswer) -> int:
    return answer.size
