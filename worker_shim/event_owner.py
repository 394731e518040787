"""`EventOwner`: whether the KV events the shim reads are its own engine's.

Two shims given each other's `--kv-events` / `--kv-replay` (a copy-paste slip) each read a live
stream of Stored events, so NO_STORED (event_health) never fires; each publishes the other engine's
cache as its own worker's, and routers send every prefix to the worker that does not hold it. The
credit check cannot see it either: one engine's unpredicted hits offset the other's predicted
misses. The shim can tell from the prompts it served:

- A prompt is *watched* when it was served with its last full block neither held by the shim's
  index at dispatch nor found cached by the engine (its usage's cached tokens, where it says). Its
  engine then stores that block, so the shim's index holds it by the time it is served or within
  `2 * timeout_s` after (checked after every batch of events, and at that deadline): *matched*.
- The last `window` watches judged are kept. When at most `most_matched` of them matched, and Stored
  events kept coming meanwhile (else the engine publishes nothing: NO_STORED's case), the events
  are another engine's: OTHER_ENGINE is raised, its ERROR naming the fix, and the worker is
  excluded like any worker whose events are down (its index entries are another engine's cache:
  worse than none, they draw that engine's prefixes to it). A worker reaches a verdict after
  `window` watched prompts.

What does not count against a worker: requests sent to the engine past the shim (warm-up, health
checks) store blocks the shim never served, and are not looked at; a prompt the index held at
dispatch, or that the engine says it served from its cache, stores nothing and is not watched; LoRA
adapters and `cache_salt` salt both sides alike (RequestService._salt, vllm_events). A healthy
worker misses a watch only rarely (a block stored and evicted before its prompt was served, a
prompt the engine held that neither the index nor the usage knew of), far from a window's worth.
SGLang's bigram pages (EAGLE) hash other tokens than the prompt's: the shim does not watch then.

The verdict ends when a window of watches matches again (more than `most_matched`); and, as routers
send the worker no request then, after `retest_s` it is lifted with a WARNING so that the next
window judges it anew. One episode (until a window matches) logs its ERROR and that WARNING once.
Synchronous; the deadlines are loop timers, cancelled by `close()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from worker_shim.event_health import EventHealth, EventProblem

__all__ = ["MOST_MATCHED", "WATCH_WINDOW", "EventOwner"]

log = logging.getLogger(__name__)
WATCH_WINDOW = 12  # watches judged together
MOST_MATCHED = 2  # ... of which at most this many matched: another engine's events
PENDING_MAX = 64  # watches awaiting their deadline; more are not watched


class EventOwner:
    def __init__(self, health: EventHealth, *, window: int = WATCH_WINDOW, most_matched: int = MOST_MATCHED) -> None:
        self.health = health
        self.window = window
        self.most_matched = most_matched
        self.watched = 0
        self.matched = 0
        self.reported = 0
        # (matched, health.live_stored when it was watched) of the last `window` watches judged
        self._judged: deque[tuple[bool, int]] = deque(maxlen=window)
        self._pending: dict[int, tuple[str, int, asyncio.TimerHandle]] = {}  # last block -> request, stores, deadline
        self._episode = False
        self._retest: asyncio.TimerHandle | None = None

    def served(self, block_hash: int, request_id: str) -> None:
        """A prompt was served whose last full block (canonical `block_hash`) the index did not hold
        at dispatch, nor the engine say it found cached."""
        if block_hash in self._pending:
            return  # the same prompt twice: one Stored answers both
        self.watched += 1
        stores = self.health.live_stored
        if self.health.holds(block_hash):
            self._judge(True, stores)
            return
        if len(self._pending) >= PENDING_MAX:
            return
        timer = asyncio.get_running_loop().call_later(2 * self.health.timeout_s, self._deadline, block_hash)
        self._pending[block_hash] = (request_id, stores, timer)

    def batch(self) -> None:
        """The shim applied a batch of engine events: a watched block may be held now."""
        if not self._pending:
            return
        for block_hash in [h for h in self._pending if self.health.holds(h)]:
            _, stores, timer = self._pending.pop(block_hash)
            timer.cancel()
            self._judge(True, stores)

    def _deadline(self, block_hash: int) -> None:
        _, stores, _ = self._pending.pop(block_hash)
        self._judge(self.health.holds(block_hash), stores)

    def _judge(self, matched: bool, stores: int) -> None:
        self.matched += matched
        judged = self._judged
        judged.append((matched, stores))
        if len(judged) < self.window:
            return
        hits = sum(m for m, _ in judged)
        if hits > self.most_matched:
            if self._episode or EventProblem.OTHER_ENGINE in self.health.problems:
                self._episode = False
                self._cancel_retest()
                self.health.resolved(EventProblem.OTHER_ENGINE)
            return
        others = self.health.live_stored - judged[0][1]
        if others <= 0:
            return  # no Stored at all meanwhile: the engine publishes nothing (NO_STORED's case)
        again, self._episode = self._episode, True
        judged.clear()
        if not again:
            self.reported += 1
        self.health.problem(
            EventProblem.OTHER_ENGINE,
            f"{self.window - hits} of the last {self.window} prompts this shim served with uncached blocks had no "
            f"Stored event of their blocks within {2 * self.health.timeout_s:g}s, while {others} batches of Stored "
            "events came for blocks it did not serve: the KV events it reads are most likely another engine's. "
            "--kv-events / --kv-replay may be another engine's: check each shim's endpoints (each shim must read "
            "the events of the engine at its own --engine-url)",
            logging.INFO if again else logging.ERROR,
        )
        if self._retest is None:
            self._retest = asyncio.get_running_loop().call_later(self.health.retest_s, self._lift, again)

    def _lift(self, again: bool) -> None:
        """Routers send the worker no request while it is out, so no watch would come: route it
        again, and let the next window judge it anew."""
        self._retest = None
        if self.health.problems.pop(EventProblem.OTHER_ENGINE, None) is None:
            return
        log.log(
            logging.INFO if again else logging.WARNING,
            "KV events: other_engine lifted after %gs: the worker is routed again so that its next %d watched "
            "prompts judge it anew",
            self.health.retest_s,
            self.window,
        )
        self.health.on_change()

    def _cancel_retest(self) -> None:
        if self._retest is not None:
            self._retest.cancel()
            self._retest = None

    def close(self, *, keep_retest: bool = False) -> None:
        """Cancel the pending deadlines (the session ended: its normaliser goes), and the retest
        unless `keep_retest` (the shim goes on)."""
        if not keep_retest:
            self._cancel_retest()
        for _, _, timer in self._pending.values():
            timer.cancel()
        self._pending.clear()
