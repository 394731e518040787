"""A process that stops of its own accord stops as on SIGTERM, and its stop is cut at the same limit
(runtime.run_service: exit 130, `on_abort` first): a shim that gave up on its engine (a flag the
engine contradicts: a ConfigError), a single simulated engine that crashed, `kvswitch up` whose demo
ended. Until a review of 2026-12-06 each went straight to its stop without setting `stop`, so only
its libraries' timeouts bounded it (as a broken router's was: tests/router/test_broken_stop_limit.py).
Each runs as a process, its drain limit shortened to 2 s; `hang` makes its stop never end, else the
stop ends in time and the process exits with the status it always had."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvswitch.servers import free_port

LIMIT_S = 2.0
SAID = f"still draining after {LIMIT_S:.0f}s: exiting now"

_CLI = """
import asyncio, sys, time
import runtime

hang = sys.argv[1] == "hang"
real_run_service = runtime.run_service

def run_service(main, **kwargs):  # each CLI's own stop path, with a shorter limit
    return real_run_service(main, **{**kwargs, "drain_limit_s": LIMIT_S})

runtime.run_service = run_service

async def stop(self):  # NATS, etcd or a child hung: the stop never ends
    print("stop began", file=sys.stderr, flush=True)
    await asyncio.sleep(3600)

def stop_sync(self, *args, **kwargs):
    print("stop began", file=sys.stderr, flush=True)
    time.sleep(3600)

if hang:
    from engine_sim.fleet import SimFleet
    from kvswitch.cluster import LocalCluster
    from worker_shim.shim import WorkerShim

    WorkerShim.stop = stop
    SimFleet.stop = stop
    LocalCluster.stop = stop_sync  # run on a thread by up

from kvswitch.cli import main
sys.exit(main(sys.argv[2:]))
""".replace("LIMIT_S", repr(LIMIT_S))


class Cli:
    """`kvswitch <argv>` as a process, its stderr read as it comes."""

    def __init__(self, how: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CLI), how, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    @property
    def said(self) -> str:
        return "".join(line for _, line in self.lines)

    def said_at(self, text: str, timeout: float) -> float:
        """When the process first said `text` (waiting up to `timeout` s for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if text in line:
                    return at
            time.sleep(0.05)
        raise AssertionError(f"never said {text!r}: {self.said}")

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)  # before the fix, a hung stop of its own never ended
        self.reader.join(5)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def cli(how: str, argv: list[str], env: dict[str, str] | None = None) -> Iterator[Cli]:
    proc = Cli(how, argv, env)
    try:
        yield proc
    finally:
        proc.close()


def assert_cut_at_the_limit(proc: Cli) -> None:
    """`proc`'s stop began and, hung, was cut at the limit: exit 130 and the ERROR."""
    began = proc.said_at("stop began", 60)
    code = proc.wait(30)
    took = time.monotonic() - began
    assert code == 130, proc.said
    assert SAID in proc.said, proc.said
    assert took <= LIMIT_S + 3.0, (took, proc.said)


@pytest.mark.parametrize("how", ["hang", "in time"])
def test_a_shim_that_gave_up_stops_within_the_sigterm_limit(how: str, nats_url: str, etcd_url: str, ns: str) -> None:
    with cli("-", ["sim", "--port", "0", "--speedup", "100"]) as sim:
        assert sim.proc.stdout is not None
        engine = json.loads(sim.proc.stdout.readline())["url"]
        args = ["shim", "--engine", "vllm", "--engine-url", engine, "--model", "sim-llama",
                "--block-size", "32",  # the sim's is 16: the shim gives up on this engine (ConfigError)
                "--namespace", ns, "--nats-servers", nats_url, "--etcd-endpoints", etcd_url,
                "--http-port", str(free_port()), "--health-interval-s", "0.1"]  # fmt: skip
        with cli(how, args) as shim:
            if how == "hang":
                assert_cut_at_the_limit(shim)
                assert "shim cannot serve this engine" in shim.said, shim.said
            else:
                assert shim.wait(30) == 2, shim.said  # a ConfigError's status, as always
                assert "invalid block_size" in shim.said and SAID not in shim.said, shim.said


@pytest.mark.parametrize("how", ["hang", "in time"])
def test_a_crashed_sim_stops_within_the_sigterm_limit(how: str) -> None:
    argv = ["sim", "--port", "0", "--speedup", "100", "--num-gpu-blocks", "65", "--max-model-len", "1024",
            "--crash-after", "0"]  # fmt: skip
    with cli(how, argv) as sim:
        assert sim.proc.stdout is not None
        url = json.loads(sim.proc.stdout.readline())["url"]
        req = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "x"}',
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(OSError):
            urllib.request.urlopen(req, timeout=10)
        if how == "hang":
            assert_cut_at_the_limit(sim)
            assert "sim crashed" in sim.said, sim.said
        else:
            assert sim.wait(15) == 1, sim.said  # a crashed engine's status, as always
            assert SAID not in sim.said, sim.said


def test_up_whose_demo_ended_stops_within_the_sigterm_limit(tmp_path: Path) -> None:
    # The in-time case is tests/kvswitch/test_up.py's test_up_demo_exits_zero_when_healthy.
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = ["up", "--demo", "--agg", "1", "--http-port", "0"]
    with cli("hang", argv, env={"TMPDIR": str(tmp)}) as up:
        assert up.proc.stdout is not None
        demo = threading.Thread(target=up.proc.stdout.read, daemon=True)  # its results: a pipe left unread may fill
        demo.start()
        assert_cut_at_the_limit(up)
        assert list(tmp.iterdir()) == []  # on_abort (cluster.kill) took everything down
