"""How long a streamed event carrying a long prompt's prompt_logprobs holds the shim's loop: vLLM
streams them in the first event. A stand-in engine in another process streams that event (`--tokens`
prompt tokens, 20 logprobs each, written in 1 MiB pieces) then one token; the shim's vLLM adapter
reads it into a ChunkWriter (NATS stubbed), while a task that only yields times the longest gap
between its turns. Also the time to fold the event's line alone (its decode).

    .venv/bin/python -m bench.long_event_hold [--tokens 32768] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any, cast

from aiohttp import web

from protocol import SamplingParams
from protocol.messages import ENDPOINT_COMPLETIONS
from worker_shim import ShimConfig
from worker_shim.adapters import openai_http
from worker_shim.adapters.base import EngineAdapter, LegRequest
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.request_service import ChunkWriter, RequestService


def first_event(tokens: int) -> bytes:
    """A vLLM 0.32 completion's first streamed event with prompt_logprobs 20."""
    entry = {str(t): {"logprob": -1.25, "rank": r + 1, "decoded_token": " tok"} for r, t in enumerate(range(100, 120))}
    choice = {
        "index": 0, "text": " a", "logprobs": None, "finish_reason": None, "stop_reason": None, "token_ids": None,
        "prompt_logprobs": [None, *[entry] * (tokens - 1)], "prompt_token_ids": None,
    }  # fmt: skip
    answer = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return json.dumps(answer, separators=(",", ":")).encode()


def _engine(tokens: int) -> None:
    data = b"data: " + first_event(tokens) + b"\n\n"
    last = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(data), 1 << 20):
            await resp.write(data[i : i + (1 << 20)])
        await resp.write(last)
        return resp

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


class _Nats:
    """Takes every chunk at once."""

    max_payload = 1 << 20
    pending_data_size = 0
    is_connected = True
    stats = {"reconnects": 0}

    async def publish(self, subject: str, data: bytes) -> None:
        pass


async def _turns(gaps: list[float], stop: asyncio.Event) -> None:
    """Yields until `stop`, keeping each gap between its turns."""
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _shim(port: int, tokens: int, rounds: int) -> None:
    line = b"data: " + first_event(tokens)
    print(f"{tokens} tokens: first event {(len(line) - 6) / 1e6:.1f} MB")
    for _ in range(2):
        start = time.perf_counter()
        openai_http._fold_lines(openai_http.Result(), [line], pass_through=True)
        print(f"  the event's line folded in {1000 * (time.perf_counter() - start):.0f} ms")
    del line
    config = ShimConfig(engine="vllm", engine_url=f"http://127.0.0.1:{port}", model="m", kv_events="tcp://127.0.0.1:1")
    adapter = VllmAdapter(config)
    await adapter.open()
    svc = RequestService(cast(Any, _Nats()), cast(EngineAdapter, None), lambda: None)
    for i in range(rounds):
        gaps: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(_turns(gaps, stop))
        writer = ChunkWriter(svc, "bench.inbox.r", f"r{i}", "w1", "agg")
        leg = LegRequest(
            request_id=f"r{i}", model="m", token_ids=[7] * 8, sampling=SamplingParams(), stream=True,
            endpoint=ENDPOINT_COMPLETIONS, params={"model": "m", "prompt_logprobs": 20},
        )  # fmt: skip
        start = time.perf_counter()
        out = await adapter.generate(leg, writer.output)
        await writer.final(finish_reason=out.finish_reason)
        took = time.perf_counter() - start
        stop.set()
        await task
        gaps.sort()
        print(
            f"  round {i}: the leg in {1000 * took:.0f} ms, {writer.sent_bytes / 1e6:.1f} MB out; the loop's "
            f"longest hold {1000 * gaps[-1]:.0f} ms, next {1000 * gaps[-2]:.0f} ms"
        )
        await asyncio.sleep(0.5)  # the pace's bucket fills again
    await adapter.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=32768, help="the prompt's tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        _engine(args.tokens)
        return
    cmd = [sys.executable, "-m", "bench.long_event_hold", "--engine", "--tokens", str(args.tokens)]
    engine = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    try:
        assert engine.stdout is not None
        asyncio.run(_shim(int(engine.stdout.readline()), args.tokens, args.rounds))
    finally:
        engine.kill()
        engine.wait()


if __name__ == "__main__":
    main()
