"""bench.virtual.measure_delays against a real local cluster: every hop it reports was observed."""

from __future__ import annotations

import pytest

from bench.virtual import measure_delays


def test_every_delay_is_measured_on_a_live_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    # The sims bind their event sockets here (ipc://), so the tool's own subscriber sees the
    # engine's batches beside the shim; with the shim binding, it saw none and the tool crashed.
    assert measure_delays.main(["--requests", "10", "--agg", "1", "--routers", "1"]) == 0
    flags = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:])
    assert set(flags) == {
        "--kv-event-delay", "--load-report-delay", "--sync-delay", "--leg-delay", "--token-delay", "--client-delay",
        "--engine-read-delay",
    }  # fmt: skip
    assert float(flags["--kv-event-delay"]) > 0 and float(flags["--load-report-delay"]) > 0
    assert float(flags["--engine-read-delay"]) > 0
    assert all(0 <= float(v) < 1 for v in flags.values())


def test_too_few_requests_are_refused_before_a_cluster_comes_up(capsys: pytest.CaptureFixture[str]) -> None:
    # One request ended before a load report or a second poll: a StatisticsError on an empty list.
    with pytest.raises(SystemExit) as exit_:
        measure_delays.main(["--requests", "1"])
    assert exit_.value.code == 2
    assert f"argument --requests: 1: at least {measure_delays.MIN_REQUESTS}," in capsys.readouterr().err
