"""`kvswitch bench ...`: argument handling and clear errors (the runs themselves are covered by
test_replay, test_summary and test_compare)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.virtual import fleet
from kvswitch.cli import main
from kvswitch.cluster import ClusterSpec
from protocol.config import RouterSettings

DATA = Path(__file__).with_name("data") / "small_results.jsonl"


def test_summary_subcommand_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "summary", str(DATA), "--latency-scale", "10"]) == 0
    out = capsys.readouterr().out
    assert "5 (4 ok, 1 errors)" in out and "simulated time" in out and "TTFT       p50 7500.0" in out


def test_unknown_configuration_is_refused_with_the_allowed_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", "--configs", "kv,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown nope" in err and "ttft_model" in err and "sglang_cache_aware" in err


def test_a_bad_trace_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 9999, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["bench", "replay", "--url", "http://127.0.0.1:1", "--trace", str(trace)]) == 2
    assert f"{trace}:1: input_length 9999" in capsys.readouterr().err


def test_a_timestamp_before_the_traces_start_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # dropped with no word: a 5-line trace ran as 3 requests
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": -1000, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    assert main(["bench", "replay", "--url", "http://127.0.0.1:1", "--trace", str(trace)]) == 2
    assert f"{trace}:1: timestamp -1000 must be >= 0" in capsys.readouterr().err


def test_an_empty_selection_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "replay", "--url", "http://127.0.0.1:1", "--start", "5000"]) == 2
    assert "selection is empty" in capsys.readouterr().err


def test_peers_are_refused_on_the_virtual_clock(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", "--clock", "virtual", "--configs", "kv,sglang_cache_aware"]) == 2
    assert "sglang_cache_aware are peer routers; they run on the live clock only" in capsys.readouterr().err


def test_live_replay_needs_a_url_and_virtual_refuses_live_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "replay", "--limit", "2"]) == 2
    assert "--url is required (or --clock virtual)" in capsys.readouterr().err
    assert main(["bench", "replay", "--clock", "virtual", "--agg", "1", "--limit", "2", "--latency-scale", "2"]) == 2
    assert "--latency-scale is for --clock live only, not --clock virtual" in capsys.readouterr().err
    assert main(["bench", "replay", "--clock", "virtual", "--agg", "1", "--limit", "2", "--speed", "0"]) == 2
    assert "--speed must be > 0 and finite, got 0" in capsys.readouterr().err


def test_a_bad_delay_names_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "compare", "--clock", "virtual", "--limit", "2", "--kv-event-delay", "-1"]
    assert main(argv) == 2
    assert "--kv-event-delay must be a finite number >= 0" in capsys.readouterr().err


def test_virtual_replay_writes_results_and_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.jsonl"
    argv = ["bench", "replay", "--clock", "virtual", "--prefill", "1", "--decode", "1", "--configuration", "slo_aware"]
    argv += ["--start", "990", "--limit", "10", "--scale-tokens", "0.125", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "10 (10 ok, 0 errors)" in printed and "(virtual time)" in printed
    assert "chosen, of " in printed and "prompt tokens routed (routers' view); one never-evicting cache" in printed
    assert len(out.read_text().splitlines()) == 10


def test_virtual_replay_speed_divides_arrival_times(tmp_path: Path) -> None:
    dues = []
    for speed in ("1", "4"):
        out = tmp_path / f"r{speed}.jsonl"
        argv = ["bench", "replay", "--clock", "virtual", "--agg", "1", "--start", "990", "--limit", "6"]
        argv += ["--scale-tokens", "0.125", "--speed", speed, "--out", str(out), "--no-progress"]
        assert main(argv) == 0
        dues.append([json.loads(line)["due_s"] for line in out.read_text().splitlines()])
    assert dues[0][-1] > dues[0][0]
    assert dues[1] == pytest.approx([d / 4 for d in dues[0]])


def test_virtual_replay_runs_its_routers_at_the_slo_goodput_is_judged_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[RouterSettings] = []

    class Recording(fleet.VirtualFleet):
        def __init__(self, spec: fleet.FleetSpec) -> None:
            seen.append(spec.settings)
            super().__init__(spec)

    monkeypatch.setattr(fleet, "VirtualFleet", Recording)
    argv = ["bench", "replay", "--clock", "virtual", "--prefill", "1", "--decode", "1", "--configuration", "slo_aware"]
    argv += ["--start", "990", "--limit", "4", "--scale-tokens", "0.125", "--out", str(tmp_path / "r.jsonl")]
    assert main([*argv, "--no-progress", "--slo-ttft", "1", "--slo-itl", "0.05"]) == 0
    assert "TTFT <= 1.0 s and TPOT <= 50 ms" in capsys.readouterr().out
    assert [(s.slo_ttft_s, s.slo_itl_s) for s in seen] == [(1.0, 0.05)]
    # A router flag given on purpose still has the last word.
    assert main([*argv, "--no-progress", "--slo-ttft", "1", "--router-arg=--slo-ttft-s=3"]) == 0
    assert seen[-1].slo_ttft_s == 3.0


def test_sigterm_stops_a_benchmarks_cluster_and_leaves_nothing(tmp_path: Path) -> None:
    # before, SIGTERM killed bench at once: its children went by pdeathsig (nats and etcd SIGKILLed
    # under draining shims) and the cluster's, NATS's and etcd's directories stayed in $TMPDIR
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "kvswitch", "bench", "chaos", "--scenarios", "baseline"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not _children_running(proc.pid, "kvswitch router"):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else b""
            time.sleep(0.2)
        assert _children_running(proc.pid, "kvswitch router"), "no router started within 90 s"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 128 + signal.SIGTERM
        assert sorted(p.name for p in tmp_path.glob("kvswitch-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_twice_stops_a_benchmark_without_a_traceback_and_leaves_nothing(tmp_path: Path) -> None:
    # Ctrl-C while `make demo` measured came out of asyncio.run as some 45 lines of chained
    # tracebacks, and a second one broke out of cluster.stop(): the cluster's, NATS's and etcd's
    # directories stayed in $TMPDIR (review of 2026-12-07).
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    argv = [sys.executable, "-m", "kvswitch", "bench", "compare", "--demo", "--configs", "round_robin", "--rates", "1"]
    proc = subprocess.Popen(
        [*argv, "--out-dir", str(out)], env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not _router_ready(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "no router became ready within 90 s"
            time.sleep(0.1)
        time.sleep(0.5)  # measuring: in asyncio.run
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: its process group
        # The second once the cluster's stop is under way (its routers stop first); sent 0.3 s
        # after the first, it came after the stop half the time on a loaded box (no line to say).
        while _children_running(proc.pid, "kvswitch router"):
            assert time.monotonic() < deadline + 60, "the router did not stop within 60 s of the Ctrl-C"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 128 + signal.SIGINT, err
        said = [line for line in err.splitlines() if "Traceback" in line or "kvswitch" in line]
        assert said == [
            "kvswitch bench compare: SIGINT again: ignored until what it started has stopped (a local cluster drains "
            "up to 35s a tier), so that nothing is left behind",
            "kvswitch bench compare stopped early: nothing was measured",
        ], err
        assert sorted(p.name for p in tmp.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_while_a_configurations_cluster_stops_lets_the_stop_end_and_keeps_what_was_measured(
    tmp_path: Path,
) -> None:
    # A first Ctrl-C during the cluster's stop after a configuration raised SystemExit inside it:
    # the tiers after the one stopping were never stopped, NATS and etcd never closed (the cluster's,
    # nats' and etcd's directories left in $TMPDIR), and the configuration just measured was lost,
    # "nothing was measured" (review of 2026-12-07).
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir()
    argv = [sys.executable, "-m", "kvswitch", "bench", "compare", "--demo", "--configs", "round_robin", "--rates", "1"]
    proc = subprocess.Popen(
        [*argv, "--duration", "10", "--no-progress", "--out-dir", str(out)], env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (routers := _children(proc.pid, "kvswitch router")):
            assert proc.poll() is None and time.monotonic() < deadline, "no router started within 90 s"
            time.sleep(0.05)
        deadline = time.monotonic() + 120
        while _running(routers[0]):  # the router goes first: the stop after the measuring has begun
            assert proc.poll() is None and time.monotonic() < deadline, "the router never stopped"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: its process group
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGINT, err
        said = [line for line in err.splitlines() if "Traceback" in line or "kvswitch" in line]
        assert sorted(p.name for p in tmp.iterdir()) == [], err
        [saved] = out.glob("compare-*.json")
        assert said == [
            "kvswitch bench compare: SIGINT: exiting once what it is stopping has stopped (a local cluster drains up "
            "to 35s a tier)",
            f"kvswitch bench compare stopped early: 1 results measured before the failure are in {saved}",
        ], err
        assert [m["configuration"] for m in json.loads(saved.read_text())] == ["round_robin"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int, command: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "-P", str(pid), command], capture_output=True, text=True, check=False)
    return [int(p) for p in out.stdout.split()]


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _router_ready(pid: int) -> bool:
    """Whether a router child of `pid` answers /ready (its --http-port read from its command line)."""
    pgrep = ["pgrep", "-f", "-P", str(pid), "kvswitch router"]
    out = subprocess.run(pgrep, capture_output=True, text=True, check=False)
    for child in out.stdout.split():
        argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        port = int(argv[argv.index("--http-port") + 1])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                return bool(r.status == 200)
        except OSError:
            return False
    return False


def _children_running(pid: int, command: str) -> bool:
    out = subprocess.run(["pgrep", "-f", "-P", str(pid), command], capture_output=True, text=True, check=False)
    return bool(out.stdout.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "--rates", "x"], "kvswitch bench compare: --rates: comma-separated numbers, got 'x'"),
        (["compare", "--rates", "-1", "--clock", "virtual", "--limit", "5"], "--rates must be finite numbers > 0"),
        (["compare", "--rates", "1,inf", "--clock", "virtual", "--limit", "5"], "> 0, got inf"),
        (["sweep", "--rates", "0", "--limit", "5"], "kvswitch bench sweep: --rates must be finite numbers > 0, got 0"),
        (["replay", "--url", "notaurl", "--limit", "1"], "--url 'notaurl': must be an http:// or https:// URL"),
        (["replay", "--url", "http://:80", "--limit", "1"], "--url 'http://:80': the URL names no host"),
        (["replay", "--url", "http://127.0.0.1:1", "--metrics-url", "ftp://x"], "--metrics-url 'ftp://x'"),
        (["replay", "--url", "http://127.0.0.1:1", "--trace", "/nonexistent"], "--trace /nonexistent: No such file"),
        (["replay", "--url", "http://127.0.0.1:1", "--latency-scale", "-1"], "--latency-scale must be > 0 and fin"),
        (["replay", "--url", "http://127.0.0.1:1", "--latency-scale", "inf"], "> 0 and finite, got inf"),
        (["summary", str(DATA), "--latency-scale", "inf"], "--latency-scale must be > 0 and finite, got inf"),
        # read as unset by an `or` default, they ran at scale 1.0 and from 0 (plan's audit, 2026-12-06)
        (["sweep", "--scale-tokens", "0", "--limit", "5"], "--scale-tokens must be > 0 and finite, got 0"),
        (["compare", "--clock", "virtual", "--scale-tokens", "0", "--limit", "5"], "--scale-tokens must be > 0"),
        (["sweep", "--start", "-5", "--limit", "5"], "--start must be >= 0 and finite, got -5"),
        (["sweep", "--fleets", ",", "--limit", "5"], "--fleets ',' names no fleet"),
    ],
)
def test_a_bad_flag_is_named_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, --rates x named no flag, --rates -1 failed after every configuration ran, a bad --url
    was aiohttp's bare text, a missing --trace an errno line, --latency-scale checked after a replay."""
    assert main(["bench", *argv]) == 2
    out = capsys.readouterr()
    assert message in out.err and out.out == "", out


def _not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started before its output place was checked")


SWEEP = ["sweep", "--fleets", "1P+1D", "--rates", "1", "--configs", "kv", "--policy", "kv", "--jobs", "1"]
COMPARE = ["compare", "--clock", "virtual", "--configs", "kv", "--prefill", "1", "--decode", "1", "--jobs", "1"]


LIVE = ["replay", "--url", "http://127.0.0.1:1", "--limit", "2"]
VIRTUAL = ["replay", "--clock", "virtual", "--agg", "1", "--limit", "2"]
MULTI_TURN = [*VIRTUAL, "--workload", "multi-turn", "--sessions", "1", "--turns", "2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # aiohttp's ClientTimeout reads 0, a negative or NaN as no limit at all
        ([*LIVE, "--timeout", "0"], "--timeout must be > 0 and finite, got 0"),
        ([*LIVE, "--timeout", "-1"], "--timeout must be > 0 and finite, got -1"),
        ([*LIVE, "--timeout", "nan"], "--timeout must be > 0 and finite, got nan"),
        ([*LIVE, "--timeout", "inf"], "--timeout must be > 0 and finite, got inf"),
        # load_trace read a NaN --duration as the whole trace, a synthetic workload as none of it
        ([*LIVE, "--duration", "nan"], "--duration must be > 0 and finite, got nan"),
        ([*VIRTUAL, "--duration", "0"], "--duration must be > 0 and finite, got 0"),
        ([*SWEEP, "--duration", "inf", "--limit", "2"], "--duration must be > 0 and finite, got inf"),
        ([*COMPARE, "--duration", "-1", "--limit", "2"], "--duration must be > 0 and finite, got -1"),
        # an infinite rate sent every request at once; the live --speed was checked after the output
        ([*LIVE, "--speed", "nan"], "--speed must be > 0 and finite, got nan"),
        ([*VIRTUAL, "--speed", "inf"], "--speed must be > 0 and finite, got inf"),
        ([*MULTI_TURN, "--rate", "inf"], "--rate must be > 0 and finite, got inf"),
        (["compare", "--configs", "kv", "--speedup", "nan", "--limit", "2"], "--speedup must be > 0 and finite"),
        # within bounds its shims' profile names take (protocol.timing.check_speedup): refused after
        # NATS, etcd and the sims had started, naming no flag (final read of d08d2f2)
        (["compare", "--configs", "kv", "--speedup", "2000000", "--limit", "2"], "--speedup must be a number in"),
        ([*MULTI_TURN, "--turn-gap", "nan"], "--turn-gap must be >= 0 and finite, got nan"),  # NaN arrivals
        ([*MULTI_TURN, "--turn-gap", "inf"], "--turn-gap must be >= 0 and finite, got inf"),
        # the synthesis refused it at the first measurement, naming no flag (live: after NATS and the sims)
        (["compare", "--configs", "kv", "--seed", "-1", "--limit", "2"], "--seed must be >= 0, got -1"),
        ([*COMPARE, "--seed", "-1", "--limit", "2"], "--seed must be >= 0, got -1"),
        ([*VIRTUAL, "--seed", "-1"], "--seed must be >= 0, got -1"),
        ([*LIVE, "--seed", "-1"], "--seed must be >= 0, got -1"),
        ([*SWEEP, "--seed", "-1", "--limit", "2"], "--seed must be >= 0, got -1"),
    ],
)
def test_a_number_read_as_no_limit_or_as_everything_is_refused_before_anything_runs(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each ran (review, 2026-12-07): a replay without a timeout, the whole trace, or all at once."""
    import bench.compare
    import bench.replay
    import bench.sweep

    for runner in ((bench.replay, "replay"), (bench.compare, "run_compare"), (bench.sweep, "_measure")):
        monkeypatch.setattr(*runner, _not_run)
    monkeypatch.setattr(fleet.VirtualFleet, "run", _not_run)
    monkeypatch.chdir(tmp_path)  # the default bench/out, had it run
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


OVERHEAD = ["overhead", "--no-aiperf", "--no-peers"]
SPEEDUPS = "0.001..1000000 (times the profile's speed)"  # protocol.timing.check_speedup's


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # n / rate: a ZeroDivisionError traceback once a cluster had started
        (["chaos", "--rate", "0"], "--rate must be > 0 and finite, got 0"),
        (["chaos", "--rate", "nan"], "--rate must be > 0 and finite, got nan"),
        (["chaos", "--rate", "inf"], "--rate must be > 0 and finite, got inf"),
        (["chaos", "--warmup", "nan"], "--warmup must be >= 0 and finite, got nan"),  # slept for ever
        (["chaos", "--window", "-1"], "--window must be >= 0 and finite, got -1"),
        (["chaos", "--settle", "inf"], "--settle must be >= 0 and finite, got inf"),
        ([*OVERHEAD, "--speedup", "nan"], "--speedup must be > 0 and finite, got nan"),
        # past protocol.timing.check_speedup's bounds, the first shim's profile name was a ValueError
        # once NATS, etcd and the sims had started
        ([*OVERHEAD, "--speedup", "2000000"], f"--speedup must be a number in {SPEEDUPS}, got 2000000.0"),
        ([*OVERHEAD, "--seconds", "inf"], "--seconds must be > 0 and finite, got inf"),
        ([*OVERHEAD, "--rates", "50,nan"], "--rates must be finite numbers > 0, got nan"),  # passed `<= 0`
        ([*OVERHEAD, "--rates", "inf"], "--rates must be finite numbers > 0, got inf"),
        (["replicas", "--check-rate", "0"], "--check-rate must be > 0 and finite, got 0"),
        (["replicas", "--seconds", "nan"], "--seconds must be > 0 and finite, got nan"),
        (["replicas", "--speedup", "-1"], "--speedup must be > 0 and finite, got -1"),
        (["replicas", "--speedup", "0.0001"], f"--speedup must be a number in {SPEEDUPS}, got 0.0001"),
        (["replicas", "--rates", "10,inf"], "--rates must be finite numbers > 0, got inf"),
        (["replicas", "--rates", "10,x"], "--rates: comma-separated numbers, got '10,x'"),
    ],
)
def test_a_chaos_overhead_or_replicas_number_out_of_range_is_refused_before_anything_starts(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """None was checked (review of 5767cb2): `chaos --rate 0` started a cluster and died dividing by
    zero, a NaN or infinite number ran for ever or sent every request at once."""
    import bench.chaos
    import bench.overhead
    import bench.replicas

    monkeypatch.setattr(bench.chaos, "LocalCluster", _not_run)
    monkeypatch.setattr(bench.overhead, "run_overhead", _not_run)
    monkeypatch.setattr(bench.replicas, "measure_ceiling", _not_run)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # overhead puts .venv-bench/bin on it
    monkeypatch.chdir(tmp_path)  # the default bench/out, had it run
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"kvswitch bench {argv[0]}: {message}\n", err
    assert not list(tmp_path.iterdir())


def _replicas_clusters(monkeypatch: pytest.MonkeyPatch) -> list[Path | None]:
    """The log_dir of every cluster `bench replicas` asks for; none starts (a ValueError: exit 2)."""
    import bench.replicas

    log_dirs: list[Path | None] = []

    def cluster(spec: ClusterSpec) -> None:
        log_dirs.append(spec.log_dir)
        raise ValueError("no cluster in this test")

    monkeypatch.setattr(bench.replicas, "LocalCluster", cluster)
    return log_dirs


def test_replicas_keep_logs_is_a_switch_that_keeps_them_under_out_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--keep-logs` took a directory here, where overhead and compare take a switch that keeps the
    logs under --out-dir: one flag, two meanings."""
    log_dirs = _replicas_clusters(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "replicas", "--keep-logs", "--out-dir", str(tmp_path / "out")]) == 2
    [kept] = log_dirs
    assert kept is not None and kept.name == "n1" and kept.parent.parent == tmp_path / "out"
    assert kept.parent.name.startswith("replicas-logs-")
    assert f"logs: {kept.parent}\n" in capsys.readouterr().err
    assert main(["bench", "replicas"]) == 2
    assert log_dirs[1:] == [None]


def test_replicas_keep_logs_with_a_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An old-style `--keep-logs DIR` fails, where it would otherwise keep the logs somewhere else."""
    log_dirs = _replicas_clusters(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["bench", "replicas", "--keep-logs", str(tmp_path / "logs")])
    assert exited.value.code == 2
    assert f"unrecognized arguments: {tmp_path / 'logs'}" in capsys.readouterr().err
    assert log_dirs == []


def test_replicas_keep_logs_under_an_out_dir_it_cannot_write_is_refused_naming_out_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was refused once a cluster started, naming `--log-dir`, a flag `bench replicas` lacks,
    after a `logs:` line naming a directory never made (review of 725dcd0)."""
    log_dirs = _replicas_clusters(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    assert main(["bench", "replicas", "--keep-logs", "--out-dir", str(tmp_path / "afile" / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--out-dir {tmp_path / 'afile' / 'out'}: cannot create it" in err, err
    assert "--log-dir" not in err and "logs:" not in err
    assert log_dirs == []


def test_replicas_refused_for_another_flag_creates_no_out_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal after --out-dir was made left the directory behind (review of de87d09)."""
    log_dirs = _replicas_clusters(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no py-spy anywhere
    out = tmp_path / "out"
    argv = ["bench", "replicas", "--keep-logs", "--out-dir", str(out), "--profile", str(tmp_path / "p")]
    assert main(argv) == 2
    assert "--profile needs py-spy" in capsys.readouterr().err
    assert not out.exists() and log_dirs == []


def test_overhead_with_rates_empty_runs_no_open_loop_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--rates ''`, as docs/benchmarks.md's runs give it, skips the open-loop client: 9db9c81's
    check of the rates refused it (`--rates: comma-separated numbers, got ''`)."""
    import bench.overhead

    specs: list[bench.overhead.OverheadSpec] = []

    def run(spec: bench.overhead.OverheadSpec, *args: object, **kwargs: object) -> list[bench.overhead.Phase]:
        specs.append(spec)
        return []

    monkeypatch.setattr(bench.overhead, "run_overhead", run)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # overhead puts .venv-bench/bin on it
    monkeypatch.chdir(tmp_path)
    main(["bench", *OVERHEAD, "--rates", "", "--out-dir", str(tmp_path)])
    assert [spec.rates for spec in specs] == [[]]


@pytest.mark.parametrize(
    ("argv", "runs", "message"),
    [
        ([*SWEEP, "--out-dir", "/proc/nope"], "sweep", "--out-dir /proc/nope: cannot create it"),
        ([*SWEEP, "--out-dir", "{file}"], "sweep", "--out-dir {file}: not a directory"),
        ([*COMPARE, "--out-dir", "/proc/nope"], "compare", "--out-dir /proc/nope: cannot create it"),
        ([*COMPARE, "--out-dir", "{file}"], "compare", "--out-dir {file}: not a directory"),
        (["replay", "--clock", "virtual", "--agg", "1", "--out", "/proc/nope/r.jsonl"], "virtual", "cannot create"),
        (["replay", "--clock", "virtual", "--agg", "1", "--out", "{dir}"], "virtual", "--out {dir}: a directory"),
        (["replay", "--url", "http://127.0.0.1:1", "--out", "/proc/nope/r.jsonl"], "live", "--out /proc/nope/r.jsonl"),
    ],
)
def test_an_output_place_that_cannot_be_written_is_refused_before_the_run(
    argv: list[str],
    runs: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before, sweep, compare and replay ran everything, then failed on the write with a bare errno
    line that named no flag, and the results were lost."""
    import bench.compare
    import bench.replay
    import bench.sweep

    run = {
        "sweep": (bench.sweep, "_measure"),
        "compare": (bench.compare, "run_compare"),
        "virtual": (fleet.VirtualFleet, "run"),
        "live": (bench.replay, "replay"),
    }[runs]
    monkeypatch.setattr(*run, _not_run)
    (tmp_path / "file").write_text("")
    places = {"file": tmp_path / "file", "dir": tmp_path}
    assert main(["bench", *(a.format(**places) for a in argv), "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert message.format(**places) in err, err


@pytest.mark.parametrize(
    "command", [SWEEP, COMPARE, ["replay", "--clock", "virtual", "--agg", "1"], ["summary", str(DATA)]]
)
@pytest.mark.parametrize(("flag", "value"), [("--slo-ttft", "nan"), ("--slo-itl", "-1")])
def test_a_bad_slo_names_the_benchs_flag(
    command: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, the message named the router's --slo-ttft-s and KVSWITCH_SLO_TTFT_S, which were not typed."""
    assert main(["bench", *command, "--limit" if command[0] != "summary" else "--latency-scale", "2", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} must be > 0 and finite, got {value}" in err and "KVSWITCH_" not in err, err


def test_summary_of_a_file_that_holds_no_results_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `Object missing required field 'ok'`, with no file, no line and nothing of what was expected."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    assert main(["bench", "summary", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:1: not a per-request result of `bench replay`" in err and "missing required field" in err, err


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank-lines"])
def test_summary_of_a_file_with_no_results_is_refused(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a table of zeros (goodput 0.00 req/s) and rc 0, as if a run had measured it."""
    path = tmp_path / "results.jsonl"
    path.write_text(content)
    assert main(["bench", "summary", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"{path} holds no results" in captured.err and "goodput" not in captured.out, captured


@pytest.mark.parametrize(
    "argv",
    [
        [*COMPARE[:4], "bogus", *COMPARE[5:], "--out-dir", "{new}"],
        ["replay", "--clock", "virtual", "--agg", "1", "--configuration", "bogus", "--out", "{new}/r.jsonl"],
        ["replay", "--clock", "virtual", "--agg", "1", "--speed", "0", "--out", "{new}/r.jsonl"],
        ["replay", "--clock", "virtual", "--agg", "1", "--routers", "0", "--out", "{new}/r.jsonl"],
        [*SWEEP[:6], "bogus", *SWEEP[7:], "--out-dir", "{new}"],
    ],
)
def test_a_command_refused_leaves_no_output_directory_behind(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The output checks created the directory before the other flags were checked (review of the
    output checks): `bench replay --configuration bogus` left ./bench/out, which then shadowed the
    bench package for `python -m kvswitch` run from that directory."""
    new = tmp_path / "new"
    assert main(["bench", *(a.format(new=new) for a in argv), "--limit", "2"]) == 2
    assert not new.exists(), capsys.readouterr().err


def test_a_sweep_of_aggregated_configurations_may_have_no_prefill_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0P+1D is one aggregated engine: the refusal of 0P is for disaggregated configurations only."""
    import bench.sweep

    monkeypatch.setattr(bench.sweep, "_measure", _not_run)
    agg = ["sweep", "--fleets", "0P+1D", "--rates", "1", "--configs", "kv", "--policy", "kv", "--jobs", "1"]
    with pytest.raises(AssertionError, match="the run started"):
        main(["bench", *agg, "--out-dir", str(tmp_path), "--limit", "2"])
    pd = ["sweep", "--fleets", "0P+1D,1P+1D", "--rates", "1", "--configs", "kv,kv_disagg", "--policy", "kv"]
    assert main(["bench", *pd, "--out-dir", str(tmp_path), "--limit", "2"]) == 2
    assert "--fleets 0P+1D: disaggregated configurations need at least one prefill engine: kv_disagg" in (
        capsys.readouterr().err
    )


def test_a_compare_that_fails_midway_keeps_what_it_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the JSON was written once, at the end: a run whose last configuration failed kept nothing
    from bench import compare

    real = compare.run_virtual

    def second_fails(
        spec: compare.CompareSpec, config: compare.Configuration, rate: float, run: int
    ) -> compare.Measurement:
        if config.name == "slo_aware":
            raise RuntimeError("engine lost")
        return real(spec, config, rate, run)

    monkeypatch.setattr(compare, "run_virtual", second_fails)
    argv = ["bench", "compare", "--clock", "virtual", "--configs", "kv,slo_aware", "--prefill", "1", "--decode", "1"]
    argv += ["--start", "990", "--limit", "4", "--scale-tokens", "0.125", "--out-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "engine lost" in err
    (saved,) = tmp_path.glob("compare-*.json")
    assert f"kvswitch bench compare stopped early: 1 results measured before the failure are in {saved}" in err
    kept = json.loads(saved.read_text())
    assert [m["configuration"] for m in kept] == ["kv"] and kept[0]["summary"]["requests"] == 4
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("argv", [["compare", "--clock", "virtual", "--limit", "2"], ["sweep", "--limit", "2"]])
def test_without_matplotlib_the_extra_is_named_before_any_run(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # matplotlib is the optional `plot` extra: its absence was a traceback
    import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "bench.plot", raising=False)
    monkeypatch.delattr(bench, "plot", raising=False)  # an earlier test's import leaves it on the package
    assert main(["bench", *argv]) == 2
    assert "the figures need matplotlib: pip install 'kvswitch[plot]'" in capsys.readouterr().err


V_REPLAY = ["replay", "--clock", "virtual", "--limit", "2", "--scale-tokens", "0.125"]
V_COMPARE = ["compare", "--clock", "virtual", "--limit", "2", "--scale-tokens", "0.125", "--jobs", "1"]
V_SWEEP = ["sweep", "--limit", "2", "--fleets", "1P+1D", "--rates", "1", "--jobs", "1"]
PROFILES = "allowed: h200:llama-3.1-8b, h200:qwen2.5-32b"
NO_PREFILL = "--prefill 0: disaggregated configurations need at least one prefill engine:"
# One request of 321286 tokens (prompt and output): more than one h200:qwen2.5-32b engine's KV cache holds.
HUGE = ["--start", "0", "--limit", "1", "--scale-tokens", "8", "--profile", "h200:qwen2.5-32b"]
TOO_LONG = (
    "max_model_len 321286, raised from the sims' 32768 to the longest request, does not fit one engine's KV cache"
    " for --profile h200:qwen2.5-32b: at most 217712 (13607 blocks of 16 tokens); set --max-model-len (longer"
    " requests are then errors) or lower --scale-tokens"
)


def _refused_before_running(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvswitch bench *argv` with an output place under tmp_path exits 2 before any run starts
    (sweep's, compare's and a virtual fleet's would raise)."""
    import bench.compare
    import bench.sweep

    monkeypatch.setattr(bench.sweep, "_measure", _not_run)
    monkeypatch.setattr(bench.compare, "_measure_one", _not_run)
    monkeypatch.setattr(fleet, "VirtualFleet", _not_run)
    out = ["--out", str(tmp_path / "r.jsonl")] if argv[0] == "replay" else ["--out-dir", str(tmp_path / "out")]
    assert main(["bench", *argv, *out]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*V_SWEEP, "--profile", "h200:nope"], f"--profile: unknown h200:nope; {PROFILES}"),
        ([*V_COMPARE, "--profile", "h200:nope"], f"--profile: unknown h200:nope; {PROFILES}"),
        ([*V_REPLAY, "--agg", "1", "--profile", "h200:nope"], f"--profile: unknown h200:nope; {PROFILES}"),
        ([*V_COMPARE, "--router-profile", "h200:llama"], "--router-profile: unknown h200:llama; allowed: none, h200:"),
        ([*V_REPLAY, "--agg", "1", "--router-profile", "None"], "--router-profile: unknown None; allowed: none, h200:"),
        ([*V_REPLAY, "--agg", "1", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
        ([*V_COMPARE, "--max-model-len", "-1"], "--max-model-len must be >= 1, got -1"),
        (
            [*V_SWEEP, "--max-model-len", "100000000"],
            "--max-model-len 100000000 does not fit one engine's KV cache for --profile h200:llama-3.1-8b: at most",
        ),
        (
            [*V_COMPARE, "--prefill", "0", "--decode", "2", "--configs", "kv,kv_disagg,slo_aware"],
            f"{NO_PREFILL} kv_disagg, slo_aware",
        ),
        # review of 2026-12-06: the default raised to a request no engine holds ran for ever (timeout 60: rc 124)
        (["replay", "--clock", "virtual", "--agg", "1", *HUGE], TOO_LONG),
        (["compare", "--clock", "virtual", "--configs", "kv", "--jobs", "1", *HUGE], TOO_LONG),
        (["sweep", "--fleets", "1P+1D", "--rates", "1", "--configs", "kv", "--policy", "kv", *HUGE], TOO_LONG),
        ([*V_REPLAY, "--decode", "1", "--configuration", "slo_aware"], f"{NO_PREFILL} slo_aware"),
        ([*V_REPLAY, "--agg", "1", "--router-arg=--disagg=always"], f"{NO_PREFILL} kv"),
        (
            ["sweep", "--fleets", "0P+1D,1P+1D", "--rates", "1", "--configs", "kv,kv_disagg", "--policy", "kv"],
            "--fleets 0P+1D: disaggregated configurations need at least one prefill engine: kv_disagg",
        ),
    ],
)
def test_engines_and_fleets_a_run_cannot_have_are_refused_by_flag_before_it(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review of 2026-12-06: an unknown --profile failed at sweep's and compare's first measurement,
    naming no flag; a --router-profile typo ran to the end (exit 0) with routers that had no cost
    model; a disaggregated configuration on no prefill engine ran under compare and replay (sweep
    alone refused it), reported as disaggregated; replay, compare and sweep had no --max-model-len."""
    _refused_before_running(argv, tmp_path, monkeypatch)
    printed = capsys.readouterr()
    assert message in printed.err and printed.out == "", printed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([*V_REPLAY, "--agg", "1", "--router-profile", "mygpu:one"], "--router-profile"),
        ([*V_COMPARE, "--router-profile", "mygpu:one"], "--router-profile"),
        ([*V_REPLAY, "--agg", "1", "--profile", "mygpu:one"], "--profile"),
        ([*V_SWEEP, "--profile", "mygpu:one"], "--profile"),
    ],
)
def test_a_profile_whose_table_the_loader_refuses_is_refused_by_flag_before_it(
    argv: list[str], flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review of 2026-12-06: the check looked at names only, so an operator's table with a one-point
    decode row passed: replay ran to exit 0 with routers without a cost model, compare and sweep
    failed at their first measurement, --out-dir created, naming no flag."""
    import protocol

    builtin = json.loads((Path(protocol.__file__).parent / "profiles" / "h200.json").read_text())
    [model] = [m for m in builtin["models"] if m["model"] == "llama-3.1-8b"]
    model["model"] = "one"
    model["decode"] = [p for p in model["decode"] if p["context_tokens"] != 256 or p["batch"] == 1]
    table = tmp_path / "tables" / "mygpu.json"
    table.parent.mkdir()
    table.write_text(json.dumps({"models": [model]}))
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(table.parent))
    _refused_before_running(argv, tmp_path, monkeypatch)
    printed = capsys.readouterr()
    message = f"{flag} mygpu:one: timing table {table}, model 'one': `decode` has one point at context_tokens 256"
    assert message in printed.err and printed.out == "", printed
    assert not (tmp_path / "out").exists() and not (tmp_path / "r.jsonl").exists()


# The trace's first second: 8 requests, 3 of them over the sims' 32768 tokens (the longest 42615).
LONG = ["--start", "0", "--duration", "1"]
RAISED = "max_model_len 42615: raised from the sims' 32768 to the longest request (3 of 8 requests are longer;"


def test_virtual_replay_says_when_it_raises_max_model_len_and_the_flag_sets_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review of 2026-12-06: replay raised its engines' max_model_len to the longest request and said
    nothing, so a replay of a `kvswitch plan` row (its engines at 32768) differed from it (52 in SLO
    against 15) with no way to ask for plan's engines."""
    from bench.replay import read_results

    out = tmp_path / "r.jsonl"
    argv = ["bench", "replay", "--clock", "virtual", "--agg", "1", *LONG, "--out", str(out), "--no-progress"]
    main([*argv, "--router-profile", "none"])
    assert RAISED in capsys.readouterr().out
    assert not [r for r in read_results(out) if r.status == 400]
    main([*argv, "--max-model-len", "32768"])
    assert "raised" not in capsys.readouterr().out
    too_long = [r for r in read_results(out) if r.status == 400]
    assert [r.prompt_tokens for r in too_long] == [40160, 36640]  # the third was refused (429) before
    assert all("maximum context length is 32768" in (r.error or "") for r in too_long)


def test_live_compare_raises_its_sims_max_model_len_as_the_virtual_clock_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review of 2026-12-06: live compare raised its sims' max_model_len to the longest request on
    its own, with no KV-fit check and no line saying so: a length no engine holds started the
    cluster, and the table did not say its engines were unlike `kvswitch up`'s. No cluster starts
    here: run_compare records the spec and measures nothing."""
    import types

    import bench.cli
    import bench.compare

    specs: list[bench.compare.CompareSpec] = []

    def recorded(spec: bench.compare.CompareSpec, **kwargs: object) -> list[bench.compare.Measurement]:
        specs.append(spec)
        return []

    monkeypatch.setattr(bench.compare, "run_compare", recorded)
    monkeypatch.setattr(bench.cli, "_plotting", lambda: types.SimpleNamespace(plot_compare=lambda *a, **k: "f.png"))
    live = ["bench", "compare", "--configs", "kv", "--no-progress", "--scale-tokens", "1"]
    live += ["--out-dir", str(tmp_path / "out")]
    assert main([*live, *LONG]) == 0
    assert RAISED in capsys.readouterr().out
    assert specs[-1].sim_args == ["--max-model-len", "42615"]
    assert main([*live, *LONG, "--sim-arg=--max-model-len", "--sim-arg=40000"]) == 0
    assert "raised" not in capsys.readouterr().out
    assert specs[-1].sim_args == ["--max-model-len", "40000"]  # the user's, as given
    assert main([*live, *HUGE]) == 2
    assert TOO_LONG in capsys.readouterr().err and len(specs) == 2  # refused before the cluster


def test_compare_and_sweep_record_their_engines_max_model_len(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.compare import Measurement
    from bench.sweep import read_points

    sweep = ["bench", "sweep", *LONG, "--fleets", "1P+1D", "--rates", "1", "--configs", "kv", "--policy", "kv"]
    assert main([*sweep, "--jobs", "1", "--out-dir", str(tmp_path / "s")]) == 0
    assert RAISED in capsys.readouterr().out
    [points] = [read_points(p) for p in (tmp_path / "s").glob("sweep-*.json")]
    assert [p.max_model_len for p in points] == [42615]
    compare = ["bench", "compare", "--clock", "virtual", *LONG, "--configs", "kv", "--prefill", "1", "--decode", "1"]
    assert main([*compare, "--jobs", "1", "--max-model-len", "40000", "--out-dir", str(tmp_path / "c")]) == 0
    assert "raised" not in capsys.readouterr().out
    [path] = (tmp_path / "c").glob("compare-*.json")
    measured = json.loads(path.read_text())
    assert [Measurement(**m).max_model_len for m in measured] == [40000]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["bench", *VIRTUAL, "--start", "1", "--speed", "1e-300"], "--speed 1e-300"),
        (["bench", *COMPARE, "--limit", "2", "--start", "1", "--rates", "1,1e-300"], "--rates 1e-300"),
        (["bench", *SWEEP, "--limit", "2", "--start", "1", "--rates", "1e-300"], "--rates 1e-300"),
        (
            ["plan", "--gpus", "1", "--policies", "kv", "--limit", "2", "--start", "1", "--rate", "1e-300"],
            "--rate 1e-300",
        ),
    ],
)
def test_a_rate_that_puts_arrivals_past_the_virtual_clocks_bound_is_refused_before_anything_runs(
    argv: list[str], flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 1e-300 times the trace's rate the arrivals came 1e301 s in, where adding a step's duration
    left the time as it was: the run took minutes and reported every request an error."""
    monkeypatch.setattr(fleet.VirtualFleet, "run", _not_run)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag}: the workload's last arrival" in err and f"past its bound of {fleet.MAX_VIRTUAL_S:g} s" in err
    assert err.count("\n") == 1 and not (tmp_path / "bench").exists(), err


def test_repeated_rates_and_configurations_are_measured_once(tmp_path: Path) -> None:
    """`--rates 1,1 --configs kv,kv` ran the same measurement twice (same seed) and reported it as a
    spread of ±0; as plan's --policies and --splits, a repeat now runs once, in order."""
    argv = [*COMPARE, "--limit", "3", "--scale-tokens", "0.125", "--no-progress", "--out-dir", str(tmp_path)]
    assert main(["bench", *argv, "--rates", "2,1,2", "--configs", "kv,round_robin,kv"]) == 0
    (saved,) = tmp_path.glob("compare-*.json")
    measured = [(m["rate"], m["configuration"], m["run"]) for m in json.loads(saved.read_text())]
    assert measured == [(2.0, "kv", 0), (2.0, "round_robin", 0), (1.0, "kv", 0), (1.0, "round_robin", 0)]


def test_a_repeated_fleet_of_a_sweep_is_measured_once(tmp_path: Path) -> None:
    """`--fleets 1P+1D,1P+2D,1P+1D` swept 1P+1D twice (same seed), as --rates and --configs did."""
    from bench.sweep import read_points

    argv = [*SWEEP[:2], "1P+1D,1P+2D,01P+1D", *SWEEP[3:], "--limit", "3", "--scale-tokens", "0.125"]
    assert main(["bench", *argv, "--out-dir", str(tmp_path)]) == 0
    (saved,) = tmp_path.glob("sweep-*.json")
    assert [p.fleet.name for p in read_points(saved)] == ["1P+1D", "1P+2D"]


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ("kv,all", "--configs: `all` stands alone (every configuration), got 'kv,all'"),
        ("kv,nope", "allowed: round_robin, kv,"),
        (",", "--configs: none given"),
    ],
)
def test_configs_all_stands_alone_and_the_message_says_so(
    configs: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--configs kv,all` said `unknown all; allowed: ..., all`."""
    monkeypatch.setattr(fleet.VirtualFleet, "run", _not_run)
    assert main(["bench", *COMPARE, "--limit", "2", "--configs", configs]) == 2
    err = capsys.readouterr().err
    assert message in err and "unknown all" not in err, err


@pytest.mark.parametrize("argv", [VIRTUAL, COMPARE, LIVE])
def test_an_empty_trace_file_is_told_from_an_empty_selection(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file read `the trace selection is empty (check --start/--duration/--limit)`, as plan's does not."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *argv, "--trace", str(empty)]) == 2
    assert f"no records in the trace file {empty}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("router_args", "message"),
    [
        (["--router-arg=--bogus"], "--router-arg --bogus: unrecognized arguments: --bogus"),
        (["--router-arg=--slo-ttft-s", "--router-arg=x"], "--router-arg --slo-ttft-s x: argument --slo-ttft-s:"),
    ],
)
def test_a_bad_router_arg_is_named(
    router_args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed the internal parser's usage under the name `router settings`, naming no --router-arg."""
    monkeypatch.setattr(fleet.VirtualFleet, "run", _not_run)
    assert main(["bench", *VIRTUAL, *router_args]) == 2
    out = capsys.readouterr()
    assert message in out.err and "router settings" not in out.err and out.out == "", out
