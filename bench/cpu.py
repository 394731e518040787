"""CPU time of named groups of processes over a measured window, from `/proc/<pid>/stat`.

A group (`router`, `shim`, ...) is one or more pids; its CPU time is the sum of their `utime` and
`stime` (fields 14 and 15: every thread of the process, in clock ticks of `SC_CLK_TCK`, usually
10 ms). The cost of a window is then spread over what the window served:

    cpu_us_per_request = (cpu ticks after - before) / ticks_per_s * 1e6 / requests
    cpu_us_per_token   = the same / streamed tokens

A tick is 10 ms, so a window of 1,000 requests resolves 10 µs per request; the window should be
seconds long. A pid that is gone when read is an error (the process died mid-window: its figure
would be wrong), never a silent zero.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuCost", "CpuSampler", "CpuWindow", "ProcStatError", "pin_process", "read_cpu_ticks"]

_UTIME_FIELD = 14  # 1-based, as proc(5) numbers them
_STIME_FIELD = 15


class ProcStatError(RuntimeError):
    def __init__(self, pid: int, why: str) -> None:
        self.pid = pid
        super().__init__(f"/proc/{pid}/stat: {why}")


def read_cpu_ticks(pid: int, proc: Path = Path("/proc")) -> int:
    """utime + stime of `pid` (all its threads), in clock ticks."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError as exc:
        raise ProcStatError(pid, f"unreadable ({exc.strerror or exc})") from exc
    # Field 2, the command name, is in parentheses and may itself hold spaces and ')'.
    _, paren, rest = text.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < _STIME_FIELD - 2:
        raise ProcStatError(pid, f"malformed: {text[:80]!r}")
    # fields[0] is field 3 (state)
    try:
        return int(fields[_UTIME_FIELD - 3]) + int(fields[_STIME_FIELD - 3])
    except ValueError as exc:
        raise ProcStatError(pid, f"malformed: {text[:80]!r}") from exc


def pin_process(pid: int, cpus: Iterable[int], proc: Path = Path("/proc")) -> None:
    """Confine every thread of `pid` to `cpus`. `os.sched_setaffinity(pid, ...)` sets one thread's
    mask, the main one's: the rest (Go's runtime threads in nats-server, a Python process's helper
    threads) keep theirs. A thread started meanwhile by one not yet pinned inherits the old mask, so
    the threads are listed again until a pass finds no new one; later threads inherit the new mask."""
    mask = set(cpus)
    pinned: set[int] = set()
    while tids := {int(tid) for tid in os.listdir(proc / str(pid) / "task")} - pinned:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # the thread ended since the listing
                os.sched_setaffinity(tid, mask)
        pinned |= tids


@dataclass(frozen=True)
class CpuCost:
    """One group's CPU over a window and what it served."""

    cpu_s: float
    requests: int
    tokens: int

    @property
    def us_per_request(self) -> float | None:
        return self.cpu_s * 1e6 / self.requests if self.requests else None

    @property
    def us_per_token(self) -> float | None:
        return self.cpu_s * 1e6 / self.tokens if self.tokens else None


@dataclass(frozen=True)
class CpuWindow:
    """CPU seconds per group between two samples `wall_s` apart."""

    cpu_s: Mapping[str, float]
    wall_s: float

    def cost(self, group: str, *, requests: int, tokens: int) -> CpuCost:
        return CpuCost(self.cpu_s[group], requests, tokens)


class CpuSampler:
    """Samples every group's ticks (`sample()`, thread-safe; `running()` samples every
    `interval_s` on a thread meanwhile) and answers for any window between two samples.

    `window(t0, t1)` spans the last sample at or before `t0` to the first at or after `t1`: a caller
    that samples at its own boundaries gets exactly its window; one that only knows the window
    afterwards (aiperf's first and last request) gets it widened by less than one interval at
    each end, i.e. at most 2 * interval_s of the groups' idle CPU more.
    """

    def __init__(
        self,
        groups: Mapping[str, Sequence[int]],
        *,
        proc: Path = Path("/proc"),
        ticks_per_s: int | None = None,
        clock: Callable[[], float] = time.time,
        interval_s: float = 0.05,
    ) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self.proc = proc
        self.ticks_per_s = ticks_per_s or os.sysconf("SC_CLK_TCK")
        self.clock = clock
        self.interval_s = interval_s
        self._samples: list[tuple[float, dict[str, int]]] = []
        self._lock = threading.Lock()

    def sample(self) -> float:
        """Read every group now; returns the sample's time."""
        ticks = {name: sum(read_cpu_ticks(pid, self.proc) for pid in pids) for name, pids in self.groups.items()}
        now = self.clock()
        with self._lock:
            self._samples.append((now, ticks))
        return now

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        stop = threading.Event()
        failure: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.wait(self.interval_s):
                    self.sample()
            except ProcStatError as exc:  # re-raised in the caller's thread below
                failure.append(exc)

        self.sample()
        thread = threading.Thread(target=loop, name="cpu-sampler", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        if failure:
            raise failure[0]
        self.sample()

    def window(self, t0: float, t1: float) -> CpuWindow:
        with self._lock:
            samples = list(self._samples)
        before = [s for s in samples if s[0] <= t0]
        after = [s for s in samples if s[0] >= t1]
        if not before or not after:
            raise ValueError(f"no samples around the window [{t0:.3f}, {t1:.3f}]: sample before and after it")
        (ta, a), (tb, b) = before[-1], after[0]
        return CpuWindow({name: (b[name] - a[name]) / self.ticks_per_s for name in self.groups}, tb - ta)
