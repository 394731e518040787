"""bench.stop_signals: a signal unwinds a benchmark; one during its cleanup waits for the cleanup's end."""

from __future__ import annotations

import os
import signal

import pytest

from bench.stop_signals import held, signals_unwind


def test_a_first_signal_in_a_held_block_is_raised_once_the_block_ends(capfd: pytest.CaptureFixture[str]) -> None:
    # Raised where it came, it cut a cluster's stop short and left its directories behind (review of 2026-12-07).
    ran = []
    with pytest.raises(SystemExit) as exited, signals_unwind("kvswitch bench x"):
        with held():
            with held():  # nested: the outermost's end raises it
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)  # again: said and ignored
                ran.append("inner")
            ran.append("outer")
        ran.append("after")
    assert exited.value.code == 128 + signal.SIGINT and ran == ["inner", "outer"]
    assert capfd.readouterr().err == (
        "kvswitch bench x: SIGINT: exiting once what it is stopping has stopped (a local cluster drains up to 35s a "
        "tier)\nkvswitch bench x: SIGTERM again: ignored until what it started has stopped (a local cluster drains up "
        "to 35s a tier), so that nothing is left behind\n"
    )


def test_a_signal_outside_a_held_block_is_raised_where_it_comes() -> None:
    ran = []
    with pytest.raises(SystemExit) as exited, signals_unwind("kvswitch bench x"):
        with held():
            ran.append("held")
        os.kill(os.getpid(), signal.SIGTERM)
        ran.append("after")
    assert exited.value.code == 128 + signal.SIGTERM and ran == ["held"]


def test_a_held_blocks_own_error_goes_on_as_it_is() -> None:
    with pytest.raises(RuntimeError, match="the stop failed"), signals_unwind("kvswitch bench x"), held():
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("the stop failed")
    with held():  # the signal held there is not raised by a later block
        pass
