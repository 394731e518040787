"""`EventHealth`: whether the engine's KV events reach the shim, and if not, why.

A shim that silently sees no events would advertise an empty cache forever; routers would route
around its real prefixes without anyone knowing. So each way events can go missing is detected,
logged at ERROR once per occurrence with the fix, and turns `ok` false (registered as
WorkerInfo.events_ok and sent in every LoadReport) until events flow:

- NO_CONNECTION (the event transport says so): the event socket has no peer for `timeout_s`
  (at WARNING where it had one: the engine is restarting, most likely).
- WRONG_TOPIC (the event transport says so): the engine's replay socket shows frames under another
  topic than the configured one; the live socket, filtering by topic, shows nothing at all.
- NO_STORED (the shim says so): a served request whose prompt had at least one full uncached
  block was followed by no live Stored event within `timeout_s`, and the shim does not hold its
  last block either. `silent` is then set so the transport reads the replay socket (a batch late
  on a loaded host is delivered from there; a wrong topic is named), and only if a second
  `timeout_s` still brings no Stored is the problem reported. One request is watched at a time:
  any later one's Stored would satisfy it too, so a busy worker costs one timer, and the next
  request served after a check is watched again.

A prompt the engine served from its cache stores nothing, and the shim's index can miss it (the
shim restarted beside a warm engine). Where the engine's usage says how many prompt tokens it found
cached (vLLM: --enable-prompt-tokens-details), that is final. Where it does not, the engine's
prefix reuse counter (`hits`, read with the load polls) is: each reading bounds the counter less the
reuse of the shim's legs the engine counted, each leg at most its prompt's reusable tokens (a pulled
prompt all of it) times the client's `n`, as vLLM runs each sample as a request of its own (a batch of
prompts or beam search: no bound, so no proof over a window such a leg overlaps), from above (less
the legs settled, their first output seen or ended, by its ask)
and from below (less every leg started by its answer). A leg that missed reuse lowers that remainder,
so a bound from below, from the first reading after the request was served on, reaching one from
above, from the last reading before it started back, says it was served from the cache; each side
stops at a reading with no leg open, which is exact. Overlapping legs cost nothing so long as some
reading before the request finds every leg the engine has scheduled settled, and one after finds
every leg started scheduled. What remains: hits on requests sent to the engine past the shim count
as its legs' (hence the stops); an engine that has a leg in between at every reading (saturated)
gives no such pair, and a cached prompt served then, its usage silent, is taken for lost events
(until a Stored, a connection or the retest), as is one whose leg started before the readings kept
(HITS_KEPT, about a minute); and a busy engine that publishes nothing is judged
only when the leg watched is one it had to compute, its cached legs being excused one at a time.

- OTHER_ENGINE (worker_shim.endpoint_probe says so): the stream is another engine's. A request
  the shim sent its own engine with a random prompt was served, its block never showed on the
  stream, and the stream delivered a Stored in a batch its engine made after that request was
  answered; cleared only when a probe's block shows on the stream. Not raised here: by the probe.

Live events (not replayed ones) clear NO_STORED and WRONG_TOPIC; a connection clears NO_CONNECTION.
NO_STORED, which withholds the very traffic whose events would clear it, also ends on a connection
(a restarted engine, maybe fixed) or a Stored from the replay socket; and after `retest_s` without
either it is lifted with a WARNING, so the next request watched judges the worker again. One
episode (until events are seen to flow) logs its ERROR and that WARNING once: an engine that really
publishes nothing costs about one judgement's traffic per `retest_s`.
`on_change` is called whenever `ok` or `why` changes; `on_connected` on every connection of the
event socket to an engine (`connected()`, from the transport). Synchronous; expectations are loop
timers, cancelled by `close()` and by a new peer or a reset of the stream (`void_judgements`): they
judge what the shim held before, which a new engine run or a reset voids.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = ["EventHealth", "EventProblem"]

log = logging.getLogger(__name__)
RETEST_TIMEOUTS = 12  # `retest_s` in events timeouts: 60 s by default
HITS_KEPT = 256  # readings of the engine's reuse counter kept: a minute at the load polls' 0.25 s


class _Hits(NamedTuple):
    asked: float
    reused: int
    started: int
    settled: int


def _until_exact(readings: Iterable[_Hits]) -> list[_Hits]:
    """`readings` up to the first with no leg open (none unsettled at its ask nor started by its answer)."""
    out = []
    for h in readings:
        out.append(h)
        if h.started == h.settled:
            break
    return out


class EventProblem(enum.Enum):
    NO_CONNECTION = "no_connection"
    WRONG_TOPIC = "wrong_topic"
    WRONG_RANK = "wrong_rank"
    NO_STORED = "no_stored"
    OTHER_ENGINE = "other_engine"
    # The shim's SUB cannot bind the events endpoint yet and waits for a later session to: the cause
    # (zmq_bind's) until a session's events go live.
    BIND_PENDING = "bind_pending"


class EventHealth:
    def __init__(self, timeout_s: float = 5.0, *, retest_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.retest_s = RETEST_TIMEOUTS * timeout_s if retest_s is None else retest_s
        self.problems: dict[EventProblem, str] = {}
        self.live_stored = 0
        self.reported = 0
        self.retests = 0  # NO_STORED lifted for want of evidence either way
        self.silent = asyncio.Event()
        self.on_change: Callable[[], None] = lambda: None
        self.on_connected: Callable[[], None] = lambda: None
        self.holds: Callable[[int], bool] = lambda _h: False
        self._timers: set[asyncio.TimerHandle] = set()
        self._episode = False  # NO_STORED was raised and nothing has shown events flow since
        self._lifts = 0  # ... and lifted for a retest this many times
        self._retest: asyncio.TimerHandle | None = None
        self._hits: deque[_Hits] = deque(maxlen=HITS_KEPT)  # this run of the counter's readings

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def why(self) -> str:
        return "; ".join(self.problems.values())

    def problem(self, kind: EventProblem, message: str, level: int = logging.ERROR) -> None:
        if self.problems.get(kind) == message:
            return
        self.problems[kind] = message
        if kind is EventProblem.NO_STORED:
            self.silent.set()
            self._retest_later()
            again, self._episode = self._episode, True
            if again:  # judged again after a retest, still nothing: its ERROR went out already
                log.info("KV events: still %s", message)
                self.on_change()
                return
        self.reported += 1
        log.log(level, "KV events: %s", message)
        self.on_change()

    def resolved(self, *kinds: EventProblem) -> None:
        gone = [k for k in kinds if self.problems.pop(k, None) is not None]
        if EventProblem.NO_STORED in kinds and self._episode:
            self._episode, self._lifts = False, 0
            self._cancel_retest()
            if EventProblem.NO_STORED not in gone:
                log.info("KV events flow again (no_stored, lifted for a retest, resolved)")
        if EventProblem.NO_STORED in gone:
            self.silent.clear()
        if gone:
            log.info("KV events flow again (%s resolved)", ", ".join(k.value for k in gone))
            self.on_change()

    def connected(self) -> None:
        """The event socket has a new peer (a ZMTP handshake, not a bare TCP connection): maybe a
        restarted engine, its cause fixed, so its events are judged anew, and the judgements
        pending are void (`void_judgements`)."""
        self.void_judgements()
        self.resolved(EventProblem.NO_CONNECTION, EventProblem.NO_STORED)
        self.on_connected()

    def void_judgements(self) -> None:
        """The stream has a new peer or was reset (a gap not replayed, a rebuild): the judgements
        pending read what the shim held before, which is void (a Stored that came before its request
        was watched is proven only by the shim holding its block), so they judge nothing; the next
        request served is watched anew. Until 2026-12-07 they ran on, and a healthy engine restarted
        right after serving a request was taken for one that publishes nothing (no_stored, out of
        routing for `retest_s`)."""
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
        if EventProblem.NO_STORED not in self.problems:
            self.silent.clear()

    def live(self, stored: bool) -> None:
        """A live (not replayed) batch of engine events arrived; `stored` if it held a Stored."""
        if stored:
            self.live_stored += 1
        self.resolved(EventProblem.NO_STORED, EventProblem.WRONG_TOPIC, EventProblem.WRONG_RANK)

    def replayed(self, stored: bool) -> None:
        """A batch came from the replay socket; one with a Stored shows the engine publishes."""
        if stored:
            self.resolved(EventProblem.NO_STORED)

    def hits(self, asked: float, reused: int | None, *, started: int, settled: int) -> None:
        """The engine's cumulative prefix reuse counter (tokens), from a load poll asked at `asked`
        (time.monotonic()); None: it has none, or the poll failed. `started`: the most reuse the
        legs the shim had started when the answer came may earn, summed; `settled`: that of the legs
        the engine had surely counted by `asked` (RequestService.reuse_started, reuse_settled_by)."""
        kept = self._hits
        if reused is None or (kept and reused < kept[-1].reused):
            kept.clear()  # no counter, or it started over (the engine restarted)
        if reused is not None:
            kept.append(_Hits(asked, reused, started, settled))

    def expect_stored(
        self,
        block_hash: int,
        request_id: str,
        blocks: int,
        *,
        before: int | None = None,
        served: float = 0.0,
        hit: int = 0,
    ) -> None:
        """A request was served whose prompt had `blocks` full uncached blocks, the last `block_hash`.
        Where the engine did not say how much of it was cached, `before` is the `started` sum of the
        legs started before it (`hits`), `served` when it was served (time.monotonic()), and `hit`
        the tokens of reuse the engine counts when it finds the whole prompt cached (its share)."""
        if self._timers:
            return
        seen = self.live_stored

        def from_cache() -> bool:
            # A reading bounds the counter less the reuse of the legs the engine has counted: from
            # above, its count less what the legs settled by its ask may have earned; from below, less
            # what all started by its answer may earn. A leg that missed some of its reuse lowers that
            # remainder from then on, so a bound from below after this leg reaching one from above
            # before it says this leg hit in full. A reading with no leg open is exact: none further
            # off is looked at, which keeps hits on requests sent past the shim out.
            if before is None or hit <= 0:
                return False
            bases = _until_exact(h for h in reversed(self._hits) if h.started <= before)
            ends = _until_exact(h for h in self._hits if h.asked >= served)
            if not bases or not ends:
                return False
            return max(h.reused - h.started for h in ends) >= min(h.reused - h.settled for h in bases)

        def stored() -> bool:
            return self.live_stored > seen or self.holds(block_hash) or from_cache()

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

    def _retest_later(self) -> None:
        if self._retest is not None:
            return  # a later judgement of the same episode must not push the retest back
        self._retest = asyncio.get_running_loop().call_later(self.retest_s, self._lift)

    def _cancel_retest(self) -> None:
        if self._retest is not None:
            self._retest.cancel()
            self._retest = None

    def _lift(self) -> None:
        """No evidence either way for `retest_s`: routers send the worker no requests, so none would
        come. Let them again; the next request watched judges it anew."""
        self._retest = None
        if self.problems.pop(EventProblem.NO_STORED, None) is None:
            return
        self.silent.clear()
        self.retests += 1
        self._lifts += 1
        log.log(
            logging.WARNING if self._lifts == 1 else logging.INFO,
            "KV events: no Stored event, live or replayed, and no new engine connection for %gs since no_stored: "
            "the worker is routed again so that the next request served with uncached prompt blocks judges it "
            "anew (an engine that really publishes nothing costs one such judgement every %gs)",
            self.retest_s,
            self.retest_s,
        )
        self.on_change()

    def close(self, *, keep_retest: bool = False) -> None:
        """Cancel the pending judgements; and the retest unless `keep_retest` (a session ended, the
        shim goes on: with no connection event to clear NO_STORED, as TensorRT-LLM's polled events
        have none, only the retest lets routers send the worker traffic again)."""
        if not keep_retest:
            self._cancel_retest()
        self.void_judgements()
