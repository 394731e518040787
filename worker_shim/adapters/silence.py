"""EngineSilence: how long the engine has left the shim waiting for an answer (the stall watchdog's
count of a frozen or cut-off engine).

The questions are the adapter's health probes and status reads; any HTTP answer to one, whatever
its status, is an answer. Silence is the time since the last answer during which at least one
question was in flight: a question that ends unanswered counts until it ends, and a pause in which
the shim asks nothing counts not at all, except after a question the engine could not be reached
for (refused, unreachable, reset; not a timeout, which a loaded engine gives): the engine is known
unreachable, and the pause until the next question counts too. A stall of the shim's own within
those spans is not counted (`own_stall`, the shim's runtime.loop_watch). Until 2026-12-07 silence
ran from the last answer, so a pause of the shim's own (up to 30 s resting after failed sessions,
or waiting for the events to go live) was the engine's: a loaded engine answering late was cut
whenever --stall-limit-s was under the pause and its two late answers; and for a while after, an
engine refusing each question in milliseconds was silent those milliseconds only, never judged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

__all__ = ["EngineSilence"]


def _never(_exc: BaseException) -> bool:
    return False


class EngineSilence:
    """`asking()` around each question, `answered()` as its answer comes; `silent_s(now)` the
    time spent waiting since the last answer."""

    def __init__(self) -> None:
        # When the engine last answered (time.monotonic()), None before it ever did.
        self.answered_at: float | None = None
        # Seconds the shim's own loop stood still within the last N (LoopWatch.stalled_within; the
        # shim sets it): taken off each span of silence as it closes, and off the one under way.
        self.own_stall: Callable[[float], float] = lambda _s: 0.0
        self._asking = 0  # questions in flight
        self._since: float | None = None  # when the span of silence under way began ...
        self._waited_s = 0.0  # ... and the spans that closed before it, since the last answer

    @contextlib.contextmanager
    def asking(self, unreached: Callable[[BaseException], bool] = _never) -> Iterator[None]:
        """Around one question; `unreached(exc)` says whether its failure means the engine could
        not be reached: then the span stays open until the next question begins (and goes on)."""
        if self._since is None:
            self._since = time.monotonic()
        self._asking += 1
        cut_off = False
        try:
            yield
        except BaseException as exc:
            cut_off = unreached(exc)
            raise
        finally:
            self._asking -= 1
            if not self._asking and not cut_off and self._since is not None:
                span = time.monotonic() - self._since
                self._waited_s += max(span - self.own_stall(span), 0.0)
                self._since = None

    def answered(self) -> None:
        self.answered_at = now = time.monotonic()
        self._waited_s = 0.0
        self._since = now if self._asking else None  # the questions still in flight wait from here

    def silent_s(self, now: float) -> float:
        if self._since is None:
            return self._waited_s
        span = now - self._since
        return self._waited_s + max(span - self.own_stall(span), 0.0)
