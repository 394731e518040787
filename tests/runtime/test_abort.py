"""run_service's exit at once (a second signal while draining, or a drain past its limit) runs
`on_abort` first: `main`'s own cleanup is skipped then, and a supervisor's children and temporary
directories would be left behind (`kvswitch up`'s were)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SERVICE = """
import asyncio, os, signal, sys
from pathlib import Path
from runtime import run_service

marker = Path(sys.argv[1])

def on_abort():
    marker.write_text("cleaned up")
    if sys.argv[2] == "raises":
        raise RuntimeError("cleanup broke")

async def main(stop):
    loop = asyncio.get_running_loop()
    if sys.argv[3].startswith("self"):  # main stops itself (a router that broke)
        loop.call_later(0.1, stop.set)
    else:
        loop.call_later(0.1, os.kill, os.getpid(), signal.SIGTERM)
    if sys.argv[3] in ("second", "self, then SIGTERM"):
        loop.call_later(0.3, os.kill, os.getpid(), signal.SIGTERM)
    await stop.wait()
    try:
        await asyncio.sleep(3600)  # a drain that never ends
    finally:
        marker.write_text("main's finally ran")

raise SystemExit(run_service(main, drain_limit_s={limit}, on_abort=on_abort))
"""


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("second", "second SIGTERM: exiting now"),
        ("slow", "still draining after"),
        # the limit runs from `stop` set by main itself too: before, only a signal started it, and
        # this drain never ended (review of 2026-12-06)
        ("self", "still draining after"),
        # a SIGTERM then is the first signal, not a second: the drain goes on to its limit
        ("self, then SIGTERM", "still draining after"),
    ],
)
def test_an_exit_at_once_runs_on_abort_first(tmp_path: Path, how: str, said: str) -> None:
    marker = tmp_path / "marker"
    code = textwrap.dedent(_SERVICE).replace("{limit}", "30" if how == "second" else "0.5")
    done = subprocess.run(
        [sys.executable, "-c", code, str(marker), "ok", how], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 130 and said in done.stderr, done.stderr
    assert marker.read_text() == "cleaned up"


def test_an_on_abort_that_raises_is_logged_and_the_exit_still_comes(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    code = textwrap.dedent(_SERVICE).replace("{limit}", "30")
    done = subprocess.run(
        [sys.executable, "-c", code, str(marker), "raises", "second"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 130, done.stderr
    assert "cleaning up before exiting failed" in done.stderr and "RuntimeError: cleanup broke" in done.stderr
    assert marker.read_text() == "cleaned up"
