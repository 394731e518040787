"""On a pytest-timeout timeout (its signal method), the running event loop's tasks, each with the
chain of coroutines it awaits down to what it waits on, printed before pytest-timeout's own
thread stacks. A test stuck in an async fixture's teardown showed only its main thread idle in the
selector: what the loop waited on was not said (the clean-clone CI, 2026-12-07: 120 s in
test_e2e_engine_faults' teardown, cause unknown). Loaded by tests/conftest.py; a pytest run
elsewhere loads it with `-p tests.loop_tasks`."""

from __future__ import annotations

import asyncio
import gc
import inspect
import signal
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

__all__ = ["pytest_timeout_set_timer"]


@pytest.hookimpl(hookwrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Iterator[None]:
    """Runs around pytest-timeout's own: its SIGALRM handler, once set, says the tasks first."""
    yield
    if settings.method != "signal":
        return  # the thread method ends the process from another thread: the loop is not its to read
    timed_out = signal.getsignal(signal.SIGALRM)
    if not callable(timed_out):
        return

    def tasks_first(signum: int, frame: FrameType | None) -> None:
        __tracebackhide__ = True
        _print_tasks(item)
        timed_out(signum, frame)

    signal.signal(signal.SIGALRM, tasks_first)


def _print_tasks(item: pytest.Item) -> None:
    """The handler runs on the main thread between two steps of the loop (or in its select), where
    reading its tasks is safe; a test with no running loop has none to say."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    tasks = sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
    terminal = item.config.get_terminal_writer()
    terminal.sep("~", title=f"asyncio tasks of the running loop ({len(tasks)})")
    for task in tasks:
        frames, waits_on = _awaits(task.get_coro())
        stack = traceback.StackSummary.extract((f, f.f_lineno) for f in frames)
        terminal.write(f"{task.get_name()}, waiting on {waits_on!r:.300}:\n{''.join(stack.format())}")


def _awaits(coro: object) -> tuple[list[FrameType], object]:
    """The frames from `coro` down the chain of what each awaits, and what the last one waits on.
    Task.print_stack shows the outermost frame alone; an async generator's __anext__ names no
    generator, nor a future's iterator its future (a task, whose name says which): gc finds them
    among their referents."""
    frames: list[FrameType] = []
    at: object = coro
    while (frame := _frame(at)) is not None:
        frames.append(frame)
        at = getattr(at, "cr_await", None) or getattr(at, "gi_yieldfrom", None) or getattr(at, "ag_await", None)
        if at is not None and _frame(at) is None:
            at = next((r for r in gc.get_referents(at) if inspect.isasyncgen(r) or isinstance(r, asyncio.Future)), at)
    return frames, at


def _frame(at: object) -> FrameType | None:
    frame = getattr(at, "cr_frame", None) or getattr(at, "gi_frame", None) or getattr(at, "ag_frame", None)
    return frame if isinstance(frame, FrameType) else None
