"""The local cluster's engines: loopback only, and their KV events reach the router through the shim."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest

import kvswitch.cluster
from kvswitch.cluster import ClusterSpec, LocalCluster, _Child
from kvswitch.servers import FREE_PORTS_ENV, ServerError, free_ports
from tests.engine_sim.listening import listening


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _overlaps(explained: Any) -> list[int]:
    """Every `overlap_blocks` in a /debug/route answer."""
    if isinstance(explained, dict):
        own = [int(explained["overlap_blocks"])] if "overlap_blocks" in explained else []
        return own + [n for v in explained.values() for n in _overlaps(v)]
    if isinstance(explained, list):
        return [n for v in explained for n in _overlaps(v)]
    return []


def test_engines_listen_on_loopback_and_their_events_reach_the_router(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(agg=1, routers=1, speedup=20, log_dir=tmp_path))
    try:
        cluster.start()
        cluster.wait_ready(60)
        router = cluster.router_urls[0]
        body = {"model": "sim-llama", "prompt": list(range(3000, 3096)), "max_tokens": 2}
        assert _post(router + "/v1/completions", body)["usage"]["completion_tokens"] == 2
        deadline = time.monotonic() + 20
        while max(_overlaps(_post(router + "/debug/route", body)), default=0) < 5:
            assert time.monotonic() < deadline, "the router never indexed the engine's blocks"
            time.sleep(0.2)
        engine = cluster.engines[0]
        events_port = int(engine.events.rsplit(":", 1)[1])
        by_name = {c.name: listening(c.proc.pid) for c in cluster.children if c.name.startswith(("sim", "shim"))}
        assert len(by_name) == 2
        for name, addresses in by_name.items():
            assert addresses and {host for host, _ in addresses} == {"127.0.0.1"}, (name, addresses)
        sim = by_name["sim-agg"]
        shim = next(a for n, a in by_name.items() if n.startswith("shim"))
        # vLLM's rule for tcp://127.0.0.1:P: the sim's PUB connects and the shim's SUB binds.
        assert ("127.0.0.1", events_port) in shim and ("127.0.0.1", events_port) not in sim
        assert ("127.0.0.1", int(engine.replay.rsplit(":", 1)[1])) in sim
        # every port the cluster chose is its own (drawn apart, two could overlap before a bind)
        ports = [int(u.rsplit(":", 1)[1]) for e in cluster.engines for u in (e.url, e.events, e.replay)]
        ports += [int(u.rsplit(":", 1)[1]) for u in cluster.router_urls]
        assert len(set(ports)) == len(ports) == 4
    finally:
        cluster.stop()


def test_a_router_whose_port_another_process_holds_is_named_with_the_holder() -> None:
    # The router said "address already in use" and its port; not who held it (CI, test_up, 2026-12-06).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cluster = LocalCluster(ClusterSpec(agg=1, routers=1, http_port=port))
        try:
            cluster.start()
            with pytest.raises(ServerError, match=rf"router-0 \(status 2; port {port} is held by pid {os.getpid()} \("):
                cluster.wait_ready(60)
        finally:
            cluster.stop()


def test_a_sim_whose_replay_port_another_process_holds_is_named_with_the_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only the HTTP ports' holders were named: the sim said its replay port was in use, not who held it.
    base = free_ports(3)  # one agg engine: HTTP, events, replay
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 2))
        holder.listen()
        monkeypatch.setattr(
            "kvswitch.cluster.free_ports", lambda count, host="127.0.0.1", avoid=(): base
        )  # every redraw
        cluster = LocalCluster(ClusterSpec(agg=1, routers=0))
        with pytest.raises(ServerError, match=rf"sim-agg \(status 2; port {base + 2} is held by pid {os.getpid()} \("):
            cluster.start()
        assert cluster.children == []


def test_a_shim_whose_event_port_another_process_holds_is_named_with_the_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The shim retried its bind each second and never registered: the router's /ready timed out
    # after 60 s saying no worker was registered, not which port was held or by whom.
    base = free_ports(4)  # one agg engine (HTTP, events, replay) and a router
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        monkeypatch.setattr("kvswitch.cluster.free_ports", lambda count, host="127.0.0.1", avoid=(): base)
        cluster = LocalCluster(ClusterSpec(agg=1, routers=1))
        try:
            cluster.start()
            started = time.monotonic()
            held = rf"shim-agg-{base} \(status 2; port {base + 1} is held by pid {os.getpid()} \("
            with pytest.raises(ServerError, match=held):
                cluster.wait_ready(60)
            assert time.monotonic() - started < 30
        finally:
            cluster.stop()


def test_a_child_that_dies_at_start_is_named_with_its_status_and_last_words() -> None:
    cluster = LocalCluster(ClusterSpec(agg=1, routers=0, sim_args=["--speedup", "0"]))
    with pytest.raises(ServerError) as caught:
        cluster.start()
    message = str(caught.value)
    assert "sim-agg (status 2; its last output:" in message
    assert "argument --speedup: 0.0 must be a finite number > 0" in message  # the sim's own error, not just "exited"
    assert cluster.children == [] and cluster.nats is None  # and nothing left running


def _first_draw_taken(
    monkeypatch: pytest.MonkeyPatch, taken: socket.socket, bound: Callable[[], None] = lambda: None
) -> list[int]:
    """The cluster's first draw is a real one whose first port (the sim's) `taken` binds and listens
    on before the sim can (`bound` then runs); later draws are real; each draw's count. The servers
    take ports of that same draw, so it must be free past its first port: a port of taken's own
    choosing was not, and etcd failed to bind one after it under -n 4."""
    draws: list[int] = []
    real = free_ports

    def first_taken(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
        draws.append(count)
        base = real(count, host, avoid)
        if len(draws) == 1:
            taken.bind((host, base))
            taken.listen()
            bound()
        return base

    monkeypatch.setattr("kvswitch.cluster.free_ports", first_taken)
    return draws


def test_a_sim_port_taken_before_the_sim_binds_it_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # free_ports checks a port, the sim binds it a moment later: a parallel test worker's server took
    # it in between once (CI, test_ha's cluster: "address already in use"), and the start failed
    taken = socket.socket()
    draws = _first_draw_taken(monkeypatch, taken)
    cluster = LocalCluster(ClusterSpec(agg=1, routers=0))
    try:
        cluster.start()
        assert len(draws) == 2 and len(cluster.engines) == 1
        assert _get(cluster.engines[0].url + "/health") == 200
        assert sum(c.name == "sim-agg" for c in cluster.children) == 1
    finally:
        cluster.stop()
        taken.close()


def test_a_sim_port_a_non_http_server_holds_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under -n 4 beside other test runs: the sim's port was a nats-server's, whose greeting the
    # health poll read as a bad status line and raised, where it should have waited for the sim to
    # fail its bind and drawn again.
    taken = socket.socket()

    def greet() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = taken.accept()
                with conn:
                    conn.sendall(b'INFO {"server_id":"x","proto":1}\r\n')

    draws = _first_draw_taken(monkeypatch, taken, threading.Thread(target=greet, daemon=True).start)
    cluster = LocalCluster(ClusterSpec(agg=1, routers=0))
    try:
        cluster.start()
        assert len(draws) == 2 and len(cluster.engines) == 1
        assert _get(cluster.engines[0].url + "/health") == 200
    finally:
        cluster.stop()
        taken.close()


def test_server_ports_taken_before_nats_and_etcd_bind_them_are_drawn_again_and_told_to_all(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # NATS's and etcd's client ports, drawn in the cluster's one draw (the sim's 3, the router's, then
    # NATS client and monitor, etcd client and peer), taken before the servers bound them: `kvswitch up`
    # failed to start ("address already in use"). The routers and shims are told the ports drawn again:
    # ready means they reached both servers.
    holders = [socket.socket(), socket.socket()]
    real = free_ports
    taken: list[int] = []

    def draw(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
        base = real(count, host, avoid)
        if not taken:
            for holder, offset in zip(holders, (4, 6), strict=True):  # NATS's client port, etcd's
                holder.bind((host, base + offset))
                holder.listen()
                taken.append(base + offset)
        return base

    monkeypatch.setattr("kvswitch.cluster.free_ports", draw)
    cluster = LocalCluster(ClusterSpec(agg=1, routers=1, speedup=20))
    try:
        with caplog.at_level(logging.WARNING, logger="kvswitch.servers"):
            cluster.start()
        cluster.wait_ready(60)
        assert cluster.nats is not None and cluster.etcd is not None
        urls = cluster.nats.urls + cluster.etcd.urls
        assert not any(url.endswith(f":{port}") for url in urls for port in taken), (urls, taken)
        for url in urls:
            assert url in cluster.describe()
            assert all(url in " ".join(c.argv) for c in cluster.children if c.kind in ("router", "shim"))
        said = [r.getMessage() for r in caplog.records]
        assert [m.split(" was taken")[0] for m in said] == [f"nats: port {taken[0]}", f"etcd: port {taken[1]}"], said
    finally:
        cluster.stop()
        for holder in holders:
            holder.close()


@pytest.mark.parametrize(("server", "name"), [("nats", "--nats-port"), ("etcd", "--etcd-port")])
def test_a_server_port_a_flag_asks_for_taken_after_the_check_is_refused_naming_the_flag(
    server: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # `kvswitch up` found it free (_check_ports), another process bound it before the server: the
    # start said the server's own log lines, no flag; it is never drawn again (the operator asked for it)
    with socket.socket() as holder, caplog.at_level(logging.WARNING, logger="kvswitch.servers"):
        holder.bind(("127.0.0.1", free_ports(1)))
        holder.listen()
        port = holder.getsockname()[1]
        cluster = LocalCluster(ClusterSpec(routers=0, **{f"{server}_port": port}))
        refused = rf"^{name} {port}: port {port} was taken by another process before {server} bound it \({server} "
        with pytest.raises(ServerError, match=refused + rf"exited with 1: port {port} is held by pid {os.getpid()}"):
            cluster.start()
        assert str(caplog.text).count("was taken") == 0 and cluster.nats is None


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return int(r.status)


def test_stop_lets_a_streamed_request_in_flight_finish() -> None:
    # Every child got SIGTERM at once: the router and the shim drained, but the sim under them went
    # at once (as vLLM does with its default --shutdown-timeout 0), cutting the stream.
    cluster = LocalCluster(ClusterSpec(agg=1, routers=1, speedup=1))
    events: list[bytes] = []
    try:
        cluster.start()
        cluster.wait_ready(60)
        body = {"model": "sim-llama", "prompt": list(range(500, 600)), "max_tokens": 300, "stream": True}
        req = urllib.request.Request(
            cluster.router_urls[0] + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )

        def client() -> None:
            with urllib.request.urlopen(req, timeout=60) as r:
                events.extend(line.strip() for line in r if line.startswith(b"data:"))

        reading = threading.Thread(target=client)
        reading.start()
        deadline = time.monotonic() + 30
        while len(events) < 5:
            assert time.monotonic() < deadline and reading.is_alive(), events
            time.sleep(0.01)
    finally:
        cluster.stop()
    reading.join(30)
    assert events[-1] == b"data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert len(chunks) == 300


def test_free_ports_are_drawn_from_the_range_given_and_a_bad_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each xdist worker draws from a range of its own (tests/conftest.py): two drawing from one
    took the same port between one's check and its server's bind."""
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20100")
    assert all(20000 <= free_ports(3) <= 20097 for _ in range(50))
    monkeypatch.setenv(FREE_PORTS_ENV, "20100-20000")
    with pytest.raises(ServerError, match=FREE_PORTS_ENV):
        free_ports(1)


def _child(tmp: Path, name: str, ignores_sigterm: bool = False) -> _Child:
    """A child that stops on SIGTERM, or ignores it (a shim SIGSTOPped, hung): started once it is set."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if ignores_sigterm else ""
    code = f"import signal, sys, time; {ignore}print('set', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"set\n"
    return _Child(name, name.partition("-")[0], proc, tmp / f"{name}.log")


def test_stop_says_each_tier_as_it_starts_and_names_the_children_it_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A stop said nothing until a tier's grace ran out: 35 s of silence a tier, and an operator
    # pressed Ctrl-C again (review of 2026-12-07: a SIGSTOPped shim); the killed shim was an
    # ERROR line among others, and `kvswitch up` then said "stopped" and exited 0.
    cluster = LocalCluster(ClusterSpec())
    names = ["sim-agg", "shim-agg-1", "shim-agg-2", "router-0"]  # in start order
    cluster.children = [_child(tmp_path, name, ignores_sigterm=name == "shim-agg-2") for name in names]
    procs = [c.proc for c in cluster.children]
    try:
        with caplog.at_level(logging.INFO, logger="kvswitch.cluster"):
            killed = cluster.stop(grace_s=1.0, again="; a second signal kills everything now")
        assert killed == ["shim-agg-2"]
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "stopping 1 router (draining up to 1s, then killed; a second signal kills everything now)"),
            ("INFO", "stopping 2 shims (draining up to 1s, then killed; a second signal kills everything now)"),
            ("ERROR", "shim-agg-2 did not stop within 1s of SIGTERM: killed"),
            ("INFO", "stopping 1 sim (draining up to 1s, then killed; a second signal kills everything now)"),
        ]
        assert [p.returncode for p in procs] == [-signal.SIGTERM, -signal.SIGTERM, -signal.SIGKILL, -signal.SIGTERM]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()


class _CloseHook:
    """The os module as kvswitch.cluster sees it, its `close` calling `hook` first."""

    def __init__(self, hook: Callable[[int], None]) -> None:
        self._hook = hook

    def close(self, fd: int) -> None:
        self._hook(fd)
        os.close(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class _WatchedLock:
    """A lock that sets `waited` when a thread finds it held."""

    def __init__(self, waited: threading.Event) -> None:
        self._lock = threading.Lock()
        self._waited = waited

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.locked():
            self._waited.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _WatchedLocks:
    """The threading module as kvswitch.cluster sees it, its locks `_WatchedLock`s."""

    def __init__(self, waited: threading.Event) -> None:
        self._waited = waited

    def Lock(self) -> _WatchedLock:  # threading's name
        return _WatchedLock(self._waited)

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


class _RmtreeHook:
    """The shutil module as kvswitch.cluster sees it, its `rmtree` calling `hook` first."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook = hook

    def rmtree(self, path: Path, ignore_errors: bool = False) -> None:
        self._hook()
        shutil.rmtree(path, ignore_errors=ignore_errors)

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)


def _stop_held_at_its_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, go: threading.Event, waited: threading.Event
) -> tuple[LocalCluster, threading.Thread, list[Path]]:
    """A cluster whose stop, on a thread of its own, has taken its directories and waits for `go`
    to remove them; `waited` is set when a thread finds one of the cluster's locks held."""
    monkeypatch.setattr(kvswitch.cluster, "threading", _WatchedLocks(waited))
    cluster = LocalCluster(ClusterSpec())
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    cluster.secrets_dir = secrets
    made = [cluster._scratch_dir(), secrets]
    removing = threading.Event()
    stopping = threading.Thread(target=cluster.stop)

    def held() -> None:
        if threading.current_thread() is stopping:
            removing.set()
            go.wait(10)

    monkeypatch.setattr(kvswitch.cluster, "shutil", _RmtreeHook(held))
    stopping.start()
    assert removing.wait(10)
    return cluster, stopping, made


def test_a_kill_while_stop_removes_the_directories_returns_once_they_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # up's second signal runs kill() while stop() removes the directories on a worker thread: kill
    # found them taken by stop and returned at once, and up's os._exit then cut stop's removal
    # part way, the directories left. Stop's removal here goes on only once kill waits for it.
    go = threading.Event()
    cluster, stopping, made = _stop_held_at_its_removal(tmp_path, monkeypatch, go, waited=go)
    try:
        cluster.kill()
        assert [path for path in made if path.exists()] == []
    finally:
        go.set()
        stopping.join(10)
    assert not stopping.is_alive()


def test_a_kill_waits_for_a_stuck_removal_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A removal that never ends (a hung file system) must not hold up's exit on a second signal.
    monkeypatch.setattr(kvswitch.cluster, "_REMOVAL_WAIT_S", 0.01)
    go, waited = threading.Event(), threading.Event()
    cluster, stopping, made = _stop_held_at_its_removal(tmp_path, monkeypatch, go, waited)
    try:
        with caplog.at_level(logging.WARNING, logger="kvswitch.cluster"):
            cluster.kill()
        assert waited.is_set()
        assert "directories were still being removed after 0s: going on, some may be left" in caplog.text
        assert [path for path in made if path.exists()] == made
    finally:
        go.set()
        stopping.join(10)
    assert not stopping.is_alive()
    assert [path for path in made if path.exists()] == []


def test_a_kill_while_stop_forgets_the_cluster_closes_and_removes_each_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `kvswitch up`'s second signal runs kill() on the loop thread while stop() runs on a worker:
    # both checked the scratch directory's descriptor, closed it, then cleared it, unlocked. The
    # kill here comes just as stop's close does: the second close was EBADF (out of kill, so up's
    # abort left the TLS directory), or closed another file that took the number meanwhile.
    waited = threading.Event()
    monkeypatch.setattr(kvswitch.cluster, "threading", _WatchedLocks(waited))
    cluster = LocalCluster(ClusterSpec())
    scratch = cluster._scratch_dir()
    fd = cluster._scratch_fd
    cluster.secrets_dir = tmp_path / "secrets"
    cluster.secrets_dir.mkdir()
    closed: list[int] = []
    killing = threading.Thread(target=cluster.kill)

    def kill_first(fd: int) -> None:
        closed.append(fd)
        if killing.ident is None:  # the first close: stop's
            killing.start()
            assert waited.wait(10)  # the kill waits for stop's removal, which this close is part of

    monkeypatch.setattr(kvswitch.cluster, "os", _CloseHook(kill_first))
    assert cluster.stop() == []
    killing.join(10)
    assert not killing.is_alive()
    assert closed == [fd]
    assert not scratch.exists() and not (tmp_path / "secrets").exists()
    assert cluster._scratch is None and cluster._scratch_fd is None
