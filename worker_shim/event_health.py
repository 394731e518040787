"""`EventHealth`: whether the engine's KV events reach the shim, and if not, why.

A shim that silently sees no events would advertise an empty cache forever; routers would route
around its real prefixes without anyone knowing. So each way events can go missing is detected,
logged at ERROR once per occurrence with the fix, and turns `ok` false (registered as
WorkerInfo.events_ok and sent in every LoadReport) until events flow:

- NO_CONNECTION (the event transport says so): the event socket has no peer for `timeout_s`.
- WRONG_TOPIC (the event transport says so): the engine's replay socket shows frames under another
  topic than the configured one; the live socket, filtering by topic, shows nothing at all.
- NO_STORED (the shim says so): a served request whose prompt had at least one full uncached
  block was followed by no live Stored event within `timeout_s`, and the shim does not hold its
  last block either. `silent` is then set so the transport reads the replay socket (a batch late
  on a loaded host is delivered from there; a wrong topic is named), and only if a second
  `timeout_s` still brings no Stored is the problem reported. One request is watched at a time:
  any later one's Stored would satisfy it too, so a busy worker costs one timer, and the next
  request served after a check is watched again.

Live events (not replayed ones) clear NO_STORED and WRONG_TOPIC; a connection clears NO_CONNECTION.
`on_change` is called whenever `ok` or `why` changes. Synchronous; expectations are loop timers,
cancelled by `close()`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

__all__ = ["EventHealth", "EventProblem"]

log = logging.getLogger(__name__)


class EventProblem(enum.Enum):
    NO_CONNECTION = "no_connection"
    WRONG_TOPIC = "wrong_topic"
    WRONG_RANK = "wrong_rank"
    NO_STORED = "no_stored"


class EventHealth:
    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.problems: dict[EventProblem, str] = {}
        self.live_batches = 0
        self.live_stored = 0
        self.reported = 0
        self.silent = asyncio.Event()
        self.on_change: Callable[[], None] = lambda: None
        self.holds: Callable[[int], bool] = lambda _h: False
        self._timers: set[asyncio.TimerHandle] = set()

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def why(self) -> str:
        return "; ".join(self.problems.values())

    def problem(self, kind: EventProblem, message: str) -> None:
        if self.problems.get(kind) == message:
            return
        self.problems[kind] = message
        self.reported += 1
        log.error("KV events: %s", message)
        if kind is EventProblem.NO_STORED:
            self.silent.set()
        self.on_change()

    def resolved(self, *kinds: EventProblem) -> None:
        gone = [k for k in kinds if self.problems.pop(k, None) is not None]
        if EventProblem.NO_STORED in gone:
            self.silent.clear()
        if gone:
            log.info("KV events flow again (%s resolved)", ", ".join(k.value for k in gone))
            self.on_change()

    def live(self, stored: bool) -> None:
        """A live (not replayed) batch of engine events arrived; `stored` if it held a Stored."""
        self.live_batches += 1
        if stored:
            self.live_stored += 1
        self.resolved(EventProblem.NO_STORED, EventProblem.WRONG_TOPIC, EventProblem.WRONG_RANK)

    def expect_stored(self, block_hash: int, request_id: str, blocks: int) -> None:
        """A request was served whose prompt had `blocks` full uncached blocks, the last `block_hash`."""
        if self._timers:
            return
        seen = self.live_stored

        def stored() -> bool:
            return self.live_stored > seen or self.holds(block_hash)

        def look() -> None:
            # Late is not lost: a loaded host can hold a live batch past the timeout. Ask the
            # transport to read the replay socket, and judge only after a second window.
            if stored():
                return
            self.silent.set()
            self._later(judge)

        def judge() -> None:
            if stored():
                if EventProblem.NO_STORED not in self.problems:
                    self.silent.clear()
                return
            self.problem(
                EventProblem.NO_STORED,
                f"no Stored event within {2 * self.timeout_s:g}s of serving request {request_id} ({blocks} full "
                "uncached prompt blocks), nor from its replay socket where it has one: the engine publishes no KV "
                "events where the shim listens. Check that the engine runs with KV events on (vLLM: "
                "--kv-events-config with enable_kv_cache_events true) and that the shim has the same endpoint "
                "and topic",
            )

        self._later(look)

    def _later(self, then: Callable[[], None]) -> None:
        handle: asyncio.TimerHandle | None = None

        def fire() -> None:
            assert handle is not None
            self._timers.discard(handle)
            then()

        handle = asyncio.get_running_loop().call_later(self.timeout_s, fire)
        self._timers.add(handle)

    def close(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
