"""Pass-through legs through the request service against a sim: the engine's own SSE payloads and
bodies come back unchanged (a body over NATS's payload limit in pieces, and so a streamed event
over it), its 400 body too, and a
whole (non-streamed) answer says when its prefill is done."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import msgspec

from engine_sim.server import SimServer
from protocol import GenerateRequest, ResponseChunk, subjects
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from tests.worker_shim.cluster import sim_config
from tests.worker_shim.test_request_service import Collector, agg_shim
from worker_shim import WorkerShim


def leg(rid: str, endpoint: str, params: dict[str, Any], tokens: list[int], stream: bool) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, model="sim-llama", token_ids=tokens, stream=stream, endpoint=endpoint, params=params
    )


async def direct(sim: SimServer, path: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as http, http.post(sim.url + path, json=body) as r:
        return await r.read()


async def test_a_stream_is_the_engines_events_and_counts_its_tokens(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        params = {"model": "sim-llama", "max_tokens": 7, "n": 2, "seed": 4, "logprobs": 1}
        await col.send(subjects.gen(ns, "agg", shim.worker_id), leg("s", ENDPOINT_COMPLETIONS, params, [5] * 40, True))
        final = await col.final("s")
        assert final.error is None
        events = [e for c in col.chunks["s"] for e in c.events]
        raw = await direct(sim, "/v1/completions", {**params, "prompt": [5] * 40, "stream": True})
        expected = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line and line != b"data: [DONE]"]
        strip = [{k: v for k, v in json.loads(e).items() if k not in ("id", "created")} for e in events]
        assert strip == [{k: v for k, v in json.loads(e).items() if k not in ("id", "created")} for e in expected]
        assert sum(c.tokens for c in col.chunks["s"]) == 2 * 7  # one token per choice with text
        assert all(not c.token_ids for c in col.chunks["s"])


async def test_a_whole_answer_says_when_its_prefill_is_done(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None and shim.requests is not None
        queued_then: list[int] = []
        col.on_chunk = lambda c: queued_then.append(shim.requests.prefill_tokens_queued) if c.prefilled else None  # type: ignore[union-attr]
        params = {"model": "sim-llama", "max_tokens": 300, "ignore_eos": True}
        prompt = list(range(300, 364))  # 4 full blocks
        await col.send(subjects.gen(ns, "agg", shim.worker_id), leg("w", ENDPOINT_COMPLETIONS, params, prompt, False))
        final = await col.final("w")
        chunks = col.chunks["w"]
        flags = [c.prefilled for c in chunks]
        assert flags.count(True) == 1 and not chunks[-1].prefilled, "one prefilled chunk, before the answer"
        assert queued_then == [0], "the prompt stopped counting as queued once the engine cached it"
        body = b"".join(c.body for c in chunks)
        assert json.loads(body)["usage"]["completion_tokens"] == 300 and final.usage is not None


LONG_PROMPT = [300 + i % 5000 for i in range(12_000)]


async def echo_long_prompt(
    shim: WorkerShim, col: Collector, ns: str, params: dict[str, Any], stream: bool
) -> list[ResponseChunk]:
    """The chunks of an echo, with logprobs, of a 12 k-token prompt: over NATS's payload limit."""
    assert shim.worker_id is not None
    await col.send(
        subjects.gen(ns, "agg", shim.worker_id), leg("big", ENDPOINT_COMPLETIONS, params, LONG_PROMPT, stream)
    )
    final = await col.final("big", timeout=60)
    assert final.error is None
    chunks: list[ResponseChunk] = col.chunks["big"]
    return chunks


async def test_a_body_over_the_payload_limit_comes_back_in_pieces(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(num_gpu_blocks=2048)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        params = {"model": "sim-llama", "max_tokens": 1, "echo": True, "logprobs": 5}
        chunks = await echo_long_prompt(shim, col, ns, params, False)
        body = b"".join(c.body for c in chunks)
        assert len(body) > col.nc.max_payload and sum(1 for c in chunks if c.body) > 1
        answer = json.loads(body)
        assert len(answer["choices"][0]["logprobs"]["tokens"]) == len(LONG_PROMPT) + 1  # the prompt echoed, then one


async def test_the_engines_own_400_body_comes_back(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        params = {
            "model": "sim-llama",
            "messages": [{"role": "user", "content": "x"}],
            "top_logprobs": 30,
            "logprobs": True,
        }
        await col.send(subjects.gen(ns, "agg", shim.worker_id), leg("bad", ENDPOINT_CHAT, params, [1, 2, 3], False))
        final = await col.final("bad")
        assert final.error is not None and final.error.code == 400
        own = await direct(sim, "/v1/chat/completions", params)
        assert json.loads(final.error.body) == json.loads(own)


async def test_a_streamed_event_over_the_payload_limit_goes_in_pieces(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(num_gpu_blocks=2048)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        params = {"model": "sim-llama", "max_tokens": 3, "echo": True, "logprobs": 5}
        chunks = await echo_long_prompt(shim, col, ns, params, True)
        assert all(len(c.events) == 1 for c in chunks if c.continued), "a piece travels alone"
        assert max(len(msgspec.msgpack.encode(c)) for c in chunks) <= col.nc.max_payload
        events: list[bytes] = []
        cut = False
        for c in chunks:
            for i, e in enumerate(c.events):
                if cut and i == 0:
                    events[-1] += e
                else:
                    events.append(e)
            cut = c.continued
        assert not cut
        raw = await direct(sim, "/v1/completions", {**params, "prompt": LONG_PROMPT, "stream": True})
        expected = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line and line != b"data: [DONE]"]
        assert len(expected[0]) > col.nc.max_payload, "the echo alone is over the limit"
        strip = [{k: v for k, v in json.loads(e).items() if k not in ("id", "created")} for e in events]
        assert strip == [{k: v for k, v in json.loads(e).items() if k not in ("id", "created")} for e in expected]
        first = next(c for c in chunks if c.events)
        assert first.continued and first.tokens > 0, "the read's tokens go with its first piece"
        assert sum(c.tokens for c in chunks) == 3, "every output token counted once"
