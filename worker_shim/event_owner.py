"""`EventOwner`: whether the KV events the shim reads are its own engine's, on positive evidence.

Two shims given each other's `--kv-events` / `--kv-replay` (a copy-paste slip) each read a live
stream of Stored events, so NO_STORED (event_health) never fires, and each publishes the other
engine's cache as its own worker's: routers send every prefix to the worker that does not hold it.

Missing blocks alone prove nothing: a shim whose index misses blocks its engine holds (restarted
without a replay endpoint, a wrapped replay buffer, an unrepairable gap) serves prompts from the
engine's cache that store nothing, and a model with no full-attention group publishes no chain at
all. So the verdict asks for blocks that are someone else's as well:

- *Own* blocks: the canonical hashes of every full block of the prompts this shim dispatched (its
  legs that compute their own prefill), kept for OWN_KEPT_S and at most OWN_KEPT of them.
- Every live full-attention Stored the normaliser folds (not a replay, not an offload tier's copy)
  counts its blocks as own (in that set) or *foreign*.
- A prompt served with its last full block uncached, by the engine's usage (where it says) and by
  the shim's index at dispatch, is *watched*: its engine stores that block, so a live Stored of it
  comes by the time it is served or within `2 * timeout_s` after: *matched*.

OTHER_ENGINE is found when, over the last WINDOW watched prompts, at most MOST_MATCHED matched AND
at least FOREIGN_MIN foreign blocks were stored meanwhile, FOREIGN_SHARE times the own ones or more.
Neither alone is enough: a restart beside a warm engine stores nothing (no foreign blocks); a
window-only or Mamba model publishes no full-attention chain (nothing counted); requests sent to the
engine past the shim store foreign blocks, but the shim's own prompts are stored too (matched).

The response is soft (a fault in one worker never stops the fleet): an ERROR once per episode naming
the fix, and `foreign` set, on which the shim publishes a Cleared and nothing more of these events
(routers route the worker by load with no prefix credit, as one without prefix caching), reports
`events_foreign` in its load reports (a warning in routers' /ready) and /health, and keeps
`events_ok`: the worker stays routable. Judging goes on; once RECOVER_MATCHED of a window of watched
prompts after the verdict are matched, its own prompts' blocks are seen again: the verdict is lifted
(WARNING) and the shim republishes its whole set. A restarted shim starts with no verdict.

Synchronous; one loop timer for the watches' deadlines, cancelled by `close()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

__all__ = ["FIX", "FOREIGN_MIN", "MOST_MATCHED", "RECOVER_MATCHED", "WINDOW", "EventOwner"]

log = logging.getLogger(__name__)
WINDOW = 12  # watched prompts judged together
MOST_MATCHED = 2  # ... of which at most this many matched, and
FOREIGN_MIN = 24  # ... at least this many foreign full-attention blocks were stored meanwhile,
FOREIGN_SHARE = 4  # ... this many times the own ones or more: another engine's events
RECOVER_MATCHED = 6  # matched of a window after the verdict: its own prompts' blocks are seen again
OWN_KEPT = 1 << 17  # canonical hashes of dispatched prompts kept (~2 M tokens at 16 a block)
OWN_KEPT_S = 600.0  # ... each for this long after its last dispatch
PENDING_MAX = 256  # watches awaiting their deadline; more are not watched
FIX = "--kv-events / --kv-replay may be another engine's: check each shim's endpoints"


class _Own:
    __slots__ = ("held", "seen", "until")

    def __init__(self, until: float) -> None:
        self.until = until
        self.seen = False  # a live Stored held it
        self.held = False  # the last block of a prompt the index held whole at its last dispatch


class _Judged:
    __slots__ = ("foreign", "matched", "own")

    def __init__(self, matched: bool, own: int, foreign: int) -> None:
        self.matched = matched
        self.own = own  # EventOwner.own_blocks when it was watched
        self.foreign = foreign  # ... and foreign_blocks


class EventOwner:
    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.on_change: Callable[[], None] = lambda: None  # `foreign` changed
        self.foreign = False
        self.why = ""
        self.own_blocks = 0  # live full-attention blocks stored that this shim's prompts hold
        self.foreign_blocks = 0  # ... that none does
        self.watched = 0
        self.matched = 0
        self.verdicts = 0
        self._clock = clock
        self._own: OrderedDict[int, _Own] = OrderedDict()
        self._pending: deque[tuple[float, int, int, int]] = deque()  # deadline, last block, own, foreign
        self._judged: deque[_Judged] = deque(maxlen=WINDOW)
        self._timer: asyncio.TimerHandle | None = None

    def dispatched(self, hashes: Sequence[int], held_blocks: int) -> None:
        """The shim dispatched a prompt of these full blocks' canonical hashes, of which the index
        held the leading `held_blocks`."""
        if not hashes:
            return
        now = self._clock()
        own, until = self._own, now + OWN_KEPT_S
        for h in hashes:
            entry = own.get(h)
            if entry is None:
                own[h] = _Own(until)
            else:
                entry.until = until
                own.move_to_end(h)
        own[hashes[-1]].held = held_blocks >= len(hashes)
        while own and (len(own) > OWN_KEPT or next(iter(own.values())).until <= now):
            own.popitem(last=False)

    def stored(self, canonical: Sequence[int]) -> None:
        """A live Stored of the full-attention chain folded these blocks."""
        own = self._own
        for h in canonical:
            entry = own.get(h)
            if entry is None:
                self.foreign_blocks += 1
            else:
                self.own_blocks += 1
                entry.seen = True

    def batch(self) -> None:
        """A batch of engine events was folded: a watched block may have been stored."""
        pending = self._pending
        if pending and any(self._seen(last) for _, last, _, _ in pending):
            keep = deque(p for p in pending if not self._seen(p[1]))
            for _, _, own, foreign in (p for p in pending if self._seen(p[1])):
                self._judge(True, own, foreign)
            self._pending = keep

    def served(self, last: int) -> None:
        """A prompt was served with its last full block (`last`) uncached, as the engine's usage says."""
        entry = self._own.get(last)
        if entry is None or entry.held:
            return  # not dispatched by this shim lately, or the index held it whole: no Stored is due
        self.watched += 1
        if entry.seen:
            self._judge(True, self.own_blocks, self.foreign_blocks)
            return
        if len(self._pending) >= PENDING_MAX:
            return
        self._pending.append((self._clock() + 2 * self.timeout_s, last, self.own_blocks, self.foreign_blocks))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(2 * self.timeout_s, self._deadlines)

    def _seen(self, last: int) -> bool:
        entry = self._own.get(last)
        return entry is not None and entry.seen

    def _deadlines(self) -> None:
        self._timer = None
        now, pending = self._clock(), self._pending
        while pending and pending[0][0] <= now:
            _, last, own, foreign = pending.popleft()
            self._judge(self._seen(last), own, foreign)
        if pending:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, pending[0][0] - now), self._deadlines)

    def _judge(self, matched: bool, own: int, foreign: int) -> None:
        self.matched += matched
        judged = self._judged
        judged.append(_Judged(matched, own, foreign))
        if len(judged) < WINDOW:
            return
        hits = sum(j.matched for j in judged)
        if self.foreign:
            if hits >= RECOVER_MATCHED:
                judged.clear()
                self._lift(hits)
            return
        theirs, ours = self.foreign_blocks - judged[0].foreign, self.own_blocks - judged[0].own
        if hits > MOST_MATCHED or theirs < FOREIGN_MIN or theirs < FOREIGN_SHARE * ours:
            return
        judged.clear()
        self.foreign = True
        self.verdicts += 1
        self.why = (
            f"{WINDOW - hits} of the last {WINDOW} prompts this shim served with uncached blocks had no Stored "
            f"event of their blocks within {2 * self.timeout_s:g}s, while {theirs} blocks of prompts it did not "
            f"serve were stored ({ours} of its own): the KV events it reads are most likely another engine's. "
            f"{FIX} (each shim must read the events of the engine at its own --engine-url). Until its own "
            "prompts' blocks are seen again its events are not published: routers give the worker no prefix "
            "credit and route it by load"
        )
        log.error("KV events: %s", self.why)
        self.on_change()

    def _lift(self, hits: int) -> None:
        self.foreign, self.why = False, ""
        log.warning(
            "KV events: %d of the last %d prompts this shim served were stored in the KV events it reads: they are "
            "its engine's again (other_engine lifted); its cached prefixes are published again",
            hits,
            WINDOW,
        )
        self.on_change()

    def close(self) -> None:
        """Cancel the deadlines (the shim stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending.clear()
