"""kvswitch.servers: free ports handed out once across a process and its children, and a server that
cannot bind naming the port and who holds it."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PosixPath
from typing import Any

import pytest

from kvswitch import servers
from kvswitch.cluster import _answers
from kvswitch.servers import (
    FREE_PORTS_ENV,
    PORTS_DIR_ENV,
    EtcdCluster,
    EtcdServer,
    NatsCluster,
    NatsServer,
    ServerError,
    free_port,
    free_ports,
    port_range,
    process_tree,
)

DRAWS = 30
_CHILD = f"from kvswitch.servers import free_port; print(*[free_port() for _ in range({DRAWS})])"


def test_a_parent_and_its_child_drawing_from_one_range_get_disjoint_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Nothing binds these ports, as nothing had yet bound a test's --http-port when its `kvswitch up`
    # drew its NATS ports: each process drew at random, alone, and the two took one port (CI, 2026-12-06).
    low = port_range()[0]
    monkeypatch.setenv(FREE_PORTS_ENV, f"{low}-{low + 100}")  # within this worker's own range
    # A cursor of this test's own, which the child inherits: another test run's draws from this
    # range (the same user's, at once) would otherwise wrap into these.
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    mine = [free_port() for _ in range(DRAWS)]
    out, _ = child.communicate(timeout=60)
    theirs = [int(p) for p in out.split()]
    assert child.returncode == 0 and len(theirs) == DRAWS
    assert len(set(mine)) == DRAWS and len(set(theirs)) == DRAWS, (mine, theirs)
    assert not set(mine) & set(theirs), sorted(set(mine) & set(theirs))


def test_consecutive_draws_do_not_overlap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A NatsCluster's client, monitor and cluster ports are three draws, none bound before the last.
    low = port_range()[0]
    monkeypatch.setenv(FREE_PORTS_ENV, f"{low}-{low + 60}")
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path))  # as above: no other run's draws in between
    taken = [p for base in (free_ports(3) for _ in range(15)) for p in range(base, base + 3)]
    assert len(set(taken)) == len(taken), sorted(taken)


def test_a_draw_larger_than_the_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    with pytest.raises(ServerError, match=r"11 consecutive ports from 20000-20010"):
        free_ports(11)


def test_a_server_that_cannot_bind_names_the_port_and_its_holder() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        server = NatsServer(port=port)
        with pytest.raises(ServerError, match=rf"port {port} is held by pid {os.getpid()} \(.*python"):
            server.start()
        # It left its store (a kvswitch-nats-* directory) behind, every failed start
        assert not server.workdir.exists() and server.proc is None


def _redraws(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "was taken by another process before" in r.getMessage()]


@contextlib.contextmanager
def _held(port: int, by: str, kind: type[NatsServer | EtcdServer], attr: str) -> Iterator[None]:
    """`port` listened on by a bare socket, or by a running server of `kind` with it as its `attr`."""
    if by == "socket":
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", port))
            holder.listen()
            yield
    else:
        given: dict[str, Any] = {attr: port}
        with kind(**given):
            yield


@pytest.mark.parametrize("by", ["socket", "server"])
@pytest.mark.parametrize(
    ("kind", "attr"),
    [(NatsServer, "port"), (NatsServer, "monitor_port"), (EtcdServer, "port"), (EtcdServer, "peer_port")],
)
def test_a_port_a_server_drew_taken_before_it_binds_it_is_drawn_again(
    kind: type[NatsServer | EtcdServer], attr: str, by: str, caplog: pytest.LogCaptureFixture
) -> None:
    # free_port checks a port, the server binds it a moment later: another process (a parallel test
    # worker's server) could take it between, and the server, a test fixture's, failed "address
    # already in use" (tests/conftest.py's nats_server and etcd_server draw their ports so). A holder
    # of its kind answered its health probe (NATS's monitor port, etcd's client port) before it
    # exited: it was taken as served, never drawn again, and start() returned a dead process and the
    # holder's URL (review of 9370f74).
    server = kind()
    taken = getattr(server, attr)
    with _held(taken, by, kind, attr), caplog.at_level(logging.WARNING, logger="kvswitch.servers"):
        try:
            server.start()
            assert server.proc is not None and server.proc.poll() is None
            assert server.healthy() and taken not in server.ports()
        finally:
            server.close()
    said = _redraws(caplog)
    assert len(said) == 1 and f"{server.name}: port {taken} was taken" in said[0], said
    assert f"its ports now {', '.join(map(str, server.ports()))}" in said[0], said


def test_a_port_given_a_server_is_never_drawn_again(caplog: pytest.LogCaptureFixture) -> None:
    # Its owner told others the port (a --nats-port, a URL handed out before the start): a server on
    # another one would serve nobody who looks for it.
    with socket.socket() as holder, caplog.at_level(logging.WARNING, logger="kvswitch.servers"):
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        server = EtcdServer(port=port)
        with pytest.raises(ServerError, match=rf"port {port} is held by pid {os.getpid()}"):
            server.start()
    assert server.port == port and _redraws(caplog) == []


def test_a_server_draws_its_ports_again_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as holder, caplog.at_level(logging.WARNING, logger="kvswitch.servers"):
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        monkeypatch.setattr(servers, "free_port", lambda host="127.0.0.1": port)  # every draw the held port
        server = NatsServer(monitor_port=free_ports(1))
        with pytest.raises(ServerError, match=rf"port {port} is held by pid {os.getpid()}"):
            server.start()
    assert len(_redraws(caplog)) == servers.PORT_DRAWS - 1 and not server.workdir.exists()


def test_a_port_an_earlier_run_said_was_taken_in_an_appended_log_is_not_taken_now(tmp_path: Path) -> None:
    # `kvswitch up --log-dir` appends: a line of an earlier run naming the port it lost is not this run's
    log = tmp_path / "nats-0.log"
    with NatsServer(log=log) as server:
        log.write_text(f"listen tcp 127.0.0.1:{server.port}: bind: address already in use\n" + log.read_text())
        server.kill()
        server.launch()
        server.wait_healthy()
        assert server.taken_ports() == []
        with log.open("a") as out:  # what this launch says counts
            out.write(f"listen tcp 127.0.0.1:{server.monitor_port}: bind: address already in use\n")
        assert server.taken_ports() == [server.monitor_port]


@pytest.mark.parametrize(("kind", "draw"), [(NatsCluster, 3), (EtcdCluster, 2)])
def test_a_members_peer_port_taken_before_it_binds_it_is_drawn_again_and_its_peers_told(
    kind: type[NatsCluster | EtcdCluster], draw: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Member 1's NATS route port (the third draw) or etcd peer port (the second), which member 0 dials:
    # the cluster failed to start. Both up (NATS's routes, etcd's quorum of 2) means member 0 was told
    # the port drawn again; etcd's member 0 waited out its timeout for the quorum of a member gone.
    with socket.socket() as holder, caplog.at_level(logging.WARNING, logger="kvswitch.servers"):
        drawn: list[int] = []

        def draws(count: int) -> int:
            drawn.append(free_ports(count))
            if len(drawn) == draw:
                holder.bind(("127.0.0.1", drawn[-1] + 1))
                holder.listen()
            return drawn[-1]

        cluster = kind(2, draw=draws)
        taken = drawn[draw - 1] + 1
        try:
            started = time.monotonic()
            cluster.start(timeout=15)
            assert time.monotonic() - started < 10
            assert cluster.healthy() and not any(taken in server.ports() for server in cluster.servers())
        finally:
            cluster.close()
    said = _redraws(caplog)
    assert len(said) == 1 and f"{cluster.name}: port {taken} was taken" in said[0], said


def test_a_failed_restart_keeps_the_store_it_served_from() -> None:
    with NatsServer() as server:
        server.stop()
        with socket.socket() as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", server.port))
            holder.listen()
            with pytest.raises(ServerError, match=rf"port {server.port} is held by pid {os.getpid()}"):
                server.start()
        assert server.workdir.is_dir()


def test_a_server_whose_failed_start_removed_its_store_is_not_started_again_at_its_path() -> None:
    # A second start() made the removed mkdtemp store again, 0o755, at its old printed path, and wrote
    # nats.conf (its authorization block) there
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        server = NatsServer(port=holder.getsockname()[1], authorization="authorization { token: s3cret }")
        with pytest.raises(ServerError, match="is held by pid"):
            server.start()
    with pytest.raises(ServerError, match=rf"^nats: closed, its store {re.escape(str(server.workdir))} removed: "
                       "make a new server$"):  # fmt: skip
        server.start()
    assert not server.workdir.exists() and server.proc is None


def test_a_store_removed_while_its_server_ran_is_never_made_again_nor_one_planted_there_taken() -> None:
    server = NatsServer(authorization="authorization { token: s3cret }").start()
    try:
        store = server.workdir
        shutil.rmtree(store)
        server.kill()
        removed = rf"^nats: its store {re.escape(str(store))} was removed while it ran .* is not made again"
        with pytest.raises(ServerError, match=removed):
            server.launch()
        assert not store.exists() and server.proc is None
        store.mkdir(mode=0o777)  # another's, planted where it was
        with pytest.raises(ServerError, match=removed):
            server.launch()
        assert list(store.iterdir()) == [] and server.proc is None
        store.rmdir()
    finally:
        server.close(now=True)


def test_a_draw_never_hands_out_a_port_to_avoid(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path))
    _cursor_file(tmp_path).write_text("20000")
    base = free_ports(2, avoid={20001})
    assert base >= 20002, base
    with pytest.raises(ServerError, match=r"no 10 consecutive free ports in 20000-20010 on 127\.0\.0\.1 besides the "
                       r"ports asked for \(20005\)"):  # fmt: skip
        free_ports(10, avoid={20005})
    # one outside the range was named too, as though it had narrowed the draw ("... asked for (8080)")
    with pytest.raises(ServerError, match=r"besides the ports asked for \(20005\)$"):
        free_ports(10, avoid={8080, 20005})


def test_a_server_given_one_port_twice_is_refused_before_it_starts() -> None:
    port = free_port()
    server = NatsServer(port=port, monitor_port=port)
    try:
        with pytest.raises(ServerError, match=rf"nats given one port for two of its listeners: \[{port}, {port}\]"):
            server.start()
        assert server.proc is None
    finally:
        server.close()


def _cursor_file(directory: Path, low: int = 20000, high: int = 20010) -> Path:
    return directory / f"kvswitch-ports-{os.getuid()}-{low}-{high}"


def test_the_cursor_is_kept_where_kvswitch_ports_dir_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # It was always /tmp, where a read-only /tmp or another user's file of that name stopped every server.
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path))
    port = free_port()
    assert _cursor_file(tmp_path).read_text() == str(port + 1 if port + 1 < 20010 else 20000)


def test_the_cursor_defaults_to_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.delenv(PORTS_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    free_port()
    assert _cursor_file(tmp_path).is_file()


def test_a_cursor_others_may_write_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Whoever may write it steers this user's draws onto ports of their choosing.
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path))
    cursor = _cursor_file(tmp_path)
    cursor.write_text("20005")
    cursor.chmod(0o666)
    said = rf"cursor {re.escape(str(cursor))} is not a file of this user's .*mode -rw-rw-rw-.*{PORTS_DIR_ENV}"
    with pytest.raises(ServerError, match=said):
        free_port()


def test_another_users_cursor_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A file of that name another user made: this process runs as a uid that does not own it.
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path))
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)
    cursor = _cursor_file(tmp_path)  # the name for uid me + 1, made by uid me
    cursor.write_text("20005")
    cursor.chmod(0o600)
    said = rf"cursor {re.escape(str(cursor))} is not a file of this user's that only it may write \(uid {me}, "
    with pytest.raises(ServerError, match=said):
        free_port()


def test_a_cursor_directory_that_cannot_be_written_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # As a read-only /tmp did (EROFS), and a file where the directory should be does (ENOTDIR).
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.setenv(PORTS_DIR_ENV, str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ServerError, match=rf"Not a directory: set {PORTS_DIR_ENV} to a writable directory"):
        free_port()


def test_a_relative_cursor_directory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A child started in another directory would keep another cursor.
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20010")
    monkeypatch.setenv(PORTS_DIR_ENV, "ports")
    with pytest.raises(ServerError, match=rf"{PORTS_DIR_ENV}='ports': give an absolute directory"):
        free_port()


def test_an_empty_default_range_names_the_kernel_setting_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # A host whose ip_local_port_range starts at 1024: "1 consecutive ports from 10000-1024: give 1 to -8976".
    monkeypatch.delenv(FREE_PORTS_ENV, raising=False)
    monkeypatch.setattr(servers, "_ephemeral_low", lambda: 1024)
    with pytest.raises(ServerError, match=rf"ip_local_port_range's low end, 1024 here; set {FREE_PORTS_ENV}=LOW-HIGH"):
        free_port()


@contextlib.contextmanager
def _answering(reply: bytes) -> Iterator[int]:
    """A port whose every connection gets `reply`, then is closed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    with contextlib.suppress(OSError):
                        conn.recv(65536)
                    conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    with listener:
        yield listener.getsockname()[1]


@pytest.mark.parametrize(
    "reply",
    [
        b'INFO {"server_id":"x","proto":1}\r\n',  # nats-server's greeting: not HTTP (BadStatusLine)
        b"HTTP/1.0 200 OK\r\n\r\nnot json",
        b"HTTP/1.0 200 OK\r\n\r\n[1]",  # JSON, not an object
    ],
)
def test_a_health_probe_answered_by_something_else_is_not_healthy(reply: bytes) -> None:
    # It raised (BadStatusLine, JSONDecodeError, AttributeError) out of the probe: `kvswitch up` crashed
    # at its start, or mid-run in its health check.
    with _answering(reply) as port:
        nats, etcd = NatsServer(monitor_port=port), EtcdServer(port=port)
        try:
            assert not nats.healthy() and nats.route_count() == 0
            assert not etcd.healthy() and etcd.status() is None
            # a child's probe asks for a 200 alone
            assert _answers(f"http://127.0.0.1:{port}/health") is reply.startswith(b"HTTP/1.0 200")
        finally:
            nats.close()
            etcd.close()


def test_a_server_that_ignores_sigterm_is_killed_and_said(caplog: pytest.LogCaptureFixture) -> None:
    # It was SIGKILLed after the wait with nothing said, where a child that did so got an ERROR
    nats = NatsServer().start()
    assert nats.pid is not None
    pid = nats.pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process takes no SIGTERM
    try:
        with caplog.at_level(logging.ERROR, logger="kvswitch.servers"):
            nats.stop(timeout=0.5)
        assert [r.getMessage() for r in caplog.records] == [
            f"nats {nats.url} did not stop within 0.5s of SIGTERM: killed"
        ]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        nats.close(now=True)


def _wrapper(tmp_path: Path, body: str) -> str:
    script = tmp_path / "wrapper"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(("kind", "finder"), [(EtcdServer, "find_etcd"), (NatsServer, "find_nats_server")])
def test_a_server_run_through_a_wrapper_that_does_not_exec_is_ready_and_stopped_whole(
    kind: type[NatsServer | EtcdServer], finder: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Review of 499c56d, finding 2: only the wrapper's own sockets counted, so such a server was
    # never ready and its start failed after the whole timeout, "not healthy"
    real = getattr(servers, finder)()
    monkeypatch.setattr(servers, finder, lambda: _wrapper(tmp_path, f'{real} "$@"'))
    server = kind()
    try:
        began = time.monotonic()
        server.start(timeout=8)
        assert time.monotonic() - began < 8 and server.healthy()
        assert server.pid is not None
        child = process_tree(server.pid)[1:]
        assert len(child) == 1 and Path(f"/proc/{child[0]}/exe").resolve() == Path(real).resolve()
    finally:
        server.close()
    # gone (a zombie at most: its reaper is now PID 1); the wrapper's SIGTERM alone left it running
    assert not servers._running(child[0])


def test_a_probe_answered_by_another_process_on_its_port_times_out_saying_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Its port is given it (never drawn again): the probe another etcd answers is not taken as its
    # own, and the timeout says so, not "not healthy"
    with EtcdServer() as other:
        monkeypatch.setattr(servers, "find_etcd", lambda: _wrapper(tmp_path, "exec sleep 60"))
        server = EtcdServer(port=other.port)
        try:
            with pytest.raises(ServerError) as err:
                server.start(timeout=1)
        finally:
            server.close()
        said = str(err.value)
        assert said.startswith("etcd not ready after 1s: its health probe is answered, but not by its own process")
        assert f"port {other.port} is held by pid {other.pid} (" in said, said


def _chars_read() -> int:
    """What this process has read from files and pipes so far (Linux's rchar)."""
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io["rchar"])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts what is read through /proc/self/io")
def test_a_servers_log_tail_reads_the_end_of_its_log_only(tmp_path: Path) -> None:
    # The whole log was read for its last lines, on kvswitch up's event loop (a dead server's at
    # each health check): a long-running server's log is hundreds of MB.
    log = tmp_path / "nats-0.log"
    with log.open("wb") as out:
        out.truncate(64 << 20)  # a long log, sparse: nothing to write
        out.seek(0, os.SEEK_END)
        out.write(b"x" * 99 + b"\n" + b"".join(b"line %d\n" % i for i in range(30)))
    server = servers._Server(tmp_path, log)
    before = _chars_read()
    tail = server.log_tail(3)
    read = _chars_read() - before
    assert tail == "line 27\nline 28\nline 29"
    assert read < 1 << 20, f"{read} bytes read for its last 3 lines"


def test_a_servers_log_tail_gives_no_line_cut_where_its_read_starts(tmp_path: Path) -> None:
    log = tmp_path / "etcd-0.log"
    log.write_bytes((b"y" * 99 + b"\n") * 1000)  # read from part way through a line
    lines = servers._Server(tmp_path, log).log_tail(1000).splitlines()
    assert 0 < len(lines) < 1000 and set(lines) == {"y" * 99}


def test_a_servers_log_tail_gives_its_only_line_though_the_read_starts_inside_it(tmp_path: Path) -> None:
    # Its last 16 KB with no newline but the last: the one line they hold, cut at the read's start,
    # was left out as every cut line is, and nothing was said of the log.
    log = tmp_path / "nats-0.log"
    log.write_bytes(b"start ok\n" + b"E" * 20000 + b"\n")
    assert servers._Server(tmp_path, log).log_tail() == "E" * (servers._TAIL_BYTES - 1)


def test_a_servers_log_tail_keeps_a_line_its_read_starts_with(tmp_path: Path) -> None:
    # The read's start falling on a line's start: that whole line was left out as a cut one.
    log = tmp_path / "nats-0.log"
    said = [b"line %010d\n" % n for n in range(servers._TAIL_BYTES // 16)]  # 16 bytes each
    log.write_bytes(b"x" * 99 + b"\n" + b"".join(said))
    lines = servers._Server(tmp_path, log).log_tail(len(said) + 10).splitlines()
    assert lines == [line.decode().rstrip("\n") for line in said]


class _GrowingAsRead:
    """A log opened for reading whose server writes 600 KB more just after its end is found."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._out = path.open("rb")

    def __enter__(self) -> _GrowingAsRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self._out.close()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        at = self._out.seek(offset, whence)
        if whence == os.SEEK_END:
            with self._path.open("ab") as more:
                more.write(b"later\n" * 100_000)
        return at

    def read(self, size: int = -1) -> bytes:
        return self._out.read(size)


class _GrowingLog(PosixPath):
    def open(self, *args: Any, **kwargs: Any) -> Any:
        return _GrowingAsRead(Path(self)) if args[:1] == ("rb",) else super().open(*args, **kwargs)


def test_a_servers_log_tail_reads_no_more_than_its_tail_of_a_log_growing_as_it_reads(tmp_path: Path) -> None:
    # After finding the log's end, it read to the end as it then was: a server writing fast (nats
    # logging slow consumers) had it read on and on, on kvswitch up's event loop.
    log = tmp_path / "nats-0.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(30)))
    assert servers._Server(tmp_path, _GrowingLog(log)).log_tail(3) == "line 27\nline 28\nline 29"
    assert log.stat().st_size > 600_000
