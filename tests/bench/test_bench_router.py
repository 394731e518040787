"""`python -m bench.bench_router`: its flags are refused before anything starts, in one line."""

from __future__ import annotations

import sys

import pytest

import bench.bench_router


def _not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the benchmark started before its flags were checked")


@pytest.mark.parametrize(
    "argv", [["overhead"], ["stream-cpu"], ["workers", "nats://127.0.0.1:1", "http://127.0.0.1:1", "ns"]]
)
def test_a_speedup_past_the_profile_bounds_is_refused_naming_the_flag(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its sims run at --speedup, which protocol.timing.check_speedup bounds as `kvswitch up`'s: only
    `> 0` was implied, and NATS, etcd and the sims started at any number."""
    for runner in ("bench_overhead", "bench_stream_cpu", "_serve_workers"):
        monkeypatch.setattr(bench.bench_router, runner, _not_run)
    monkeypatch.setattr(sys, "argv", ["bench_router.py", *argv, "--speedup", "2000000"])
    with pytest.raises(SystemExit) as exc:
        bench.bench_router.main()
    assert exc.value.code == 2
    want = "--speedup must be a number in 0.001..1000000 (times the profile's speed), got 2000000.0"
    assert capsys.readouterr().err == f"bench_router.py {argv[0]}: {want}\n"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["decision", "--wrokers", "8"],
            "bench_router.py: unrecognized arguments: --wrokers 8: --wrokers (did you mean --workers?); "
            "bench_router.py decision --help lists its flags",
        ),
        (["decision", "--workers", "3"], "bench_router.py decision: --workers 3: at least 4, so that three workers"),
        (["pending", "--blocks", "x"], "bench_router.py pending: argument --blocks: invalid int value: 'x'"),
        (["bogus"], "bench_router.py: invalid benchmark = 'bogus': allowed values: decision, overhead,"),
    ],
)
def test_a_refusal_is_one_line_as_every_kvswitch_commands(
    argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed argparse's usage and `...: error: ...` (kvswitch.flags.FlagParser's refusals now)."""
    for runner in ("bench_decision", "bench_pending"):
        monkeypatch.setattr(bench.bench_router, runner, _not_run)
    monkeypatch.setattr(sys, "argv", ["bench_router.py", *argv])
    with pytest.raises(SystemExit) as exc:
        bench.bench_router.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err
