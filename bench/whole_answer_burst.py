"""How far behind whole answers' bursts put a router's NATS connection: a shim's ChunkWriters
send `--concurrent` bodies of `--mb` MB at once, each a leg of its own, to one router-like reader
in another process (nats-py, the dispatcher's one wildcard inbox and msgpack decode per chunk;
`--busy-ms` of other work on its loop every 100 ms), while nats-server's pending bytes for the
reader are sampled every 5 ms. nats-server cuts a client past max_pending (64 MiB by default) as a
slow consumer: the reader's every leg is lost.

    .venv/bin/python -m bench.whole_answer_burst [--mb 193] [--rounds 5] [--busy-ms 0] [--concurrent 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, cast

import nats

from kvswitch.servers import NatsServer
from protocol import ResponseChunk, decode_msg
from runtime.nats_flush import flush
from worker_shim.adapters.base import EngineAdapter
from worker_shim.request_service import ChunkWriter, RequestService

_READER = "bench-whole-reader"


async def _reader(url: str, busy_ms: float) -> None:
    """The router's side: prints the bytes and seconds of each answer, or 'cut' when NATS drops it."""
    cut = asyncio.Event()

    async def on_disconnect() -> None:
        cut.set()

    async def on_error(_exc: Exception) -> None:
        pass  # the cut, said on stdout

    nc = await nats.connect(
        url, name=_READER, disconnected_cb=on_disconnect, error_cb=on_error, max_reconnect_attempts=0
    )
    got: dict[str, int] = {}  # bytes by leg (reply subject)
    started: dict[str, float] = {}

    async def on_chunk(msg: Any) -> None:
        chunk = decode_msg(msg.data, ResponseChunk)
        started.setdefault(msg.subject, time.monotonic())
        got[msg.subject] = got.get(msg.subject, 0) + len(chunk.body)
        if chunk.final:
            s = round(time.monotonic() - started.pop(msg.subject), 3)
            print(json.dumps({"bytes": got.pop(msg.subject), "s": s}), flush=True)

    async def busy() -> None:
        while True:
            await asyncio.sleep(0.1)
            end = time.monotonic() + busy_ms / 1000
            while time.monotonic() < end:
                pass

    await nc.subscribe("bench.inbox.*", cb=on_chunk, pending_msgs_limit=-1)
    await flush(nc)
    task = asyncio.create_task(busy()) if busy_ms > 0 else None
    print(json.dumps({"ready": True}), flush=True)
    await cut.wait()
    print(json.dumps({"cut": True}), flush=True)
    if task is not None:
        task.cancel()


def _sample(monitor: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/connz") as resp:
            for conn in json.load(resp)["connections"]:
                if conn.get("name") == _READER:
                    peak[0] = max(peak[0], conn.get("pending_bytes", 0))
        time.sleep(0.005)


async def _rounds(server: NatsServer, mb: float, rounds: int, busy_ms: float, concurrent: int) -> None:
    reader = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.whole_answer_burst", "--reader", server.url, "--busy-ms", str(busy_ms),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert reader.stdout is not None
    await reader.stdout.readline()  # ready
    nc = await nats.connect(server.url)
    svc = RequestService(nc, cast(EngineAdapter, None), lambda: None)
    body = b"z" * int(mb * 1e6)
    for i in range(rounds):
        stop, peak = threading.Event(), [0]
        sampler = threading.Thread(target=_sample, args=(server.monitor_port, stop, peak))
        sampler.start()
        writers = [
            ChunkWriter(svc, f"bench.inbox.r{i}x{k}", f"r{i}x{k}", "w1", "agg", heartbeat_s=0.4)
            for k in range(concurrent)
        ]
        start = time.monotonic()
        await asyncio.gather(*(w.final(finish_reason="stop", body=body) for w in writers))
        sent = time.monotonic() - start
        lines = []
        for _ in writers:
            lines.append(line := json.loads(await asyncio.wait_for(reader.stdout.readline(), 120)))
            if line.get("cut"):
                break
        stop.set()
        sampler.join()
        cut = any(line.get("cut") for line in lines)
        print(
            f"round {i}: {concurrent} x {mb:g} MB sent in {sent:.3f} s; reader: "
            + (
                "cut off as a slow consumer"
                if cut
                else ", ".join(f"{line['bytes'] / 1e6:.1f} MB in {line['s']:.3f} s" for line in lines)
            )
            + f"; peak pending at nats-server {peak[0] / 2**20:.1f} MiB",
            flush=True,
        )
        if cut:
            break
    await nc.close()
    with contextlib.suppress(ProcessLookupError):  # a reader cut off has ended
        reader.kill()
    await reader.wait()


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--mb", type=float, default=193.0, help="the answer's body, MB (193: 130k tokens, prompt_logprobs 20)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy-ms", type=float, default=0.0, help="the reader's loop busy this long every 100 ms")
    ap.add_argument("--concurrent", type=int, default=1, help="whole answers at once, each a leg, to the one reader")
    ap.add_argument("--reader", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        asyncio.run(_reader(args.reader, args.busy_ms))
        return
    with NatsServer() as server:
        asyncio.run(_rounds(server, args.mb, args.rounds, args.busy_ms, args.concurrent))


if __name__ == "__main__":
    main()
