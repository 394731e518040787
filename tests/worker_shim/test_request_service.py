"""The request service through NATS against a sim: streaming, cancel, deadline, P/D, bypass,
utility calls."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client as Nats

from engine_sim.server import SimServer
from protocol import (
    CancelRequest,
    GenerateRequest,
    LoadReport,
    ResponseChunk,
    SamplingParams,
    TransferHandle,
    decode_msg,
    encode_msg,
    subjects,
)
from protocol.messages import (
    ANNOTATION_BYPASS,
    ENDPOINT_COMPLETIONS,
    ENDPOINT_DETOKENIZE,
    ENDPOINT_TOKENIZE,
    ENGINE_UTILITY_ENDPOINTS,
)
from tests.worker_shim.cluster import BLOCK, connect, shim_for, sim_config, wait_for
from worker_shim import ShimConfig, WorkerShim
from worker_shim.adapters.base import EngineError
from worker_shim.adapters.sglang import SglangAdapter
from worker_shim.adapters.trtllm import TrtllmAdapter
from worker_shim.adapters.vllm import VllmAdapter
from worker_shim.config import ENGINES


class Collector:
    """Every chunk of every request, by request id, through one wildcard inbox."""

    def __init__(self, nc: Nats) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.chunks: dict[str, list[ResponseChunk]] = defaultdict(list)
        self.finals: dict[str, ResponseChunk] = {}
        self.events: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        self.on_chunk: Callable[[ResponseChunk], None] = lambda _c: None

    async def start(self) -> None:
        await self.nc.subscribe(self.prefix + ".*", cb=self._on)

    async def _on(self, msg: Any) -> None:
        c = decode_msg(msg.data, ResponseChunk)
        rid = msg.subject.rsplit(".", 1)[1]
        self.on_chunk(c)
        self.chunks[rid].append(c)
        if c.final:
            self.finals[rid] = c
        self.events[rid].set()

    async def send(self, subject: str, req: GenerateRequest) -> None:
        await self.nc.publish(subject, encode_msg(req), reply=f"{self.prefix}.{req.request_id}")

    async def final(self, rid: str, timeout: float = 20.0) -> ResponseChunk:
        await wait_for(lambda: rid in self.finals, timeout, what=f"final chunk of {rid}")
        return self.finals[rid]


def gen(rid: str, tokens: list[int], max_tokens: int = 8, **kw: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model="sim-llama",
        token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        **kw,
    )


@asynccontextmanager
async def agg_shim(
    sim: SimServer, ns: str, nats_url: str, etcd_url: str
) -> AsyncIterator[tuple[WorkerShim, Collector]]:
    """A registered agg shim beside `sim`, its endpoint probe settled (its one request on the engine
    served, so a test reads the engine's counters from after it), and a Collector on its own NATS
    connection; both closed on exit."""
    async with shim_for(sim, ns, nats_url, etcd_url) as shim:
        await shim.registered.wait()
        await wait_for(lambda: shim.probe.settled, what="the endpoint probe settled")
        assert shim.worker_id is not None
        nc = await connect(nats_url)
        try:
            col = Collector(nc)
            await col.start()
            yield shim, col
        finally:
            await nc.close()


async def test_1000_streamed_requests_lose_duplicate_and_reorder_nothing(ns: str, nats_url: str, etcd_url: str) -> None:
    async with (
        SimServer(sim_config(num_gpu_blocks=2048)) as sim,
        agg_shim(sim, ns, nats_url, etcd_url) as (shim, col),
    ):
        assert shim.worker_id is not None
        subject = subjects.gen(ns, "agg", shim.worker_id)
        n = 1000
        sem = asyncio.Semaphore(128)

        async def one(i: int) -> None:
            async with sem:
                rid = f"r{i}"
                await col.send(subject, gen(rid, [1 + i % 97] * (20 + i % 50), max_tokens=4 + i % 9))
                await col.final(rid, timeout=60)

        await asyncio.gather(*(one(i) for i in range(n)))
        for i in range(n):
            chunks = col.chunks[f"r{i}"]
            assert [c.seq for c in chunks] == list(range(len(chunks))), f"r{i} out of order"
            assert [c.final for c in chunks].count(True) == 1 and chunks[-1].final
            final = chunks[-1]
            assert final.error is None and final.finish_reason == "length"
            assert final.usage is not None and final.usage.completion_tokens == 4 + i % 9
            assert sum(len(c.token_ids) for c in chunks) == 4 + i % 9
            assert {c.worker for c in chunks} == {shim.worker_id}
        assert shim.requests is not None and not shim.requests.inflight
        assert shim.requests.prefill_tokens_queued == 0


async def test_cancel_aborts_the_engine_request_and_frees_its_blocks(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("long", list(range(1, 200)), max_tokens=5000))
        await wait_for(lambda: len(col.chunks["long"]) >= 2, what="streaming started")
        assert sim.engine.num_blocks_in_use > 0
        await col.nc.publish(subjects.cancel(ns, shim.worker_id), encode_msg(CancelRequest(request_id="long")))
        final = await col.final("long")
        assert final.finish_reason == "abort" and final.error is None
        await wait_for(lambda: sim.engine.num_blocks_in_use == 0, what="engine freed the blocks")


async def test_deadline_aborts_with_a_deadline_error(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        req = gen("late", list(range(1, 100)), max_tokens=5000, deadline=time.time() + 0.3)
        await col.send(subjects.gen(ns, "agg", shim.worker_id), req)
        final = await col.final("late")
        assert final.error is not None and final.error.kind == "deadline" and final.error.code == 504
        await wait_for(lambda: sim.engine.num_blocks_in_use == 0, what="engine freed the blocks")


async def test_non_stream_request_gets_one_final_chunk_with_every_token(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("ns", [5] * 40, max_tokens=7, stream=False))
        final = await col.final("ns")
        assert len(col.chunks["ns"]) == 1 and final.seq == 0
        assert len(final.token_ids) == 7 and final.usage is not None and final.usage.prompt_tokens == 40


async def test_bad_requests_end_with_an_error_chunk(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        foreign = TransferHandle(engine="trtllm", params={})
        await col.send(subjects.gen(ns, "decode", shim.worker_id), gen("foreign", [1] * 20, disagg=foreign))
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("huge", [1] * 40_000))
        await col.nc.publish(subjects.gen(ns, "agg", shim.worker_id), b"\x93junk", reply=f"{col.prefix}.junk")
        assert (await col.final("foreign")).error.kind == "bad_request"  # type: ignore[union-attr]
        huge = await col.final("huge")
        assert huge.error is not None and huge.error.code == 400 and "context length" in huge.error.message
        junk = await col.final("junk")
        assert junk.error is not None and junk.error.kind == "bad_request"


async def test_prefill_decode_through_two_shims_and_the_bypass(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config(role="prefill")) as psim, SimServer(sim_config(role="decode")) as dsim:
        pshim = shim_for(psim, ns, nats_url, etcd_url, role="prefill")
        dshim = shim_for(dsim, ns, nats_url, etcd_url, role="decode")
        async with pshim, dshim:
            await pshim.registered.wait()
            await dshim.registered.wait()
            assert pshim.worker_id is not None and dshim.worker_id is not None
            nc = await connect(nats_url)
            col = Collector(nc)
            await col.start()
            prompt = list(range(1, 161))
            await col.send(subjects.gen(ns, "prefill", pshim.worker_id), gen("pd", prompt, max_tokens=1))
            pre = await col.final("pd")
            assert pre.error is None and pre.transfer is not None
            assert pre.transfer.engine == "vllm" and pre.transfer.prefill_worker == pshim.worker_id
            assert pre.transfer.params.get("do_remote_prefill") is True
            assert psim.engine.prefill_tokens_computed >= len(prompt)

            before = dsim.engine.prefill_tokens_computed
            await col.send(
                subjects.gen(ns, "decode", dshim.worker_id), gen("pd", prompt, max_tokens=6, disagg=pre.transfer)
            )
            col.finals.pop("pd")
            dec = await col.final("pd")
            assert dec.error is None and dec.usage is not None and dec.usage.completion_tokens == 6
            assert dsim.engine.prefill_tokens_computed == before, "the decode leg prefilled: params were not carried"

            # A fresh prompt (the first one is now cached on the decode sim): the bypass ignores the
            # handle it is given and prefills locally.
            fresh = list(range(1000, 1160))
            await col.send(
                subjects.gen(ns, "decode", dshim.worker_id),
                gen("bp", fresh, max_tokens=6, disagg=pre.transfer, annotations=[ANNOTATION_BYPASS]),
            )
            bp = await col.final("bp")
            assert bp.error is None and bp.usage is not None and bp.usage.completion_tokens == 6
            assert dsim.engine.prefill_tokens_computed >= before + len(fresh), "bypass must prefill locally"
            await nc.close()


async def test_a_whole_answer_fed_by_a_transfer_says_when_its_prompt_is_in(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """It queues no prefill, but the router counts its blocks on the decode worker until it hears
    `prefilled` (or the answer): the pulled prompt's blocks in the engine's KV events, which come
    once the engine has allocated them (bookings audit, D1)."""
    async with SimServer(sim_config(role="prefill")) as psim, SimServer(sim_config(role="decode", speedup=5.0)) as dsim:
        pshim = shim_for(psim, ns, nats_url, etcd_url, role="prefill")
        dshim = shim_for(dsim, ns, nats_url, etcd_url, role="decode")
        async with pshim, dshim:
            await pshim.registered.wait()
            await dshim.registered.wait()
            assert pshim.worker_id is not None and dshim.worker_id is not None
            nc = await connect(nats_url)
            try:
                col = Collector(nc)
                await col.start()
                prompt = list(range(1, 161))  # 10 full blocks
                await col.send(subjects.gen(ns, "prefill", pshim.worker_id), gen("pd", prompt, max_tokens=1))
                pre = await col.final("pd")
                assert pre.transfer is not None
                col.finals.pop("pd")
                col.chunks.pop("pd")
                held_then: list[int] = []
                col.on_chunk = lambda c: held_then.append(dsim.engine.num_blocks_in_use) if c.prefilled else None
                leg = gen("pd", prompt, max_tokens=300, disagg=pre.transfer, stream=False)
                await col.send(subjects.gen(ns, "decode", dshim.worker_id), leg)
                final = await col.final("pd")
                assert final.error is None and len(final.token_ids) == 300
                flags = [c.prefilled for c in col.chunks["pd"]]
                assert flags.count(True) == 1 and not flags[-1], "one prefilled chunk, before the answer"
                assert held_then[0] >= len(prompt) // BLOCK, "said once the engine held the pulled prompt"
            finally:
                await nc.close()


@pytest.mark.timing
async def test_a_long_prefill_sends_heartbeats_at_the_asked_period(ns: str, nats_url: str, etcd_url: str) -> None:
    # ~1.3 s of prefill: a 4,000-token prompt on a sim slowed twelvefold.
    async with (
        SimServer(sim_config(role="prefill", speedup=1.0, slowdown=12.0)) as sim,
        agg_shim(sim, ns, nats_url, etcd_url) as (shim, col),
    ):
        assert shim.worker_id is not None
        arrived: list[float] = []
        col.on_chunk = lambda _c: arrived.append(time.monotonic())
        started = time.monotonic()
        req = gen("slow", list(range(1, 4001)), max_tokens=1, heartbeat_s=0.2)
        await col.send(subjects.gen(ns, "prefill", shim.worker_id), req)
        final = await col.final("slow")
        chunks = col.chunks["slow"]
        beats = chunks[:-1]
        assert final.error is None and final.transfer is not None
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert all(not c.token_ids and not c.final for c in beats)
        assert len(beats) >= 4, f"{len(beats)} heartbeats in {arrived[-1] - started:.2f}s"
        gaps = [b - a for a, b in zip([started, *arrived[:-2]], arrived[:-1], strict=True)]
        assert all(0.18 <= g <= 0.45 for g in gaps), [round(g, 3) for g in gaps]
        assert shim.requests is not None and shim.requests.heartbeats == len(beats)


async def test_no_heartbeat_unless_asked(ns: str, nats_url: str, etcd_url: str) -> None:
    async with (
        SimServer(sim_config(role="prefill", speedup=1.0, slowdown=6.0)) as sim,
        agg_shim(sim, ns, nats_url, etcd_url) as (shim, col),
    ):
        assert shim.worker_id is not None
        await col.send(subjects.gen(ns, "prefill", shim.worker_id), gen("quiet", list(range(1, 4001)), max_tokens=1))
        final = await col.final("quiet")
        assert final.error is None and len(col.chunks["quiet"]) == 1 and final.seq == 0


async def test_a_lone_stream_sends_each_token_the_moment_it_comes(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("lone", [7] * 40, max_tokens=60))
        final = await col.final("lone")
        chunks = col.chunks["lone"]
        assert final.error is None and final.usage is not None and final.usage.completion_tokens == 60
        # The sim steps far faster than 5 ms, yet no token waited for another: each went out with
        # the read that brought it (a read may bring several), and no chunk was held back.
        assert sum(len(c.token_ids) for c in chunks) == 60 and all(c.token_ids for c in chunks[:-1])
        assert shim.requests is not None and shim.requests.held_chunks == 0


async def test_under_load_frames_carry_several_tokens(ns: str, nats_url: str, etcd_url: str) -> None:
    async with (
        SimServer(sim_config(num_gpu_blocks=4096)) as sim,
        agg_shim(sim, ns, nats_url, etcd_url) as (shim, col),
    ):
        assert shim.worker_id is not None and shim.requests is not None
        n = shim.requests.busy_legs * 2
        subject = subjects.gen(ns, "agg", shim.worker_id)
        for i in range(n):
            await col.send(subject, gen(f"l{i}", [1 + i] * 40, max_tokens=64))
        for i in range(n):
            assert (await col.final(f"l{i}", timeout=60)).error is None
        frames = [c for i in range(n) for c in col.chunks[f"l{i}"] if c.token_ids]
        tokens = sum(len(c.token_ids) for c in frames)
        assert tokens == n * 64
        assert tokens / len(frames) >= 1.5, f"{tokens} tokens in {len(frames)} frames"


async def test_a_router_that_lost_chunks_gets_them_again_from_a_finished_leg(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None
        subject = subjects.gen(ns, "agg", shim.worker_id)
        await col.send(subject, gen("r1", [5] * 40, max_tokens=6))
        first = await col.final("r1")
        sent = [c.seq for c in col.chunks["r1"]]
        assert sent == list(range(first.seq + 1))
        # As a router whose NATS node died after chunk 0: the same leg from seq 1, to a new inbox
        # (a leg has at least two chunks: its tokens, then the final one).
        col.finals.pop("r1")
        before = len(col.chunks["r1"])
        await col.send(subject, gen("r1", [5] * 40, max_tokens=6, resume=1))
        again = await col.final("r1")
        resent = col.chunks["r1"][before:]
        assert first.seq >= 1 and [c.seq for c in resent] == list(range(1, first.seq + 1))
        assert [c.token_ids for c in resent] == [c.token_ids for c in col.chunks["r1"][1:before]]
        assert again.finish_reason == first.finish_reason
        # A leg the shim never served cannot be resumed: an error chunk at the asked seq.
        await col.send(subject, gen("r9", [5] * 40, resume=3))
        gone = await col.final("r9")
        assert gone.seq == 3 and gone.error is not None and gone.error.code == 410


async def test_load_reports_carry_the_decoding_legs_mean_context(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SimServer(sim_config(speedup=5.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None and shim.requests is not None
        contexts = shim.requests.contexts
        reports: list[LoadReport] = []

        async def on_report(msg: Any) -> None:
            reports.append(decode_msg(msg.data, LoadReport))

        await col.nc.subscribe(subjects.load(ns, shim.worker_id), cb=on_report)
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("long", list(range(1, 201)), max_tokens=5000))
        await wait_for(lambda: len(col.chunks["long"]) >= 3, what="streaming started")
        seen = sum(len(c.token_ids) for c in col.chunks["long"])
        # The shim counts a token before it sends it: at least what the collector saw.
        assert len(contexts) == 1 and 200 + seen <= contexts.mean() < 200 + 5000
        await wait_for(lambda: any(r.decode_context > 200 for r in reports), what="a report with the context")
        await col.nc.publish(subjects.cancel(ns, shim.worker_id), encode_msg(CancelRequest(request_id="long")))
        assert (await col.final("long")).finish_reason == "abort"
        await wait_for(lambda: len(contexts) == 0, what="the leg's end counted")
        assert contexts.mean() == 0.0
        await wait_for(lambda: reports[-1].decode_context == 0.0, what="a report after the leg ended")
        # A prefill leg never decodes here: its one token is not counted.
        grown: list[str] = []
        grow = contexts.grow

        def recording(leg: str, tokens: int, prompt_tokens: int, sequences: int = 1) -> None:
            grown.append(leg)
            grow(leg, tokens, prompt_tokens, sequences)

        monkeypatch.setattr(contexts, "grow", recording)
        await col.send(subjects.gen(ns, "prefill", shim.worker_id), gen("p", list(range(1, 65)), max_tokens=1))
        assert (await col.final("p")).error is None
        await col.send(subjects.gen(ns, "agg", shim.worker_id), gen("a", list(range(1, 65)), max_tokens=2))
        assert (await col.final("a")).error is None
        await wait_for(lambda: len(contexts) == 0, what="the legs' ends counted")
        assert "p" not in grown and "a" in grown


async def test_a_utility_call_gets_the_engines_whole_answer_and_queues_nothing(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    """/tokenize through the shim is the engine's own answer, in pieces when over NATS's payload
    limit; it is no generation, so nothing counts as queued prefill; a refusal is the engine's."""
    async with SimServer(sim_config()) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None and shim.requests is not None
        queued: list[int] = []
        col.on_chunk = lambda _c: queued.append(shim.requests.prefill_tokens_queued)  # type: ignore[union-attr]
        cases: dict[str, tuple[str, dict[str, Any]]] = {
            "small": (ENDPOINT_TOKENIZE, {"prompt": "hello world", "return_token_strs": True}),
            "big": (ENDPOINT_TOKENIZE, {"prompt": "ab " * 150_000}),  # a 1.6 MB answer, over the 1 MB limit
            "back": (ENDPOINT_DETOKENIZE, {"tokens": [104, 105]}),
            "refused": (ENDPOINT_DETOKENIZE, {"tokens": "x"}),
        }
        for rid, (endpoint, params) in cases.items():
            req = GenerateRequest(
                request_id=rid, model="sim-llama", token_ids=[], stream=False, endpoint=endpoint, params=params
            )
            await col.send(subjects.gen(ns, "agg", shim.worker_id), req)
        async with aiohttp.ClientSession() as http:
            for rid, (endpoint, params) in cases.items():
                final = await col.final(rid)
                async with http.post(f"{sim.url}/{endpoint}", json={**params, "model": "sim-llama"}) as r:
                    direct = await r.read()
                    if r.status != 200:
                        assert final.error is not None and final.error.code == r.status == 400, rid
                        assert final.error.body == direct, "the engine's own refusal"
                        continue
                chunks = col.chunks[rid]
                assert final.error is None and b"".join(c.body for c in chunks) == direct, rid
                assert (len(chunks) > 1) == (rid == "big"), rid
        assert set(queued) == {0}
        assert not shim.requests.inflight


async def test_an_engine_without_the_route_refuses_a_utility_call() -> None:
    """TensorRT-LLM serves no /tokenize: the adapter says so (404) instead of asking the engine."""
    adapter = TrtllmAdapter(ShimConfig(engine="trtllm", engine_url="http://127.0.0.1:9", model="m"))
    with pytest.raises(EngineError) as err:
        await adapter.call(ENDPOINT_TOKENIZE, {"prompt": "x"})
    assert err.value.code == 404 and "trtllm engine serves no /tokenize" in err.value.message
    assert {
        VllmAdapter.kind: {ENDPOINT_TOKENIZE, ENDPOINT_DETOKENIZE},
        SglangAdapter.kind: set(),
        TrtllmAdapter.kind: set(),
    } == ENGINE_UTILITY_ENDPOINTS
    # every engine a shim runs is in the table: one missing, routers call it a newer shim's
    assert set(ENGINES) == set(ENGINE_UTILITY_ENDPOINTS)


async def test_a_leg_of_n_sequences_counts_as_n_in_the_decode_context(ns: str, nats_url: str, etcd_url: str) -> None:
    """LoadReport.decode_context is the mean context of the sequences an engine decodes: a leg with
    n = 4 counted as one sequence at its prompt plus all four's tokens."""
    async with SimServer(sim_config(speedup=2.0)) as sim, agg_shim(sim, ns, nats_url, etcd_url) as (shim, col):
        assert shim.worker_id is not None and shim.requests is not None
        prompt = list(range(1, 101))
        params = {"model": "sim-llama", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "n": 4, "stream": True}
        req = GenerateRequest(
            request_id="n4", model="sim-llama", token_ids=prompt, endpoint=ENDPOINT_COMPLETIONS, params=params
        )
        await col.send(subjects.gen(ns, "agg", shim.worker_id), req)
        contexts = shim.requests.contexts
        await wait_for(lambda: contexts.mean() > 100 + 40, what="forty steps decoded")
        assert sim.engine.running and len(sim.engine.running) == 4
        each = max(len(r.output_token_ids) for r in sim.engine.running)
        assert contexts.mean() <= 100 + each + 8  # each sequence's context, not four sequences' tokens
        await col.final("n4", timeout=60)
