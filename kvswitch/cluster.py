"""The local cluster supervisor behind `kvswitch up` (the embedded default) and the benchmarks.

It starts, in order: nats-server and etcd (from the main thread: they die with it, see
kvswitch.servers), one `kvswitch sim --count N` fleet process per pool, one `kvswitch shim` per
simulated engine, then the router replicas; and stops children in reverse order with SIGTERM,
killing what has not exited after a grace period.

High availability: `nats_nodes` / `etcd_members` > 1 run a NATS cluster and an etcd cluster, and
every router and shim is given every node's URL. Security (`kvswitch up --secure`): `tls` puts
NATS and etcd behind TLS, `etcd_auth` turns etcd's users on (router and worker, random passwords,
handed to children in the environment, never on a command line), `nats_auth` gives every router
and shim its own nkey with kvswitch.nats_auth's permissions (shims then need `--worker-name`).
Secrets live in a private temporary directory removed on stop.

Restarts (`spec.restart`, on in `kvswitch up` unless --no-restart): a child or server that exits
while the cluster runs is started again as it was first (the same argv, environment and ports, its
log appended; a server with its store) after a back-off (`RestartPolicy`); one that cannot be started
again counts as another exit, the others start as ever. Whoever supervises calls
`note_exits` and `restart_due` from one thread; `stop` and `kill` hold the same lock, so a restart
never races a stop: once stopping, nothing is restarted, and what was restarted before is stopped.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import functools
import http.client
import importlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from kvswitch.etcd_auth import EtcdAuthError, EtcdGateway, b64, enable_auth, namespace_users
from kvswitch.nats_auth import NatsAuthPlan
from kvswitch.servers import (
    PORT_DRAWS,
    PROBE_ERRORS,
    ControlPlaneTls,
    EtcdCluster,
    EtcdServer,
    NatsCluster,
    NatsServer,
    PortTaken,
    ServerError,
    dying_with_parent,
    free_ports,
    open_log,
    port_taken,
)
from protocol import subjects
from protocol.messages import RouterInfo, decode_json
from protocol.port_holders import port_holders
from protocol.timing import speed_profile

log = logging.getLogger("kvswitch.cluster")

__all__ = ["STOP_GRACE_S", "ClusterSpec", "LocalCluster", "RestartPolicy", "shim_argv"]

POOLS = ("prefill", "decode", "agg")
# With security on and no workers of its own, the identities it makes for a router and a shim the
# operator runs by hand (`LocalCluster.own_commands`).
OWN_ROUTER, OWN_WORKER = "router-0", "worker-0"
STOP_GRACE_S = 35.0  # per tier of children at stop: the shim drains for 30 s at most
# How long `kill` waits for `stop`'s removal of the directories on another thread: up exits after it.
_REMOVAL_WAIT_S = 10.0
# What a start of a process may fail with: its log or store cannot be written, its binary is gone,
# fork failed (EAGAIN, ENOMEM), or a server's own refusal.
_START_ERRORS = (OSError, subprocess.SubprocessError, ServerError)


def _why(exc: BaseException) -> str:
    """A start error in a line: a ServerError says it all, another is named by its type."""
    return str(exc) if isinstance(exc, ServerError) else f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class RestartPolicy:
    """When a child or server that exited is started again: `first_s` after its exit, doubling at
    each exit in a row up to `most_s`. An exit after it ran `settled_s` starts the count again. The
    `failures`-th exit in a row (each before it settled) is given up: a child that can never start,
    a bad flag or a port another process took, must not loop forever."""

    first_s: float = 1.0
    most_s: float = 30.0
    settled_s: float = 60.0
    failures: int = 5

    def delay(self, failures: int) -> float:
        """The back-off before the restart after the `failures`-th exit in a row."""
        return min(self.most_s, self.first_s * 2.0 ** (failures - 1))


@dataclass
class _Backoff:
    """One supervised process's restarts (LocalCluster.note_exits, restart_due)."""

    started_at: float = field(default_factory=time.monotonic)
    failures: int = 0  # exits in a row, each before it settled
    restart_at: float | None = None  # when it is due to start again; None when not waiting
    noted: bool = False  # its exit is known (reported once)
    given_up: bool = False
    restarts: int = 0  # in all


@dataclass
class ClusterSpec:
    """What `kvswitch up` runs. Ports 0 mean free ones; routers take `http_port`, `http_port + 1`, ...;
    NATS and etcd members take consecutive client ports from `nats_port` and `etcd_port`."""

    nats_port: int = 0
    etcd_port: int = 0
    nats_nodes: int = 1
    etcd_members: int = 1
    tls: ControlPlaneTls | None = None
    etcd_auth: bool = False
    nats_auth: bool = False
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
    # The mapping of the router --config in `router_args`, as up's check of the router flags read it:
    # LocalCluster.own_commands copies this, not the file, which may be gone or half-saved by then.
    router_file: dict[str, Any] = field(default_factory=dict)
    sim_args: list[str] = field(default_factory=list)
    shim_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    # The sims bind their KV event sockets (ipc:// in the cluster's scratch directory: vLLM's rule binds
    # those, and they stay on this machine) and the shims connect, so another subscriber can listen
    # too (bench.virtual.measure_delays). Otherwise each sim's PUB connects to 127.0.0.1 and its shim
    # binds, as a shim beside vLLM usually runs.
    engines_bind_events: bool = False
    restart: RestartPolicy | None = None  # None: a child or server that exits stays down

    def drawn_ports(self) -> tuple[int, int]:
        """The ports `LocalCluster.start` draws, all in one run of consecutive free ports: (the
        workers' (3 each) and the routers' without `http_port`, NATS's and etcd's: a monitor port per
        NATS node, a route port per node of a cluster, a peer port per etcd member, and a client port
        each without `nats_port` or `etcd_port`). One of them another process binds before its server
        or sim does is drawn again outside this run (kvswitch.servers.port_taken)."""
        n, m = self.nats_nodes, self.etcd_members
        servers = n + (n if n > 1 else 0) + (0 if self.nats_port else n) + m + (0 if self.etcd_port else m)
        workers = 3 * sum(getattr(self, role) for role in POOLS)
        return workers + (0 if self.http_port else self.routers), servers


class _Ports:
    """Consecutive ports of one draw, handed out in order."""

    def __init__(self, first: int, count: int) -> None:
        self._next, self._end = first, first + count

    def take(self, count: int) -> int:
        if self._next + count > self._end:  # ClusterSpec.drawn_ports counted fewer than were taken
            raise ServerError(f"{count} ports taken of a draw with {self._end - self._next} left")
        first, self._next = self._next, self._next + count
        return first


@dataclass
class _Child:
    name: str
    kind: str  # the kvswitch command it runs: router, shim, sim ...
    proc: subprocess.Popen[bytes]
    log: Path  # its output
    argv: list[str] = field(default_factory=list)  # after `python -m kvswitch`, to start it again
    env: dict[str, str] = field(default_factory=dict)
    # URLs that answer 200 once it serves: a restarted child counts as restarting until they do (a
    # shim has none: its HTTP port is a free one; the router's /ready says whether it registered).
    probes: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)  # the TCP ports it binds, to name their holder
    serving: bool = True
    backoff: _Backoff = field(default_factory=_Backoff)

    def state(self) -> str:
        """up, restarting (waiting for its restart, or restarted and not serving yet) or dead."""
        if self.proc.poll() is None:
            return "up" if self.serving else "restarting"
        return "restarting" if self.backoff.restart_at is not None else "dead"

    def died(self) -> str:
        """Its exit status and last lines of output, for an error that says why it went."""
        tail: list[str] = []
        with contextlib.suppress(OSError):
            tail = self.log.read_bytes()[-2000:].decode(errors="replace").strip().splitlines()[-12:]
        said = "; its last output:\n    " + "\n    ".join(tail) if tail else ""
        # Its output names a port it could not bind, not who holds it.
        held = "".join(f"; {h}" for h in port_holders(self.ports))
        return f"{self.name} (status {self.proc.returncode}{held}{said})"


def _tiers(children: list[_Child]) -> list[list[_Child]]:
    """`children` cut where the kind of child (`router`, `shim`, `sim`) changes, in order."""
    tiers: list[list[_Child]] = []
    for child in children:
        if tiers and tiers[-1][0].kind == child.kind:
            tiers[-1].append(child)
        else:
            tiers.append([child])
    return tiers


@dataclass
class _Engine:
    role: str
    url: str
    events: str
    replay: str


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.nats: NatsCluster | None = None
        self.etcd: EtcdCluster | None = None
        self.children: list[_Child] = []
        self.engines: list[_Engine] = []
        self.router_urls: list[str] = []
        self.secrets_dir: Path | None = None
        self._scratch: Path | None = None  # children's output when no log_dir is asked for
        self._scratch_fd: int | None = None  # the scratch directory, held open (`_scratch_dir`)
        self._etcd_passwords: dict[str, str] = {}
        self._nats_auth: NatsAuthPlan | None = None
        self._abandon = threading.Event()  # set from another thread: starting stops at its next wait
        self._lock = threading.Lock()  # a restart against `stop` and `kill`
        self._removing = threading.Lock()  # held across a `_forget`: `kill`'s waits for `stop`'s
        self._stopping = False
        self._server_backoff: dict[str, _Backoff] = {}
        self._servers_ok = True  # NATS and etcd all up and none exited, at the last `health`

    @property
    def sim_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def _connection_args(self, role: str, name: str) -> list[str]:
        """Flags that point a router (`role` router) or a shim (`role` worker) at NATS and etcd."""
        assert self.nats is not None and self.etcd is not None
        args = ["--nats-servers", ",".join(self.nats.urls), "--etcd-endpoints", ",".join(self.etcd.urls)]
        args += ["--namespace", self.spec.namespace]
        if self.spec.tls is not None:
            args += ["--nats-tls-ca", str(self.spec.tls.ca), "--etcd-tls-ca", str(self.spec.tls.ca)]
        if self._nats_auth is not None:
            assert self.secrets_dir is not None
            identity = self._nats_auth.identity("worker" if role == "worker" else "router", name)
            args += ["--nats-nkey-file", str(self.secrets_dir / identity.seed_file_name)]
            if role == "worker":
                args += ["--worker-name", name]
        return args

    def own_commands(self) -> list[str]:
        """With security on and no workers of its own, the command lines (less the engine's flags for
        the shim) of a router and a shim the operator runs against its NATS and etcd: the identities
        made for them (OWN_ROUTER, OWN_WORKER), and each role's etcd user and password in a settings
        file (`--config`, 0600, in the private secrets directory removed on stop), never on the
        command line or in this output. The router's line carries the router flags given to up
        (`router_args`; they were checked, then dropped): a --config of the operator's is copied
        into the role's file as the check read it (`router_file`), with the etcd keys added, as one
        --config only is read. Empty otherwise."""
        spec = self.spec
        if not (spec.etcd_auth or spec.nats_auth) or self._worker_names() or self.secrets_dir is None:
            return []
        lines = []
        for program, role, name in (("router", "router", OWN_ROUTER), ("shim", "worker", OWN_WORKER)):
            argv = ["kvswitch", program, *self._connection_args(role, name)]
            given, config = _without_config(spec.router_args) if role == "router" else ([], None)
            argv += given
            if role in self._etcd_passwords:
                settings = self.secrets_dir / f"{role}-etcd.yaml"
                settings.touch(mode=0o600)
                settings.chmod(0o600)
                login = {"etcd_user": role, "etcd_password": self._etcd_passwords[role]}
                own = spec.router_file if role == "router" else {}  # the operator's file is the router's
                settings.write_text(yaml.safe_dump({**own, **login}))
                argv += ["--config", str(settings)]
            elif config is not None:
                argv += ["--config", config]
            lines.append(shlex.join(argv))
        return lines

    def _child_env(self, role: str) -> dict[str, str]:
        if role not in self._etcd_passwords:
            return {}
        return {"KVSWITCH_ETCD_USER": role, "KVSWITCH_ETCD_PASSWORD": self._etcd_passwords[role]}

    def _worker_names(self) -> list[str]:
        return [f"{role}-{i}" for role in POOLS for i in range(getattr(self.spec, role))]

    def _start_servers(self, draw: Callable[[int], int]) -> None:
        """NATS and etcd, the ports no flag gives them from `draw` (a count: the first of that many
        consecutive ports)."""
        spec = self.spec
        if spec.etcd_auth or spec.nats_auth:
            self.secrets_dir = Path(tempfile.mkdtemp(prefix="kvswitch-secrets-"))
        authorization = None
        if spec.nats_auth:
            _require_shim_flag("--worker-name", "nats_auth (per-worker NATS permissions)")
            assert self.secrets_dir is not None
            routers = [f"router-{i}" for i in range(spec.routers)]
            workers = self._worker_names()
            if not workers:  # for the operator's own router and shim (own_commands)
                routers, workers = [OWN_ROUTER], [OWN_WORKER]
            self._nats_auth = NatsAuthPlan.generate(spec.namespace, routers, workers)
            self._nats_auth.write(self.secrets_dir)
            authorization = self._nats_auth.authorization_block()
        # With a log_dir, their output goes there as the children's does (else into their stores).
        nats_logs = [self._log(f"nats-{i}") for i in range(spec.nats_nodes)] if spec.log_dir is not None else []
        etcd_logs = [self._log(f"etcd-{i}") for i in range(spec.etcd_members)] if spec.log_dir is not None else []
        # Held before they start, so that `kill` from another thread meanwhile finds them.
        tls = spec.tls
        self.nats = NatsCluster(
            spec.nats_nodes,
            port=spec.nats_port or None,
            tls=tls.nats if tls else None,
            route_tls=tls.nats_route if tls else None,
            authorization=authorization,
            logs=nats_logs,
            draw=draw,
            avoid=self._flagged_ports(),
        )
        _start_flagged(self.nats, "--nats-port", spec.nats_port)
        self.etcd = EtcdCluster(
            spec.etcd_members,
            port=spec.etcd_port or None,
            tls=tls.etcd if tls else None,
            peer_tls=tls.etcd_peer if tls else None,
            logs=etcd_logs,
            draw=draw,
            avoid=self._flagged_ports(),
        )
        _start_flagged(self.etcd, "--etcd-port", spec.etcd_port)
        if spec.etcd_auth:
            self._etcd_passwords = {role: secrets.token_urlsafe(24) for role in ("root", "router", "worker")}
            users = namespace_users(spec.namespace, self._etcd_passwords["router"], self._etcd_passwords["worker"])
            context = spec.tls.client_context() if spec.tls is not None else None
            enable_auth(self.etcd.urls[0], self._etcd_passwords["root"], users, context=context)

    def _flagged_ports(self) -> set[int]:
        """The ports the spec names (routers from `http_port`, NATS from `nats_port`, etcd from
        `etcd_port`): each bound only when its process starts, so no draw before then may take one."""
        spec = self.spec
        asked = [(spec.http_port, spec.routers), (spec.nats_port, spec.nats_nodes), (spec.etcd_port, spec.etcd_members)]
        return {port for first, count in asked if first for port in range(first, first + count)}

    def start(self, *, stop_if_failed: bool = True) -> None:
        """Start the servers, the sims, the shims, then the routers. A start that fails stops what it
        started, unless `stop_if_failed` is False; one abandoned (`abandon_start`) never does. Both
        leave that to the caller's `stop`, which says each tier with what a second signal does and
        returns the children it killed. It fails with a ServerError: an OSError or SubprocessError
        (no process to fork, a directory that cannot be made) or etcd refusing its authentication
        setup is wrapped in one."""
        self._stopping = False
        try:
            # Every port drawn in one draw, so that `kvswitch up`'s range check (`drawn_ports`: one
            # run of consecutive ports) is what happens: NATS and etcd drew first, from anywhere in the
            # range, and split it, the workers' block then fitting nowhere, after they had started.
            # The pools and the routers take consecutive ports from its base, the servers the rest.
            workers, servers = self.spec.drawn_ports()
            base = free_ports(workers + servers, avoid=self._flagged_ports())
            self._start_servers(_Ports(base + workers, servers).take)
            for draw in range(1, PORT_DRAWS + 1):
                try:
                    base = self._start_pools(base)
                    break
                except ServerError as exc:
                    if not port_taken(str(exc)) or draw == PORT_DRAWS:  # as a server's (kvswitch.servers)
                        raise
                    log.warning(
                        "a sim's port was taken before it bound it: drawing others (%d of %d)", draw, PORT_DRAWS
                    )
                    self._kill_children()
                    base = free_ports(workers, avoid=self._flagged_ports())
            for engine in self.engines:
                self._start_shim(engine)
            base = self.spec.http_port or base
            for i in range(self.spec.routers):
                self._start_router(i, base + i)
        except BaseException as exc:
            if stop_if_failed and not self._abandon.is_set():
                self.stop()
            if isinstance(exc, ServerError) or not isinstance(exc, (*_START_ERRORS, EtcdAuthError)):
                raise
            # One kind of failure for the caller to say in a line (`kvswitch up`), not a traceback.
            raise ServerError(f"cannot start the cluster: {_why(exc)}") from exc

    def _start_pools(self, base: int) -> int:
        """Every pool's sims on the ports from `base`; the first port none of them took."""
        for role in POOLS:
            count = getattr(self.spec, role)
            if count:
                self._start_pool(role, count, base)
                base += 3 * count
        return base

    def _kill_children(self) -> None:
        """Before any shim or router: the sims of a draw whose ports another process took."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(5)
        self.children = []
        self.engines = []

    def _start_pool(self, role: str, count: int, base: int) -> None:
        """`count` sims on the free ports from `base`: HTTP, then KV events, then replay."""
        http, events, replay = base, base + count, base + 2 * count
        if self.spec.engines_bind_events:  # engine i's is `{base}-{i}` (engine_sim.fleet)
            bound = f"ipc://{self._scratch_dir()}/kv-events-{role}"
            event_endpoints = [bound if i == 0 else f"{bound}-{i}" for i in range(count)]
        else:
            event_endpoints = [f"tcp://127.0.0.1:{events + i}" for i in range(count)]
        kv_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": event_endpoints[0],
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv-events",
        }
        argv = [
            "sim", "--count", str(count), "--host", "127.0.0.1", "--port", str(http), "--role", role,
            "--model", self.spec.model, "--profile", self.spec.profile, "--speedup", str(self.spec.speedup),
            "--block-size", str(self.spec.block_size), "--kv-events-config", json.dumps(kv_config),
            "--max-num-batched-tokens", str(self.spec.max_num_batched_tokens), *self.spec.sim_args,
        ]  # fmt: skip
        fleet = self.spawn(f"sim-{role}", argv)
        for i in range(count):
            # The shim takes the endpoints as the engine was given them: by vLLM's rule the sim's PUB
            # connects to 127.0.0.1 and the shim binds it (an ipc:// one the sim binds); the sim binds
            # replay there, the shim connects.
            engine = _Engine(role, f"http://127.0.0.1:{http + i}", event_endpoints[i], f"tcp://127.0.0.1:{replay + i}")
            self.engines.append(engine)
            fleet.probes.append(engine.url + "/health")
            fleet.ports += [http + i, replay + i]
        for engine in self.engines[-count:]:
            self._wait_http(engine.url + "/health", what=f"sim {engine.url}")

    def _start_shim(self, engine: _Engine) -> None:
        name = f"{engine.role}-{sum(e.role == engine.role for e in self.engines[: self.engines.index(engine)])}"
        argv = shim_argv(self.spec, engine.role, engine.url, engine.events, engine.replay)
        argv[1:1] = self._connection_args("worker", name)
        shim = self.spawn(f"shim-{engine.role}-{engine.url.rsplit(':', 1)[-1]}", argv, self._child_env("worker"))
        if not self.spec.engines_bind_events:  # it binds the engine's tcp:// event endpoint
            shim.ports.append(int(engine.events.rsplit(":", 1)[1]))

    def _start_router(self, index: int, port: int) -> None:
        argv = [
            "router", "--http-host", "127.0.0.1", "--http-port", str(port), "--model", self.spec.model,
            *self._connection_args("router", f"router-{index}"), *self.spec.router_args,
        ]  # fmt: skip
        router = self.spawn(f"router-{index}", argv, self._child_env("router"))
        self.router_urls.append(f"http://127.0.0.1:{port}")
        router.probes.append(f"http://127.0.0.1:{port}/health")
        router.ports.append(port)

    def _scratch_dir(self) -> Path:
        """A directory of this cluster's own (0o700, mkdtemp's), removed at `stop`. It is held open,
        and its logs are opened through that descriptor: one removed meanwhile is never made again
        (0o755, or one another user planted at its path, taken as ours), a restart then fails."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="kvswitch-cluster-"))
            self._scratch_fd = os.open(self._scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return self._scratch

    def _log(self, name: str) -> Path:
        """Where `name` writes its output: `log_dir/<name>.log` when set (one that cannot be opened is
        a ServerError naming --log-dir, not an OSError), else the scratch directory."""
        if self.spec.log_dir is None:
            return self._scratch_dir() / f"{name}.log"
        log = self.spec.log_dir / f"{name}.log"
        self._open_log(log).close()
        return log

    def _open_log(self, log: Path) -> BinaryIO:
        """`log` opened to append (made 0o600; a symlink there is refused, not followed); one that
        cannot be opened is a ServerError naming --log-dir, or the scratch directory, not an OSError.
        An `rm -rf` of the operator's --log-dir while the cluster runs makes it again, so a restart
        still has somewhere to write; the scratch directory is never made again (`_scratch_dir`)."""
        try:
            if self._scratch_fd is not None and log.parent == self._scratch:
                return open_log(log.name, dir_fd=self._scratch_fd)
            log.parent.mkdir(parents=True, exist_ok=True)
            return open_log(log)
        except OSError as exc:
            why = exc.strerror or exc
            if self.spec.log_dir is not None and log.parent == self.spec.log_dir:
                raise ServerError(f"--log-dir {self.spec.log_dir}: cannot write {log.name}: {why}") from None
            if log.parent == self._scratch and exc.errno == errno.ENOENT:
                raise ServerError(
                    f"cannot write {log}: the cluster's scratch directory {log.parent} was removed while it ran, and "
                    "is not made again (give --log-dir for logs in a directory of your own)"
                ) from None
            raise ServerError(f"cannot write {log}: {why}") from None

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> _Child:
        """Start `python -m kvswitch <argv>`; its output goes to `log_dir/<name>.log` when set, else
        to a scratch directory removed at `stop`, so an error can quote why a child died. (A file,
        not a pipe: reading a pipe would cost this process CPU, and benchmarks run their client in
        it.)"""
        log = self._log(name)
        child = _Child(name, argv[0], self._popen(argv, env or {}, log), log, argv, env or {})
        self.children.append(child)
        return child

    def _popen(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        command, preexec = dying_with_parent([sys.executable, "-m", "kvswitch", *argv], signal.SIGTERM)
        with self._open_log(log) as out:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                # A supervisor killed outright must not orphan its children: they drain on SIGTERM.
                preexec_fn=preexec,  # noqa: PLW1509
                # Out of the terminal's process group: a Ctrl-C is for `kvswitch up` alone, which
                # stops its children in tiers (signalled at once, the sims cut what the rest drain).
                start_new_session=True,
            )  # fmt: skip
        return proc

    def note_exits(self, now: float) -> list[tuple[str, str, _Backoff]]:
        """(name, its exit status and last output, its back-off) of each child and server whose exit
        is new since the last call; with a restart policy, each is due again after its back-off, or
        given up (`given_up`) at its policy's bound. Nothing is scheduled once stopping."""
        exits = []
        with self._lock:
            for child in self.children:
                if not child.backoff.noted and child.proc.poll() is not None:
                    exits.append((child.name, child.died(), child.backoff))
            servers = dict(self.servers())
            for name in self.dead_server_names():
                backoff = self._server_backoff.setdefault(name, _Backoff())
                if not backoff.noted:  # its log read once an exit, not each tick it stays dead
                    exits.append((name, _died(name, servers[name]), backoff))
            for _, _, backoff in exits:
                backoff.noted = True
                if self.spec.restart is not None and not self._stopping:
                    self._schedule(backoff, self.spec.restart, now)
        return exits

    @staticmethod
    def _schedule(backoff: _Backoff, policy: RestartPolicy, now: float) -> None:
        settled = now - backoff.started_at >= policy.settled_s
        backoff.failures = 1 if settled else backoff.failures + 1
        if backoff.failures >= policy.failures:
            backoff.given_up = True
        else:
            backoff.restart_at = now + policy.delay(backoff.failures)

    def restart_due(self, now: float) -> list[tuple[str, str | None, _Backoff]]:
        """Start again, as each was started first, every child and server whose back-off ended:
        (name, None or why it could not be started, its back-off) of each. One that cannot be started
        (its log's directory made a file, its binary gone, no process to fork) counts as another exit:
        due again after its back-off, or given up at its policy's bound; the others start as ever.
        Nothing once stopping: `stop` takes down what this restarted before it."""
        tried: list[tuple[str, str | None, _Backoff]] = []
        with self._lock:
            if self._stopping:
                return []
            for child in self.children:
                if child.backoff.restart_at is not None and child.backoff.restart_at <= now:
                    try:
                        child.proc = self._popen(child.argv, child.env, child.log)
                    except _START_ERRORS as exc:
                        tried.append((child.name, self._not_restarted(child.backoff, exc, now), child.backoff))
                        continue
                    child.serving = not child.probes
                    self._restarted(child.backoff, now)
                    tried.append((child.name, None, child.backoff))
            for name, server in self.servers():
                backoff = self._server_backoff.get(name)
                if backoff is not None and backoff.restart_at is not None and backoff.restart_at <= now:
                    try:
                        server.launch()  # its ports and store, its log appended
                    except _START_ERRORS as exc:
                        tried.append((name, self._not_restarted(backoff, exc, now), backoff))
                        continue
                    self._restarted(backoff, now)
                    tried.append((name, None, backoff))
        return tried

    @staticmethod
    def _restarted(backoff: _Backoff, now: float) -> None:
        backoff.restart_at, backoff.noted, backoff.started_at = None, False, now
        backoff.restarts += 1

    def _not_restarted(self, backoff: _Backoff, exc: BaseException, now: float) -> str:
        """Count a start that failed as an exit at its start (never settled, so the bound is reached
        however long it ran before), and say why it failed."""
        assert self.spec.restart is not None  # a back-off ends only under a policy
        backoff.restart_at, backoff.started_at = None, now
        self._schedule(backoff, self.spec.restart, now)
        return _why(exc)

    def next_restart(self) -> float | None:
        """When the next restart is due (time.monotonic), None when none waits."""
        due = [c.backoff.restart_at for c in self.children] + [b.restart_at for b in self._server_backoff.values()]
        return min((d for d in due if d is not None), default=None)

    def _wait_http(
        self, url: str, what: str, timeout: float = 60.0, ok: Callable[[bytes], bool] = lambda _body: True
    ) -> None:
        """Poll `url` until it answers 200 with a body `ok` accepts; fail early if a child died. The
        error quotes the last body seen, which for /ready says why the router is not ready and why the
        first eight workers left out are."""
        deadline = time.monotonic() + timeout
        last = b""
        while time.monotonic() < deadline:
            if self._abandon.is_set():
                raise ServerError(f"stopped while waiting for {what}")
            dead = [c.died() for c in self.children if c.proc.poll() is not None]
            dead += [died for _, died in self.dead_servers()]
            if dead:
                raise ServerError(f"{', '.join(dead)} exited while waiting for {what}")
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    last = resp.read()
                    if resp.status == 200 and ok(last):
                        return
            except urllib.error.HTTPError as e:
                with contextlib.suppress(OSError):
                    last = e.read()
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
                pass  # HTTPException: another server (nats-server greets first) holds the port; the child's bind fails
            time.sleep(0.2)
        raise ServerError(f"{what} not ready after {timeout:.0f}s ({url}): {last[:2000]!r}")

    def abandon_start(self) -> None:
        """Make a `start` or `wait_ready` running in another thread give up at its next poll
        (ServerError), so a supervisor told to stop while the cluster starts need not wait for it.
        What started is left running for the supervisor's `stop`: stopped inside `start`, its tiers
        were said without the caller's `again`, and the children it killed were counted nowhere."""
        self._abandon.set()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Every router answers /ready and can route to every engine: a worker merely registered
        may still be bootstrapping its index, and a request then would skip it. The answer must
        come from this cluster's router: a ServerError names the port when another process serves
        it (another `kvswitch up` on the same --http-port), whose 200 proves nothing of ours."""
        deadline = time.monotonic() + timeout
        n = len(self.engines)
        for url in self.router_urls:
            self._wait_http(
                url + "/ready",
                what=f"router {url} with {n} routable workers",
                timeout=max(1.0, deadline - time.monotonic()),
                ok=functools.partial(self._ready_and_ours, url, n),
            )

    def _ready_and_ours(self, url: str, n: int, body: bytes) -> bool:
        """Whether `url`'s /ready `body` counts `n` routable workers, from the router registered in
        this cluster's etcd at `url` (an id no other cluster's etcd holds)."""
        ready = json.loads(body)
        if not isinstance(ready, dict) or int(ready.get("routable", 0)) < n:
            return False
        router = ready.get("router")
        try:
            registered = self._registered_url(router)
        except EtcdAuthError:  # etcd did not answer this time: not known to be ready yet
            return False
        if registered != url:
            port = url.rsplit(":", 1)[1]
            raise ServerError(
                f"{url} answers as router {router!r}, which is not this cluster's: another process serves port "
                f"{port} (another kvswitch up?); choose another --http-port, or 0 for free ones"
            )
        return True

    def _registered_url(self, router: object) -> str | None:
        """The URL router `router` registered under this cluster's namespace in its etcd (read over
        etcd's JSON gateway), None when it is not registered there."""
        assert self.etcd is not None
        try:
            key = subjects.router_key(self.spec.namespace, router if isinstance(router, str) else "")
        except ValueError:  # not an id a router of ours could have
            return None
        gateway = EtcdGateway(self.etcd.urls[0], self.spec.tls.client_context() if self.spec.tls is not None else None)
        if self._etcd_passwords:
            login: dict[str, object] = {"name": "root", "password": self._etcd_passwords["root"]}
            gateway.token = str(gateway.call("auth/authenticate", login).get("token"))
        kvs = gateway.call("kv/range", {"key": b64(key)}).get("kvs") or []
        if not kvs:
            return None
        return decode_json(base64.b64decode(kvs[0].get("value", "")), RouterInfo).http_url

    def stop(self, grace_s: float = STOP_GRACE_S, *, again: str = "") -> list[str]:
        """Stop the children tier by tier, the last started first (routers, then shims, then
        sims), each tier drained before the next is signalled: requests in flight finish on
        engines that are still up. A tier gets `grace_s` (the shim drains for 30 s at most), then
        is killed. Then the servers go. Each tier is said as it starts (a stop can take minutes: a
        silent one looked hung), with `again`: what a second signal does, where the caller has one.
        The names of the children that had to be killed."""
        with self._lock:  # a restart meanwhile: none after this, and the one before is stopped here
            self._stopping = True
        killed: list[str] = []
        for tier in _tiers(list(reversed(self.children))):
            running = [child for child in tier if child.proc.poll() is None]
            if running:
                kind = running[0].kind + ("s" if len(running) > 1 else "")
                log.info("stopping %d %s (draining up to %.0fs, then killed%s)", len(running), kind, grace_s, again)
            for child in running:
                child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in tier:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                if child.proc.poll() is None:
                    log.error("%s did not stop within %.0fs of SIGTERM: killed", child.name, grace_s)
                    child.proc.kill()
                    child.proc.wait(5)
                    killed.append(child.name)
        for servers in (self.etcd, self.nats):
            if servers is not None:
                servers.close()
        self._forget()
        return killed

    def kill(self) -> None:
        """SIGKILL every child and server now and remove the cluster's directories: for a
        supervisor that must exit at once, even while `stop` drains on another thread (whose
        directories a plain exit would leave behind)."""
        with self._lock:
            self._stopping = True
        children = list(self.children)
        running = sum(child.proc.poll() is None for child in children)
        named = [s.name for s in (self.nats, self.etcd) if s is not None]
        if running or named:
            also = f", {' and '.join(named)}" if named else ""
            log.warning("killing %d children%s now: requests and streams in flight are cut", running, also)
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(5)
        for servers in (self.etcd, self.nats):
            if servers is not None:
                servers.close(now=True)
        self._forget()

    def _forget(self) -> None:
        """Remove the cluster's directories; what ran in it is gone. `kill` (a second signal) may run
        it while `stop` does on another thread: each takes the fields under the lock, so the directories
        are removed and the descriptor closed once (closed twice, it was EBADF, or another file's). The
        removal lock is held from before the take to after the removal: a `kill` that finds the fields
        taken has waited for their removal (up exits at once after it), `_REMOVAL_WAIT_S` at most."""
        removing = self._removing.acquire(timeout=_REMOVAL_WAIT_S)
        if not removing:
            log.warning(
                "the cluster's directories were still being removed after %.0fs: going on, some may be left",
                _REMOVAL_WAIT_S,
            )
        try:
            with self._lock:
                made, fd = (self.secrets_dir, self._scratch), self._scratch_fd
                self.secrets_dir = self._scratch = self._scratch_fd = None
                self.children = []
                self.etcd = self.nats = None
                self.engines = []
                self.router_urls = []
                self._server_backoff = {}
            for path in made:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
            if fd is not None:
                os.close(fd)
        finally:
            if removing:
                self._removing.release()

    def healthy(self) -> bool:
        return self.health()[1]

    def describe(self) -> str:
        lines = ["kvswitch local cluster:"]
        for node in self.nats.nodes if self.nats is not None else []:
            lines.append(f"  nats     {node.url}  (monitor http://127.0.0.1:{node.monitor_port})")
        for member in self.etcd.members if self.etcd is not None else []:
            lines.append(f"  etcd     {member.url}")
        if self.spec.tls is not None:
            lines.append(f"  tls      CA {self.spec.tls.ca}")
        lines.append(f"  namespace {self.spec.namespace}")
        for e in self.engines:
            lines.append(f"  sim      {e.role:<7} {e.url}  events {e.events}")
        for url in self.router_urls:
            lines.append(f"  router   {url}/v1  (ready: {url}/ready, metrics: {url}/metrics)")
        return "\n".join(lines)

    def health_line(self) -> str:
        return self.health()[0]

    def servers(self) -> list[tuple[str, NatsServer | EtcdServer]]:
        """Every NATS and etcd server, by the name its --log-dir file and the health line give it."""
        nats = self.nats.nodes if self.nats is not None else []
        etcd = self.etcd.members if self.etcd is not None else []
        return [(f"nats-{i}", n) for i, n in enumerate(nats)] + [(f"etcd-{i}", m) for i, m in enumerate(etcd)]

    def dead_server_names(self) -> list[str]:
        """The servers that exited on their own (one stopped or killed on purpose has no process left),
        waiting for a restart or not."""
        return [name for name, server in self.servers() if server.proc is not None and server.proc.poll() is not None]

    def dead_servers(self) -> list[tuple[str, str]]:
        """(name, its address, exit status and last lines of output) of each server that exited on
        its own."""
        servers = dict(self.servers())
        return [(name, _died(name, servers[name])) for name in self.dead_server_names()]

    def health(self) -> tuple[str, bool]:
        """One probe of every server and child: the health line, and whether all are up."""
        nats = [n.healthy() for n in self.nats.nodes] if self.nats is not None else [False]
        etcd = [m.healthy() for m in self.etcd.members] if self.etcd is not None else [False]
        parts = [f"nats={_members_state(nats)}", f"etcd={_members_state(etcd)}"]
        for child in self.children:
            if not child.serving and child.proc.poll() is None:
                child.serving = all(_answers(url) for url in child.probes)
        states = [(c.name, c.state()) for c in self.children]
        up = sum(state == "up" for _, state in states)
        parts.append(f"children={up}/{len(self.children)} up")
        restarting = [name for name, state in states if state == "restarting"]
        dead = [name for name, state in states if state == "dead"]
        dead_servers = self.dead_server_names()
        for name in dead_servers:  # names only: the log tails are up's to read, once
            backoff = self._server_backoff.get(name)
            (restarting if backoff is not None and backoff.restart_at is not None else dead).append(name)
        if restarting:
            parts.append("restarting=" + ",".join(restarting))
        if dead:
            parts.append("dead=" + ",".join(dead))
        self._servers_ok = all(nats) and all(etcd) and not dead_servers
        return "health: " + " ".join(parts), all(nats) and all(etcd) and not dead and not restarting

    def restarting_only(self, now: float, grace_s: float) -> bool:
        """Whether all the last `health` found down are children restarting within their back-off:
        waiting out its delay, or restarted under `grace_s` ago and not serving yet; NATS and etcd
        all up, none dead or given up."""
        for child in self.children:
            state = child.state()
            if state == "dead":
                return False
            if state == "restarting" and child.backoff.restart_at is None and now - child.backoff.started_at > grace_s:
                return False
        return self._servers_ok


def _without_config(router_args: list[str]) -> tuple[list[str], str | None]:
    """`router_args` less their --config FILE (as `--config F`, `--config=F` or an abbreviation
    argparse took for it: up's check parsed them), and that FILE (the last, as argparse keeps it)."""
    rest: list[str] = []
    config = None
    args = iter(router_args)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if len(flag) > 2 and "--config".startswith(flag):
            config = value if eq else next(args, None)
        else:
            rest.append(arg)
    return rest, config


def shim_argv(spec: ClusterSpec, role: str, engine_url: str, events: str, replay: str) -> list[str]:
    """`kvswitch shim`'s argv beside the sim at `engine_url` (`events`, `replay`: its endpoints), but
    for its NATS and etcd flags (LocalCluster._connection_args): `kvswitch up` resolves it before
    anything starts. Its /health and /metrics listen on 127.0.0.1 at a free port by flag, which wins
    over KVSWITCH_HTTP_HOST and KVSWITCH_HTTP_PORT: those are the router's too, and the one
    environment `kvswitch up` runs in is every child's (a port given to both made a shim's bind fail
    after NATS, etcd and the sims had started; a host beside every URL up printed as 127.0.0.1).
    `spec.shim_args` come after these, and win (but for --max-num-batched-tokens, the sims'). Its
    --timing-profile is the sims' at their --speedup (`h200:llama-3.1-8b@10x`): the routers predict
    and calibrate against the speed the engines run at (the profile's own made every shim fit
    k_d = 1 / speedup, past the calibration's bound of 0.2 at 10x, and said so at WARNING)."""
    return [
        "shim", "--engine", "vllm", "--engine-url", engine_url, "--role", role, "--model", spec.model,
        "--kv-events", events, "--kv-replay", replay,
        "--timing-profile", speed_profile(spec.profile, spec.speedup),
        "--http-host", "127.0.0.1", "--http-port", "0", *spec.shim_args,
        # vLLM does not report it; the router's prefill_load policy needs it, and it is the sims' own.
        "--max-num-batched-tokens", str(spec.max_num_batched_tokens),
    ]  # fmt: skip


def _start_flagged(servers: NatsCluster | EtcdCluster, flag: str, first: int) -> None:
    """Start `servers`, whose client ports `flag` asks for from `first` (0: drawn): one of those taken
    by another process since `kvswitch up` found it free is never drawn again (kvswitch.servers
    draws again only what it drew), and the refusal names the flag."""
    try:
        servers.start()
    except PortTaken as exc:
        asked = [p for p in exc.ports if first and first <= p < first + servers.size]
        if not asked:
            raise
        raise ServerError(
            f"{flag} {first}: port {asked[0]} was taken by another process before {servers.name} bound it ({exc}): "
            f"choose another {flag}, or 0 for free ones"
        ) from None


def _answers(url: str) -> bool:
    """Whether `url` answers 200 now (a restarted child's probe)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except PROBE_ERRORS:
        return False


def _died(name: str, server: NatsServer | EtcdServer) -> str:
    """A server that exited: its name, address, exit status and last lines of output."""
    assert server.proc is not None
    tail = server.log_tail(12).splitlines()
    said = "; its last output:\n    " + "\n    ".join(tail) if tail else ""
    return f"{name} {server.url} (status {server.proc.returncode}{said})"


def _members_state(up: list[bool]) -> str:
    if all(up):
        return "ok"
    return "DOWN" if not any(up) else f"{sum(up)}/{len(up)} up"


def _require_shim_flag(flag: str, why: str) -> None:
    """Refuse at once, naming the flag, when this build's shim lacks one the cluster must pass."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    importlib.import_module("worker_shim.cli").add_arguments(parser)
    _, unknown = parser.parse_known_args([flag, "x"])
    if unknown:
        raise ServerError(f"{why} needs the shim's {flag} flag, which this build's `kvswitch shim` does not have")
