"""Worker shim micro-benchmarks, each against a baseline measured in the same run.

1. Event throughput: vLLM KV event payloads (map form, 16 blocks of 16 tokens per BlockStored, one
   BlockRemoved per stored batch) decoded, normalised to canonical hashes, coalesced and published
   as KvEventBatches to a real nats-server. Baseline: a relay that only msgpack-decodes each payload
   and publishes the raw bytes. Figure: blocks per second (target >= 200k).
2. Added latency per streamed chunk: an SSE engine stand-in sends one vLLM completion chunk every
   20 ms, stamped with its send time. Baseline: a client reading that stream over HTTP directly.
   Through the shim: GenerateRequest over NATS -> RequestService -> VllmAdapter -> the same engine ->
   ResponseChunks over NATS. Figure: p50/p99 latency through the shim minus the direct one
   (target p50 <= 0.5 ms).

    .venv/bin/python -m bench.bench_shim [--blocks 400000] [--chunks 400]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aiohttp
import msgspec
import nats
from aiohttp import web

from kvswitch.servers import NatsServer
from protocol import GenerateRequest, ResponseChunk, SamplingParams, decode_msg, encode_msg, subjects
from runtime.nats_flush import flush
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.adapters.vllm_events import decode_payload
from worker_shim.config import ShimConfig
from worker_shim.kv_pace import KvPace
from worker_shim.kv_publisher import KvPublisher
from worker_shim.normaliser import Normaliser
from worker_shim.request_service import RequestService

BS = 16
BLOCKS_PER_EVENT = 16


def payloads(n_blocks: int) -> list[bytes]:
    out = []
    h = 1
    for i in range(n_blocks // BLOCKS_PER_EVENT):
        hashes = list(range(h, h + BLOCKS_PER_EVENT))
        tokens = [(i * 7 + j) % 32000 for j in range(BLOCKS_PER_EVENT * BS)]
        ev: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
        }
        rm = {"type": "BlockRemoved", "block_hashes": hashes[:], "medium": "GPU"}
        out.append(msgspec.msgpack.encode([time.time(), [ev, rm], 0]))
        h += BLOCKS_PER_EVENT
    return out


async def bench_events(url: str, n_blocks: int) -> dict[str, float]:
    data = payloads(n_blocks)
    nc = await nats.connect(url)
    raw = msgspec.msgpack.Decoder()
    t0 = time.perf_counter()
    for p in data:
        raw.decode(p)
        await nc.publish("bench.relay", p)
    await flush(nc)
    relay_s = time.perf_counter() - t0

    norm = Normaliser(BS)
    # Unpaced: this measures the shim's CPU per block, not worker_shim.kv_pace's 2 MiB a second.
    unpaced = KvPace(1e12, 1e12, 1e15, 1e15)
    pub = KvPublisher(nc, "bench", "w1", 1, norm, pace=unpaced)
    pub.start()
    t0 = time.perf_counter()
    for p in data:
        pub.add(norm.apply(decode_payload(p)))
        if len(pub._outbox) > 64:
            await asyncio.sleep(0)  # let the publisher task drain, as the event loop would
    await pub.stop()
    await flush(nc)
    shim_s = time.perf_counter() - t0
    await nc.close()
    blocks = len(data) * BLOCKS_PER_EVENT
    return {"blocks": blocks, "relay_blocks_per_s": blocks / relay_s, "shim_blocks_per_s": blocks / shim_s}


class Engine:
    """An SSE stand-in for vLLM's /v1/completions that stamps each chunk's send time."""

    def __init__(self, chunks: int, gap_s: float) -> None:
        self.chunks, self.gap_s = chunks, gap_s
        self.sent: dict[tuple[str, int], float] = {}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id", "direct")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            await asyncio.sleep(self.gap_s)
            body = {"choices": [{"index": 0, "text": "x", "token_ids": [i], "finish_reason": None}]}
            self.sent[(rid, i)] = time.perf_counter()
            await resp.write(b"data: " + msgspec.json.encode(body) + b"\n\n")
        final = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": self.chunks}}
        await resp.write(b"data: " + msgspec.json.encode(final) + b"\n\ndata: [DONE]\n\n")
        return resp


async def bench_latency(url: str, chunks: int) -> dict[str, float]:
    engine = Engine(chunks, 0.02)
    app = web.Application()
    app.router.add_post("/v1/completions", engine.completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"

    direct: list[float] = []
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/completions", json={}) as r:
        async for line in r.content:
            if line.startswith(b"data: {") and b'"token_ids"' in line:
                i = msgspec.json.decode(line[6:])["choices"][0]["token_ids"][0]
                direct.append(time.perf_counter() - engine.sent[("direct", i)])

    nc = await nats.connect(url)
    adapter = VllmAdapter(ShimConfig(engine_url=base, model="m", kv_events="tcp://*:1"))
    await adapter.open()
    svc = RequestService(nc, adapter, lambda: None)
    await nc.subscribe(subjects.gen("bench", "agg", "w1"), cb=svc.on_generate)
    via: list[float] = []
    done = asyncio.Event()

    async def on_chunk(msg: Any) -> None:
        c = decode_msg(msg.data, ResponseChunk)
        now = time.perf_counter()
        for t in c.token_ids:
            via.append(now - engine.sent[("b1", t)])
        if c.final:
            done.set()

    await nc.subscribe("bench.reply", cb=on_chunk)
    req = GenerateRequest(
        request_id="b1", model="m", token_ids=[1, 2, 3, 4], sampling=SamplingParams(max_tokens=chunks)
    )
    await nc.publish(subjects.gen("bench", "agg", "w1"), encode_msg(req), reply="bench.reply")
    await asyncio.wait_for(done.wait(), chunks * 0.1 + 10)
    await adapter.close()
    await nc.close()
    await runner.cleanup()

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100)[int(q) - 1] * 1e3

    return {
        "chunks": len(via),
        "direct_p50_ms": statistics.median(direct) * 1e3,
        "shim_p50_ms": statistics.median(via) * 1e3,
        "added_p50_ms": (statistics.median(via) - statistics.median(direct)) * 1e3,
        "direct_p99_ms": pct(direct, 99),
        "shim_p99_ms": pct(via, 99),
    }


async def main(args: argparse.Namespace) -> None:
    with NatsServer() as server:
        ev = await bench_events(server.url, args.blocks)
        print(
            f"events: {ev['blocks']:.0f} blocks; shim {ev['shim_blocks_per_s']:,.0f} blocks/s; "
            f"relay baseline {ev['relay_blocks_per_s']:,.0f} blocks/s; "
            f"ratio {ev['shim_blocks_per_s'] / ev['relay_blocks_per_s']:.2f}",
            flush=True,
        )
        lat = await bench_latency(server.url, args.chunks)
        print(
            f"latency per chunk ({lat['chunks']:.0f} chunks): direct p50 {lat['direct_p50_ms']:.3f} ms, "
            f"through the shim p50 {lat['shim_p50_ms']:.3f} ms -> added p50 {lat['added_p50_ms']:.3f} ms; "
            f"p99 direct {lat['direct_p99_ms']:.3f} ms, shim {lat['shim_p99_ms']:.3f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=400_000)
    parser.add_argument("--chunks", type=int, default=400)
    try:
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:
        asyncio.run(main(parser.parse_args()))
