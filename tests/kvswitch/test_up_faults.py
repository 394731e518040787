"""`kvswitch up` as a supervisor when something is wrong: a server that dies, a router port another
cluster serves, routers without workers, a stop during --demo, a missing binary, an unwritable log."""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import engine_sim
import kvswitch.cluster
import kvswitch.servers
import kvswitch.up
from kvswitch.cluster import ClusterSpec, LocalCluster
from kvswitch.etcd_auth import EtcdAuthError
from kvswitch.servers import FREE_PORTS_ENV, EtcdServer, NatsServer, ServerError, free_ports
from kvswitch.up import _check_ports, _HealthLog, _spec
from protocol import subjects
from protocol.messages import RouterInfo, encode_json
from tests.kvswitch.test_up import _up_args


def test_a_server_that_dies_is_said_once_with_its_status_and_last_words_and_its_log_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A killed nats-server or etcd was only "nats=DOWN" (as a hung one reads), and its log, with
    # its last words, went with its store at stop, even with --log-dir.
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path))
    try:
        cluster.start()  # the servers alone
        assert cluster.nats is not None
        nats = cluster.nats.nodes[0]
        assert nats.proc is not None
        nats.proc.kill()
        nats.proc.wait(10)
        health = _HealthLog(cluster, "health: nats=ok etcd=ok children=0/0 up")
        with caplog.at_level(logging.INFO, logger="kvswitch.up"):
            health.check()
            health.check()
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2, errors
        assert errors[0].startswith(f"server exited: nats-0 {nats.url} (status -9; its last output:\n    ")
        assert "Starting nats-server" in errors[0]
        assert errors[1] == "unhealthy: health: nats=DOWN etcd=ok children=0/0 up dead=nats-0"
    finally:
        cluster.stop()
    assert "Starting nats-server" in (tmp_path / "nats-0.log").read_text()
    assert (tmp_path / "etcd-0.log").exists()


def test_a_dead_servers_log_is_read_once_not_at_every_health_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # note_exits built every dead server's "died" text, its log read, before checking whether that
    # exit was noted already: a server given up (or under --no-restart) had its log read again at
    # every tick of up's event loop.
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path, restart=None))
    try:
        cluster.start()  # the servers alone
        assert cluster.nats is not None
        nats = cluster.nats.nodes[0]
        assert nats.proc is not None
        nats.proc.kill()
        nats.proc.wait(10)
        tails: list[str] = []
        log_tail = NatsServer.log_tail

        def counted(self: NatsServer, lines: int = 20) -> str:
            tails.append(self.name)
            return log_tail(self, lines)

        monkeypatch.setattr(NatsServer, "log_tail", counted)
        [(name, died, _)] = cluster.note_exits(time.monotonic())
        assert name == "nats-0" and died.startswith(f"nats-0 {nats.url} (status -9; its last output:"), died
        for _ in range(10):
            assert cluster.note_exits(time.monotonic()) == []
        assert tails == ["nats"]
    finally:
        cluster.stop()


class _Ready(BaseHTTPRequestHandler):
    """/ready answered 200 as a router that can route: the one at another cluster's port."""

    router = "7a3f"

    def do_GET(self) -> None:
        body = json.dumps({"status": "running", "router": self.router, "workers": 1, "routable": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def other_router() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_wait_ready_refuses_a_router_of_another_cluster_naming_the_port(other_router: str) -> None:
    # A second `kvswitch up` (or `make demo`) on a busy --http-port was ready through the other
    # cluster's router, and --demo sent its requests there and exited 0.
    cluster = LocalCluster(ClusterSpec())
    try:
        cluster.start()  # the servers alone; the router a port answers for is the other one
        cluster.router_urls = [other_router]
        port = other_router.rsplit(":", 1)[1]
        with pytest.raises(ServerError, match=rf"not this cluster's: another process serves port {port} .*--http-port"):
            cluster.wait_ready(timeout=10)
        # The same answer from a router registered in this cluster's etcd at that URL is ready.
        assert cluster.etcd is not None
        key = subjects.router_key("kvswitch", _Ready.router).encode()
        value = encode_json(RouterInfo(router=_Ready.router, http_url=other_router, started_at=0.0))
        put = json.dumps({"key": base64.b64encode(key).decode(), "value": base64.b64encode(value).decode()})
        urllib.request.urlopen(cluster.etcd.urls[0] + "/v3/kv/put", data=put.encode(), timeout=5).close()
        cluster.wait_ready(timeout=10)
    finally:
        cluster.stop()


@contextlib.contextmanager
def _held_after_free(free: int) -> Iterator[socket.socket]:
    """A listening socket on a port whose `free` ports below it are free now: the ports the cluster
    takes before the busy one (a parallel test's port among them failed the check on another)."""
    for _ in range(50):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        if all(_bindable(port - k) for k in range(1, free + 1)):
            held.listen()
            with held:
                yield held
            return
        held.close()
    pytest.fail(f"no port with {free} free ports below it")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(
    ("flag", "extra", "first", "what"),
    [
        ("--http-port", [], 0, "router 0"),
        ("--nats-port", [], 0, "NATS node 0"),
        ("--etcd-port", [], 0, "etcd member 0"),
        ("--etcd-port", ["--etcd-members", "3"], 2, "etcd member 2"),  # the third of its consecutive ports
    ],
)
def test_a_busy_port_is_refused_before_anything_starts_naming_its_flag(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    extra: list[str],
    first: int,
    what: str,
) -> None:
    # nats-server and etcd said it only in their own logs, after the other server had started
    with _held_after_free(first) as held:
        port = held.getsockname()[1]
        start = port - first
        monkeypatch.setattr(kvswitch.up, "LocalCluster", lambda spec: pytest.fail("a cluster was started"))
        # the router's default 8080 may be another's (a developer's own up): only the port under test is held
        http = [] if flag == "--http-port" else ["--http-port", "0"]
        assert kvswitch.up.run(_up_args(["--agg", "1", flag, str(start), *http, *extra])) == 2  # a flag refused
        said = capsys.readouterr().err
        assert re.search(
            rf"{flag} {start}: {what} cannot listen on 127.0.0.1:{port} .*choose another {flag}, or 0", said
        ), said
        # who holds it: it was "(Address already in use; another kvswitch up?)"
        assert f"(Address already in use; port {port} is held by pid {os.getpid()} (" in said, said


def test_a_router_tokenizer_is_refused_since_the_simulated_engines_have_only_the_builtin(tmp_path: Path) -> None:
    # It started, reported healthy, and every text prompt got a 503 (no worker shares its fingerprint)
    with pytest.raises(SystemExit, match=r"--tokenizer .*built-in tokenizer only.*drop --tokenizer"):
        _spec(_up_args(["--agg", "1", "--tokenizer", str(tmp_path)]))


def test_routers_without_workers_are_refused_naming_the_flags() -> None:
    # They were accepted, then up printed nothing for 120 s and failed: a router is ready only
    # once a worker registers.
    with pytest.raises(SystemExit, match=r"--routers 2 needs simulated workers: add --agg, --prefill or --decode"):
        _spec(_up_args(["--routers", "2"]))
    assert _spec(_up_args(["--routers", "0"])).routers == 0  # NATS and etcd alone


_STUCK_DEMO = """
import asyncio, sys
import kvswitch.demo, kvswitch.up

class Cluster:
    router_urls = ["http://127.0.0.1:1"]
    def __init__(self, spec): pass
    def start(self, stop_if_failed): pass
    def wait_ready(self, timeout): pass
    def abandon_start(self): pass
    def describe(self): return "a cluster"
    def health_line(self): return "health: ok"
    def healthy(self): return True
    def stop(self): pass
    def kill(self): pass

async def stuck(url, model):
    await asyncio.sleep(3600)

kvswitch.up.LocalCluster = Cluster
kvswitch.demo.run_demo_requests = stuck
from kvswitch.cli import main
sys.exit(main(["up", "--demo", "--agg", "1", "--http-port", "0"]))
"""


def test_a_sigterm_during_the_demo_requests_is_heard_at_once() -> None:
    # The demo's requests were awaited alone: a SIGTERM or Ctrl-C waited for them (up to 60 s each).
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_DEMO], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        while not (line := proc.stdout.readline()).startswith("health:"):
            assert line, proc.communicate(timeout=10)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 1 and "kvswitch up: --demo stopped before its requests ended" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("server", "finder"), [(NatsServer, "find_nats_server"), (EtcdServer, "find_etcd")])
def test_a_missing_server_binary_leaves_no_directory(
    server: type[NatsServer | EtcdServer], finder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its store was made first, then left in $TMPDIR at each attempt.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def missing() -> str:
        raise ServerError(f"{server.name} not found")

    monkeypatch.setattr(kvswitch.servers, finder, missing)
    with pytest.raises(ServerError, match="not found"):
        server()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("binary", "says", "finder", "message"),
    [
        ("etcd", "etcd Version: 3.3.25", kvswitch.servers.find_etcd, "is 3.3.25; kvswitch needs 3.4 or newer"),
        ("nats-server", "nats-server: v2.9.11", kvswitch.servers.find_nats_server, "is 2.9.11; kvswitch needs 2.15"),
    ],
)
def test_an_old_server_binary_on_path_is_refused_naming_its_version(
    binary: str, says: str, finder: object, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # it was used in silence, and failed later on a flag (etcd 3.3: --log-level) or an endpoint
    fake = tmp_path / binary
    fake.write_text(f"#!/bin/sh\necho '{says}'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python"))
    monkeypatch.setattr(sysconfig, "get_path", lambda *a, **k: str(tmp_path / "scripts"))
    kvswitch.servers.binary_version.cache_clear()
    assert callable(finder)
    with pytest.raises(ServerError, match=message):
        finder()


def test_a_log_that_cannot_be_written_is_a_server_error_naming_log_dir(tmp_path: Path) -> None:
    # An OSError opening a child's log was a traceback, after NATS and etcd had started.
    (tmp_path / "sim-agg.log").mkdir()
    cluster = LocalCluster(ClusterSpec(log_dir=tmp_path))
    with pytest.raises(ServerError, match=rf"--log-dir {tmp_path}: cannot write sim-agg.log: Is a directory"):
        cluster.spawn("sim-agg", ["sim", "--help"])
    assert cluster.children == []


def test_up_with_a_server_log_it_cannot_write_says_so_in_one_line_before_starting_it(tmp_path: Path) -> None:
    (tmp_path / "nats-0.log").mkdir()
    (tmp_path / "sim-agg.log").mkdir()
    argv = ["up", "--agg", "1", "--routers", "0", "--log-dir", str(tmp_path)]
    out = subprocess.run([sys.executable, "-m", "kvswitch", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"kvswitch up: --log-dir {tmp_path}: cannot write nats-0.log: Is a directory" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nats-0.log", "sim-agg.log"]  # nothing started


@pytest.mark.skipif(
    not (Path("/sys/kernel").is_dir() and os.access("/sys/kernel", os.W_OK)),
    reason="needs a directory os.access calls writable where nothing can be created (/sys/kernel as root)",
)
def test_a_log_dir_the_mode_bits_allow_but_that_takes_no_file_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"kvswitch up: --log-dir /sys/kernel: not writable"):
        _spec(_up_args(["--agg", "1", "--log-dir", "/sys/kernel"]))


@pytest.mark.parametrize("name", ["nats-0.log", "etcd-2.log", "sim-decode.log", "shim-agg-20417.log", "router-1.log"])
def test_a_symlink_in_the_place_of_a_log_is_refused_before_anything_starts(tmp_path: Path, name: str) -> None:
    # refused only once the cluster half started, exit 1, a bare "Too many levels of symbolic links"
    (tmp_path / "elsewhere.log").write_text("kept\n")
    (tmp_path / name).symlink_to(tmp_path / "elsewhere.log")
    argv = ["--agg", "1", "--decode", "1", "--routers", "2", "--etcd-members", "3", "--log-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as refused:
        _spec(_up_args(argv))
    assert refused.value.code == 2 and str(refused.value) == (
        f"kvswitch up: --log-dir {tmp_path}: {tmp_path / name} is a symlink; kvswitch up writes no log through a "
        "symlink (replace it with a file)"
    )


def test_a_symlink_up_writes_no_log_through_is_no_refusal(tmp_path: Path) -> None:
    for name in ("router-2.log", "sim-prefill.log", "nats-1.log", "notes.log"):  # none of these it writes
        (tmp_path / name).symlink_to(tmp_path / "elsewhere.log")
    assert _spec(_up_args(["--agg", "1", "--routers", "2", "--log-dir", str(tmp_path)])).log_dir == tmp_path


def test_the_max_model_len_default_is_the_sims_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_sim, "SimConfig", functools.partial(engine_sim.SimConfig, max_model_len=4096))
    assert _up_args([]).max_model_len == 4096


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--nats-port", "{p}", "--etcd-port", "{p}"],
            "--nats-port {p} and --etcd-port {p} overlap: --nats-port takes {p} (--nats-nodes 1) and --etcd-port "
            "takes {p} (--etcd-members 1): choose ports apart, or 0 for free ones",
        ),
        (
            ["--nats-nodes", "3", "--nats-port", "{p}", "--etcd-port", "{p+2}"],
            "--nats-port {p} and --etcd-port {p+2} overlap: --nats-port takes {p}-{p+2} (--nats-nodes 3) and",
        ),
        (["--http-port", "{p}", "--nats-port", "{p}"], "--http-port {p} and --nats-port {p} overlap"),
        (
            ["--routers", "2", "--http-port", "{p+2}", "--etcd-members", "3", "--etcd-port", "{p}"],
            "--http-port {p+2} and --etcd-port {p} overlap: --http-port takes {p+2}-{p+3} (--routers 2) and "
            "--etcd-port takes {p}-{p+2}",
        ),
    ],
)
def test_flags_whose_ports_overlap_are_refused_before_anything_starts_naming_both(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    # Each port was checked free alone: NATS took it, then etcd failed to bind after it had started
    port = free_ports(4)

    def ported(text: str) -> str:
        return text.replace("{p+2}", str(port + 2)).replace("{p+3}", str(port + 3)).replace("{p}", str(port))

    monkeypatch.setattr(kvswitch.up, "LocalCluster", lambda spec: pytest.fail("a cluster was started"))
    assert kvswitch.up.run(_up_args(["--agg", "1", *map(ported, argv)])) == 2
    assert f"kvswitch up: {ported(said)}" in capsys.readouterr().err


def test_ports_side_by_side_do_not_overlap() -> None:
    port = free_ports(4)
    argv = [
        "--agg",
        "1",
        "--nats-nodes",
        "3",
        "--nats-port",
        str(port),
        "--etcd-port",
        str(port + 3),
        "--http-port",
        "0",
    ]
    _check_ports(_spec(_up_args(argv)))


def test_more_workers_than_the_port_range_holds_are_refused_naming_the_flags_and_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --agg 8000 started NATS and etcd, then failed in free_ports naming no flag
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-30000")
    with pytest.raises(SystemExit) as refused:
        _spec(_up_args(["--agg", "4000", "--decode", "10", "--http-port", "0"]))
    assert refused.value.code == 2 and str(refused.value) == (
        "kvswitch up: --agg 4000 --prefill 0 --decode 10 (3 ports per worker), --routers 1 (1 port each, "
        "without --http-port) and NATS and etcd (4 for --nats-nodes 1 and --etcd-members 1: a monitor port per NATS "
        "node, a route port per node of a cluster, a peer port per etcd member, and a client port each without "
        "--nats-port or --etcd-port) take 12035 consecutive ports, more than the 10000 in a row of 20000-30000 "
        "(KVSWITCH_FREE_PORTS=20000-30000): at most 3331 workers with these routers"
    )
    assert _spec(_up_args(["--agg", "3331", "--http-port", "0"])).agg == 3331  # the most it allows
    monkeypatch.delenv(FREE_PORTS_ENV)
    monkeypatch.setattr(kvswitch.servers, "_ephemeral_low", lambda: 32768)
    with pytest.raises(SystemExit, match=re.escape(
        "--prefill 8000 --decode 1 (3 ports per worker) and NATS and etcd (4 for --nats-nodes 1 and --etcd-members 1"
    )) as refused:  # fmt: skip
        _spec(_up_args(["--prefill", "8000", "--decode", "1"]))
    assert str(refused.value).endswith(
        "take 24007 consecutive ports, more than the 22768 in a row of 10000-32768 (10000 up to "
        "net.ipv4.ip_local_port_range's low end): "
        "at most 7588 workers"
    )


@pytest.mark.parametrize(
    ("free", "argv", "said"),
    [
        # passed, then failed after NATS and etcd had started: their 4 draws came from the same range
        (
            "20000-20006",
            ["--agg", "1", "--routers", "1", "--demo"],
            "take 7 consecutive ports, more than the 6 in a row of 20000-20006 "
            "(KVSWITCH_FREE_PORTS=20000-20006): no worker fits: give a wider range",
        ),
        # "at most -1 workers"
        (
            "20000-20002",
            ["--agg", "1", "--routers", "5", "--http-port", "0"],
            "take 12 consecutive ports, more than the 2 in a row of "
            "20000-20002 (KVSWITCH_FREE_PORTS=20000-20002): no worker fits with these routers: give a wider range",
        ),
        # a 3-node cluster of each: 3 monitors, 3 routes, 3 clients; 3 peers, 3 clients
        (
            "20000-20017",
            ["--agg", "1", "--nats-nodes", "3", "--etcd-members", "3"],
            "NATS and etcd (15 for --nats-nodes 3 and --etcd-members 3: ",
        ),
        # NATS's drawn port took the --etcd-port asked for, and etcd failed after NATS started
        (
            "20000-20003",
            ["--etcd-port", "20000", "--routers", "0"],
            "kvswitch up: NATS and etcd (3 for --nats-nodes 1 and --etcd-members 1: ",
        ),
        (
            "20000-20003",
            ["--etcd-port", "20000", "--routers", "0"],
            "take 3 consecutive ports, more than the 2 in a row of 20000-20003 "
            "(KVSWITCH_FREE_PORTS=20000-20003, split by the 1 asked for by flag: 20000): give a wider range",
        ),
    ],
)
def test_the_servers_draws_count_against_the_range_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, free: str, argv: list[str], said: str
) -> None:
    monkeypatch.setenv(FREE_PORTS_ENV, free)
    with pytest.raises(SystemExit) as refused:
        _spec(_up_args(argv))
    assert refused.value.code == 2 and said in str(refused.value), str(refused.value)


def test_the_fewest_ports_the_servers_and_a_worker_need_are_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20007")
    assert _spec(_up_args(["--agg", "1", "--routers", "1", "--demo"])).agg == 1
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20004")
    assert _spec(_up_args(["--etcd-port", "20000", "--routers", "0"])).etcd_port == 20000


def test_no_draw_takes_a_port_a_flag_asks_for(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # KVSWITCH_FREE_PORTS=20000-20003 --etcd-port 20000: NATS's drawn port took 20000, and etcd failed
    base = free_ports(8)  # handed to this test alone: the draws walk the range round-robin
    monkeypatch.setenv(FREE_PORTS_ENV, f"{base}-{base + 8}")
    monkeypatch.setenv(kvswitch.servers.PORTS_DIR_ENV, str(tmp_path))
    cursor = tmp_path / f"kvswitch-ports-{os.getuid()}-{base}-{base + 8}"
    cursor.write_text(str(base))  # the next draw starts at the port --etcd-port asks for
    cluster = LocalCluster(ClusterSpec(etcd_port=base, agg=1, routers=1, http_port=base + 1))
    try:
        cluster._start_servers(functools.partial(free_ports, avoid=cluster._flagged_ports()))
        assert cluster.nats is not None and cluster.etcd is not None
        drawn = [*cluster.nats.nodes[0].ports(), cluster.etcd.members[0].peer_port]
        assert cluster.etcd.members[0].port == base and not {base, base + 1} & set(drawn), drawn
        assert free_ports(3, avoid=cluster._flagged_ports()) not in (base - 1, base)  # the workers' draw
    finally:
        cluster.stop()


def test_a_port_asked_for_inside_the_range_splits_it_for_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # 99 ports of 20000-20100 are free of --http-port 20050, yet the longest run of them is 50: --agg 20
    # passed the check (64 ports) and failed in the workers' draw, after NATS and etcd started
    monkeypatch.setenv(FREE_PORTS_ENV, "20000-20100")
    with pytest.raises(SystemExit) as refused:
        _spec(_up_args(["--agg", "20", "--http-port", "20050"]))
    assert refused.value.code == 2 and str(refused.value).endswith(
        "take 64 consecutive ports, more than the 50 in a row of 20000-20100 (KVSWITCH_FREE_PORTS=20000-20100, "
        "split by the 1 asked for by flag: 20050): at most 15 workers"
    ), str(refused.value)
    assert _spec(_up_args(["--agg", "15", "--http-port", "20050"])).agg == 15


def test_the_servers_and_the_workers_are_drawn_in_one_run_as_the_check_counts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # NATS and etcd drew first from the shared cursor, in the middle of a range that the check passed
    # (8 ports of 10), and split it: "no 4 consecutive free ports" for the workers, after they started
    base = free_ports(10)  # handed to this test alone: the draws walk the range round-robin
    monkeypatch.setenv(FREE_PORTS_ENV, f"{base}-{base + 10}")
    monkeypatch.setenv(kvswitch.servers.PORTS_DIR_ENV, str(tmp_path))
    (tmp_path / f"kvswitch-ports-{os.getuid()}-{base}-{base + 10}").write_text(str(base + 3))
    pools: list[int] = []

    def start_pools(self: LocalCluster, first: int) -> int:  # the sims' ports, and none started
        pools.append(first)
        return first + 3

    monkeypatch.setattr(LocalCluster, "_start_pools", start_pools)
    monkeypatch.setattr(LocalCluster, "_start_router", lambda self, index, port: pools.append(port))
    cluster = LocalCluster(ClusterSpec(agg=1, routers=1))
    try:
        cluster.start()
        assert cluster.nats is not None and cluster.etcd is not None
        servers = [*cluster.nats.nodes[0].ports(), *cluster.etcd.members[0].ports()]
        assert pools == [base, base + 3] and sorted(servers) == list(range(base + 4, base + 8)), (pools, servers)
    finally:
        cluster.stop()


def test_a_start_that_fails_is_stopped_saying_what_a_second_signal_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A part that fails to start (the router here, its sim and shim up): the start stopped what it
    had started itself, each tier said without what a second SIGTERM or Ctrl-C does, where up's own
    stop says it (review of 2026-12-07). Its stop is now up's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def fails(self: LocalCluster, index: int, port: int) -> None:
        raise ServerError(f"router-{index} failed to start")

    monkeypatch.setattr(LocalCluster, "_start_router", fails)
    assert kvswitch.up.run(_up_args(["--agg", "1", "--speedup", "20", "--http-port", "0"])) == 1
    err = capsys.readouterr().err
    tiers = [line for line in err.splitlines() if "kvswitch.cluster: stopping" in line]
    assert any("stopping 1 shim " in line for line in tiers) and any("stopping 1 sim " in line for line in tiers), err
    assert all(line.endswith(f"then killed{kvswitch.up._AGAIN})") for line in tiers), err
    assert "kvswitch up: router-0 failed to start\n" in err and err.endswith("kvswitch up: stopped\n"), err
    assert list(tmp_path.iterdir()) == []


def test_etcd_refusing_its_auth_setup_at_start_is_said_in_one_line_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An EtcdAuthError (--secure: etcd's auth/enable timed out) went past up's ServerError: a
    # traceback, not "kvswitch up: ..." and exit 1.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def refused(*args: object, **kwargs: object) -> None:
        raise EtcdAuthError("etcd auth/enable at https://127.0.0.1:1: <urlopen error timed out>")

    monkeypatch.setattr(kvswitch.cluster, "enable_auth", refused)
    assert kvswitch.up.run(_up_args(["--secure", "--routers", "0"])) == 1
    err = capsys.readouterr().err
    said = "kvswitch up: cannot start the cluster: EtcdAuthError: etcd auth/enable at https://127.0.0.1:1: "
    assert said in err and "Traceback" not in err and err.endswith("kvswitch up: stopped\n"), err
    assert list(tmp_path.iterdir()) == []  # its TLS, secrets and servers' directories removed


def test_no_process_to_fork_at_start_is_said_in_one_line_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # fork's EAGAIN (an OSError out of Popen) was a traceback, NATS and etcd up.
    def no_fork(self: LocalCluster, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(LocalCluster, "_popen", no_fork)
    assert kvswitch.up.run(_up_args(["--agg", "1", "--routers", "0"])) == 1
    err = capsys.readouterr().err
    said = "kvswitch up: cannot start the cluster: BlockingIOError: [Errno 11] Resource temporarily unavailable\n"
    assert said in err and "Traceback" not in err and err.endswith("kvswitch up: stopped\n"), err


def test_a_start_error_not_a_server_error_is_wrapped_in_one_and_what_started_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The secrets directory (--secure's nkey seeds) cannot be made: an OSError from mkdtemp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    cluster = LocalCluster(ClusterSpec(etcd_auth=True))
    with pytest.raises(ServerError, match=r"^cannot start the cluster: FileNotFoundError: ") as caught:
        cluster.start()
    assert isinstance(caught.value.__cause__, FileNotFoundError)
    assert cluster.nats is None and cluster.etcd is None
