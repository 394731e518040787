"""SIGTERM unwinds a benchmark like Ctrl-C.

By Python's default SIGTERM kills the process where it stands: a benchmark's `finally:
cluster.stop()` never ran (NATS and etcd were SIGKILLed under draining shims, their directories
left in $TMPDIR), and a process pool's workers were left behind, reparented to init, waiting on
their queue for ever. Raised as SystemExit instead, the `with` and `finally` blocks run. A second
SIGTERM is ignored, so that the stopping runs to its end (each tier's grace bounds it).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["sigterm_unwinds"]


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
