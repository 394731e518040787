"""The local cluster supervisor behind `kvswitch up`: nats-server and etcd, then (as later parts
are added) simulated engines, their shims and router replicas as child processes.

Servers start from the main thread (they die with it: see kvswitch.servers); children are
stopped in reverse order of start with SIGTERM, then killed after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from kvswitch.servers import EtcdServer, NatsServer

__all__ = ["ClusterSpec", "LocalCluster"]


@dataclass
class ClusterSpec:
    nats_port: int = 0
    etcd_port: int = 0
    namespace: str = "kvswitch"


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.nats: NatsServer | None = None
        self.etcd: EtcdServer | None = None
        self.children: list[_Child] = []

    def start(self) -> None:
        try:
            self.nats = NatsServer(port=self.spec.nats_port or None).start()
            self.etcd = EtcdServer(port=self.spec.etcd_port or None).start()
        except BaseException:
            self.stop()
            raise

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> _Child:
        """Start `python -m kvswitch <argv>` as a child that dies with this process."""
        full = [sys.executable, "-m", "kvswitch", *argv]
        proc = subprocess.Popen(full, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
        child = _Child(name, proc, full)
        self.children.append(child)
        return child

    def stop(self, grace_s: float = 10.0) -> None:
        children, self.children = self.children, []
        for child in reversed(children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(children):
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait(5)
        for server in (self.etcd, self.nats):
            if server is not None:
                server.close()
        self.etcd = self.nats = None

    def healthy(self) -> bool:
        servers_ok = all(s is not None and s.healthy() for s in (self.nats, self.etcd))
        return servers_ok and all(c.proc.poll() is None for c in self.children)

    def describe(self) -> str:
        lines = ["kvswitch local cluster:"]
        if self.nats is not None:
            lines.append(f"  nats   {self.nats.url}  (monitor http://127.0.0.1:{self.nats.monitor_port})")
        if self.etcd is not None:
            lines.append(f"  etcd   {self.etcd.url}")
        lines.append(f"  namespace {self.spec.namespace}")
        return "\n".join(lines)

    def health_line(self) -> str:
        parts = [
            f"nats={'ok' if self.nats is not None and self.nats.healthy() else 'DOWN'}",
            f"etcd={'ok' if self.etcd is not None and self.etcd.healthy() else 'DOWN'}",
        ]
        dead = [c.name for c in self.children if c.proc.poll() is not None]
        parts.append(f"children={len(self.children) - len(dead)}/{len(self.children)} up")
        if dead:
            parts.append("dead=" + ",".join(dead))
        return "health: " + " ".join(parts)
