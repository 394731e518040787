"""tests/loop_tasks.py: a pytest-timeout timeout in an async fixture's teardown names what the
event loop was waiting on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HELD = """
import asyncio

import pytest


async def waiting_on_a_peer_that_never_answers() -> None:
    await asyncio.Event().wait()


@pytest.fixture
async def held():
    yield
    await waiting_on_a_peer_that_never_answers()


async def test_passes_then_its_teardown_hangs(held: None) -> None:
    pass
"""


def test_a_timeout_in_an_async_teardown_prints_the_coroutines_the_loop_awaits(tmp_path: Path) -> None:
    """Before: pytest-timeout's dump showed the other threads and, in the error, the main thread
    idle in the selector; which coroutine held the teardown went unsaid."""
    (tmp_path / "test_held.py").write_text(HELD)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.loop_tasks", "-o", "asyncio_mode=auto",
         "-o", "asyncio_default_fixture_loop_scope=function", "--timeout", "2", "-q", "test_held.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert "1 passed, 1 error" in out, out
    assert "asyncio tasks of the running loop" in out, out
    assert "in waiting_on_a_peer_that_never_answers" in out, out
