"""`kvswitch bench`: no setting is dropped without a word. A flag the chosen --clock or --workload
does not read, an impossible fleet, a sweep policy that is not run are refused before anything runs,
naming the flag; a results file keeps the clock it was measured on."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

import bench.cli
from bench import compare
from bench.compare import CONFIGURATIONS, CompareSpec, run_compare
from bench.trace import load_trace, shipped_trace
from bench.workloads import from_trace
from kvswitch.cli import main

VIRTUAL_REPLAY = ["replay", "--clock", "virtual", "--agg", "1", "--limit", "1"]
LIVE_REPLAY = ["replay", "--url", "http://127.0.0.1:9", "--limit", "1"]  # nothing listens: refused first or it fails
VIRTUAL_COMPARE = ["compare", "--clock", "virtual", "--limit", "1", "--configs", "kv"]
LIVE_COMPARE = ["compare", "--limit", "1", "--configs", "kv"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # D1: a synthetic workload's flags on a trace and the reverse
        (
            [*VIRTUAL_REPLAY, "--workload", "shared-prefix", "--max-input-len", "16"],
            "--max-input-len is for --workload trace only, not --workload shared-prefix",
        ),
        ([*VIRTUAL_REPLAY, "--workload", "multi-turn", "--start", "100"], "--start is for --workload trace only"),
        ([*VIRTUAL_REPLAY, "--workload", "multi-turn", "--scale-tokens", "0.5"], "--scale-tokens is for --workload"),
        ([*VIRTUAL_REPLAY, "--workload", "shared-prefix", "--trace", "/nonexistent"], "--trace is for --workload"),
        ([*VIRTUAL_REPLAY, "--groups", "2"], "--groups is for --workload shared-prefix only, not --workload trace"),
        ([*VIRTUAL_REPLAY, "--workload", "multi-turn", "--groups", "2"], "--groups is for --workload shared-prefix"),
        ([*VIRTUAL_REPLAY, "--workload", "shared-prefix", "--turns", "2"], "--turns is for --workload multi-turn"),
        ([*VIRTUAL_REPLAY, "--rate", "2"], "--rate is for --workload shared-prefix/multi-turn only"),
        (["sweep", "--workload", "multi-turn", "--max-input-len", "8"], "--max-input-len is for --workload trace"),
        # D2: the other clock's flags
        ([*VIRTUAL_COMPARE, "--speedup", "5"], "--speedup is for --clock live only, not --clock virtual"),
        ([*VIRTUAL_COMPARE, "--keep-logs"], "--keep-logs is for --clock live only"),
        ([*VIRTUAL_COMPARE, "--sim-arg=--max-num-seqs=4"], "--sim-arg is for --clock live only"),
        ([*LIVE_COMPARE, "--jobs", "3"], "--jobs is for --clock virtual only, not --clock live"),
        ([*LIVE_COMPARE, "--kv-event-delay", "1"], "--kv-event-delay is for --clock virtual only"),
        ([*LIVE_COMPARE, "--no-calibrate"], "--calibrate/--no-calibrate is for --clock virtual only"),
        ([*LIVE_COMPARE, "--router-seed", "3"], "--router-seed is for --clock virtual only"),
        ([*LIVE_COMPARE, "--router-profile-error", "0.1"], "--router-profile-error is for --clock virtual only"),
        ([*VIRTUAL_REPLAY, "--url", "http://10.0.0.1:9"], "--url is for --clock live only, not --clock virtual"),
        ([*VIRTUAL_REPLAY, "--model", "m"], "--model is for --clock live only"),
        ([*VIRTUAL_REPLAY, "--timeout", "1"], "--timeout is for --clock live only"),
        ([*VIRTUAL_REPLAY, "--prompt-format", "text"], "--prompt-format is for --clock live only"),
        ([*VIRTUAL_REPLAY, "--metrics-url", "http://10.0.0.1:9"], "--metrics-url is for --clock live only"),
        ([*LIVE_REPLAY, "--kv-event-delay", "1"], "--kv-event-delay is for --clock virtual only, not --clock live"),
        ([*LIVE_REPLAY, "--router-profile", "none"], "--router-profile is for --clock virtual only"),
        ([*LIVE_REPLAY, "--prefill", "3"], "--prefill is for --clock virtual only"),
        ([*LIVE_REPLAY, "--routers", "2"], "--routers is for --clock virtual only"),
        ([*LIVE_REPLAY, "--profile", "h200:llama-3.1-8b-tp2"], "--profile is for --clock virtual only"),
        ([*LIVE_REPLAY, "--configuration", "slo_aware"], "--configuration is for --clock virtual only"),
        ([*LIVE_REPLAY, "--router-arg=--routing=kv"], "--router-arg is for --clock virtual only"),
        # D4
        (["sweep", "--jobs", "0", "--limit", "1", "--fleets", "1P+1D", "--rates", "1"], "--jobs must be >= 1, got 0"),
        (
            ["sweep", "--policy", "nosuch", "--limit", "1", "--fleets", "1P+1D", "--rates", "1"],
            "--policy nosuch must be one of --configs (round_robin, kv, kv_disagg, slo_aware)",
        ),
        # D3, through the CLI
        (
            ["compare", "--clock", "virtual", "--prefill", "1", "--decode", "0", "--limit", "1", "--jobs", "1"],
            "--decode must be >= 1 for disaggregated configurations (kv_disagg, isl_bounding,",
        ),
    ],
)
def test_a_flag_the_run_would_not_read_is_refused_by_name(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, each of these ran (or failed on a connection) with the flag ignored."""
    out = {
        "replay": ["--out", str(tmp_path / "r.jsonl"), "--no-progress"],
        "compare": ["--out-dir", str(tmp_path), "--no-progress"],
        "sweep": ["--out-dir", str(tmp_path)],
    }[argv[0]]
    assert main(["bench", *argv, *out]) == 2
    printed = capsys.readouterr()
    assert message in printed.err and printed.out == "", printed
    assert list(tmp_path.iterdir()) == []


def test_an_impossible_fleet_is_refused_before_any_configuration_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, round_robin ran, then kv_disagg's fleet was refused and round_robin's result lost."""

    def measure(job: object) -> compare.Measurement:
        raise AssertionError("a configuration ran")

    monkeypatch.setattr(compare, "_measure_one", measure)
    items = from_trace(load_trace(shipped_trace(), start_s=990, limit=2), scale_tokens=0.125)
    configs = [CONFIGURATIONS["round_robin"], CONFIGURATIONS["kv_disagg"]]
    for clock in ("virtual", "live"):
        spec = CompareSpec(items=items, configurations=configs, prefill=1, decode=0, runs=1, clock=clock, jobs=1)
        with pytest.raises(ValueError, match=r"--decode must be >= 1 for disaggregated configurations \(kv_disagg\)"):
            run_compare(spec)
    spec = CompareSpec(items=items, configurations=configs[:1], prefill=0, decode=0, runs=1, clock="virtual")
    with pytest.raises(ValueError, match=r"--prefill \+ --decode must be >= 1 for aggregated .* \(round_robin\)"):
        run_compare(spec)


def test_summary_of_virtual_results_says_virtual_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "v.jsonl"
    argv = ["bench", "replay", "--clock", "virtual", "--agg", "1", "--start", "990", "--limit", "2"]
    assert main([*argv, "--scale-tokens", "0.125", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["bench", "summary", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(virtual time)" in printed and "send lag" not in printed, printed
    # virtual seconds are simulated already: a scale would relabel them
    assert main(["bench", "summary", str(out), "--latency-scale", "10"]) == 2
    assert f"--latency-scale is for live-clock results; {out} holds virtual-clock ones" in capsys.readouterr().err


def test_the_modules_virtual_example_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/cli.py's docstring example (the whole trace), cut to 3 requests of one configuration."""
    assert bench.cli.__doc__ is not None
    (line,) = [line for line in bench.cli.__doc__.splitlines() if "# the whole trace, simulated" in line]
    argv = shlex.split(line.split("#")[0])[1:]
    assert argv[:3] == ["bench", "compare", "--clock"]
    more = ["--limit", "3", "--configs", "kv", "--jobs", "1", "--out-dir", str(tmp_path), "--no-progress"]
    assert main([*argv, *more]) == 0, capsys.readouterr().err


def test_scale_tokens_help_says_what_a_factor_above_one_does(capsys: pytest.CaptureFixture[str]) -> None:
    """The help said F <= 1, which nothing enforced; F > 1 lengthens prompts (bench.workloads.from_trace)."""
    with pytest.raises(SystemExit):
        main(["bench", "replay", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "F <= 1" not in text and "prompts F times as long (F > 1 lengthens)" in text
