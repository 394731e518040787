"""Measure the live stack's hop delays, the virtual clock's defaults (bench/virtual/delays.py).

    python -m bench.virtual.measure_delays [--requests 200] [--agg 2] [--routers 2]

Brings up a local cluster (nats, etcd, `agg` simulated engines at 1x, a shim each, `routers`
replicas routing aggregated), sends `requests` (at least 10) small requests one after another to the
first router, and measures what each hop costs here:

- `kv_event_s`: engine -> shim (its ZMQ batches, received by a subscriber of our own, against the
  engine's batch timestamp) plus shim -> router (its NATS KvEventBatches against their `ts`);
- `load_report_s`: LoadReports on NATS against their `ts`;
- `sync_s`: the replica sync's flush window (router.replica_sync's 2 ms) plus that NATS hop;
- `leg_s` + `token_s`: the router's TTFT (from dispatch to the first chunk) minus the engine's own
  (`vllm:time_to_first_token_seconds`), means over the requests, split evenly;
- `client_s`: half of the client's TTFT minus the router's (HTTP both ways, and the router's
  planning, which the virtual clock otherwise counts as instant);
- `engine_read_s`: each engine's load polled as the shim's poll loop (worker_shim.load_reporter)
  polls it, GET /metrics and its parse, then POLL_S asleep, throughout the requests: the mean of
  each period beyond POLL_S (the read, and the event loop's lateness waking from the sleep). A
  mean: the overruns add up to the poll's drift, which the virtual shim models.

Medians of each (but where said), in seconds, printed as the flags `compare --clock virtual` takes. Our subscribers
run in this process, so NATS and ZMQ delivery to them stands in for delivery to the router.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time

import aiohttp
import nats
import zmq
import zmq.asyncio
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from bench.virtual.shim import POLL_S
from kvswitch.client import CompletionClient
from kvswitch.cluster import ClusterSpec, LocalCluster
from protocol import KvEventBatch, LoadReport, decode_msg, subjects
from protocol.vllm_events import decode_batch, decode_pub_frames
from worker_shim.adapters.vllm import load_from_metrics
from worker_shim.load_reporter import DEFAULT_PERIOD_S

__all__ = ["main"]

SYNC_FLUSH_S = 0.002  # router.replica_sync.ReplicaSync's default flush_ms
SETTLE_S = 0.05  # after each request: its events and reports settle, and no request queues behind another
# Their pauses alone outlast a load report heartbeat and a poll period, so every list below has a value.
MIN_REQUESTS = math.ceil(DEFAULT_PERIOD_S / SETTLE_S)


async def _histogram_mean(session: aiohttp.ClientSession, url: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` over all its label sets at `url`/metrics."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return total, count


async def _zmq_lags(endpoints: list[str], lags: list[float], stop: asyncio.Event) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    try:
        for endpoint in endpoints:
            sock.connect(endpoint.replace("*", "127.0.0.1"))
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        while not stop.is_set():
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), 0.2)
            except TimeoutError:
                continue
            _, _, payload = decode_pub_frames(frames)
            lags.append(time.time() - decode_batch(payload).ts)
    finally:
        sock.close(0)
        ctx.term()


async def _poll_overruns(session: aiohttp.ClientSession, url: str, out: list[float], stop: asyncio.Event) -> None:
    """worker_shim.load_reporter's poll loop against one engine (the read, then POLL_S asleep):
    each period's overrun of POLL_S."""
    last: float | None = None
    while not stop.is_set():
        asked = time.monotonic()
        if last is not None:
            out.append(asked - last - POLL_S)
        last = asked
        async with session.get(f"{url}/metrics") as resp:
            load_from_metrics(await resp.text())
        await asyncio.sleep(POLL_S)


async def _measure(cluster: LocalCluster, requests: int) -> dict[str, float]:
    assert cluster.nats is not None
    ns = cluster.spec.namespace
    kv_lags: list[float] = []
    load_lags: list[float] = []
    zmq_lags: list[float] = []
    nc = await nats.connect(cluster.nats.urls)

    async def on_kv(msg: Msg) -> None:
        kv_lags.append(time.time() - decode_msg(msg.data, KvEventBatch).ts)

    async def on_load(msg: Msg) -> None:
        load_lags.append(time.time() - decode_msg(msg.data, LoadReport).ts)

    await nc.subscribe(subjects.kv_all(ns), cb=on_kv)
    await nc.subscribe(subjects.load_all(ns), cb=on_load)
    stop = asyncio.Event()
    zmq_task = asyncio.create_task(_zmq_lags([e.events for e in cluster.engines], zmq_lags, stop))
    router = cluster.router_urls[0]
    rng = random.Random(0)
    client_ttft: list[float] = []
    overruns: list[float] = []
    async with aiohttp.ClientSession() as session:
        client = CompletionClient(session, cluster.spec.model)
        r0 = await _histogram_mean(session, router, "kvswitch_router_upstream_ttft_seconds")
        e0 = [await _histogram_mean(session, u, "vllm:time_to_first_token_seconds") for u in cluster.sim_urls]
        pollers = [asyncio.create_task(_poll_overruns(session, u, overruns, stop)) for u in cluster.sim_urls]
        for i in range(requests):
            prompt = [rng.randrange(300, 30000) for _ in range(64)]
            done = await client.complete(router, prompt, 3, request_id=f"delay-{i}")
            if not done.ok or done.ttft_s is None:
                raise RuntimeError(f"request {i} failed: {done.error}")
            client_ttft.append(done.ttft_s)
            await asyncio.sleep(SETTLE_S)
        r1 = await _histogram_mean(session, router, "kvswitch_router_upstream_ttft_seconds")
        e1 = [await _histogram_mean(session, u, "vllm:time_to_first_token_seconds") for u in cluster.sim_urls]
        stop.set()
        await asyncio.gather(*pollers)
    await zmq_task
    await nc.close()
    router_ttft = (r1[0] - r0[0]) / max(r1[1] - r0[1], 1)
    engine_sum = sum(b[0] - a[0] for a, b in zip(e0, e1, strict=True))
    engine_n = sum(b[1] - a[1] for a, b in zip(e0, e1, strict=True))
    engine_ttft = engine_sum / max(engine_n, 1)
    nats_hop = statistics.median(load_lags)
    legs = max(0.0, router_ttft - engine_ttft)
    return {
        "kv_event_s": statistics.median(zmq_lags) + statistics.median(kv_lags),
        "load_report_s": nats_hop,
        "sync_s": SYNC_FLUSH_S + nats_hop,
        "leg_s": legs / 2,
        "token_s": legs / 2,
        "client_s": max(0.0, statistics.mean(client_ttft) - router_ttft) / 2,
        "engine_read_s": statistics.mean(overruns),
    }


def _requests(text: str) -> int:
    n = int(text)
    if n < MIN_REQUESTS:
        raise argparse.ArgumentTypeError(
            f"{n}: at least {MIN_REQUESTS}, so that the run outlasts a load report heartbeat and a poll period"
        )
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.virtual.measure_delays", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=_requests, default=200, help=f"at least {MIN_REQUESTS}")
    p.add_argument("--agg", type=int, default=2, help="simulated engines (agg role, 1x)")
    p.add_argument("--routers", type=int, default=2)
    args = p.parse_args(argv)
    # The sims bind their event sockets so that our own subscriber sees the batches the shims get.
    spec = ClusterSpec(
        agg=args.agg, routers=args.routers, speedup=1.0, router_args=["--disagg", "never"], engines_bind_events=True
    )
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout=90.0)
        delays = asyncio.run(_measure(cluster, args.requests))
    finally:
        cluster.stop()
    print(
        f"{args.requests} requests, {args.agg} agg engines at 1x, {args.routers} routers"
        " (seconds; kv-event, load-report and sync medians, leg, token, client and engine-read means)"
    )
    for name, value in delays.items():
        flag = "--" + name.removesuffix("_s").replace("_", "-") + "-delay"
        print(f"{flag} {value:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
