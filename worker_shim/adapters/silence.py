"""EngineSilence: how long the engine has left the shim waiting for an answer (the stall watchdog's
count of a frozen or cut-off engine).

The questions are the adapter's health probes and status reads; any HTTP answer to one, whatever
its status, is an answer. Silence is the time since the last answer during which at least one
question was in flight: a question that ends unanswered (a timeout, a reset) counts until it ends,
and a pause in which the shim asks nothing counts not at all. Until 2026-12-07 silence ran from
the last answer, so a pause of the shim's own (up to 30 s resting after failed sessions, or waiting
for the events to go live) was the engine's: a loaded engine answering late was cut whenever
--stall-limit-s was under the pause and its two late answers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["EngineSilence"]


class EngineSilence:
    """`asking()` around each question, `answered()` as its answer comes; `silent_s(now)` the
    time spent waiting since the last answer."""

    def __init__(self) -> None:
        # When the engine last answered (time.monotonic()), None before it ever did.
        self.answered_at: float | None = None
        self._asking = 0  # questions in flight
        self._since: float | None = None  # when the wait under way began (one is in flight since) ...
        self._waited_s = 0.0  # ... and the waits that ended before it, since the last answer

    @contextlib.contextmanager
    def asking(self) -> Iterator[None]:
        if not self._asking:
            self._since = time.monotonic()
        self._asking += 1
        try:
            yield
        finally:
            self._asking -= 1
            if not self._asking and self._since is not None:
                self._waited_s += time.monotonic() - self._since
                self._since = None

    def answered(self) -> None:
        self.answered_at = now = time.monotonic()
        self._waited_s = 0.0
        self._since = now if self._asking else None  # the questions still in flight wait from here

    def silent_s(self, now: float) -> float:
        return self._waited_s + (now - self._since if self._since is not None else 0.0)
