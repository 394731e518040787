"""A process stopped with SIGSTOP for a block: a frozen server, or one behind a partition that drops
its packets. Its TCP connections stay open, so only the peers' own timers can notice it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """`pid` stopped for the block and continued however the block ends: a server left stopped
    would hold its ports and leave its SIGTERM at teardown pending for good."""
    assert pid > 0, pid  # 0 or -1 would stop this test's own process group
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped now: SIGSTOP lands late on a loaded machine, and a
    server asked meanwhile still answers. Each thread stops on its own way back to user space, so
    the main thread stopped says nothing of the rest (nats-server's network threads among them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "T":
                    return False
        except FileNotFoundError:  # the thread exited meanwhile
            continue
    return True
