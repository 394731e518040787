"""SIGTERM and Ctrl-C unwind a benchmark.

By Python's default SIGTERM kills the process where it stands: a benchmark's `finally:
cluster.stop()` never ran (NATS and etcd were SIGKILLed under draining shims, their directories
left in $TMPDIR), and a process pool's workers were left behind, reparented to init, waiting on
their queue for ever. Ctrl-C's KeyboardInterrupt came out of `asyncio.run` as some 45 lines of
chained tracebacks (asyncio cancels its main task, then raises it), and a second Ctrl-C broke out
of `cluster.stop()` in the `finally`, leaving the cluster's directories behind (review of
2026-12-07). Either signal is raised as SystemExit (status 128 + the signal: 143, 130), and the
`with` and `finally` blocks run. Another one meanwhile is said and ignored, so that the stopping
runs to its end (each tier's grace bounds it).

A benchmark's cleanup (a cluster's stop between configurations, a peer's, a py-spy's) runs in
`held()`: a first signal there is said and raised once the cleanup ends. Raised where it came, it
cut the stop short: the tiers after it were never stopped, NATS and etcd never closed (their
directories and the cluster's left in $TMPDIR), and the configuration just measured was lost
(review of 2026-12-07).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from kvswitch.cluster import STOP_GRACE_S

__all__ = ["STOP_SIGNALS", "held", "signals_unwind"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_held = 0  # held() blocks the main thread is in
_pending: int | None = None  # the first signal, come in one of them: raised when the outermost ends


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A first SIGTERM or SIGINT (in `signals_unwind`) in the block is raised as SystemExit when it
    ends, not where it came; an exception of the block's own goes on as it is."""
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
    if not _held and _pending is not None:
        signum, _pending = _pending, None
        raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_unwind(what: str, *, exits: bool = False) -> Iterator[None]:
    """SIGTERM and SIGINT raise SystemExit in the block (`what`: the command, for the line said).
    `exits`: the process ends with the block (a command's entry point), so once a signal stopped
    it, later ones are ignored through the exit rather than the handlers put back."""
    global _pending
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        yield
        return

    def say(line: str) -> None:
        # Not print(): a handler that runs while the main thread writes to stderr (a progress bar)
        # would re-enter its buffer, a RuntimeError in the place of the SystemExit.
        os.write(2, f"{what}: {line}\n".encode())

    def again(signum: int, frame: FrameType | None) -> None:
        say(
            f"{signal.Signals(signum).name} again: ignored until what it started has stopped (a local cluster "
            f"drains up to {STOP_GRACE_S:.0f}s a tier), so that nothing is left behind"
        )

    def first(signum: int, frame: FrameType | None) -> None:
        global _pending
        stopped.append(signum)
        for sig in STOP_SIGNALS:
            signal.signal(sig, again)
        if _held:
            _pending = signum
            say(
                f"{signal.Signals(signum).name}: exiting once what it is stopping has stopped (a local cluster "
                f"drains up to {STOP_GRACE_S:.0f}s a tier)"
            )
            return
        raise SystemExit(128 + signum)  # said by the command as it stops (a progress bar may be on the line)

    stopped: list[int] = []
    before = {sig: signal.signal(sig, first) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        _pending = None  # held by a cleanup whose own exception went on: that one says why it stopped
        for sig, handler in before.items():
            # A Python handler put back is reset to the default as the interpreter finalizes, and
            # a second Ctrl-C then killed the exiting process (status -2, not 130). Ignored only
            # where the process exits: SIG_IGN outlives the block, and every child inherits it.
            signal.signal(sig, signal.SIG_IGN if stopped and exits else handler)
