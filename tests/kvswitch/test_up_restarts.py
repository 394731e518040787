"""`kvswitch up` restarts a child or server that exits while the cluster runs: as it was started (its
ports, argv, environment, log), after a back-off, given up after `RestartPolicy.failures` exits in a
row; never during or after a stop."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import kvswitch.up
from kvswitch.cluster import ClusterSpec, LocalCluster, RestartPolicy
from kvswitch.servers import free_port
from kvswitch.up import _HealthLog, _RoundFaults, _spec, _supervise
from tests.kvswitch.test_up import _alive, _cmdline, _descendants, _up_args


def _until(what: str, ok: Callable[[], object], timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while not (got := ok()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.05)
    return got


def _watched(health: _HealthLog) -> bool:
    health.watch()
    return True


class _Up:
    """A real `kvswitch up` in a session of its own, its log (stderr) in a file to read as it runs."""

    def __init__(self, argv: list[str], tmp_path: Path) -> None:
        self.err = tmp_path / "up.err"
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvswitch", "up", "--speedup", "20", *argv],
                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            )  # fmt: skip
        assert self.proc.stdout is not None
        out = ""
        while "health:" not in out:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.kill()
                pytest.fail(f"kvswitch up exited: {out}{self.said()}")
            out += line

    def said(self) -> str:
        return self.err.read_text(errors="replace")

    def pid(self, command: str) -> int | None:
        """The live child running `kvswitch <command>`."""
        pids = [p for p in _descendants(self.proc.pid) if f"-m kvswitch {command} " in _cmdline(p) and _alive(p)]
        return pids[0] if pids else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _complete(url: str) -> bool:
    body = json.dumps({"model": "sim-llama", "prompt": list(range(300, 340)), "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return bool(json.loads(r.read())["usage"]["completion_tokens"] == 2)
    except (urllib.error.URLError, OSError):
        return False


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return bool(json.loads(r.read()).get("routable", 0) >= 1)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def test_a_killed_engine_and_its_shim_are_restarted_and_requests_route_again(tmp_path: Path) -> None:
    # Each stayed dead ("dead=sim-agg,shim-agg-P" in the health line) until an operator restarted
    # kvswitch up by hand.
    http = free_port()
    up = _Up(["--agg", "1", "--http-port", str(http), "--restart-backoff-s", "0.2"], tmp_path)
    try:
        sim, shim = up.pid("sim"), up.pid("shim")
        assert sim and shim
        os.kill(sim, signal.SIGKILL)
        os.kill(shim, signal.SIGKILL)
        _until("both restarted", lambda: {up.pid("sim"), up.pid("shim")}.isdisjoint({sim, shim, None}))
        said = up.said()
        for name in ("sim-agg", r"shim-agg-\d+"):
            exited = rf"WARNING .*child exited: {name} \(status -9.*restarting it in 0\.\ds"
            assert re.search(exited, said, re.DOTALL), said
        # the shim registers again and points at its engine's port, which the sim listens on again
        _until("a request routed", lambda: _complete(f"http://127.0.0.1:{http}"), timeout=30)
        _until("healthy again", lambda: "healthy again: health: nats=ok etcd=ok children=3/3 up" in up.said())
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.close()


def test_a_killed_router_is_restarted_on_its_port_and_ready(tmp_path: Path) -> None:
    http = free_port()
    up = _Up(["--agg", "1", "--http-port", str(http), "--restart-backoff-s", "0.2"], tmp_path)
    try:
        router = up.pid("router")
        assert router
        os.kill(router, signal.SIGKILL)
        again = _until("restarted", lambda: (p := up.pid("router")) not in (None, router) and p)
        assert isinstance(again, int) and f"--http-port {http} " in _cmdline(again)
        assert re.search(r"WARNING .*child exited: router-0 \(status -9.*restarting it in", up.said(), re.DOTALL)
        _until("ready", lambda: _ready(f"http://127.0.0.1:{http}"), timeout=30)
        assert _complete(f"http://127.0.0.1:{http}")
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0
    finally:
        up.close()


def test_a_sigterm_during_a_back_off_stops_cleanly_and_restarts_nothing(tmp_path: Path) -> None:
    up = _Up(["--agg", "1", "--routers", "0", "--restart-backoff-s", "30"], tmp_path)
    try:
        everything = _descendants(up.proc.pid)
        shim = up.pid("shim")
        assert shim
        os.kill(shim, signal.SIGKILL)
        _until("the back-off", lambda: "restarting it in 30.0s" in up.said())
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(30) == 0
        assert "kvswitch up: stopped" in up.said() and "restarted " not in up.said(), up.said()
        time.sleep(0.3)
        assert not [p for p in everything + _descendants(up.proc.pid) if _alive(p)], "children left behind"
    finally:
        up.close()


def test_a_child_that_fails_at_once_every_time_is_given_up_and_the_rest_runs_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = RestartPolicy(first_s=0.1, failures=5)
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path, restart=policy))
    try:
        cluster.start()  # the servers alone
        bad = cluster.spawn("sim-agg", ["sim", "--no-such-flag"])
        health = _HealthLog(cluster, cluster.health_line())
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            _until("given up", lambda: _watched(health) and bad.backoff.given_up)
            for _ in range(3):  # and no more restarts after
                time.sleep(policy.first_s)
                health.watch()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(warnings) == 4 and bad.backoff.restarts == 4, warnings
        assert "restarting it in 0.1s (exit 1 in a row; given up at 5)" in warnings[0]
        assert "restarting it in 0.8s (exit 4 in a row; given up at 5)" in warnings[3]
        assert len(errors) == 1, errors
        assert errors[0].startswith("child exited: sim-agg (status 2; its last output:")
        assert "unrecognized arguments: --no-such-flag" in errors[0]
        assert "given up: it exited 5 times in a row, each within 60s of its start" in errors[0]
        assert "a bad flag?" in errors[0]
        refusal = "kvswitch sim: unrecognized arguments: --no-such-flag;"
        assert (tmp_path / "sim-agg.log").read_text().count(refusal) == 5  # one log, appended
        line, healthy = cluster.health()
        assert line == "health: nats=ok etcd=ok children=0/1 up dead=sim-agg" and not healthy
    finally:
        cluster.stop()


def test_a_killed_nats_server_is_restarted_on_its_port(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path, restart=RestartPolicy(first_s=0.05)))
    try:
        cluster.start()  # the servers alone
        assert cluster.nats is not None
        nats = cluster.nats.nodes[0]
        assert nats.proc is not None
        url, first = nats.url, nats.proc.pid
        nats.proc.kill()
        nats.proc.wait(10)
        health = _HealthLog(cluster, cluster.health_line())
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            health.watch()
            assert "restarting=nats-0" in cluster.health_line()
            _until("restarted", lambda: _watched(health) and nats.proc is not None and nats.proc.pid != first)
        _until("healthy", nats.healthy)
        assert nats.url == url and cluster.health() == ("health: nats=ok etcd=ok children=0/0 up", True)
        said = [r.getMessage()[:34] for r in caplog.records]
        assert said == ["server exited: nats-0 nats://127.0", "restarted nats-0"]
    finally:
        cluster.stop()


def test_a_stop_ends_restarts(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path, restart=RestartPolicy(first_s=0.01)))
    child = cluster.spawn("sim-agg", ["sim", "--no-such-flag"])
    child.proc.wait(30)
    cluster.note_exits(time.monotonic())
    cluster.stop()
    assert cluster.restart_due(time.monotonic() + 1) == [] and child.proc.poll() is not None


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--restart-backoff-s", "0"],
            "--restart-backoff-s must be a finite number of seconds >= 0.1, got 0.0",
        ),
        (
            ["--restart-backoff-s", "nan"],
            "--restart-backoff-s must be a finite number of seconds >= 0.1, got nan",
        ),
        # a supervisor that looks for exits every half back-off spun at 92% of a core at 0.001
        (["--restart-backoff-s", "0.001"], "--restart-backoff-s must be a finite number of seconds >= 0.1, got 0.001"),
        (["--no-restart", "--restart-backoff-s", "2"], "--restart-backoff-s has no effect with --no-restart"),
    ],
)
def test_a_bad_restart_flag_is_refused_naming_it(argv: list[str], said: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(said)):
        _spec(_up_args(["--agg", "1", *argv]))


def test_restarts_are_on_unless_no_restart() -> None:
    assert _spec(_up_args(["--agg", "1"])).restart == RestartPolicy()
    assert _spec(_up_args(["--agg", "1", "--restart-backoff-s", "45"])).restart == RestartPolicy(45.0, 45.0)
    assert _spec(_up_args(["--agg", "1", "--no-restart"])).restart is None


def test_a_restart_after_its_log_directory_was_removed_makes_it_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # `rm -rf` of --log-dir while up ran: the restart's FileNotFoundError took the whole cluster down
    logs = tmp_path / "logs"
    cluster = LocalCluster(ClusterSpec(log_dir=logs, restart=RestartPolicy(first_s=0.05)))
    try:
        child = cluster.spawn("sim-agg", ["sim", "--no-such-flag"])
        child.proc.wait(30)
        health = _HealthLog(cluster, cluster.health_line())
        health.watch()
        shutil.rmtree(logs)
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            _until("restarted", lambda: _watched(health) and child.backoff.restarts == 1)
        assert "restarted sim-agg" in [r.getMessage() for r in caplog.records]
        child.proc.wait(30)
        assert "--no-such-flag" in (logs / "sim-agg.log").read_text()
    finally:
        cluster.stop()


def test_a_restart_after_the_scratch_directory_was_removed_fails_and_never_writes_where_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # It was made again, 0o755 where mkdtemp's was 0o700, and a directory planted at its path was taken
    cluster = LocalCluster(ClusterSpec(restart=RestartPolicy(first_s=0.05, failures=2)))
    try:
        child = cluster.spawn("sim-agg", ["sim", "--no-such-flag"])
        child.proc.wait(30)
        scratch = child.log.parent
        health = _HealthLog(cluster, cluster.health_line())
        health.watch()
        shutil.rmtree(scratch)
        scratch.mkdir(mode=0o777)  # another's, planted where it was
        with caplog.at_level(logging.ERROR, logger="kvswitch.up"):
            _until("given up", lambda: _watched(health) and child.backoff.given_up)
        assert list(scratch.iterdir()) == [] and child.backoff.restarts == 0
        said = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        assert said.startswith(
            f"child sim-agg could not be restarted: cannot write {scratch}/sim-agg.log: the cluster's scratch "
            f"directory {scratch} was removed while it ran, and is not made again"
        ), said
        scratch.rmdir()
    finally:
        cluster.stop()


def test_a_server_whose_store_was_removed_is_not_restarted_and_counts_as_an_exit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Its store was made again, 0o755, empty: a NATS node restarted on nothing it held
    cluster = LocalCluster(ClusterSpec(restart=RestartPolicy(first_s=0.05, failures=2)))
    try:
        cluster.start()  # the servers alone
        assert cluster.nats is not None
        nats = cluster.nats.nodes[0]
        assert nats.proc is not None
        store = nats.workdir
        shutil.rmtree(store)
        nats.proc.kill()
        health = _HealthLog(cluster, cluster.health_line())
        with caplog.at_level(logging.ERROR, logger="kvswitch.up"):
            _until("given up", lambda: _watched(health) and cluster._server_backoff["nats-0"].given_up)
        assert not store.exists() and cluster._server_backoff["nats-0"].restarts == 0
        said = [r.getMessage() for r in caplog.records if "could not be restarted" in r.getMessage()]
        assert said and said[0].startswith(
            f"server nats-0 could not be restarted: nats: its store {store} was removed while it ran"
        ), said
    finally:
        cluster.stop()


def test_a_log_is_made_private_and_a_symlink_in_its_place_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # open("ab") made it 0o644 and followed a link planted in its place, appending to the file it named
    logs, target = tmp_path / "logs", tmp_path / "not-a-log"
    target.write_text("kept\n")
    cluster = LocalCluster(ClusterSpec(log_dir=logs, restart=RestartPolicy(first_s=0.05, failures=2)))
    try:
        child = cluster.spawn("sim-agg", ["sim", "--no-such-flag"])
        child.proc.wait(30)
        assert (logs / "sim-agg.log").stat().st_mode & 0o777 == 0o600
        health = _HealthLog(cluster, cluster.health_line())
        health.watch()
        (logs / "sim-agg.log").unlink()
        (logs / "sim-agg.log").symlink_to(target)
        with caplog.at_level(logging.ERROR, logger="kvswitch.up"):
            _until("given up", lambda: _watched(health) and child.backoff.given_up)
        assert target.read_text() == "kept\n" and child.backoff.restarts == 0
        said = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
        assert said.startswith(
            f"child sim-agg could not be restarted: --log-dir {logs}: cannot write sim-agg.log: {logs}/sim-agg.log is "
            "a symlink; kvswitch up writes no log through a symlink (replace it with a file)"
        ), said
    finally:
        cluster.stop()


def test_a_child_that_cannot_be_started_again_counts_as_an_exit_and_the_rest_runs_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The OSError from its log's open left restart_due with a traceback, and up with rc 1: the whole
    # cluster went down for one child; the child after it was never restarted.
    policy = RestartPolicy(first_s=0.05, failures=3)
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path, restart=policy))
    try:
        bad = cluster.spawn("sim-agg", ["sim", "--no-such-flag"])
        other = cluster.spawn("sim-decode", ["sim", "--no-such-flag"])
        bad.proc.wait(30)
        other.proc.wait(30)
        (tmp_path / "sim-agg.log").unlink()
        (tmp_path / "sim-agg.log").mkdir()  # its log cannot be opened any more
        health = _HealthLog(cluster, cluster.health_line())
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            _until("given up", lambda: _watched(health) and bad.backoff.given_up)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "sim-agg" in r.getMessage()]
        cannot = f"child sim-agg could not be restarted: --log-dir {tmp_path}: cannot write sim-agg.log: Is a directory"
        assert len(errors) == 2 and all(e.startswith(cannot) for e in errors), errors
        assert re.search(r"; trying again in 0\.\ds \(counted as exit 2 in a row; given up at 3\)$", errors[0]), errors
        assert errors[1].endswith(
            "; given up: it exited or could not be started 3 times in a row, each within 60s of its start; the rest of "
            "the cluster runs on, restart kvswitch up to try it again"
        ), errors
        assert bad.backoff.restarts == 0 and other.backoff.restarts >= 1
        assert "restarted sim-decode" in [r.getMessage() for r in caplog.records]
        assert "dead=sim-agg" in cluster.health_line()
    finally:
        cluster.stop()


def test_a_server_that_cannot_be_started_again_is_tried_again_after_its_back_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # `rm -rf` of --log-dir, then a nats-server exit: launch's FileNotFoundError took the cluster down.
    logs = tmp_path / "logs"
    cluster = LocalCluster(ClusterSpec(log_dir=logs, restart=RestartPolicy(first_s=0.05)))
    try:
        cluster.start()  # the servers alone
        assert cluster.nats is not None
        nats = cluster.nats.nodes[0]
        assert nats.proc is not None
        first = nats.proc.pid
        shutil.rmtree(logs)
        logs.write_text("")  # a file where its directory was: nothing can make it again
        nats.proc.kill()
        nats.proc.wait(10)
        health = _HealthLog(cluster, cluster.health_line())
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            _until(
                "a failed restart", lambda: _watched(health) and any(r.levelno == logging.ERROR for r in caplog.records)
            )
            error = next(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
            assert error.startswith(
                f"server nats-0 could not be restarted: nats: cannot write its log {logs}/nats-0.log"
            )
            assert (
                "(counted as exit 2 in a row; given up at 5)" in error and "restarting=nats-0" in cluster.health_line()
            )
            logs.unlink()
            _until("restarted", lambda: _watched(health) and nats.proc is not None and nats.proc.pid != first)
        _until("healthy", nats.healthy)
        assert (logs / "nats-0.log").stat().st_size > 0
    finally:
        cluster.stop()


class _Raising:
    """A health log whose first watch raises `error`; the next ends the supervision."""

    def __init__(self, error: BaseException, stop: asyncio.Event) -> None:
        self.error, self.stop, self.watched = error, stop, 0

    def watch(self) -> None:
        self.watched += 1
        if self.watched == 1:
            raise self.error
        self.stop.set()

    probe = watch


class _Cluster:
    spec = ClusterSpec(restart=RestartPolicy())

    def next_restart(self) -> None:
        return None


def _supervised(error: BaseException, monkeypatch: pytest.MonkeyPatch) -> _Raising:
    monkeypatch.setattr(kvswitch.up, "WATCH_S", 0.01)

    async def supervise() -> _Raising:
        stop = asyncio.Event()
        health = _Raising(error, stop)
        await _supervise(_Cluster(), health, stop)  # type: ignore[arg-type]
        return health

    return asyncio.run(supervise())


def test_a_supervision_round_that_raises_is_logged_and_supervision_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An exception in one round of the loop (an OSError no restart foresaw) stopped the whole cluster
    with caplog.at_level(logging.ERROR, logger="kvswitch.up"):
        health = _supervised(OSError(24, "Too many open files"), monkeypatch)
    assert health.watched == 2
    [record] = caplog.records
    assert record.getMessage() == (
        "watching for exits and restarts failed: OSError: [Errno 24] Too many open files; the cluster runs on, "
        "and is stopped if none works for 60s"
    )
    assert record.exc_info is not None and isinstance(record.exc_info[1], OSError)


def test_a_keyboard_interrupt_in_a_supervision_round_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyboardInterrupt):
        _supervised(KeyboardInterrupt(), monkeypatch)


class _AlwaysRaising:
    """A health log whose every round raises, as a fault no restart foresaw would."""

    def __init__(self, failing: int | None = None, stop: asyncio.Event | None = None) -> None:
        self.rounds, self.failing, self.stop = 0, failing, stop

    def watch(self) -> None:
        self.rounds += 1
        if self.failing is None or self.rounds <= self.failing:
            raise KeyError("a fault no restart foresaw")
        assert self.stop is not None
        self.stop.set()

    probe = watch


def _supervised_until_it_ends(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, health: _AlwaysRaising
) -> str | None:
    """`_supervise` with `health`, rounds half a second apart on a fake clock, its ERRORs captured:
    the fault it ended with (None: stopped)."""
    monkeypatch.setattr(kvswitch.up, "WATCH_S", 0.001)
    now = [0.0]

    def clock() -> float:  # half a second per round, as WATCH_S's
        now[0] += 0.5
        return now[0]

    async def supervise() -> str | None:
        faults = _RoundFaults(every_s=30.0, bound_s=60.0, clock=clock)
        return await _supervise(_Cluster(), health, asyncio.Event(), faults)  # type: ignore[arg-type]

    with caplog.at_level(logging.ERROR, logger="kvswitch.up"):
        return asyncio.run(supervise())


def test_rounds_that_keep_failing_are_said_once_then_counted_then_end_supervision_naming_the_fault(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Each failing round (every 0.5 s) logged a whole traceback, forever: 19 in 10 s, "supervised still"
    fault = _supervised_until_it_ends(monkeypatch, caplog, _AlwaysRaising())
    assert fault == (
        "watching for exits and restarts failed for 60s, none working since, the last with KeyError: 'a fault no "
        "restart foresaw'"
    )
    first, again = caplog.records
    assert first.exc_info is not None and first.getMessage().startswith("watching for exits and restarts failed: ")
    assert again.exc_info is None and again.getMessage() == (
        "watching for exits and restarts failed again (60 times in 30s), the last with KeyError: 'a fault no "
        "restart foresaw'; none worked for 30s, the cluster is stopped at 60s"
    )


def test_a_round_that_works_again_ends_the_count(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kvswitch.up, "WATCH_S", 0.001)

    async def supervise() -> str | None:
        stop = asyncio.Event()
        return await _supervise(_Cluster(), _AlwaysRaising(3, stop), stop)  # type: ignore[arg-type]

    with caplog.at_level(logging.INFO, logger="kvswitch.up"):
        assert asyncio.run(supervise()) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[1].startswith("watching for exits and restarts works again, after "), said


class _HealthFailing(_Cluster):
    """A cluster whose exits and restarts are watched as ever, and whose health probe raises."""

    def __init__(self) -> None:
        self.watched = self.probed = 0

    def note_exits(self, now: float) -> list[object]:
        self.watched += 1
        return []

    def restart_due(self, now: float) -> list[object]:
        return []

    def health(self) -> tuple[str, bool]:
        self.probed += 1
        raise KeyError("a fault in the health check alone")


def test_a_health_check_that_keeps_failing_between_working_watch_rounds_ends_supervision(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The check every 5 s failed and each 0.5 s watch between worked: "works again" each time, the count
    # reset, a whole traceback every 5 s (15 in 75 s), never stopped, and no health line said
    monkeypatch.setattr(kvswitch.up, "WATCH_S", 0.001)
    monkeypatch.setattr(kvswitch.up, "CHECK_S", 0.02)
    cluster = _HealthFailing()

    async def supervise() -> str | None:
        faults = _RoundFaults(every_s=30.0, bound_s=0.3)
        health = _HealthLog(cluster, "health: nats=ok etcd=ok children=0/0 up")  # type: ignore[arg-type]
        return await asyncio.wait_for(_supervise(cluster, health, asyncio.Event(), faults), 10)  # type: ignore[arg-type]

    with caplog.at_level(logging.INFO, logger="kvswitch.up"):
        fault = asyncio.run(supervise())
    assert fault == (
        "the health check failed for 0s, none working since, the last with KeyError: 'a fault in the health check "
        "alone'"
    )
    assert cluster.probed > 3 and cluster.watched > 2 * cluster.probed, (cluster.probed, cluster.watched)
    [record] = caplog.records  # no "works again" at each watch between
    assert record.getMessage().startswith("the health check failed: KeyError: 'a fault in the health check alone'")
    assert record.exc_info is not None and record.exc_info[1] is not None
    # the round ran inside the wait's `except TimeoutError:`: its traceback carried both, chained
    assert record.exc_info[1].__context__ is None


def test_a_new_fault_is_said_at_once_and_the_same_one_again_only_after_every_s() -> None:
    now = [0.0]
    part = kvswitch.up._PartFaults("the health check", 30.0, 60.0, lambda: now[0])
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage().split(";")[0])  # type: ignore[method-assign]
    kvswitch.up.log.addHandler(handler)
    try:
        for now[0], exc in [(0, KeyError("a")), (5, KeyError("a")), (10, OSError("b")), (15, KeyError("a")),
                            (30, KeyError("a"))]:  # fmt: skip
            assert part.failed(exc) is None
    finally:
        kvswitch.up.log.removeHandler(handler)
    assert said == [
        "the health check failed: KeyError: 'a'",
        "the health check failed: OSError: b",
        "the health check failed again (3 times in 30s), the last with KeyError: 'a'",
    ]


class _ExitedAt(_AlwaysRaising):
    """A health log whose every round raises from one line, its message naming the round's time."""

    def watch(self) -> None:
        self.rounds += 1
        raise RuntimeError(f"child router-0 exited at t={self.rounds * 0.5:.1f}s")


def test_a_fault_whose_message_changes_each_round_is_one_fault_said_once_then_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Review of d7e1f1e: keyed on its text, each round's was a new fault, a whole traceback every
    # 0.5 s (20 in 10 s), where the same fault again was promised at most every 30 s with a count
    fault = _supervised_until_it_ends(monkeypatch, caplog, _ExitedAt())
    assert fault == (
        "watching for exits and restarts failed for 60s, none working since, the last with RuntimeError: child "
        "router-0 exited at t=60.5s"
    )
    first, again = caplog.records
    assert first.exc_info is not None and first.getMessage().startswith(
        "watching for exits and restarts failed: RuntimeError: child router-0 exited at t=0.5s; "
    )
    assert again.exc_info is None and again.getMessage() == (
        "watching for exits and restarts failed again (60 times in 30s), the last with RuntimeError: child "
        "router-0 exited at t=30.5s; none worked for 30s, the cluster is stopped at 60s"
    )


def _raised_at(line: int) -> KeyError:
    """A KeyError raised from `line` of a file of its own: a fault of its own."""
    try:
        exec(compile("\n" * (line - 1) + "raise KeyError('x')", "faults.py", "exec"))
    except KeyError as exc:
        return exc
    raise AssertionError("unreachable")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_new_faults_show_one_traceback_every_s_the_others_a_line_each() -> None:
    now = [0.0]
    part = kvswitch.up._PartFaults("the health check", 30.0, 600.0, lambda: now[0])
    handler = _Records()
    records = handler.records
    kvswitch.up.log.addHandler(handler)
    try:
        for now[0], line in [(0, 1), (0.5, 2), (1, 3), (1.5, 2), (30, 4), (31, 5)]:
            assert part.failed(_raised_at(line)) is None
        part.ok()  # the cap outlives a working round: failing and working in turn must not flood either
        now[0] = 32
        assert part.failed(_raised_at(1)) is None
    finally:
        kvswitch.up.log.removeHandler(handler)
    traced = "the cluster runs on, and is stopped if none works for 600s"
    assert [
        (r.getMessage().split("; ", 1)[1], r.exc_info is not None) for r in records if r.levelno >= logging.ERROR
    ] == [
        (traced, True),  # line 1, at 0
        (f"raised at faults.py:2, its traceback not shown (one every 30s at most, the last 0s ago); {traced}", False),
        (f"raised at faults.py:3, its traceback not shown (one every 30s at most, the last 1s ago); {traced}", False),
        (traced, True),  # line 4, at 30 (line 2 again at 1.5 was counted)
        (f"raised at faults.py:5, its traceback not shown (one every 30s at most, the last 1s ago); {traced}", False),
        (f"raised at faults.py:1, its traceback not shown (one every 30s at most, the last 2s ago); {traced}", False),
    ]


class _FakeCluster:
    """Enough of LocalCluster for `run` with no workers: it starts, and `stop` is counted; it says
    it killed the children named in `killed`."""

    killed: list[str] = []

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec, self.stops = spec, 0
        _FakeCluster.made = self

    made: _FakeCluster

    def start(self, *, stop_if_failed: bool = True) -> None:
        pass

    def describe(self) -> str:
        return "a fake cluster"

    def health_line(self) -> str:
        return "health: fake"

    def next_restart(self) -> None:
        return None

    def own_commands(self) -> list[str]:
        return []

    def stop(self, grace_s: float = 0.0, *, again: str = "") -> list[str]:
        self.stops += 1
        return self.killed


def test_up_stops_its_cluster_and_exits_1_naming_the_fault_when_supervision_keeps_failing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(kvswitch.up, "WATCH_S", 0.001)
    monkeypatch.setattr(kvswitch.up, "LocalCluster", _FakeCluster)
    monkeypatch.setattr(kvswitch.up, "_HealthLog", lambda cluster, said: _AlwaysRaising())
    monkeypatch.setattr(kvswitch.up, "_RoundFaults", functools.partial(_RoundFaults, bound_s=0.05))
    assert kvswitch.up.run(_up_args(["--routers", "0"])) == 1
    assert _FakeCluster.made.stops == 1
    err = capsys.readouterr().err
    assert re.search(
        r"kvswitch up: watching for exits and restarts failed for 0s, none working since, the last with KeyError: "
        r"'a fault no restart foresaw': the cluster is no longer supervised, so it is stopped\n",
        err,
    ), err


class _Signalling:
    """A health log whose first round sends this process SIGTERM, as an operator stopping up would."""

    def watch(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def probe(self) -> None:
        pass


@pytest.mark.parametrize(
    ("killed", "status", "said"),
    [
        ([], 0, "kvswitch up: stopped\n"),
        (
            ["shim-agg-1"],
            1,
            "kvswitch up: stopped, but killed 1 child that did not stop within 35s of SIGTERM (shim-agg-1): what it "
            "served was cut; exit 1\n",
        ),
    ],
    ids=["clean", "killed"],
)
def test_up_says_so_and_exits_1_when_its_stop_had_to_kill_a_child(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], killed: list[str], status: int, said: str
) -> None:
    # A shim that did not stop within 35 s of SIGTERM was an ERROR line among others; up then said
    # "kvswitch up: stopped" and exited 0, as after a clean stop (review of 2026-12-07).
    monkeypatch.setattr(kvswitch.up, "WATCH_S", 0.001)
    monkeypatch.setattr(kvswitch.up, "LocalCluster", _FakeCluster)
    monkeypatch.setattr(kvswitch.up, "_HealthLog", lambda cluster, said: _Signalling())
    monkeypatch.setattr(_FakeCluster, "killed", killed)
    assert kvswitch.up.run(_up_args(["--routers", "0"])) == status
    assert _FakeCluster.made.stops == 1
    err = capsys.readouterr().err
    assert err.endswith(said), err


def test_a_child_restarting_within_its_back_off_is_a_warning_and_an_error_only_once_it_stays_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Log audit: a plain router restart (SIGTERM, status 0) was `WARNING child exited` and then
    `ERROR unhealthy: ... restarting=router-0`, an ERROR for a restart up was already doing."""
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path, restart=RestartPolicy(first_s=0.05)))
    now = [time.monotonic()]
    try:
        cluster.start()  # the servers alone
        port = free_port()
        child = cluster.spawn("router-0", ["sim", "--host", "127.0.0.1", "--port", str(port)])
        child.probes = [f"http://127.0.0.1:{port}/health"]
        child.serving = False
        _until("serving", lambda: cluster.health()[1], timeout=60)
        health = _HealthLog(cluster, cluster.health_line(), clock=lambda: now[0])
        child.proc.terminate()
        child.proc.wait(10)
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            health.check()  # its exit, and the cluster waiting out its back-off
            now[0] += 0.1
            health.watch()  # restarted
            child.probes = [f"http://127.0.0.1:{free_port()}/health"]  # and never serving again
            health.probe()
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
            said = [(r.levelno, r.getMessage()) for r in caplog.records if "unhealthy" in r.getMessage()]
            assert said == [(logging.WARNING, "unhealthy: health: nats=ok etcd=ok children=0/1 up restarting=router-0")]
            now[0] += kvswitch.up.RESTART_GRACE_S + 1  # down past its back-off and the grace to serve
            health.probe()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == ["unhealthy: health: nats=ok etcd=ok children=0/1 up restarting=router-0"]
    finally:
        cluster.stop()
