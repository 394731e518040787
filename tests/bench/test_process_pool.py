"""bench.process_pool: a raise (SIGTERM, Ctrl-C) stops plan's, compare's and sweep's measurements
at once, workers included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.process_pool import STOP_S, process_pool


def test_a_raise_stops_the_running_workers_and_starts_no_queued_one() -> None:
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), process_pool(2) as pool:
        futures = [pool.submit(time.sleep, 60) for _ in range(4)]
        while not (futures[0].running() and futures[1].running()):
            time.sleep(0.01)
        workers = list(pool._processes.values())
        raise KeyboardInterrupt
    assert time.monotonic() - started < STOP_S + 5
    # Gone, not is_alive(): see the test below.
    assert len(workers) == 2 and not [p.pid for p in workers if Path(f"/proc/{p.pid}").exists()]
    assert all(f.cancelled() or f.exception() is not None for f in futures)  # none ran to its end


def _sleep_through_sigterm(ready: Path) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.touch()
    time.sleep(60)


def test_workers_that_outlive_sigterm_share_one_stop_s_then_are_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of 2026-12-06: each worker was given STOP_S in turn, so 4 hung ones held the exit 4 x STOP_S."""
    import bench.process_pool

    monkeypatch.setattr(bench.process_pool, "STOP_S", 1.0)
    with pytest.raises(KeyboardInterrupt), process_pool(4) as pool:
        for i in range(4):
            pool.submit(_sleep_through_sigterm, tmp_path / str(i))
        while len(list(tmp_path.iterdir())) < 4:
            time.sleep(0.01)
        workers = list(pool._processes.values())
        started = time.monotonic()
        raise KeyboardInterrupt
    assert time.monotonic() - started < 3.0  # 4 s and more when each worker had its own STOP_S
    # Gone, not is_alive(): the executor's manager thread reaps workers too, and one it reaped reads
    # alive until that thread records the exit code.
    assert len(workers) == 4 and not [p.pid for p in workers if Path(f"/proc/{p.pid}").exists()]


def test_without_a_raise_every_measurement_is_waited_for() -> None:
    with process_pool(2) as pool:
        out = list(pool.map(abs, [-1, -2, -3]))
    assert out == [1, 2, 3]


# Each runs for minutes (the trace's last 300 s): both workers busy when SIGTERM comes, jobs queued.
COMMANDS = {
    "plan": ["plan", "--gpus", "4", "--start", "722", "--jobs", "2", "--out", "{tmp}/plan.json"],
    "sweep": ["bench", "sweep", "--start", "722", "--jobs", "2", "--out-dir", "{tmp}"],
    "compare": [
        *["bench", "compare", "--clock", "virtual", "--start", "722", "--jobs", "2"],
        *["--configs", "kv,kv_disagg,slo_aware", "--out-dir", "{tmp}"],
    ],
}


@pytest.mark.parametrize(
    ("command", "sig"),
    [*((command, signal.SIGTERM) for command in COMMANDS), ("compare", signal.SIGINT)],
    ids=[*COMMANDS, "compare-ctrl-c"],
)
def test_sigterm_or_ctrl_c_stops_the_command_and_its_workers_at_once(
    tmp_path: Path, command: str, sig: signal.Signals
) -> None:
    """Before, the pool's workers outlived a SIGTERMed plan (reparented to init, waiting for ever);
    then the command waited for its running measurements and started a queued one (31 s for plan).
    A Ctrl-C (SIGINT to the whole process group, workers included) was a traceback from the command
    and one from each worker, until 2026-12-07."""
    argv = [sys.executable, "-m", "kvswitch", *(a.format(tmp=tmp_path) for a in COMMANDS[command])]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None
            out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False)
            workers = [int(p) for p in out.stdout.split()]
            time.sleep(0.1)
        assert len(workers) >= 2, "the pool's workers never started"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=10)  # 0.5 s on a 2-core box; STOP_S if a worker hangs
        assert proc.returncode == 128 + sig and "Traceback" not in err, err
        left = [w for w in workers if Path(f"/proc/{w}").exists()]
        assert not left, f"pool workers {left} outlived {command}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)
