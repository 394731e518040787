"""The bytes a replica holds for its clients, under one budget for all of them (--client-buffer-mib):
each streamed leg's chunks its client has not taken yet (router.leg, `Leg.queued`), and what is left
to write of each whole answer (router.http_api writes it in SLICE_BYTES slices and lets each piece
go once written, `HeldAnswer.queued` counted down as each slice drains). One stream is bounded on
its own too (router.dispatch.MAX_QUEUED_BYTES), but until 2026-12-07 nothing bounded them all but
the fleet's engine slots: 100 streaming clients that stopped reading held 8.2 MB each, 30 whole
answers 818 MB until their deadline, and an OOM kill would end every stream on the replica
(slow-consumer audit).

Over budget, the holder furthest behind is ended until the total is within it: a stream is cut as
a slow reader (its 408 error event, counted as the per-stream limit's), a whole answer's connection
is aborted by its writer. Behind is first how long its client has taken nothing (from `taken_at`: a
stream's reader last came for its next chunk or was waiting for one, an answer's last slice
drained): those that took nothing for STALLED_S go first, the one holding the most first. Only if
none did, a whole answer none of whose slices has drained yet (just admitted: its client has shown
nothing), then the stream holding the most, furthest behind its worker though its client reads; a
whole answer whose client takes it is never ended. So a client that keeps up goes last however large its
answer, and one that reads nothing goes first however little it holds (until 2026-12-07 the most
bytes went first: any whole answer over a stream's 8 MiB was cut first, its client reading it or
not; bufrev audit).

A whole answer about to be written (its head not out) is admitted only with SPARE_BYTES of the budget
left free, made only by ending holders that took nothing for STALLED_S: while the others take their
bytes it is refused (`admit` False, a 503 with Retry-After) rather than end one that reads. It counts
in `held` only once admitted. One that does not fit the budget less SPARE_BYTES is never admitted
(`fits`: the client's to change, a 400). Until 2026-12-07 one was admitted that filled the budget to
its last byte, so the next chunk of a stream whose client read took it over and, nobody stalled
(the newcomer just admitted), that stream was cut; and while room was made for it its own bytes
counted, ending stalled holders for bytes not yet held (newcomer_brim audit).

`held` is kept by an integer add or subtract per chunk (per slice for an answer); the holders are
scanned only when over.

The kernel's send buffer of each client connection holds at most UNSENT_BYTES not yet sent
(`bound_unsent`): otherwise it took ~3 MB of an answer its client read nothing of, uncounted, and
let the writer go on only once a third of it was free, so a client reading 512 KiB/s took nothing
for seconds at a time by `taken_at` and was ended as stalled (found by this change's tests).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.leg import Leg

__all__ = [
    "CLIENT_BUFFER_MIB",
    "CLIENT_BUFFER_MIB_RANGE",
    "ROOM_RETRY_S",
    "SLICE_BYTES",
    "SPARE_BYTES",
    "STALLED_S",
    "UNSENT_BYTES",
    "ClientBuffers",
    "HeldAnswer",
    "bound_unsent",
]

CLIENT_BUFFER_MIB = 512
# The least is one stream's own limit (MAX_QUEUED_BYTES); the most only catches a typo's extra digits.
CLIENT_BUFFER_MIB_RANGE = (8, 1 << 20)
# A whole answer's writes: over aiohttp's 64 KiB each one waits for the transport to drain, so a
# slice counts off as its client takes it (what the transport still holds stays under 64 KiB).
SLICE_BYTES = 128 << 10
# A holder whose client took nothing for this long is behind: a reader slower than a slice in this
# time (64 KiB/s) is counted with those that stopped.
STALLED_S = 2.0
# Left free when an answer is admitted: the next chunk or slice takes the total over no sooner.
SPARE_BYTES = SLICE_BYTES
ROOM_RETRY_S = 1  # Retry-After of an answer refused while the others took theirs: a slice's time
# TCP_NOTSENT_LOWAT: what is in flight to the client is not bounded by it, so neither is throughput
UNSENT_BYTES = 128 << 10


def bound_unsent(transport: asyncio.BaseTransport) -> None:
    """A client connection's kernel holds at most UNSENT_BYTES not yet sent (where the system has
    TCP_NOTSENT_LOWAT: Linux, macOS)."""
    sock = transport.get_extra_info("socket")
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is not None and option is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_BYTES)


class _Holder(Protocol):
    queued: int  # bytes held for its client
    taken_at: float  # time.monotonic() its client last took bytes


@dataclass(eq=False, slots=True)
class HeldAnswer:
    """A whole answer being written to its client: `end` makes its write's timer (`watch`) go off
    now, and its writer aborts the connection (router.http_api)."""

    queued: int  # bytes not written yet
    taken_at: float = field(default_factory=time.monotonic)  # admitted, or its last slice drained
    admitted: bool = False  # its head may go out, its bytes counted: from then on it can be ended for others
    drained: bool = False  # a slice of it went to its client: its client takes it
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
    (router.dispatch), its queue subtracted before its first await (Leg.drop)."""

    def __init__(
        self, budget: int, streams: Callable[[], Iterable[Leg]], cut: Callable[[Leg], Awaitable[None]]
    ) -> None:
        self.budget = budget
        self.held = 0
        # ended over budget: "stream", "answer"; answers refused before their head: "refused"
        self.cuts: Counter[str] = Counter()
        self._answers: set[HeldAnswer] = set()
        self._streams = streams
        self._cut = cut

    def fits(self, size: int) -> bool:
        """A whole answer of `size` bytes can be admitted at all; one that cannot is counted refused."""
        if size + SPARE_BYTES <= self.budget:
            return True
        self.cuts["refused"] += 1
        return False

    def hold(self, size: int) -> HeldAnswer:
        """Hold a whole answer (`fits` it) from now until `release`: at once, with no await, so
        that its writer's `finally` releases it however it ends (a client that left while `admit`
        ended others for it had its bytes counted for good: bufrev audit). Counted once admitted."""
        answer = HeldAnswer(size)
        self._answers.add(answer)
        return answer

    async def admit(self, answer: HeldAnswer) -> bool:
        """Whether `answer`, held, may be written, counted from now: stalled holders are ended to
        leave SPARE_BYTES free with it, never one whose client took bytes within STALLED_S; False
        while there is not that room (refused)."""
        if not await self.make_room(answer.queued + SPARE_BYTES, stalled_only=True):
            self.cuts["refused"] += 1
            return False
        answer.admitted = True  # no await since make_room's check: the room is still there
        answer.taken_at = time.monotonic()
        self.held += answer.queued
        return True

    def taken(self, answer: HeldAnswer, size: int) -> None:
        """`size` bytes of `answer` went to its client (a slice drained)."""
        if answer in self._answers:  # not ended meanwhile
            answer.queued -= size
            self.held -= size
            answer.taken_at = time.monotonic()
            answer.drained = True

    def release(self, answer: HeldAnswer) -> None:
        """Its write is over (idempotent: an answer ended over budget was released then)."""
        if answer in self._answers:
            self._answers.remove(answer)
            if answer.admitted:
                self.held -= answer.queued

    async def make_room(self, room: int = 0, *, stalled_only: bool = False) -> bool:
        """End the holders furthest behind until `room` bytes more fit in the budget, only those
        stalled if `stalled_only`: whether they fit then."""
        while self.held + room > self.budget:
            holder = self._furthest_behind(stalled_only)
            if holder is None:
                return False
            if isinstance(holder, HeldAnswer):
                self.release(holder)
                self.cuts["answer"] += 1
                holder.end()
            else:
                self.cuts["stream"] += 1
                await self._cut(holder)
        return True

    def _furthest_behind(self, stalled_only: bool) -> Leg | HeldAnswer | None:
        now = time.monotonic()
        streams = [leg for leg in self._streams() if leg.queued > 0]
        answers = [a for a in self._answers if a.admitted]  # one not admitted yet is its own to refuse
        holders: list[Leg | HeldAnswer] = [*streams, *answers]
        stalled = [h for h in holders if now - h.taken_at >= STALLED_S]
        if stalled or stalled_only:
            return max(stalled, key=_queued, default=None)
        # An answer just admitted, whose client has taken none of it, before a stream whose client reads
        unread = [a for a in answers if not a.drained]
        return max(unread or streams, key=_queued, default=None)


def _queued(holder: _Holder) -> int:
    return holder.queued
