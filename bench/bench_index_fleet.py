"""The prefix index fed over NATS by 1,000 simulated workers: how long a new replica takes to
bootstrap the whole index from the workers' dumps, and the event lag while they publish at a
realistic rate (issue 12, items 5 and 6; figures in docs/router_index.md).

    .venv/bin/python -m bench.bench_index_fleet [--workers 1000] [--blocks 16384] [--sharing low]
        [--duration 30] [--rate-scale 1.0] [--procs 2] [--profile PREFIX]

Processes: a real nats-server (kvswitch.servers), `--procs` shim simulators, and this one as the
router side: `router.kv_ingest.KvIngest` feeding `router.block_index.BlockIndex`, as they are and on
uvloop, as the router runs them. Nothing else runs in the router process (no routing).

Each simulator owns every `procs`-th worker, on one NATS connection. Per worker: the blocks of
bench/index_fleet_workload.py, and worker_shim.event_log.EventLog, which numbers its batches and
answers `{ns}.kvstate.{worker}` with a full dump in KvStateChunks exactly as a shim does (its ring
of batches is cut to 64 to keep 1,000 of them in memory; nothing here asks for replays).

1. Bootstrap: the router side calls `add_worker` for every worker at once (what the registry's
   first snapshot does) and times until KvIngest reports synced; then every worker's
   `index.digest` is checked against the simulator's blocks.
2. Lag: every worker publishes KvEventBatches on `{ns}.kv.{worker}` for `--duration` seconds,
   Poisson-spaced at the rate engine_sim produces on one H200 serving the Mooncake trace at 88%
   load (bench/index_event_rate.py, run here first: batches per second and the (stored, removed)
   sizes of its batches, sampled). Each batch evicts as many blocks as it stores (a full cache), so
   it carries 2 x max(stored, removed) hashes. Lag = the time KvIngest has applied a batch minus the
   batch's `ts` (sealed just before publishing), read through KvIngest's own `stats.last_lag_s`.
   At the end, every worker's `index.digest` is compared with the simulator's (count, xor).

`--pin` puts the router process alone on the last CPU and nats-server and the simulators on the
others (as in a deployment, where the shims run on the GPU hosts, not next to the router); other
processes on the machine still share every CPU. Every thread of each is pinned: nats-server starts
with the others' mask (so each thread Go's runtime makes inherits it), and the router and the
simulators pin all their threads (bench.cpu.pin_process), not only their main ones.
`--profile PREFIX` runs the router side under cProfile (CPU time, not wall) and prints where the
time of each phase went (also saved as PREFIX.bootstrap and PREFIX.live).

The simulators stamp `ts` when they seal a batch, so a simulator that falls behind (its CPU taken)
adds its own delay to the lag: each reports how far behind its schedule it sealed (p99), and a run
where that is not small says more about the machine than about the router.

KvIngest runs as it is in the router: dumps stored chunk by chunk, at most `--dump-concurrency`
(default 32, the router's own) kvstate replies in flight.
Target: bootstrap <= 10 s; lag p99 <= 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import heapq
import multiprocessing
import os
import pstats
import socket
import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import numpy as np
import uvloop
from nats.aio.client import Client
from nats.aio.msg import Msg

from bench.cpu import pin_process
from bench.index_event_rate import EventRate
from bench.index_event_rate import measure as measure_event_rate
from bench.index_fleet_workload import SHARINGS, FleetWorkload
from kvswitch.servers import NatsServer
from protocol import pack_batch, pack_chunk, subjects
from protocol.messages import KvEvent, KvEventBatch, KvStateRequest, Removed, Stored, decode_msg, encode_msg
from router.block_index import BlockIndex
from router.ingest_stats import IngestStats
from router.kv_ingest import KvIngest
from runtime.nats_flush import flush
from worker_shim.event_log import EventLog
from worker_shim.kv_digest import KvDigest

NS = "bench"
EPOCH = 1
RING = 64
RATE_SPEED = 0.25  # the Mooncake trace's arrival rate x this keeps one H200 at ~88% busy
RATE_SECONDS = 300.0
RECONNECT: dict[str, Any] = {"max_reconnect_attempts": -1, "reconnect_time_wait": 0.5}  # as the router and shim


class Go(msgspec.Struct):
    duration: float
    rate: float  # batches per second per worker
    sizes: list[tuple[int, int]]  # (stored, removed) of engine_sim's batches, to sample from


class Final(msgspec.Struct):
    proc: int
    published: int
    cpu: float  # this simulator's CPU over the live phase, share of one core
    late_p99_ms: float  # how far behind its schedule it sealed batches
    digests: list[tuple[str, int, int, int]]  # (worker, seq, count, xor)


def _xor(hashes: np.ndarray) -> int:
    return int(np.bitwise_xor.reduce(hashes)) if len(hashes) else 0


# --- the shim simulators -------------------------------------------------------------------------


class _Draws:
    """Values drawn in bulk and handed out one by one: a numpy call per batch would cost more
    than the batch."""

    def __init__(self, draw: Any, n: int = 65_536) -> None:
        self._draw, self._n = draw, n
        self._drawn: list[Any] = []
        self._at = 0

    def take(self, k: int = 1) -> list[Any]:
        if self._at + k > len(self._drawn):
            self._drawn = self._drawn[self._at :] + self._draw(max(k, self._n)).tolist()
            self._at = 0
        self._at += k
        return self._drawn[self._at - k : self._at]


class _NoDigest(KvDigest):
    """A simulated worker's log keeps no digest: nothing here reads it (the bench checks its own
    XOR of the ring), and folding every hash into a set per batch is a shim host's cost that, for
    500 workers in one process, kept the simulators' core over 100% busy at the full rate: they fell
    behind, then published in bursts that delayed nats-server and showed up as router lag."""

    __slots__ = ()

    def apply(self, events: Iterable[KvEvent]) -> None:
        return None


def _sim_log(name: str) -> EventLog:
    log = EventLog(name, EPOCH, ring_size=RING)
    log.digest = _NoDigest()
    return log


@dataclass
class _SimWorker:
    name: str
    ring: list[int]  # the blocks held, oldest first from `head` (a list: numpy slices cost more here)
    log: EventLog
    head: int = 0

    def dump(self) -> list[int]:
        return self.ring[self.head :] + self.ring[: self.head]

    def next_batch(self, new: list[int]) -> KvEventBatch:
        """Evict as many of the oldest blocks as `new` has and cache `new`, as one batch sealed now."""
        old: list[int] = []
        while len(old) < len(new):  # at most twice: the ring wraps once
            part = new[len(old) : len(old) + len(self.ring) - self.head]
            end = self.head + len(part)
            old += self.ring[self.head : end]
            self.ring[self.head : end] = part
            self.head = end % len(self.ring)
        return self.log.seal([Removed(hashes=old), Stored(hashes=new)])


class _RawPublisher:
    """Live batches go out with a plain socket write the moment they are sealed. nats-py would hold
    them in its buffer until its flusher task runs, and with hundreds of simulated shims in one
    process that wait, which a real shim does not have, would be part of every batch's lag."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("nats://").rpartition(":")
        self._sock = socket.create_connection((host, int(port)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.recv(65536)  # INFO
        self._sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"name":"bench-raw"}\r\nPING\r\n')
        if b"PONG" not in self._sock.recv(65536):
            raise RuntimeError("nats-server did not answer the raw publisher's PING")
        self._sock.setblocking(False)

    def publish(self, subject: str, payload: bytes) -> None:
        self._sock.setblocking(True)  # back-pressure from the server shows as falling behind schedule
        self._sock.sendall(b"PUB %b %d\r\n%b\r\n" % (subject.encode(), len(payload), payload))
        self._sock.setblocking(False)

    def answer_pings(self) -> None:
        with contextlib.suppress(BlockingIOError):
            if b"PING" in self._sock.recv(65536):
                self._sock.sendall(b"PONG\r\n")

    def close(self) -> None:
        self._sock.close()


async def _simulate(proc: int, procs: int, url: str, wl: FleetWorkload) -> None:
    nc = await nats.connect(url, name=f"bench-shims-{proc}", **RECONNECT)
    workers = [
        _SimWorker(wl.name(w), wl.hashes(w).tolist(), _sim_log(wl.name(w))) for w in range(proc, wl.workers, procs)
    ]

    gc.freeze()  # 500 rings of 16 k blocks: full collections would walk them again and again

    def answer(sim: _SimWorker) -> Any:
        async def on_request(msg: Msg) -> None:
            request = decode_msg(msg.data, KvStateRequest)
            for chunk in sim.log.reply(request, sim.dump):
                await nc.publish(msg.reply, encode_msg(pack_chunk(chunk)))

        return on_request

    for sim in workers:
        await nc.subscribe(subjects.kvstate(NS, sim.name), cb=answer(sim))
    go_sub = await nc.subscribe(f"{NS}.bench.go")
    await flush(nc)
    await nc.publish(f"{NS}.bench.ready", msgspec.msgpack.encode(proc))
    go = msgspec.msgpack.decode((await go_sub.next_msg(timeout=600)).data, type=Go)
    rng = np.random.default_rng(proc)
    sizes = np.array([max(s, r) for s, r in go.sizes])
    gaps = _Draws(lambda n: rng.exponential(1 / go.rate, n))
    picks = _Draws(lambda n: sizes[rng.integers(len(sizes), size=n)])
    fresh = iter(range(1 << 40))  # new blocks come from a stream of this process's own

    def new_blocks(n: int) -> np.ndarray:
        return wl.fresh(wl.workers + proc, next(fresh) * n, n)

    blocks = _Draws(new_blocks, 1 << 20)
    raw = _RawPublisher(url)
    start, cpu = time.monotonic(), time.process_time()
    end = start + go.duration
    due = [(start + gap, i) for i, gap in enumerate(gaps.take(len(workers)))]
    heapq.heapify(due)
    published = 0
    late: list[float] = []
    while True:
        now = time.monotonic()
        if now >= end:
            break
        while due[0][0] <= now:
            at, i = due[0]
            late.append(now - at)
            sim = workers[i]
            batch = sim.next_batch(blocks.take(picks.take()[0]))
            raw.publish(subjects.kv(NS, sim.name), encode_msg(pack_batch(batch)))
            published += 1
            heapq.heapreplace(due, (at + gaps.take()[0], i))
        raw.answer_pings()
        await asyncio.sleep(min(0.002, max(0.0, due[0][0] - time.monotonic())))
    raw.close()
    cpu = (time.process_time() - cpu) / (time.monotonic() - start)
    late_p99 = float(np.percentile(late, 99)) * 1e3 if late else 0.0
    digests = [(s.name, s.log.seq, len(s.ring), _xor(np.array(s.ring, dtype=np.uint64))) for s in workers]
    final = Final(proc, published, cpu, late_p99, digests)
    stop = await nc.subscribe(f"{NS}.bench.stop")
    for _ in range(150):  # a request, retried: a router far behind answers late
        try:
            await nc.request(f"{NS}.bench.final", msgspec.msgpack.encode(final), timeout=2)
            break
        except nats.errors.Error:
            continue
    with contextlib.suppress(nats.errors.Error):  # keep answering kvstate until the router is done
        await stop.next_msg(timeout=600)
    await nc.close()


def _simulator_main(proc: int, procs: int, url: str, wl: FleetWorkload, cpus: set[int] | None) -> None:
    if cpus:  # spawned with the router's CPU: threads made at import (numpy's) have it too
        pin_process(os.getpid(), cpus)
    uvloop.run(_simulate(proc, procs, url, wl))


# --- the router side -----------------------------------------------------------------------------


class LagStats(IngestStats):
    """KvIngest's counters, keeping every `last_lag_s` it sets (one per live batch applied)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        super().__init__()
        self.lags.clear()  # the dataclass's initial 0.0

    @property
    def last_lag_s(self) -> float:
        return self.lags[-1] if self.lags else 0.0

    @last_lag_s.setter
    def last_lag_s(self, value: float) -> None:
        self.lags.append(value)


@dataclass
class Result:
    bootstrap_s: float = 0.0
    entries: int = 0
    digests_ok_after_bootstrap: int = 0
    rate: float = 0.0
    published: int = 0
    live_s: float = 0.0
    lags: list[float] = field(default_factory=list)
    router_cpu: float = 0.0
    router_disconnects: int = 0
    caught_up: bool = False  # every published batch applied within 60 s of the simulators' end
    client_dropped: int = 0  # messages nats-py dropped for the router (its subscription queue was full)
    nats_cpu: float = 0.0
    sims: list[tuple[float, float]] = field(default_factory=list)  # (cpu, late p99 ms) per simulator
    digests_ok_after_live: int = 0
    stats: dict[str, int] = field(default_factory=dict)


class _Phase:
    """cProfile (CPU time) over one phase when a prefix is given, saved as PREFIX.phase."""

    def __init__(self, prefix: str | None, phase: str) -> None:
        self._path = f"{prefix}.{phase}" if prefix else None
        self._profiler = cProfile.Profile(time.process_time) if prefix else None
        if self._profiler is not None:
            self._profiler.enable()

    def done(self) -> None:
        if self._profiler is not None and self._path is not None:
            self._profiler.disable()
            self._profiler.dump_stats(self._path)


async def _collect(nc: Client, subject: str, count: int, timeout: float) -> list[bytes]:
    """`count` distinct payloads sent on `subject` (requests are answered; a retried one, the same
    payload again, is counted once)."""
    sub = await nc.subscribe(subject)
    await flush(nc)
    got: set[bytes] = set()
    try:
        while len(got) < count:
            msg = await sub.next_msg(timeout=timeout)
            got.add(msg.data)
            if msg.reply:
                await nc.publish(msg.reply, b"")
        return list(got)
    finally:
        await sub.unsubscribe()


async def _router(args: argparse.Namespace, url: str, wl: FleetWorkload, engine: EventRate) -> Result:
    out = Result()
    disconnects = dropped = 0

    async def disconnected() -> None:
        nonlocal disconnects
        disconnects += 1

    async def error(exc: Exception) -> None:
        nonlocal dropped
        if isinstance(exc, nats.errors.SlowConsumerError):
            dropped += 1  # nats-py's own queue for a subscription overflowed: a message is lost

    nc = await nats.connect(url, name="bench-router", disconnected_cb=disconnected, error_cb=error, **RECONNECT)
    ready = asyncio.create_task(_collect(nc, f"{NS}.bench.ready", args.procs, 120))
    procs = [
        multiprocessing.get_context("spawn").Process(
            target=_simulator_main, args=(p, args.procs, url, wl, args.others), daemon=True
        )
        for p in range(args.procs)
    ]
    for p in procs:
        p.start()
    try:
        await ready
        index = BlockIndex()
        ingest = KvIngest(nc, NS, index, max_kvstate_in_flight=args.dump_concurrency)
        ingest.stats = stats = LagStats()
        await ingest.start()
        profile = _Phase(args.profile, "bootstrap")
        start = time.monotonic()
        for w in range(wl.workers):
            ingest.add_worker(wl.name(w), EPOCH)
        if not await ingest.wait_synced(300):
            raise RuntimeError(f"not synced after 300 s: {stats.repair_timeouts} kvstate timeouts")
        out.bootstrap_s = time.monotonic() - start
        profile.done()
        out.entries = index.entries
        out.digests_ok_after_bootstrap = sum(
            index.digest(wl.name(w)) == (wl.blocks, _xor(wl.hashes(w))) for w in range(wl.workers)
        )
        out.rate = args.rate_scale * engine.batches / engine.sim_s
        finals_task = asyncio.create_task(_collect(nc, f"{NS}.bench.final", args.procs, args.duration + 300))
        await flush(nc)
        profile = _Phase(args.profile, "live")
        cpu, nats_cpu = time.process_time(), _cpu_seconds(args.nats_pid)
        start = time.monotonic()
        await nc.publish(f"{NS}.bench.go", msgspec.msgpack.encode(Go(args.duration, out.rate, engine.batch_sizes)))
        finals = [msgspec.msgpack.decode(data, type=Final) for data in await finals_task]
        expected = {name: (seq, count, x) for f in finals for name, seq, count, x in f.digests}
        for _ in range(6000):  # up to 60 s for the router to apply what was published
            if all(stats.workers[name].last_seq >= seq for name, (seq, _, _) in expected.items()):
                out.caught_up = True
                break
            await asyncio.sleep(0.01)
        out.live_s = time.monotonic() - start
        profile.done()
        out.router_cpu = (time.process_time() - cpu) / out.live_s
        out.nats_cpu = (_cpu_seconds(args.nats_pid) - nats_cpu) / out.live_s
        out.sims = [(f.cpu, f.late_p99_ms) for f in finals]
        out.published = sum(f.published for f in finals)
        out.lags = stats.lags
        out.digests_ok_after_live = sum(index.digest(name) == (c, x) for name, (_, c, x) in expected.items())
        out.stats = {
            k: v for k, v in vars(stats).items() if isinstance(v, int) and k not in ("lags",) and not k.startswith("_")
        }
        await ingest.stop()
        out.router_disconnects, out.client_dropped = disconnects, dropped
    finally:
        with contextlib.suppress(nats.errors.Error):
            await nc.publish(f"{NS}.bench.stop", b"")
            await flush(nc, 5)
        await nc.close()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return out


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def report(args: argparse.Namespace, rate_line: str, r: Result, slow_consumers: int) -> None:
    n = args.workers
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}  {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    print(f"{n} workers x {args.blocks} blocks ({args.sharing} sharing), {args.procs} simulator processes")
    if args.pin:
        print(f"pinned: the router on CPU {max(os.sched_getaffinity(0))}, nats-server and simulators on {args.others}")
    print(f"at most {args.dump_concurrency} kvstate replies in flight")
    print(f"engine_sim, one H200 at the Mooncake trace x{RATE_SPEED}: {rate_line}")
    print(
        f"bootstrap: {r.bootstrap_s:.2f} s to synced ({r.entries:,} entries,"
        f" {r.entries / r.bootstrap_s / 1e6:.1f} M/s); digests match for {r.digests_ok_after_bootstrap}/{n} workers"
    )
    lags_ms = [x * 1e3 for x in r.lags]
    print(
        f"live: {r.rate:.1f} batches/s per worker x {n} = {r.rate * n:,.0f}/s offered; {r.published:,} published,"
        f" {len(lags_ms):,} applied in {r.live_s:.1f} s"
    )
    sims = ", ".join(f"{cpu:.0%} (p99 {late:.0f} ms behind schedule)" for cpu, late in r.sims)
    print(f"CPU, share of one core: router {r.router_cpu:.0%}, nats-server {r.nats_cpu:.0%}, simulators {sims}")
    print(
        f"lag ms: p50 {_pct(lags_ms, 0.5):.1f}  p90 {_pct(lags_ms, 0.9):.1f}  p99 {_pct(lags_ms, 0.99):.1f}"
        f"  p99.9 {_pct(lags_ms, 0.999):.1f}  max {max(lags_ms, default=float('nan')):.1f}"
        f"  mean {statistics.fmean(lags_ms) if lags_ms else float('nan'):.1f}"
    )
    tenth = max(1, len(lags_ms) // 10)
    trend = " ".join(f"{_pct(lags_ms[i : i + tenth], 0.99):.0f}" for i in range(0, len(lags_ms), tenth))
    print(f"lag p99 ms by tenth of the batches applied, in order: {trend}")
    if not r.caught_up:
        print("NOT CAUGHT UP: 60 s after the simulators stopped, some published batches were still not applied")
    print(f"digests match after the live phase for {r.digests_ok_after_live}/{n} workers")
    print("ingest counters: " + ", ".join(f"{k}={v}" for k, v in r.stats.items() if v))
    print(
        f"router connection lost {r.router_disconnects} times; nats-server logged {slow_consumers} slow consumers;"
        f" nats-py dropped {r.client_dropped} messages for the router"
    )


@contextlib.contextmanager
def nats_server(pin: bool) -> Iterator[tuple[NatsServer, set[int] | None]]:
    """A nats-server and, with `pin`, the CPUs it runs on: every one but the last, which this process
    (the router side), every thread of it, then has alone. nats-server is started with that mask, so
    every thread it makes has it too."""
    cpus = sorted(os.sched_getaffinity(0))
    others = set(cpus[:-1]) if pin else None
    if others is not None:
        if not others:
            raise SystemExit("--pin needs at least 2 CPUs")
        pin_process(os.getpid(), others)
    with NatsServer() as server:
        if others is not None:
            pin_process(os.getpid(), {cpus[-1]})
        yield server, others


def count_slow_consumers(log: Path) -> int:
    """The "Slow Consumer" lines in nats-server's log, all of it: a run says hundreds, more than
    `log_tail`'s last 16 KB hold."""
    with log.open("rb") as out:
        return sum(b"Slow Consumer" in line for line in out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=16_384, help="blocks per worker")
    ap.add_argument("--sharing", choices=SHARINGS, default="low")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of live publishing")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="multiply the per-worker batch rate")
    ap.add_argument("--procs", type=int, default=2, help="shim simulator processes")
    ap.add_argument(
        "--dump-concurrency", type=lambda v: max(1, int(v)), default=32, help="kvstate replies in flight (router's 32)"
    )
    ap.add_argument("--pin", action="store_true", help="the router on a CPU of its own, the rest on the others")
    ap.add_argument("--profile", metavar="PREFIX", help="cProfile the router side, per phase, and print the tops")
    args = ap.parse_args(argv)
    rate = measure_event_rate(RATE_SECONDS, RATE_SPEED)
    rate_line = rate.line()
    wl = FleetWorkload(args.workers, args.blocks, args.sharing)
    with nats_server(args.pin) as (server, args.others):
        if server.pid is None:
            raise RuntimeError("nats-server did not start")
        args.nats_pid = server.pid
        result = uvloop.run(asyncio.wait_for(_router(args, server.url, wl, rate), args.duration + 900))
        slow = count_slow_consumers(server.log_path)
    report(args, rate_line, result, slow)
    for phase in ("bootstrap", "live") if args.profile else ():
        print(f"\n--- router side, {phase}: CPU time by function ---")
        pstats.Stats(f"{args.profile}.{phase}").sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
