"""Builders shared by the shim's integration tests: a sim, a shim beside it, a router-like follower."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import nats
from aiohttp import web
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_port
from protocol import (
    Cleared,
    GenerateRequest,
    KvEventBatch,
    KvStateChunk,
    KvStateRequest,
    Removed,
    ResponseChunk,
    Stored,
    block_hashes,
    decode_msg,
    encode_msg,
    subjects,
    unpack_hashes,
)
from protocol.config import EtcdSettings, NatsSettings
from runtime.nats_flush import flush
from worker_shim import EngineBatch, ShimConfig, WorkerShim
from worker_shim.adapters.base import EngineAdapter
from worker_shim.engine_events import EventSink
from worker_shim.request_service import RequestService

BLOCK = 16


def sim_config(**kw: Any) -> SimConfig:
    base: dict[str, Any] = {"speedup": 100.0, "num_gpu_blocks": 256, "block_size": BLOCK}
    base.update(kw)
    return SimConfig(**base)


def shim_for(sim: SimServer, ns: str, nats_url: str, etcd_url: str, **kw: Any) -> WorkerShim:
    """A shim beside `sim` (its resolved endpoints unless `kw` names others; None: the shim reads
    them from the sim's /kv_event_sources). `nats_token`: NATS credentials."""
    nats = NatsSettings(servers=[nats_url], token=kw.pop("nats_token", None))
    cfg = ShimConfig(
        engine=kw.pop("engine", "vllm"),
        engine_url=kw.pop("engine_url", sim.url),
        model=kw.pop("model", sim.config.model),
        kv_events=kw.pop("kv_events", sim.events_endpoint),
        kv_events_mode=kw.pop("kv_events_mode", "connect"),
        kv_replay=kw.pop("kv_replay", sim.replay_endpoint),
        namespace=ns,
        lease_ttl=kw.pop("lease_ttl", 3),
        health_interval_s=kw.pop("health_interval_s", 0.1),
        drain_grace_s=kw.pop("drain_grace_s", 2.0),
        **kw,
    )
    return WorkerShim(cfg, nats, EtcdSettings(endpoints=[etcd_url]))


def engine_set(sim: SimServer) -> set[int]:
    """The canonical hashes of every block in the sim's own pool, at its block size."""
    out: set[int] = set()
    for prefix in sim.engine.cached_block_prefixes():
        out.add(block_hashes(prefix, sim.engine.block_size)[-1])
    return out


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """`app` on a free loopback port (a stand-in engine); its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def collector(into: list[EngineBatch]) -> EventSink:
    """An event sink that keeps every batch it is given in `into`."""

    async def sink(batch: EngineBatch) -> None:
        into.append(batch)

    return sink


async def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def decode_leg_final(
    nats_url: str, ns: str, adapter: EngineAdapter, req: GenerateRequest
) -> tuple[ResponseChunk, list[str]]:
    """Sends `req` to decode worker w1's request service over `adapter`: its final chunk, and one
    "leg" for each failed transfer-fed leg the service counted (on_transfer_failed)."""
    nc = await nats.connect(nats_url)
    failed: list[str] = []
    svc = RequestService(
        nc, adapter, lambda: None, lambda _ids, _salt: 0,
        on_transfer_failed=lambda: failed.append("leg"), block_size=lambda: 16,
    )  # fmt: skip
    try:
        subject = subjects.gen(ns, "decode", "w1")
        await nc.subscribe(subject, cb=svc.on_generate)
        finals: list[ResponseChunk] = []

        async def on_reply(msg: Msg) -> None:
            chunk = decode_msg(msg.data, ResponseChunk)
            if chunk.final:
                finals.append(chunk)

        inbox = f"{ns}.inbox.{req.request_id}"
        await nc.subscribe(inbox, cb=on_reply)
        await flush(nc)
        await nc.publish(subject, encode_msg(req), reply=inbox)
        await wait_for(lambda: bool(finals), what="the leg's final chunk")
    finally:
        await nc.close()
    return finals[0], failed


class Follower:
    """A router-like subscriber: applies every batch; on a seq gap, repairs through kvstate."""

    def __init__(self, nc: Nats, ns: str, worker: str) -> None:
        self.nc, self.ns, self.worker = nc, ns, worker
        self.hashes: set[int] = set()
        self.epoch: int | None = None
        self.seq = 0
        self.batches: list[KvEventBatch] = []
        self.cleared = 0
        self.repairs = 0
        self._buf: list[KvEventBatch] = []
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(subjects.kv(self.ns, self.worker), cb=self._on)

    def _apply(self, b: KvEventBatch) -> None:
        for e in b.events:
            if isinstance(e, Stored):
                self.hashes.update(unpack_hashes(e.hashes))
            elif isinstance(e, Removed):
                self.hashes.difference_update(unpack_hashes(e.hashes))
            elif isinstance(e, Cleared):
                self.cleared += 1
                self.hashes.clear()
        self.seq = b.seq

    async def _on(self, msg: Any) -> None:
        b = decode_msg(msg.data, KvEventBatch)
        self.batches.append(b)
        async with self._lock:
            if self.epoch == b.epoch and b.seq == self.seq + 1:
                self._apply(b)
            elif self.epoch == b.epoch and b.seq <= self.seq:
                pass
            else:
                await self.repair(b.epoch if self.epoch == b.epoch else None)

    async def repair(self, epoch: int | None) -> None:
        self.repairs += 1
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        await self.nc.publish(
            subjects.kvstate(self.ns, self.worker),
            encode_msg(KvStateRequest(since_seq=self.seq, epoch=epoch)),
            reply=inbox,
        )
        chunks: list[KvStateChunk] = []
        while True:
            m = await sub.next_msg(timeout=5)
            c = decode_msg(m.data, KvStateChunk)
            chunks.append(c)
            if c.final:
                break
        await sub.unsubscribe()
        if chunks[0].dump:
            self.hashes = {h for c in chunks for h in unpack_hashes(c.hashes)}
            self.epoch, self.seq = chunks[0].epoch, chunks[0].seq
        else:
            for c in chunks:
                for b in c.batches:
                    if b.seq == self.seq + 1:
                        self._apply(b)


async def said_at_start(
    flag: str, engine: str, ns: str, nats_url: str, etcd_url: str, caplog: Any, **config: Any
) -> list[logging.LogRecord]:
    """The shim's WARNING-or-above records naming `flag`, from a start and a stop with no engine
    before it (it starts and waits for one); `config`: ShimConfig fields over the defaults."""
    cfg = ShimConfig(
        engine=engine,  # type: ignore[arg-type]
        engine_url="http://127.0.0.1:9",
        model="m",
        kv_events="tcp://127.0.0.1:9" if engine != "trtllm" else None,
        namespace=ns,
        **config,
    )
    shim = WorkerShim(cfg, NatsSettings(servers=[nats_url]), EtcdSettings(endpoints=[etcd_url]))
    with caplog.at_level(logging.WARNING, logger="worker_shim.shim"):
        async with shim:
            pass
    return [r for r in caplog.records if flag in r.getMessage()]


async def connect(url: str) -> Nats:
    return await nats.connect(url)


@asynccontextmanager
async def follower_of(shim: WorkerShim, ns: str, nats_url: str) -> AsyncIterator[Follower]:
    """A Follower on the registered shim's KV subject, on its own NATS connection (closed on exit)."""
    await shim.registered.wait()
    assert shim.worker_id is not None
    nc = await connect(nats_url)
    try:
        follower = Follower(nc, ns, shim.worker_id)
        await follower.start()
        yield follower
    finally:
        await nc.close()


def shared_prefix_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts, each one of four 64-token system prompts plus a random tail."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 4000) for _ in range(64)] for _ in range(4)]
    return [rng.choice(systems) + [rng.randrange(1, 4000) for _ in range(rng.randrange(8, 120))] for _ in range(n)]


async def complete(url: str, tokens: list[int], max_tokens: int = 2) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"model": "sim-llama", "prompt": tokens, "max_tokens": max_tokens}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
