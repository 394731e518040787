"""How every long-running kvswitch process runs: uvloop when installed, structured logging, and a
stop event set by SIGTERM or SIGINT so services drain instead of dying mid-request.

A package of its own, below every service (it imports nothing of kvswitch's), so the router, the
shim and the simulator need not import the `kvswitch` CLI package to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, NoReturn

__all__ = [
    "LISTEN_BACKLOG",
    "SHOWN_CHARS",
    "JsonFormatter",
    "LogConfigError",
    "RepeatedErrors",
    "RepeatedLines",
    "StopSteps",
    "Throttle",
    "TickErrors",
    "background",
    "cancel_and_wait",
    "clipped",
    "configure_logging",
    "ended",
    "guarded",
    "run_service",
    "start_or_stop",
    "stop_signals_held",
    "tune_gc",
]

_log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048
"""The listen backlog of the HTTP servers clients burst into (the router's front door, engine_sim):
vLLM's server listens with uvicorn's default of 2048; aiohttp's 128 reset the connections of a burst
while the event loop was busy (a shim opens one per leg, bench chaos's overload_5x)."""
SHOWN_CHARS = 1000
"""The most of an error's text a log line or a status field shows: a repr can carry a whole foreign
body (a UnicodeDecodeError's holds every byte it was given: an engine's /metrics, 21 KB a line).
Room for the project's own longest errors, whose advice comes last (a TensorRT-LLM engine's cold
start names --no-endpoint-probe after some 300 characters): 200 cut it off."""


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text`, cut to `limit` characters, the last three `...`, where it is longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


_STD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class Throttle:
    """Whether a repeated thing is said now: the first time, then at most every `every_s`."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._said: dict[object, tuple[float, int]] = {}  # key -> (last said at, held back since)

    def __call__(self, key: object) -> tuple[int, float] | None:
        """None to hold it back; else how many were held back since it was last said, and how many
        seconds ago that was (0, 0.0 the first time)."""
        now = self._clock()
        seen = self._said.get(key)
        if seen is not None and now - seen[0] < self.every_s:
            self._said[key] = (seen[0], seen[1] + 1)
            return None
        self._said[key] = (now, 0)
        return (0, 0.0) if seen is None else (seen[1], now - seen[0])

    def forget(self, key: object) -> None:
        """`key` is gone (a worker left): its next time is a first time, and it holds no memory."""
        self._said.pop(key, None)


class RepeatedLines(logging.Filter):
    """A handler filter for libraries that log every retry: a line of theirs (same logger, same
    format) goes through the first time, then at most every `every_s`, saying how many like it were
    held back. etcd3aio's own watch and keep-alive helpers warn at every retry while etcd is down;
    our lease's and watches' own lines say when it went and when it came back. OpenTelemetry's
    exporter logs every batch it fails to send, twice a second while its collector is unreachable
    or refuses it."""

    def __init__(
        self, prefixes: tuple[str, ...], every_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.prefixes = prefixes
        self._throttle = Throttle(every_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        said = self._throttle((record.name, record.msg))
        if said is None:
            return False
        held, ago = said
        if held:
            record.msg = f"{record.msg} ({held} more like it in {ago:.0f}s)"
        return True


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


class LogConfigError(ValueError):
    """KVSWITCH_LOG_LEVEL or KVSWITCH_LOG_FORMAT has a value it may not have; names both."""

    def __init__(self, variable: str, value: str, allowed: tuple[str, ...]) -> None:
        super().__init__(f"invalid {variable} = {value!r}: allowed values: {', '.join(allowed)}")


def configure_logging(level: str | None = None, fmt: str | None = None) -> None:
    """`KVSWITCH_LOG_LEVEL` (info) and `KVSWITCH_LOG_FORMAT` (`text` or `json`) unless given;
    LogConfigError for any other value (a typo must not silently mean text, or crash later).
    The root logger's handlers become this one handler, to the `sys.stderr` of the call, so a
    second call replaces the first; the process keeps it (a caller running a service in-process,
    as tests do, puts back what it found: tests/conftest.py)."""
    level = level or os.environ.get("KVSWITCH_LOG_LEVEL", "info")
    fmt = fmt or os.environ.get("KVSWITCH_LOG_FORMAT", "text")
    if level.lower() not in LOG_LEVELS:
        raise LogConfigError("KVSWITCH_LOG_LEVEL", level, LOG_LEVELS)
    if fmt.lower() not in LOG_FORMATS:
        raise LogConfigError("KVSWITCH_LOG_FORMAT", fmt, LOG_FORMATS)
    level, fmt = level.upper(), fmt.lower()
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        # UTC on our own formatter: set on logging.Formatter, it changed every formatter in the
        # process, and outlived a configuration a caller put back (a test's, pytest's own)
        text.converter = time.gmtime
        handler.setFormatter(text)
    handler.addFilter(RepeatedLines(("etcd3aio", "opentelemetry")))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def tune_gc() -> None:
    """Move every object alive now out of the cyclic collector's view and collect young objects
    less often. A service allocates a steady stream of short-lived objects (messages, chunks,
    futures) beside a large long-lived heap (imported modules, an engine's blocks); with the default
    thresholds, full collections rescan that heap every few thousand allocations: 9.7% of the
    router's busy samples at 200 req/s in a profile (docs/benchmarks.md, "Overhead"). Called by `run_service` before a
    service starts, and again by whoever builds a large heap of its own (a simulated fleet)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def start_or_stop(start: Coroutine[Any, Any, object], stop: asyncio.Event) -> bool:
    """True once `start` is done (its error raised if it failed); False when `stop` is set first,
    after cancelling `start`, and it ended cancelled. A service that cannot reach NATS or etcd keeps
    trying to start; a SIGTERM then must end it at once, not after `run_service`'s drain limit. A
    start that finished though cancelled (its cancellation lost below it, in its last call) is
    started: True, and its caller stops it as it stops a serving one (`stop` is set), where False
    left its lease to its TTL and its NATS connections undrained."""
    starting = asyncio.create_task(start, name="start")
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not starting.done():
        await cancel_and_wait(starting)
        if starting.cancelled():
            return False
    starting.result()  # its error, raised as it ended
    return True


def background(
    coro: Coroutine[Any, Any, None], name: str, stops: str, on_crash: Callable[[], None] = lambda: None
) -> asyncio.Task[None]:
    """A task that runs for the life of its owner. Should it crash, the crash is said at once, as an
    ERROR with its traceback and `stops` (what no longer happens, and until when), rather than kept in the task
    until its owner's stop() awaits it, or lost if that never comes; then `on_crash` (its owner counts it)."""
    task = asyncio.create_task(coro, name=name)
    _stops[task] = stops
    task.add_done_callback(lambda t: _crashed(t, stops, on_crash))
    return task


CANCEL_AGAIN_S = 10.0
"""Longer than any cleanup a cancelled task awaits (a lease's revoke: 3 s a try, two tries): a
second cancel cut that short at 1 s and left a new lease in etcd (a review of 2026-12-07)."""


async def cancel_and_wait(*tasks: asyncio.Task[Any], again_s: float | None = None) -> None:
    """Cancel `tasks` and wait for their end, cancelling again every `again_s` (CANCEL_AGAIN_S) each that runs on.
    A cancellation can be lost below a task (Python 3.11's asyncio and grpc.aio each can drop one
    that comes with an answer), and a task that loops then runs for good: a shim's stop waited on
    its registration's supervisor forever (a full test run of 2026-12-07, its loop idle in a
    teardown; CI's like it had no trace). Said at WARNING, per task, when it had to cancel again.

    A caller cancelled meanwhile is as one awaiting them: each of its cancellations goes on to the
    tasks still running, the wait goes on, and CancelledError is raised once they all ended. Raised
    at once, a stop that ran in a cancelled task's cleanup (a leg's heartbeat reaped before its final
    chunk) was cut off by the stop waiting on that task, when it cancelled again: the rest of that
    cleanup never ran. A cancellation that a cancel_and_wait above passes down so (its again_s
    passed) counts against the tasks it reaches, not the task that waits on them. So a timeout
    around it (`asyncio.timeout`, `wait_for`) bounds nothing: its cancellation is passed on, and it
    fires once the tasks ended (run_service's drain limit bounds a process's stop).

    Their outcomes are retrieved, not raised: a crash was said as it came (background()), or is read
    from the task by a caller whose own error it is (task.result())."""
    every = CANCEL_AGAIN_S if again_s is None else again_s
    loop = asyncio.get_running_loop()
    for task in tasks:
        task.cancel()
    wait = _Wait(tasks)
    me = asyncio.current_task()
    if me is not None:
        _waiting[me] = wait
    cut: asyncio.CancelledError | None = None  # the caller's own cancellation, raised once they ended
    again_at = loop.time() + every
    try:
        while running := [task for task in tasks if not task.done()]:
            try:
                await asyncio.wait(running, timeout=max(again_at - loop.time(), 0.0))
            except asyncio.CancelledError as exc:
                cut = exc
                for task in running:
                    task.cancel()
                again_at = loop.time() + every  # as its own: a cleanup it begins gets a whole again_s
                continue
            if loop.time() >= again_at:
                wait.ran_on()
                for task in running:
                    task.cancel()
                again_at = loop.time() + every
    finally:
        if me is not None:
            _waiting.pop(me, None)
    for task, times in wait.again.items():
        if times:
            _log.warning(
                "task %s ran on through its cancellation (lost below it): cancelled again %d time(s) before it ended",
                task.get_name(),
                times,
            )
        if not task.cancelled():
            task.exception()
    if cut is not None:
        raise cut


class _Wait:
    """One cancel_and_wait's tasks, and how many times each was cancelled again while it ran on."""

    def __init__(self, tasks: tuple[asyncio.Task[Any], ...]) -> None:
        self.again = dict.fromkeys(tasks, 0)

    def ran_on(self) -> None:
        """A cancellation again for each task still running: counted against it, or, where it waits
        in a cancel_and_wait of its own (which passes it on), against the tasks that one waits on."""
        for task in self.again:
            if task.done():
                continue
            inner = _waiting.get(task)
            if inner is not None:
                inner.ran_on()
            else:
                self.again[task] += 1


# the cancel_and_wait each task waits in, while it does
_waiting: weakref.WeakKeyDictionary[asyncio.Task[Any], _Wait] = weakref.WeakKeyDictionary()


class StopSteps:
    """A stop's steps, each run though a cancellation cut one before it short; that cancellation
    raised once the last has run (`end()`). A stop that runs in a cancelled task's cleanup (a
    start's, a leg's) is cancelled again every CANCEL_AGAIN_S by the stop that waits on the task
    (cancel_and_wait): raised where it came, it skipped what came after (a lease's revoke, a leg's
    final chunk). `with steps:` around each step.

    Each later step runs after a cut, so a timeout around the whole stop (`asyncio.timeout`,
    `wait_for`) fires only once the last step ran: it bounds no step. Bound each step on its own
    where a bound matters; a process's stop is bounded by run_service's drain limit."""

    def __init__(self) -> None:
        self.cut: asyncio.CancelledError | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, asyncio.CancelledError):
            self.cut = exc
            return True
        return False

    def end(self) -> None:
        """Raise the cancellation that came during a step, if one did."""
        if self.cut is not None:
            raise self.cut


# what each background task's end stops (its owner's readiness names it: ended())
_stops: weakref.WeakKeyDictionary[asyncio.Task[None], str] = weakref.WeakKeyDictionary()


def _crashed(task: asyncio.Task[None], stops: str, on_crash: Callable[[], None]) -> None:
    if task.cancelled() or (exc := task.exception()) is None:
        return
    _log.error("task %s crashed: %s", task.get_name(), stops, exc_info=exc)
    on_crash()


def ended(task: asyncio.Task[None] | None) -> str | None:
    """Why `task`, a background() task meant to run for the life of its owner, no longer runs, and
    what that stops; None while it runs, was cancelled (its owner stopping it), or never started.
    For an owner's readiness: a loop that crashed, or returned, leaves it no longer correct."""
    if task is None or not task.done() or task.cancelled():
        return None
    exc = task.exception()
    how = f"crashed ({type(exc).__name__}: {exc})" if exc is not None else "ended"
    return f"task {task.get_name()} {how}: {_stops.get(task, 'what it did no longer happens')}"


_handler_errors = Throttle(30.0)


def guarded(cb: Callable[[Any], Awaitable[None]], what: str) -> Callable[[Any], Awaitable[None]]:
    """`cb` made fit to handle a NATS subscription's messages: an exception it raises is logged as
    `what`'s, with its traceback (the first, then at most every 30 s with a count), and the next
    message is handled as usual. nats-py would hand it to the connection's error callback, which
    blames NATS ("check --nats-servers") and shows no traceback."""

    async def handle(msg: Any) -> None:
        try:
            await cb(msg)
        except Exception as exc:
            said = _handler_errors((what, type(exc).__name__))
            if said is not None:
                held, ago = said
                more = f" ({held} more in {ago:.0f}s)" if held else ""
                _log.error("%s failed on a message of %s%s", what, getattr(msg, "subject", "?"), more, exc_info=exc)

    return handle


class TickErrors:
    """What a loop that must outlive a failing tick says of one: an ERROR with the traceback and
    `what`, the first, then at most every `every_s` with how many came meanwhile (`per_kind`: per
    type of exception, so a new kind of failure is said at once); the caller goes on with its next
    tick. For a loop whose tick may fail on its data (or a bug) while the loop itself is what keeps
    its owner correct: ending it would stop that for good (background())."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        every_s: float = 30.0,
        per_kind: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = logger
        self.what = what
        self.count = 0
        self.per_kind = per_kind
        self._throttle = Throttle(every_s, clock)

    def __call__(self, exc: Exception) -> None:
        self.count += 1
        said = self._throttle(type(exc).__name__ if self.per_kind else None)
        if said is None:
            return
        held, ago = said
        more = f" ({held} more in {ago:.0f}s)" if held else ""
        self.log.error("%s failed%s; going on with its next round", self.what, more, exc_info=exc)


class RepeatedErrors:
    """`on_error` is a NATS client's `error_cb` that says what is wrong without a traceback a try:
    the first error of a kind at WARNING, with `hint` (the flag to check), then how many more at
    most every `every_s`. nats-py's own callback logs a full traceback per attempt, twice a second
    while the server is unreachable."""

    def __init__(self, logger: logging.Logger, what: str, hint: str, *, every_s: float = 30.0) -> None:
        self.log = logger
        self.what = what
        self.hint = hint
        self.count = 0
        self._throttle = Throttle(every_s)

    async def on_error(self, exc: Exception) -> None:  # nats-py takes coroutine functions only
        self.count += 1
        said = self._throttle(type(exc).__name__)
        if said is None:
            return
        held, ago = said
        if ago:
            self.log.warning("%s: %s, %d times more in %.0fs (%s)", self.what, _said(exc), held + 1, ago, self.hint)
        else:
            self.log.warning("%s: %s (%s)", self.what, _said(exc), self.hint)


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT held back (blocked) while a service loads, until `run_service` hears them:
    importing the router and reading its settings takes seconds (more on a busy machine), and a
    SIGTERM then killed it with status 143 and an empty log. One that came meanwhile is said by
    run_service as a stop during start, exit 0, before `main` starts anything. On the way out, one
    still held (`run` returned before run_service, a settings error) is taken, not delivered."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        _taken()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _taken() -> str:
    """The names of the stop signals that came while held back, taken: not delivered once let through."""
    came = sorted(signal.sigpending() & STOP_SIGNALS)
    for sig in came:
        signal.sigwait({sig})
    return " and ".join(sig.name for sig in came)


def run_service(
    main: Callable[[asyncio.Event], Awaitable[int | None]],
    *,
    service: str | None = None,
    drain_limit_s: float = 60.0,
    on_abort: Callable[[], None] | None = None,
) -> int:
    """Run `main(stop)` on uvloop (when installed) until it returns; SIGTERM/SIGINT set `stop`.

    A second signal while draining exits at once with status 130; so does a drain that takes longer
    than `drain_limit_s` (logged as an ERROR): a process whose NATS or etcd vanished under it must
    still go when its supervisor says so. The limit runs from whenever `stop` is set, by a signal or
    by `main` itself (a router that broke stops as on SIGTERM): one path bounds every stop; a signal
    then is the first. `on_abort` runs just before such an exit, on the event loop's thread, for
    what `main`'s own cleanup (skipped then) must not leave behind: a supervisor's children and
    temporary directories. A signal held back while the process loaded (`stop_signals_held`) ends
    it before `main` runs: "SIGTERM: stopped during start (loading)", status 0. With `service`
    named, traces are exported over OTLP when the OTEL_* environment asks for it
    (runtime.telemetry), and flushed at the end. An invalid
    KVSWITCH_LOG_LEVEL or KVSWITCH_LOG_FORMAT, or an OTEL_* value it cannot export with, is one
    line on stderr and status 2.
    """
    try:
        configure_logging()
    except LogConfigError as exc:
        print(f"kvswitch: {exc}", file=sys.stderr)
        return 2
    tune_gc()
    provider = None
    if service is not None:
        from runtime.telemetry import TracingConfigError, configure_tracing

        try:
            provider = configure_tracing(service)
        except TracingConfigError as exc:
            print(f"kvswitch: {exc}", file=sys.stderr)
            return 2
    try:
        return _run(main, drain_limit_s, on_abort)
    finally:
        if provider is not None:
            provider.shutdown()


def _run(
    main: Callable[[asyncio.Event], Awaitable[int | None]],
    drain_limit_s: float,
    on_abort: Callable[[], None] | None,
) -> int:
    log = logging.getLogger("kvswitch")

    def exit_now() -> NoReturn:
        if on_abort is not None:
            try:
                on_abort()
            except Exception:
                log.exception("cleaning up before exiting failed")
        os._exit(130)

    async def runner() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        signalled = False

        def on_signal(signum: int) -> None:
            nonlocal signalled
            if signalled:
                log.warning("second %s: exiting now", signal.Signals(signum).name)
                exit_now()
            signalled = True
            log.info("%s: draining", signal.Signals(signum).name)
            stop.set()

        async def limit_drain() -> None:
            # Not started by the signal handler alone: `main` may set `stop` itself, and its stop
            # must not be bounded only by its libraries' timeouts (31 s for a broken router with
            # NATS frozen, against 20 s after SIGTERM: review of 2026-12-06).
            await stop.wait()
            await asyncio.sleep(drain_limit_s)
            log.error("still draining after %.0fs: exiting now", drain_limit_s)
            exit_now()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        if came := _taken():
            log.info("%s: stopped during start (loading)", came)
            return 0
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # heard by on_signal from now on
        limit = asyncio.create_task(limit_drain(), name="drain-limit")
        try:
            return int(await main(stop) or 0)
        finally:
            limit.cancel()

    try:
        import uvloop
    except ImportError:
        return asyncio.run(runner())
    return uvloop.run(runner())
