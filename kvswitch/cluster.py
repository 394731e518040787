"""The local cluster supervisor behind `kvswitch up` (the embedded default) and the benchmarks.

It starts, in order: nats-server and etcd (from the main thread: they die with it, see
kvswitch.servers), one `kvswitch sim --count N` fleet process per pool, one `kvswitch shim` per
simulated engine, then the router replicas; and stops children in reverse order with SIGTERM,
killing what has not exited after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvswitch.servers import EtcdServer, NatsServer, ServerError, die_with_parent, free_ports

__all__ = ["ClusterSpec", "LocalCluster"]

POOLS = ("prefill", "decode", "agg")


@dataclass
class ClusterSpec:
    """What `kvswitch up` runs. Ports 0 mean free ones; routers take `http_port`, `http_port + 1`, ..."""

    nats_port: int = 0
    etcd_port: int = 0
    namespace: str = "kvswitch"
    prefill: int = 0
    decode: int = 0
    agg: int = 0
    routers: int = 0
    http_port: int = 0
    speedup: float = 1.0
    model: str = "sim-llama"
    profile: str = "h200:llama-3.1-8b"
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    router_args: list[str] = field(default_factory=list)
    sim_args: list[str] = field(default_factory=list)
    shim_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class _Engine:
    role: str
    url: str
    events: str
    replay: str


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.nats: NatsServer | None = None
        self.etcd: EtcdServer | None = None
        self.children: list[_Child] = []
        self.engines: list[_Engine] = []
        self.router_urls: list[str] = []

    @property
    def sim_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _connection_args(self) -> list[str]:
        assert self.nats is not None and self.etcd is not None
        return ["--nats-servers", self.nats.url, "--etcd-endpoints", self.etcd.url, "--namespace", self.spec.namespace]

    def start(self) -> None:
        try:
            self.nats = NatsServer(port=self.spec.nats_port or None).start()
            self.etcd = EtcdServer(port=self.spec.etcd_port or None).start()
            for role in POOLS:
                count = getattr(self.spec, role)
                if count:
                    self._start_pool(role, count)
            for engine in self.engines:
                self._start_shim(engine)
            base = self.spec.http_port or (free_ports(self.spec.routers) if self.spec.routers else 0)
            for i in range(self.spec.routers):
                self._start_router(i, base + i)
        except BaseException:
            self.stop()
            raise

    def _start_pool(self, role: str, count: int) -> None:
        http, events, replay = free_ports(count), free_ports(count), free_ports(count)
        kv_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv-events",
        }
        argv = [
            "sim", "--count", str(count), "--host", "127.0.0.1", "--port", str(http), "--role", role,
            "--model", self.spec.model, "--profile", self.spec.profile, "--speedup", str(self.spec.speedup),
            "--block-size", str(self.spec.block_size), "--kv-events-config", json.dumps(kv_config),
            "--max-num-batched-tokens", str(self.spec.max_num_batched_tokens), *self.spec.sim_args,
        ]  # fmt: skip
        self.spawn(f"sim-{role}", argv)
        for i in range(count):
            # The shim takes the endpoints as the engine was given them: by vLLM's rule the sim's PUB
            # connects to 127.0.0.1 and the shim binds it; the sim binds replay there, the shim connects.
            engine = _Engine(
                role, f"http://127.0.0.1:{http + i}", f"tcp://127.0.0.1:{events + i}", f"tcp://127.0.0.1:{replay + i}"
            )
            self.engines.append(engine)
        for engine in self.engines[-count:]:
            self._wait_http(engine.url + "/health", what=f"sim {engine.url}")

    def _start_shim(self, engine: _Engine) -> None:
        argv = [
            "shim", "--engine", "vllm", "--engine-url", engine.url, "--role", engine.role,
            "--model", self.spec.model, "--kv-events", engine.events, "--kv-replay", engine.replay,
            "--timing-profile", self.spec.profile, *self._connection_args(), *self.spec.shim_args,
            # vLLM does not report it; the router's prefill_load policy needs it.
            "--max-num-batched-tokens", str(self.spec.max_num_batched_tokens),
        ]  # fmt: skip
        self.spawn(f"shim-{engine.role}-{engine.url.rsplit(':', 1)[-1]}", argv)

    def _start_router(self, index: int, port: int) -> None:
        argv = [
            "router", "--http-host", "127.0.0.1", "--http-port", str(port), "--model", self.spec.model,
            *self._connection_args(), *self.spec.router_args,
        ]  # fmt: skip
        self.spawn(f"router-{index}", argv)
        self.router_urls.append(f"http://127.0.0.1:{port}")

    def spawn(self, name: str, argv: list[str]) -> _Child:
        """Start `python -m kvswitch <argv>`; its output goes to `log_dir/<name>.log` when set."""
        out: int | object = subprocess.DEVNULL
        if self.spec.log_dir is not None:
            self.spec.log_dir.mkdir(parents=True, exist_ok=True)
            out = (self.spec.log_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvswitch", *argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,  # type: ignore[arg-type]
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # A supervisor killed outright must not orphan its children: they drain on SIGTERM.
            preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # noqa: PLW1509
        )  # fmt: skip
        child = _Child(name, proc)
        self.children.append(child)
        return child

    def _wait_http(
        self, url: str, what: str, timeout: float = 60.0, ok: Callable[[bytes], bool] = lambda _body: True
    ) -> None:
        """Poll `url` until it answers 200 with a body `ok` accepts; fail early if a child died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [c.name for c in self.children if c.proc.poll() is not None]
            if dead:
                raise ServerError(f"{', '.join(dead)} exited while waiting for {what}")
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    if resp.status == 200 and ok(resp.read()):
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise ServerError(f"{what} not ready after {timeout:.0f}s ({url})")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every router answers /ready and sees every engine as a registered worker."""
        deadline = time.monotonic() + timeout
        n = len(self.engines)
        for url in self.router_urls:
            self._wait_http(
                url + "/ready",
                what=f"router {url} with {n} workers",
                timeout=max(1.0, deadline - time.monotonic()),
                ok=lambda body: int(json.loads(body).get("workers", 0)) >= n,
            )

    def stop(self, grace_s: float = 15.0) -> None:
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
        self.engines = []
        self.router_urls = []

    def healthy(self) -> bool:
        servers_ok = all(s is not None and s.healthy() for s in (self.nats, self.etcd))
        return servers_ok and all(c.proc.poll() is None for c in self.children)

    def describe(self) -> str:
        lines = ["kvswitch local cluster:"]
        if self.nats is not None:
            lines.append(f"  nats     {self.nats.url}  (monitor http://127.0.0.1:{self.nats.monitor_port})")
        if self.etcd is not None:
            lines.append(f"  etcd     {self.etcd.url}")
        lines.append(f"  namespace {self.spec.namespace}")
        for e in self.engines:
            lines.append(f"  sim      {e.role:<7} {e.url}  events {e.events}")
        for url in self.router_urls:
            lines.append(f"  router   {url}/v1  (ready: {url}/ready, metrics: {url}/metrics)")
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
