"""Starting a service whose NATS or etcd cannot be reached: `start_or_stop` lets a SIGTERM end the
wait at once, `RepeatedErrors` says a connection error once and then counts it, and the router
and shim CLIs put both together: a stop during the wait exits in a second, not after the drain
limit, with a line naming the flag to check and no traceback per retry; an unreachable etcd is one
line and exit status 1, and a port in use one line and exit status 2."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import runtime
from kvswitch.servers import free_port
from runtime import RepeatedErrors, start_or_stop
from tests.lost_cancellation import ends_within, never_answers


async def test_a_start_that_finishes_first_is_started() -> None:
    assert await start_or_stop(asyncio.sleep(0.01), asyncio.Event()) is True


async def test_a_stop_first_cancels_the_start_and_its_cleanup_runs() -> None:
    cleaned = []

    async def start() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await start_or_stop(start(), stop) is False
    assert cleaned == [True]


async def test_a_stop_first_ends_a_start_that_lost_its_cancellation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start whose first cancellation is lost below it and that tries again (as a connect does):
    the wait for it ended only once it started, which it might never. It is now cancelled again
    until it ends."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.05)  # 10 s in service
    lost: list[str] = []

    async def start() -> None:
        while True:
            await never_answers(lost, "connect")

    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    started: list[bool] = []

    async def starting() -> None:
        started.append(await start_or_stop(start(), stop))

    assert await ends_within(starting(), 5), "start_or_stop still waits on its start"
    assert started == [False] and lost == ["connect"]


async def test_a_start_that_finished_though_cancelled_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """A start whose last call answered as the stop's cancellation came (lost below it) went on and
    finished: the service was started, yet start_or_stop said False, and the CLIs returned 1
    without stopping it, its lease kept to its TTL and its NATS connections undrained (a review of
    2026-12-07). True now: its caller stops it as it stops one that serves."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)  # 10 s in service
    lost: list[str] = []
    started: list[bool] = []

    async def start() -> None:
        await never_answers(lost, "register")
        started.append(True)

    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await start_or_stop(start(), stop) is True
    assert lost == ["register"] and started == [True]


async def test_a_start_that_fails_raises_its_error() -> None:
    async def start() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await start_or_stop(start(), asyncio.Event())


async def test_repeated_errors_are_said_once_then_counted(caplog: pytest.LogCaptureFixture) -> None:
    errors = RepeatedErrors(logging.getLogger("t"), "NATS x", "check --nats-servers", every_s=0.2)
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(50):
            await errors.on_error(ConnectionRefusedError(111, "refused"))
        await errors.on_error(TimeoutError())
        time.sleep(0.25)
        await errors.on_error(ConnectionRefusedError(111, "refused"))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "NATS x: ConnectionRefusedError: [Errno 111] refused (check --nats-servers)",
        "NATS x: TimeoutError (check --nats-servers)",
        lines[2],
    ]
    assert re.fullmatch(
        r"NATS x: ConnectionRefusedError: \[Errno 111\] refused, 50 times more in \d+s \(check --nats-servers\)",
        lines[2],
    )
    assert errors.count == 52


def _run(args: list[str], *, term_after: str | None = None, timeout: float = 30) -> tuple[int, str, float]:
    """The CLI's exit status, stderr and seconds from the SIGTERM (or from start) to its exit."""
    proc = subprocess.Popen([sys.executable, "-m", "kvswitch", *args], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = ""
    started = time.monotonic()
    if term_after is not None:
        while term_after not in err:
            line = proc.stderr.readline()
            assert line, f"exited before saying {term_after!r}: {err}"
            err += line
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
    try:
        rest = proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err + rest, time.monotonic() - started


@pytest.mark.parametrize("cli", ["router", "shim"])
def test_a_stop_while_nats_is_unreachable_exits_at_once_with_one_line(cli: str) -> None:
    nats = f"nats://127.0.0.1:{free_port()}"  # nobody listens
    args = ["--model", "m", "--http-port", "0", "--nats-servers", nats]
    if cli == "shim":
        args += ["--engine", "vllm", "--engine-url", "http://127.0.0.1:1", "--block-size", "16",
                 "--kv-events", "tcp://127.0.0.1:1"]  # fmt: skip
    code, err, took = _run([cli, *args], term_after="check --nats-servers")
    assert code == 0 and took < 5, (code, took, err)  # a stop asked for, as one after the start (was 1)
    assert "Traceback" not in err and err.count(nats) == 1, err
    assert "stopped during start (starting)" in err, err


@pytest.mark.parametrize("cli", ["router", "shim"])
def test_an_unreachable_etcd_is_one_line_naming_the_flag(cli: str, nats_url: str) -> None:
    etcd = f"http://127.0.0.1:{free_port()}"
    args = ["--model", "m", "--http-port", "0", "--nats-servers", nats_url, "--etcd-endpoints", etcd]
    if cli == "shim":
        args += ["--engine", "vllm", "--engine-url", "http://127.0.0.1:1", "--block-size", "16",
                 "--kv-events", "tcp://127.0.0.1:1"]  # fmt: skip
    code, err, _ = _run([cli, *args])
    assert code == 1, err
    assert "Traceback" not in err and f"etcd at {etcd} is not reachable" in err and "--etcd-endpoints" in err, err


def test_a_router_port_in_use_is_one_line_naming_the_flag(nats_url: str, etcd_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--model", "m", "--http-port", str(port), "--nats-servers", nats_url, "--etcd-endpoints", etcd_url]
        code, err, _ = _run(["router", *args])
    assert code == 2, err
    assert "Traceback" not in err and f"invalid http_port (--http-port, KVSWITCH_HTTP_PORT) = {port}" in err, err


def _holds_sigterm(pid: int) -> bool:
    """Whether `pid` has SIGTERM blocked now (/proc's SigBlk mask)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.parametrize("cli", ["router", "shim", "sim"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_it_loads_is_said_and_exits_0(cli: str, sig: signal.Signals, nats_url: str, etcd_url: str) -> None:
    """A signal in the seconds a service spends importing and reading its settings, before
    run_service handles signals: a SIGTERM killed it with status 143 and an empty log, a SIGINT was
    a KeyboardInterrupt traceback. Held back now, it is said once run_service hears it, and the
    process exits 0, as a stop after the start does, having started nothing."""
    args = ["--port", "0"] if cli == "sim" else ["--http-port", "0"]
    if cli != "sim":
        args += ["--model", "m", "--nats-servers", nats_url, "--etcd-endpoints", etcd_url]
    if cli == "shim":
        args += ["--engine", "vllm", "--engine-url", "http://127.0.0.1:1", "--block-size", "16",
                 "--kv-events", "tcp://127.0.0.1:1"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "kvswitch", cli, *args], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _holds_sigterm(proc.pid):  # past the interpreter's start, in kvswitch's own code
            assert proc.poll() is None and time.monotonic() < deadline, "it never held the stop signals back"
            time.sleep(0.001)
        proc.send_signal(sig)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (proc.returncode, err)
    assert f"INFO kvswitch: {sig.name}: stopped during start (loading)" in err, err
    assert "Traceback" not in err and "listening" not in err and "draining" not in err, err
