"""CPU accounting from /proc/<pid>/stat: exact arithmetic on a fixed workload (a fake /proc whose
counters move by known amounts), the parse of awkward command names, loud failures, a real
process that burns a known amount of its own CPU time, and pinning every thread of a real
nats-server and of this process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench.bench_index_fleet import nats_server
from bench.cpu import CpuCost, CpuSampler, ProcStatError, pin_process, read_cpu_ticks
from kvswitch.servers import NatsServer


def _write_stat(proc: Path, pid: int, utime: int, stime: int, comm: str = "python3") -> None:
    # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime ...
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "100", "0", "0", "0", str(utime), str(stime)]
    fields += ["7", "3", "20", "0", "4", "0", "12345"]  # cutime cstime priority nice threads ... (ignored)
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_reads_utime_plus_stime_not_the_children_fields(tmp_path: Path) -> None:
    _write_stat(tmp_path, 42, utime=1234, stime=56)
    assert read_cpu_ticks(42, tmp_path) == 1290


@pytest.mark.parametrize("comm", ["kvswitch router", "a) b", "((x))", ") 1 2 3 4 5 6 7 8 9 10 11 12"])
def test_command_names_with_spaces_and_parentheses_do_not_shift_the_fields(tmp_path: Path, comm: str) -> None:
    _write_stat(tmp_path, 7, utime=300, stime=20, comm=comm)
    assert read_cpu_ticks(7, tmp_path) == 320


def test_a_missing_process_is_an_error_naming_the_pid(tmp_path: Path) -> None:
    with pytest.raises(ProcStatError, match="/proc/99/stat"):
        read_cpu_ticks(99, tmp_path)


def test_a_malformed_stat_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "stat").write_text("5 (x) S 1 2\n")
    with pytest.raises(ProcStatError, match="malformed"):
        read_cpu_ticks(5, tmp_path)


def test_fixed_workload_costs_exactly_its_tick_delta_per_request_and_per_token(tmp_path: Path) -> None:
    """Router pid 10, shims 11 and 12; 100 ticks/s. Over the window the router uses 250 ticks
    (2.5 s) and the shims 40 + 60 ticks (1.0 s); the window served 500 requests, 8,000 tokens."""
    clock = _Clock()
    sampler = CpuSampler({"router": [10], "shim": [11, 12]}, proc=tmp_path, ticks_per_s=100, clock=clock)
    _write_stat(tmp_path, 10, utime=1000, stime=200)
    _write_stat(tmp_path, 11, utime=50, stime=5)
    _write_stat(tmp_path, 12, utime=70, stime=7)
    clock.now = 100.0
    t0 = sampler.sample()
    _write_stat(tmp_path, 10, utime=1200, stime=250)
    _write_stat(tmp_path, 11, utime=80, stime=15)
    _write_stat(tmp_path, 12, utime=120, stime=17)
    clock.now = 105.0
    t1 = sampler.sample()

    window = sampler.window(t0, t1)
    assert window.wall_s == 5.0
    assert window.cpu_s == {"router": 2.5, "shim": 1.0}
    router = window.cost("router", requests=500, tokens=8000)
    shim = window.cost("shim", requests=500, tokens=8000)
    assert (router.us_per_request, router.us_per_token) == (5000.0, 312.5)
    assert (shim.us_per_request, shim.us_per_token) == (2000.0, 125.0)


def test_a_window_known_only_afterwards_widens_to_the_samples_around_it(tmp_path: Path) -> None:
    clock = _Clock()
    sampler = CpuSampler({"router": [1]}, proc=tmp_path, ticks_per_s=100, clock=clock)
    for t, ticks in [(0.0, 0), (1.0, 10), (2.0, 30), (3.0, 60), (4.0, 100)]:
        _write_stat(tmp_path, 1, utime=ticks, stime=0)
        clock.now = t
        sampler.sample()
    window = sampler.window(1.5, 2.5)  # samples at 1.0 and 3.0 enclose it
    assert (window.wall_s, window.cpu_s["router"]) == (2.0, 0.5)
    assert sampler.window(2.0, 3.0).cpu_s["router"] == 0.3  # exact on sample times
    with pytest.raises(ValueError, match="no samples around"):
        sampler.window(3.5, 4.5)


def test_nothing_served_has_no_per_unit_cost() -> None:
    cost = CpuCost(cpu_s=0.2, requests=0, tokens=0)
    assert cost.us_per_request is None and cost.us_per_token is None


def test_a_process_that_burns_a_known_cpu_time_is_measured_to_the_tick(tmp_path: Path) -> None:
    """The child spins until its own CPU clock has advanced 0.4 s; /proc must show the same,
    within a tick either side (however busy the machine: this is CPU time, not wall time)."""
    code = (
        "import sys, time\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
        "start = time.process_time()\n"
        "while time.process_time() - start < 0.4: pass\n"
        "sys.stdout.write(f'{time.process_time() - start}\\n'); sys.stdout.flush(); sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline() == "ready\n"
        sampler = CpuSampler({"child": [child.pid]})
        t0 = sampler.sample()
        child.stdin.write("go\n")
        child.stdin.flush()
        burned = float(child.stdout.readline())
        t1 = sampler.sample()
        tick = 1 / sampler.ticks_per_s
        assert abs(sampler.window(t0, t1).cpu_s["child"] - burned) <= 2 * tick
    finally:
        child.kill()
        child.wait()


def _masks(pid: int) -> dict[int, set[int]]:
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def _threads_of(server: NatsServer, least: int = 2) -> None:
    assert server.pid is not None
    deadline = time.monotonic() + 5
    while len(os.listdir(f"/proc/{server.pid}/task")) < least and time.monotonic() < deadline:
        time.sleep(0.05)


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs to tell apart")


@needs_two_cpus
def test_pinning_confines_every_thread_of_a_running_nats_server() -> None:
    one = {min(os.sched_getaffinity(0))}
    with NatsServer() as server:
        assert server.pid is not None
        _threads_of(server)
        before = _masks(server.pid)
        assert len(before) > 1 and all(mask != one for mask in before.values())  # Go's runtime threads
        pin_process(server.pid, one)
        after = _masks(server.pid)
    assert after.keys() >= before.keys() and all(mask == one for mask in after.values()), after


@needs_two_cpus
def test_index_fleet_pin_starts_nats_on_the_others_and_leaves_the_router_alone_on_the_last() -> None:
    mine = os.sched_getaffinity(0)
    idle = threading.Event()
    helper = threading.Thread(target=idle.wait)  # a thread of the router side that is not its main one
    helper.start()
    try:
        with nats_server(True) as (server, others):
            assert server.pid is not None
            _threads_of(server)
            assert others == mine - {max(mine)}
            nats = _masks(server.pid)
            router = _masks(os.getpid())
    finally:
        pin_process(os.getpid(), mine)
        idle.set()
        helper.join()
    assert len(nats) > 1 and all(mask == others for mask in nats.values()), nats
    assert helper.native_id in router and all(mask == {max(mine)} for mask in router.values()), router
