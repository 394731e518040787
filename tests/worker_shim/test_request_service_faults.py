"""The request service against a fake NATS and a fake engine: a leg's first token under load, NATS
refusing chunks (an outage that filled its reconnect buffer), the chunks kept for a resume, the
cap on legs in flight."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import OutboundBufferLimitError

from protocol import GenerateRequest, ResponseChunk, SamplingParams, Usage, decode_msg, encode_msg
from worker_shim.adapters.base import EngineAdapter, LegOutcome, LegRequest, OnOutput
from worker_shim.request_service import RECENT_BYTES, RequestService, _ChunkWriter


class FakeNats:
    """Takes chunks while up; while down refuses them as nats-py does once its reconnect buffer is full."""

    max_payload = 1 << 20

    def __init__(self) -> None:
        self.pending_data_size = 0
        self.down = False
        self.got: list[tuple[str, ResponseChunk, float]] = []

    @property
    def is_connected(self) -> bool:
        return not self.down

    async def publish(self, subject: str, data: bytes) -> None:
        if self.down:
            raise OutboundBufferLimitError
        self.got.append((subject, decode_msg(data, ResponseChunk), time.monotonic()))

    def chunks(self, subject: str) -> list[ResponseChunk]:
        return [c for s, c, _ in self.got if s == subject]


class FakeEngine:
    """Streams `tokens` tokens `gap_s` apart, then ends once `release` is set."""

    kind = "vllm"

    def __init__(self, tokens: int = 10, gap_s: float = 0.005) -> None:
        self.tokens, self.gap_s = tokens, gap_s
        self.outputs = 0
        self.finished = 0
        self.release = asyncio.Event()
        self.release.set()

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        for i in range(self.tokens):
            await asyncio.sleep(self.gap_s)
            self.outputs += 1
            await on_output(1, [], [i])
        await self.release.wait()
        self.finished += 1
        return LegOutcome("length", Usage(prompt_tokens=len(leg.token_ids), completion_tokens=self.tokens))


def service(
    nc: FakeNats,
    engine: FakeEngine | None = None,
    cached: Callable[[list[int], str], int] = lambda _ids, _salt: 0,
    **kw: Any,
) -> RequestService:
    return RequestService(
        cast(Nats, nc),
        cast(EngineAdapter, engine or FakeEngine()),
        lambda: None,
        cached,
        block_size=lambda: 4,
        **kw,
    )


@dataclass
class FakeMsg:
    subject: str
    reply: str
    data: bytes


def request(rid: str, **kw: Any) -> Msg:
    req = GenerateRequest(
        request_id=rid, model="m", token_ids=[1] * 8, sampling=SamplingParams(max_tokens=10, ignore_eos=True), **kw
    )
    return cast(Msg, FakeMsg("ns.gen.agg.w1", f"inbox.{rid}", encode_msg(req)))


async def ended(svc: RequestService, timeout: float = 5.0) -> None:
    until = time.monotonic() + timeout
    while svc.inflight:
        assert time.monotonic() < until, f"legs still in flight: {list(svc.inflight)}"
        await asyncio.sleep(0.01)


# --- the first token ----------------------------------------------------------------------------


async def test_a_legs_first_token_goes_at_once_under_load() -> None:
    nc = FakeNats()
    svc = service(nc, busy_legs=0)  # always busy: every later token waits for the 5 ms mark
    assert svc.busy()
    writer = _ChunkWriter(svc, "inbox.r1", "r1", "w1", "agg", heartbeat_s=0.2)
    await asyncio.sleep(0.001)
    await writer.output(1, [], [42])
    assert [c.token_ids for c in nc.chunks("inbox.r1")] == [[42]], "the first token was held"
    await writer.output(1, [], [43])  # right behind it: held for the mark
    assert len(nc.chunks("inbox.r1")) == 1
    await asyncio.sleep(0.03)
    assert [c.token_ids for c in nc.chunks("inbox.r1")] == [[42], [43]]
    assert svc.held_chunks == 1
    await writer.final(finish_reason="length")


async def test_the_heartbeat_clock_starts_with_the_leg() -> None:
    nc = FakeNats()
    svc = service(nc, busy_legs=0)
    writer = _ChunkWriter(svc, "inbox.r1", "r1", "w1", "agg", heartbeat_s=0.1)
    await asyncio.sleep(0.06)
    assert nc.chunks("inbox.r1") == []
    await asyncio.sleep(0.08)
    assert [c.seq for c in nc.chunks("inbox.r1")] == [0] and svc.heartbeats == 1
    await writer.final(finish_reason="length")


# --- NATS refusing chunks -----------------------------------------------------------------------


async def test_heartbeats_refused_during_an_outage_leave_the_final_chunk_to_go() -> None:
    nc = FakeNats()
    svc = service(nc)
    writer = _ChunkWriter(svc, "inbox.r1", "r1", "w1", "agg", heartbeat_s=0.02)
    nc.down = True
    await asyncio.sleep(0.09)
    nc.down = False
    await writer.final(finish_reason="length", usage=Usage(prompt_tokens=8, completion_tokens=0))
    chunks = nc.chunks("inbox.r1")
    assert chunks[-1].final and chunks[-1].finish_reason == "length"
    assert svc.chunks_unsent >= 2  # heartbeats NATS refused
    # The refused heartbeats are kept: a router asking from seq 0 gets every chunk, in order.
    assert await writer.resume("inbox.again", 0)
    assert [c.seq for c in nc.chunks("inbox.again")] == list(range(chunks[-1].seq + 1))


async def test_a_stream_runs_on_through_an_outage_and_ends_with_its_final_chunk() -> None:
    nc = FakeNats()
    engine = FakeEngine(tokens=20, gap_s=0.005)
    svc = service(nc, engine)
    nc.down = True
    await svc.on_generate(request("s1", stream=True, heartbeat_s=0.02))
    await asyncio.sleep(0.04)
    assert engine.outputs > 0
    nc.down = False
    await ended(svc)
    assert engine.outputs == 20 and engine.finished == 1, "the engine request was aborted"
    final = nc.chunks("inbox.s1")[-1]
    assert final.final and final.error is None and final.finish_reason == "length"
    assert svc.chunks_unsent > 0 and svc.failed == 0
    assert len(svc.contexts) == 0 and svc.prefill_tokens_queued == 0
    # Every token reaches a router that asks again from seq 0.
    assert await svc.recent["s1"].resume("inbox.again", 0)
    assert sum(len(c.token_ids) for c in nc.chunks("inbox.again")) == 20


async def test_a_prefilled_notice_refused_during_an_outage_leaks_no_bookkeeping() -> None:
    nc = FakeNats()
    engine = FakeEngine(tokens=0)  # a whole answer: no output until its end
    engine.release.clear()
    calls = [0]

    def cached(ids: list[int], _salt: str) -> int:  # nothing at dispatch; then the prompt's blocks
        calls[0] += 1
        return 0 if calls[0] == 1 else len(ids)

    svc = service(nc, engine, cached)
    nc.down = True
    await svc.on_generate(request("whole", stream=False))  # whole answer: the watch sends `prefilled`
    await asyncio.sleep(0.15)
    assert len(svc.contexts) == 1  # the watch saw the prefill done
    nc.down = False
    engine.release.set()
    await ended(svc)
    final = nc.chunks("inbox.whole")[-1]
    assert final.final and final.finish_reason == "length"
    assert svc.inflight == {} and len(svc.contexts) == 0 and svc.prefill_tokens_queued == 0
    assert "whole" in svc.recent and svc.chunks_unsent >= 1  # the `prefilled` notice among them


# --- chunks kept for a resume -------------------------------------------------------------------


async def test_ended_legs_chunks_are_bounded_in_bytes_oldest_dropped_first() -> None:
    nc = FakeNats()
    svc = service(nc)
    body = b"x" * (nc.max_payload - 8192)  # one chunk of ~1 MiB per leg
    legs = RECENT_BYTES // len(body) + 16
    for i in range(legs):
        writer = _ChunkWriter(svc, f"inbox.r{i}", f"r{i}", "w1", "agg")
        await writer.final(finish_reason="stop", body=body)
        svc.remember(writer)
    held = sum(len(b) for w in svc.recent.values() for b in w.sent)
    assert held <= RECENT_BYTES
    assert f"r{legs - 1}" in svc.recent and "r0" not in svc.recent
    # A resume for dropped chunks gets 410 `gone`.
    msg = encode_msg(GenerateRequest(request_id="r0", model="m", token_ids=[1], resume=0))
    await svc.on_generate(cast(Msg, FakeMsg("ns.gen.agg.w1", "inbox.gone", msg)))
    [gone] = nc.chunks("inbox.gone")
    assert gone.error is not None and (gone.error.code, gone.error.kind) == (410, "gone")


async def test_ended_legs_chunks_are_dropped_past_the_resume_window() -> None:
    nc = FakeNats()
    svc = service(nc)
    writer = _ChunkWriter(svc, "inbox.old", "old", "w1", "agg")
    await writer.final(finish_reason="stop")
    svc.remember(writer)
    writer.ended = time.monotonic() - 60.0  # a minute ago: past any router's MAX_RESUMES x 3 heartbeats
    msg = encode_msg(GenerateRequest(request_id="old", model="m", token_ids=[1], resume=0))
    await svc.on_generate(cast(Msg, FakeMsg("ns.gen.agg.w1", "inbox.again", msg)))
    [again] = nc.chunks("inbox.again")
    assert again.error is not None and again.error.kind == "gone"
    assert "old" not in svc.recent


# --- the cap on legs in flight ------------------------------------------------------------------


async def test_a_leg_past_the_cap_is_refused_at_once_with_a_retryable_503(caplog: pytest.LogCaptureFixture) -> None:
    nc = FakeNats()
    engine = FakeEngine(tokens=1)
    engine.release.clear()
    svc = service(nc, engine, max_legs=2)
    for rid in ("a", "b", "c", "c2"):
        await svc.on_generate(request(rid))
    [refused] = nc.chunks("inbox.c")
    assert refused.final and refused.error is not None
    assert (refused.error.code, refused.error.kind) == (503, "overloaded")
    assert "--max-inflight-legs" in refused.error.message
    assert sorted(svc.inflight) == ["a", "b"] and svc.outcomes[("agg", "overloaded")] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--max-inflight-legs" in warnings[0]  # once, not per refusal
    engine.release.set()
    await ended(svc)
    await svc.on_generate(request("d"))  # room again
    await ended(svc)
    assert nc.chunks("inbox.d")[-1].finish_reason == "length"
