"""A process pool for the virtual-clock measurements that stops at once when its `with` raises.

`with ProcessPoolExecutor(...)` shuts down with wait=True: on SIGTERM or Ctrl-C (bench.stop_signals
raises SystemExit) it waited for every running measurement and started the queued ones, and
`kvswitch plan --jobs 2` took 31 s to exit. Here a raise cancels what has not started, SIGTERMs
the workers and waits at most `STOP_S` for them all (then SIGKILLs the rest) before it goes on.

The workers take SIGTERM's default action, death: a virtual-clock measurement is in-process and
holds nothing to unwind, and bench.stop_signals' SystemExit, inherited through fork, would be caught
by the pool's worker loop, which then ran the next queued measurement with SIGTERM ignored. They
ignore SIGINT: a terminal's Ctrl-C reaches its whole process group, and the command, hearing it
too, stops them as above (each worker's KeyboardInterrupt was a traceback of its own).
"""

from __future__ import annotations

import concurrent.futures.process as _futures_process
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

__all__ = ["STOP_S", "process_pool"]

STOP_S = 3.0  # how long stopped workers get to exit before they are SIGKILLed


def _worker_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    pool = ProcessPoolExecutor(workers, initializer=_worker_signals)
    try:
        yield pool
    except BaseException:
        processes = list(pool._processes.values())  # the executor keeps no public handle on them
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.terminate()
        deadline = time.monotonic() + STOP_S  # one for them all: each its own made it workers x STOP_S
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join()
        # Its manager thread closes its wakeup pipe as it ends; CPython 3.11's exit hook, run while
        # it still ran, wrote to that pipe as it closed ("Exception ignored ... Bad file descriptor"
        # on stderr after a SIGTERM, twice in full runs of 2026-12-07): ended first, it is skipped.
        manager = getattr(pool, "_executor_manager_thread", None)  # no public handle (typeshed: a wakeup)
        if isinstance(manager, threading.Thread):
            manager.join(max(0.0, deadline - time.monotonic()))
            # Still running on a loaded box (CI, 2026-12-08), the race stood: its wakeup is taken
            # from the exit hook's list (the thread ends on its dead workers' sentinels, and
            # threading's shutdown still joins it).
            getattr(_futures_process, "_threads_wakeups", {}).pop(manager, None)
        raise
    pool.shutdown(wait=True)
