"""StallWatchdog: whether an engine with work makes progress, or is hung.

A hung engine answers /health and /metrics; only the work it does not do shows it. While the engine
has work (legs in flight, or requests it reports running or waiting), the watchdog takes where that
work stands (`Progress`: legs that ended well, tokens each leg in flight has sent, the engine's step
counter and KV use) at each look, and an engine whose work has not moved for `stall_limit_s` on
fresh load readings is hung: the shim ends its legs and keeps it deregistered until it moves again
(`stalled`, where it stood). No work to judge, or an engine that holds its load reading while it
runs iterations, start the count again; so do stale readings (older than STALE_READINGS health
intervals and STALE_MIN_S), unless a leg in flight has streamed output: its tokens tell progress
themselves, so the count goes on and an engine whose streams stop too is judged hung (until
2026-12-07 stale readings always started it again, and a hung TensorRT-LLM executor, whose /metrics
answers [] for ever, was never caught). An engine that answers nothing at all, neither /health nor
/metrics (any HTTP status is an answer), while legs are in flight is frozen or cut off: its silence for
`stall_limit_s` (time spent waiting on it since its last answer, or since the last output of a
leg; a pause in which the shim asks nothing is none, unless the engine could not be reached
for its last question) is taken for a hang too, stale readings or
not (until 2026-12-07 a SIGSTOPped engine with only non-streamed legs on it was never judged, and
they waited out the router's --request-timeout). A stall of the shim's own is no silence of the
engine's: it is not counted.

The shim's, not a session's: legs left running when a session ends on a busy or down engine stay
watched while the shim waits for it and in the next session. The shim owns the load readings and
passes them to each look.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker_shim.adapters import EngineAdapter, EngineLoad
from worker_shim.request_service import RequestService

__all__ = ["STALE_MIN_S", "STALE_READINGS", "Progress", "StallWatchdog"]

log = logging.getLogger(__name__)
# The engine's load reading older than this many health intervals (and than STALE_MIN_S, beyond a
# slow /metrics' probe timeout) is unknown: the progress watchdog takes no silence from it.
STALE_READINGS = 3
STALE_MIN_S = 3.0


@dataclass(frozen=True, slots=True)
class Progress:
    """What moves while a busy engine works: legs that ended well, the tokens each leg in flight has
    sent, and the engine's own step counter and KV use (an engine without a step counter still
    fills its KV cache as it decodes)."""

    completed: int
    sent: dict[str, int]
    iterations: int
    kv_usage: float | None

    def moved_since(self, before: Progress) -> bool:
        # A leg that leaves (cancelled) is no progress: only output, a step or a KV change is.
        return (
            self.completed > before.completed
            or self.iterations != before.iterations
            or self.kv_usage != before.kv_usage
            or any(n > before.sent.get(leg, 0) for leg, n in self.sent.items())
        )


class StallWatchdog:
    """`look` at each health check (and between sessions, over legs left running); `stalled` is
    where a hung engine stood when it was judged, until the shim sees it move (and clears it).
    `requests()` and `adapter()` are the shim's, read at each look."""

    def __init__(
        self,
        requests: Callable[[], RequestService | None],
        adapter: Callable[[], EngineAdapter],
        *,
        stall_limit_s: float,
        health_interval_s: float,
        engine_url: str,
        own_stall: Callable[[float], float],
    ) -> None:
        self._requests = requests
        self._adapter = adapter
        self._own_stall = own_stall  # seconds the shim's own loop stood still within the last N (LoopWatch)
        self.stall_limit_s = stall_limit_s
        self.health_interval_s = health_interval_s
        self.engine_url = engine_url
        self.stalled: Progress | None = None  # where a hung engine stood when its session ended
        self._mark: Progress | None = None  # the last sight of a move: where the engine's work stood ...
        self._moved_at = time.monotonic()  # ... and when
        self._output: Progress | None = None  # what the legs in flight had sent and ended at the last look ...
        self._output_at = -math.inf  # ... and when that last moved

    def look(
        self, now: float, load: EngineLoad | None, load_at: float | None, iterating_at: float | None
    ) -> str | None:
        """Why the engine is hung (it is marked stalled), where its work has not moved for the
        stall limit on fresh readings, or it has answered nothing for as long with legs in flight;
        else None. `load` is the last usable reading of the engine's load, `load_at` when it came
        back, `iterating_at` the last reading held while iterations ran (EngineLoad.iterating)."""
        mark, known_at = self.progress(load), self._known_at(now, load_at)
        iterating = iterating_at is not None and now - iterating_at <= self.stale_s()
        if (silent_s := self._silent_s(now)) >= self.stall_limit_s:
            self._mark = None  # its legs end: the count starts again
            self._stall(
                mark if mark is not None else self.idle(load),
                f"answered neither /health nor /metrics for {silent_s:.0f}s ({self._legs()} legs in flight): frozen, "
                "or cut off by the network",
            )
            return f"it answered nothing for {silent_s:.0f}s (frozen, or cut off)"
        if mark is None or self._mark is None or known_at is None or iterating or mark.moved_since(self._mark):
            self._mark, self._moved_at = mark, now
            return None
        # The shim's own stalls between then and known_at are not the engine's (a paused VM wakes
        # to no token read); those after a fresh reading fall outside what it judges
        own_s = self._own_stall(now - self._moved_at) - self._own_stall(now - known_at)
        still_s = known_at - self._moved_at - own_s
        if still_s < self.stall_limit_s:
            return None
        self._mark = None  # its legs end: the count starts again
        self._stall(
            mark,
            f"made no progress for {still_s:.0f}s ({self._legs()} legs in flight; it reports "
            f"{load.running if load is not None else '?'} running, {load.waiting if load is not None else '?'} "
            "waiting): hung",
        )
        return f"it made no progress for {still_s:.0f}s (hung)"

    def idle(self, load: EngineLoad | None) -> Progress:
        """Where an engine with no work stands: its step counter and KV usage as last read."""
        requests = self._requests()
        assert requests is not None
        return Progress(
            completed=requests.completed,
            sent={},
            iterations=load.timing.iterations if load is not None else 0,
            kv_usage=load.kv_usage if load is not None else None,
        )

    def progress(self, load: EngineLoad | None) -> Progress | None:
        """Where the engine stands while it has work (legs in flight, or requests it reports
        running or waiting); None while it has none. A decode leg whose KV the engine still pulls
        is no work of its own (a slow pull from another worker shows no step and no token), nor
        is the request the engine reports for it; nor is a prefill leg whose engine waits for its
        decode peer (SGLang's, after its handle went), nor what the engine reports in its P/D
        queues (EngineLoad.peer_waiting). Until 2026-12-07 a healthy SGLang prefill engine holding
        requests for slow decode peers was taken for hung."""
        requests, adapter = self._requests(), self._adapter()
        assert requests is not None
        # A pull is exempt for one stall limit: one that takes longer is a hang like any other. A wait
        # for a decode peer is not: a full decode pool keeps it waiting as long as it stays full,
        # which says nothing of this engine; the leg's deadline and SGLang's own bootstrap timeout end it.
        since = time.monotonic() - self.stall_limit_s
        pulling = sum(1 for rid, at in adapter.pulling.items() if at > since and rid in requests.inflight)
        exempt = pulling + sum(1 for rid in adapter.waiting_peer if rid in requests.inflight)
        reported = load.running + load.waiting - load.peer_waiting if load is not None else 0
        if len(requests.inflight) == exempt and reported <= exempt:
            return None
        return Progress(
            completed=requests.completed,
            sent={rid: leg.writer.sent_tokens for rid, leg in requests.inflight.items() if leg.writer is not None},
            iterations=load.timing.iterations if load is not None else 0,
            kv_usage=load.kv_usage if load is not None else None,
        )

    def stale_s(self) -> float:
        return max(STALE_READINGS * self.health_interval_s, STALE_MIN_S)

    def _known_at(self, now: float, load_at: float | None) -> float | None:
        """Until when the engine's progress is known: its last load reading's time. While that is
        stale (/metrics fails, hangs or repeats itself: its frozen counters are no evidence of a
        hang), now if a leg in flight has streamed output, whose tokens tell progress themselves;
        else None (a long non-streamed request from idle shows nothing until it ends; an engine
        that answers nothing at all is judged by its silence: _silent_s). Until
        2026-12-07 stale readings alone were None: a hung TensorRT-LLM executor, whose /metrics
        answers [] for ever and whose /health says its process is alive, was never caught."""
        if load_at is not None and now - load_at <= self.stale_s():
            return load_at
        requests = self._requests()
        legs = requests.inflight.values() if requests is not None else ()
        return now if any(leg.writer is not None and leg.writer.sent_tokens for leg in legs) else None

    def _silent_s(self, now: float) -> float:
        """How long the engine has answered nothing (neither /health nor /metrics) while legs are in
        flight, less the shim's own stalls: the time it left a question in flight unanswered since
        its last answer (EngineSilence: a pause in which the shim asks nothing is not its silence,
        unless the engine was unreachable for its last question; the shim's stalls within those
        spans are taken off there), or since a leg's last output; 0 with no leg in flight (nothing
        to end: the health checks judge it) or no answer ever. A /metrics answer held
        (TensorRT-LLM's, iterations running) is no answer: a frozen engine holds it too."""
        requests = self._requests()
        legs = requests.inflight if requests is not None else {}
        output = Progress(
            completed=requests.completed if requests is not None else 0,
            sent={rid: leg.writer.sent_tokens for rid, leg in legs.items() if leg.writer is not None},
            iterations=0,
            kv_usage=None,
        )
        if self._output is not None and output.moved_since(self._output):
            self._output_at = now
        self._output = output
        silence = self._adapter().silence
        if not legs or silence.answered_at is None:
            return 0.0
        since_output = now - self._output_at  # its own stalls taken off here, the silence's already
        return min(silence.silent_s(now), since_output - self._own_stall(since_output))

    def _legs(self) -> int:
        requests = self._requests()
        return len(requests.inflight) if requests is not None else 0

    def _stall(self, mark: Progress, what: str) -> None:
        log.error(
            "engine at %s %s: its legs end, and it is kept deregistered until it moves again", self.engine_url, what
        )
        self.stalled = mark
