"""The request service against a real nats-server and a fake engine: a leg's first token under load,
NATS refusing chunks (an outage that filled the client's reconnect buffer), the chunks kept for a
resume, the cap on legs in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import types
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import nats
import pytest
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import OutboundBufferLimitError

import runtime
from kvswitch.servers import NatsServer
from protocol import GenerateRequest, ResponseChunk, SamplingParams, Usage, decode_msg, encode_msg, subjects
from protocol.messages import ENDPOINT_COMPLETIONS, ENDPOINT_TOKENIZE, CancelRequest
from runtime.nats_flush import flush
from tests.lost_cancellation import ends_within, never_answers
from tests.worker_shim.cluster import wait_for
from worker_shim import request_service
from worker_shim.adapters.base import EngineAdapter, EngineError, LegOutcome, LegRequest, OnOutput
from worker_shim.request_service import LEG_KEPT_BYTES, RECENT_BYTES, ChunkWriter, RequestService


class FakeEngine:
    """Streams `tokens` tokens `gap_s` apart once `go` is set, then ends once `release` is set."""

    kind = "vllm"

    def __init__(self, tokens: int = 10, gap_s: float = 0.005) -> None:
        self.tokens, self.gap_s = tokens, gap_s
        self.outputs = 0
        self.finished = 0
        self.go = asyncio.Event()
        self.go.set()
        self.release = asyncio.Event()
        self.release.set()

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        await self.go.wait()
        for i in range(self.tokens):
            await asyncio.sleep(self.gap_s)
            self.outputs += 1
            await on_output(1, [], [i])
        await self.release.wait()
        self.finished += 1
        return LegOutcome("length", Usage(prompt_tokens=len(leg.token_ids), completion_tokens=self.tokens))


class Replies:
    """What the service publishes to `{ns}.inbox.*`, as a router gets it: over NATS, on the
    service's own connection (on a reconnect nats-py sends its SUBs before the buffered chunks)."""

    def __init__(self, nc: Nats, ns: str) -> None:
        self.nc, self.ns = nc, ns
        self.got: list[tuple[str, ResponseChunk]] = []
        self._marked = asyncio.Event()

    def inbox(self, name: str) -> str:
        return f"{self.ns}.inbox.{name}"

    async def start(self) -> None:
        await self.nc.subscribe(self.inbox("*"), cb=self._on)
        await flush(self.nc)

    async def _on(self, msg: Msg) -> None:
        if msg.subject == self.inbox("mark"):
            self._marked.set()
        else:
            self.got.append((msg.subject, decode_msg(msg.data, ResponseChunk)))

    async def settled(self) -> None:
        """Every chunk published so far received: one subscription gets its messages in order."""
        self._marked.clear()
        await self.nc.publish(self.inbox("mark"), b"")
        await asyncio.wait_for(self._marked.wait(), 10)

    def chunks(self, name: str) -> list[ResponseChunk]:
        return [c for s, c in self.got if s == self.inbox(name)]


async def _quiet(_exc: Exception) -> None:
    pass  # nats-py says each failed reconnect during an outage


@pytest.fixture
async def nc(own_nats: NatsServer) -> AsyncIterator[Nats]:
    conn = await nats.connect(
        own_nats.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1, error_cb=_quiet, connect_timeout=2
    )
    yield conn
    await conn.close()


@pytest.fixture
async def replies(nc: Nats, ns: str) -> Replies:
    out = Replies(nc, ns)
    await out.start()
    return out


async def outage(nc: Nats, own_nats: NatsServer) -> None:
    """NATS gone and the client's reconnect buffer full (as other legs' output fills it): nats-py
    then refuses every publish with OutboundBufferLimitError."""
    own_nats.kill()
    await wait_for(lambda: not nc.is_connected, what="the client to see NATS gone")
    for size in (65536, 4096, 256, 16, 1):
        with contextlib.suppress(OutboundBufferLimitError):
            while True:
                await nc.publish("fill", b"x" * size)
    with pytest.raises(OutboundBufferLimitError):
        await nc.publish("fill", b"x")


async def back(nc: Nats, own_nats: NatsServer) -> None:
    """NATS up again on its port, the client reconnected (its buffer sent)."""
    own_nats.launch()
    await asyncio.to_thread(own_nats.wait_healthy)
    await wait_for(lambda: nc.is_connected, what="the client to reconnect")


def service(
    nc: Nats,
    engine: FakeEngine | None = None,
    cached: Callable[[list[int], str], int] = lambda _ids, _salt: 0,
    **kw: Any,
) -> RequestService:
    return RequestService(
        nc,
        cast(EngineAdapter, engine or FakeEngine()),
        lambda: None,
        cached,
        block_size=lambda: 4,
        **kw,
    )


async def serving(svc: RequestService, ns: str) -> str:
    """The service subscribed as worker w1's agg subject, which it returns."""
    subject = subjects.gen(ns, "agg", "w1")
    await svc.nc.subscribe(subject, cb=svc.on_generate)
    await flush(svc.nc)
    return subject


async def send(replies: Replies, subject: str, rid: str, reply: str = "", **kw: Any) -> None:
    req = GenerateRequest(
        request_id=rid, model="m", token_ids=[1] * 8, sampling=SamplingParams(max_tokens=10, ignore_eos=True), **kw
    )
    await replies.nc.publish(subject, encode_msg(req), reply=replies.inbox(reply or rid))


async def ask_again(replies: Replies, subject: str, rid: str, reply: str) -> list[ResponseChunk]:
    """A router's resume of leg `rid` (ended) from seq 0; the chunks it gets, to the final one."""
    msg = encode_msg(GenerateRequest(request_id=rid, model="m", token_ids=[1], resume=0))
    await replies.nc.publish(subject, msg, reply=replies.inbox(reply))
    await wait_for(lambda: any(c.final for c in replies.chunks(reply)), what=f"the answer to a resume of {rid}")
    await replies.settled()
    return replies.chunks(reply)


def published(writer: ChunkWriter) -> list[list[int]]:
    """The token ids of the chunks the writer has handed to NATS so far."""
    return [decode_msg(data, ResponseChunk).token_ids for data in writer.sent]


async def ended(svc: RequestService, timeout: float = 5.0) -> None:
    await wait_for(lambda: not svc.inflight, timeout, what=f"legs still in flight: {list(svc.inflight)}")


# --- the first token ----------------------------------------------------------------------------


async def test_a_legs_first_token_goes_at_once_under_load(nc: Nats, replies: Replies) -> None:
    svc = service(nc, busy_legs=0)  # always busy: every later token waits for the 5 ms mark
    assert svc.busy()
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.2)
    await asyncio.sleep(0.001)
    await writer.output(1, [], [42])
    assert published(writer) == [[42]], "the first token was held"
    await writer.output(1, [], [43])  # right behind it: held for the mark
    assert len(writer.sent) == 1
    await asyncio.sleep(0.03)
    await replies.settled()
    assert [c.token_ids for c in replies.chunks("r1")] == [[42], [43]]
    assert svc.held_chunks == 1
    await writer.final(finish_reason="length")


async def test_a_first_token_after_a_heartbeat_is_not_held(
    nc: Nats, replies: Replies, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A prefill that outlasts heartbeat_s: the heartbeat (or a `prefilled` notice) is no output.
    monkeypatch.setattr(request_service, "COALESCE_S", 5.0)  # a held token would wait 5 s
    svc = service(nc, busy_legs=0)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.05)
    await wait_for(lambda: svc.heartbeats == 1, what="the heartbeat")
    await writer.output(1, [], [42])
    assert published(writer) == [[], [42]] and svc.held_chunks == 0, "the first token was held"
    await replies.settled()
    assert [c.token_ids for c in replies.chunks("r1")] == [[], [42]]
    await writer.output(1, [], [43])  # the next one is held for the mark
    assert len(writer.sent) == 2
    await writer.final(finish_reason="length")


async def test_the_heartbeat_clock_starts_with_the_leg(nc: Nats, replies: Replies) -> None:
    svc = service(nc, busy_legs=0)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.1)
    await asyncio.sleep(0.06)
    await replies.settled()
    assert replies.chunks("r1") == []
    await asyncio.sleep(0.08)
    await replies.settled()
    assert [c.seq for c in replies.chunks("r1")] == [0] and svc.heartbeats == 1
    await writer.final(finish_reason="length")


# --- chunk sizes ---------------------------------------------------------------------------------


async def test_a_backlog_of_small_events_goes_in_chunks_nats_takes(nc: Nats, replies: Replies) -> None:
    """20,000 engine events of ~230 bytes in one read while busy (the engine's backlog after NATS
    was slow): counted by their bytes alone, a chunk held ~10 kB of msgpack framing past its
    envelope, and NATS refused it for good; the router's resumes got the same refusal."""
    svc = service(nc, busy_legs=0)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg")
    event = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"x","logprobs":null}]}'
    event += b" " * (230 - len(event))
    await writer.output(1, [b"first"], [])  # the first output goes at once; the backlog is held
    await writer.output(20_000, [event] * 20_000, [])
    await writer.final(finish_reason="length")
    assert max(len(d) for d in writer.sent) <= nc.max_payload and svc.chunks_unsent == 0
    await wait_for(lambda: any(c.final for c in replies.chunks("r1")), what="the final chunk")
    chunks = replies.chunks("r1")
    assert [c.seq for c in chunks] == list(range(len(writer.sent)))
    assert sum(len(c.events) for c in chunks) == 20_001 and sum(c.tokens for c in chunks) == 20_001


async def test_token_ids_held_beside_an_event_cut_in_pieces_go_in_chunks_nats_takes(nc: Nats, replies: Replies) -> None:
    """A piece of a cut event counted nothing against the chunk's room, so token ids held beside it
    filled that chunk past max_payload (review, 2026-12-06)."""
    svc = service(nc, busy_legs=0)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg")
    await writer.output(1, [], [1])  # the first goes at once; the rest are held for the mark
    await writer.output(1000, [], list(range(100_000, 101_000)))
    await writer.output(1, [b"x" * (2 << 20)], [])
    await writer.final(finish_reason="length")
    assert max(len(d) for d in writer.sent) <= nc.max_payload and svc.chunks_unsent == 0


async def test_a_whole_token_id_answer_goes_in_chunks_nats_takes(nc: Nats, replies: Replies) -> None:
    """Every id of a whole answer went in its final chunk: 220 k of them, 1.1 MB, refused."""
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg")
    ids = [100_000 + i for i in range(220_000)]
    await writer.final(finish_reason="length", tokens=ids)
    assert len(writer.sent) > 1 and max(len(d) for d in writer.sent) <= nc.max_payload and svc.chunks_unsent == 0
    await wait_for(lambda: any(c.final for c in replies.chunks("r1")), what="the final chunk")
    chunks = replies.chunks("r1")
    assert [t for c in chunks for t in c.token_ids] == ids and chunks[-1].final


async def test_a_leg_in_flight_keeps_only_the_chunks_a_router_may_ask_for_again(
    nc: Nats, replies: Replies, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leg in flight kept every chunk since its first for a resume (74 MiB in 10 s for 8 legs
    with logprobs): now those of its resume window (RESUME_HEARTBEATS heartbeats), and of the
    last RECENT_S at most LEG_KEPT_BYTES."""
    monkeypatch.setattr(request_service, "LEG_KEPT_BYTES", 64 * 1024)
    monkeypatch.setattr(request_service, "RECENT_S", 0.5)
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.01)  # resume window 0.12 s
    event = b"x" * 1000

    async def burst() -> None:
        for _ in range(100):  # 100 kB in a moment, over the bytes kept
            await writer.output(1, [event], [])

    await burst()
    assert writer.first == 0, "a burst is kept whole through its resume window"
    await asyncio.sleep(0.15)
    await burst()
    assert writer.first >= 100 and writer.first + len(writer.sent) == writer.seq  # heartbeats too
    end = writer.seq
    assert not writer.resume(replies.inbox("again"), 0), "chunks forgotten are gone (410)"
    assert writer.resume(replies.inbox("again"), writer.first)
    await asyncio.sleep(0.55)  # past RECENT_S
    await writer.output(1, [event], [])
    assert writer.first >= end, "older than RECENT_S: none of the bursts kept"
    await writer.final(finish_reason="length")


async def test_a_whole_answer_larger_than_a_legs_keep_can_still_be_asked_for_again(nc: Nats, replies: Replies) -> None:
    """A whole answer's body goes out in milliseconds, max_payload pieces at a time: a router that
    sees a gap asks within its resume window, and the piece is still kept (review, 2026-12-06)."""
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.4)
    await writer.final(finish_reason="stop", body=b"z" * (LEG_KEPT_BYTES + (8 << 20)))
    assert writer.first == 0 and writer.sent_bytes > LEG_KEPT_BYTES
    assert writer.resume(replies.inbox("again"), 2)


async def test_a_resume_during_a_whole_answers_burst_sends_each_chunk_once_more_in_order(
    nc: Nats, replies: Replies, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router asked for chunks from seq 2 while a whole answer's body was still going out (the
    shim's heartbeats had stopped while it read a long answer): the resume re-sent what was out as
    the leg went on with the rest to the same subject, the router dropped the new chunks amid the
    old and asked again, and a second ask sent everything again on top of the burst."""
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.4)
    publish, published, taken = svc.publish, list[str](), asyncio.Event()

    async def slow(subject: str, data: bytes) -> None:  # NATS slow to take the fifth piece
        published.append(subject)
        if len(published) == 5:
            await taken.wait()
        await publish(subject, data)

    monkeypatch.setattr(svc, "publish", slow)
    burst = asyncio.create_task(writer.final(finish_reason="stop", body=b"z" * (12 * nc.max_payload)))
    await wait_for(lambda: len(published) == 5, what="the burst's fifth piece")
    assert writer.resume(replies.inbox("again"), 2) and writer.resume(replies.inbox("again"), 2)
    taken.set()
    await burst
    await replies.settled()
    assert [c.seq for c in replies.chunks("r1")] == [0, 1, 2, 3, 4]  # out before the asks
    again = [c.seq for c in replies.chunks("again")]
    assert again == list(range(2, writer.seq)) and writer.seq > 12  # each once more, in order, to the end
    assert replies.chunks("again")[-1].final


@pytest.mark.parametrize(
    ("steps", "waits"),
    [
        ([(0.0, 4), (0.0, 6)], [0.0, 0.0]),  # the bucket at once
        ([(0.0, 10), (0.0, 5)], [0.0, 1.0]),  # past it, at the rate
        ([(0.0, 10), (1.0, 5), (1.0, 5)], [0.0, 0.0, 1.0]),  # what the rate filled meanwhile goes at once
        ([(0.0, 10), (100.0, 10), (100.0, 1)], [0.0, 0.0, 0.2]),  # idle, it fills up to the bucket only
    ],
)
def test_a_legs_pace_lets_a_bucket_go_at_once_then_the_rate(steps: list[tuple[float, int]], waits: list[float]) -> None:
    pace = request_service._Pace(10, 5.0, 0.0)
    assert [pace.delay(now, size) for now, size in steps] == pytest.approx(waits)


async def test_a_whole_answers_burst_goes_out_at_the_legs_pace(
    nc: Nats, replies: Replies, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole answer's body went out as fast as NATS took it (193 MB for a long prompt's
    prompt_logprobs), faster than a router with other work reads: nats-server cut the router's
    connection, every leg on it, past its max_pending. Now BURST_BYTES at once, then BURST_BYTES_S."""
    burst, rate = 2 << 20, 32 << 20
    monkeypatch.setattr(request_service, "BURST_BYTES", burst)
    monkeypatch.setattr(request_service, "BURST_BYTES_S", rate)
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.4)
    publish, out, total = svc.publish, list[tuple[float, int]](), [0]

    async def timed(subject: str, data: bytes) -> None:
        total[0] += len(data)
        out.append((time.monotonic(), total[0]))  # when, and the bytes out with this chunk
        await publish(subject, data)

    monkeypatch.setattr(svc, "publish", timed)
    body = bytes(range(256)) * (8 << 12)  # 8 MiB
    start = time.monotonic()
    await writer.final(finish_reason="stop", body=body)
    assert all(sent <= burst + rate * (at - start) + nc.max_payload for at, sent in out)
    await replies.settled()
    assert b"".join(c.body for c in replies.chunks("r1")) == body


async def test_legs_to_one_router_share_one_burst_and_a_leg_to_another_goes_at_once(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pace was per leg: whole answers to one router at once each went out with a burst and a
    rate of their own, and together passed the router's max_pending, where one could not. Now the
    legs to one router (reply subjects under its inbox prefix) share one bucket, and take turns in
    it; a leg to another router has its own."""
    burst, rate = 2 << 20, 8 << 20
    monkeypatch.setattr(request_service, "BURST_BYTES", burst)
    monkeypatch.setattr(request_service, "BURST_BYTES_S", rate)
    svc = service(nc)
    publish, out = svc.publish, list[tuple[str, float, int]]()

    async def timed(subject: str, data: bytes) -> None:
        out.append((subject, time.monotonic(), len(data)))
        await publish(subject, data)

    monkeypatch.setattr(svc, "publish", timed)
    body = b"a" * (6 << 20)
    start = time.monotonic()
    legs = [
        asyncio.create_task(ChunkWriter(svc, replies.inbox(name), name, "w1", "agg").final(body=body))
        for name in ("a", "b")
    ]
    await wait_for(lambda: sum(size for _, _, size in out) >= burst, what="the router's burst")
    other = f"{ns}.elsewhere.c"  # another router's inbox
    await ChunkWriter(svc, other, "c", "w1", "agg").final(body=b"c" * (burst - nc.max_payload))
    after = [subject for subject, _, _ in out[[s for s, _, _ in out].index(other) :]]
    assert after[: after.count(other)] == [other] * after.count(other)  # at once, before the next of a or b
    await asyncio.gather(*legs)
    ours = [(subject, at, size) for subject, at, size in out if subject != other]
    sent = 0
    for _, at, size in ours:
        sent += size
        assert sent <= burst + rate * (at - start) + (64 << 10)  # one burst, not two, then one rate
    # in turns once the bucket is spent: neither leg waits for the other's whole answer
    late = [subject for subject, _, _ in ours[len(ours) // 2 :]]
    assert replies.inbox("a") in late and replies.inbox("b") in late
    await replies.settled()
    assert all(b"".join(c.body for c in replies.chunks(name)) == body for name in ("a", "b"))


async def test_a_token_stream_beside_whole_answers_to_its_router_is_not_paced(
    nc: Nats, replies: Replies, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Booked in its router's bucket behind whole answers, a stream got one chunk through per chunk of
    theirs and fell ever further behind (1.7 s at 100 tokens a second beside three 193 MB answers):
    only large chunks are paced."""
    burst, rate = 2 << 20, 4 << 20
    monkeypatch.setattr(request_service, "BURST_BYTES", burst)
    monkeypatch.setattr(request_service, "BURST_BYTES_S", rate)
    svc = service(nc)
    publish, out, streamed = svc.publish, list[tuple[str, int]](), list[int]()

    async def counted(subject: str, data: bytes) -> None:
        out.append((subject, len(data)))
        if subject == replies.inbox("s"):
            streamed.extend(decode_msg(data, ResponseChunk).token_ids)
        await publish(subject, data)

    monkeypatch.setattr(svc, "publish", counted)
    answer = asyncio.create_task(ChunkWriter(svc, replies.inbox("a"), "a", "w1", "agg").final(body=b"a" * (8 << 20)))
    await wait_for(lambda: sum(size for _, size in out) >= burst, what="the router's burst")
    stream = ChunkWriter(svc, replies.inbox("s"), "s", "w1", "agg")
    for token in range(20):
        await stream.output(1, [], [token])
        await stream._pump()  # what a lone token's flush does: it goes now, or waits for the pace
    # NATS behind (the client's buffer past BEHIND_BYTES with the answer's pieces, as under load):
    # the tokens after the first are coalesced for COALESCE_S, in fewer chunks, none of them paced.
    await wait_for(lambda: len(streamed) == 20, what="the stream's tokens")
    assert not answer.done(), "each token went at once, not behind the answer's pieces"
    assert streamed == list(range(20))
    await answer
    assert len(svc._paces) == 1  # one router, one bucket, kept


def test_two_routers_keep_their_buckets_as_their_legs_take_turns(nc: Nats) -> None:
    """A bucket was forgotten whenever another router's was made: with two routers in turn, every
    chunk made one anew (800 for 800 chunks)."""
    svc = service(nc)
    first = svc.pace("_INBOX.r1.1"), svc.pace("_INBOX.r2.1")
    for i in range(100):
        assert (svc.pace(f"_INBOX.r1.{i}"), svc.pace(f"_INBOX.r2.{i}")) == first


# --- NATS refusing chunks -----------------------------------------------------------------------


async def test_heartbeats_refused_during_an_outage_leave_the_final_chunk_to_go(
    nc: Nats, own_nats: NatsServer, replies: Replies
) -> None:
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg", heartbeat_s=0.02)
    await outage(nc, own_nats)
    await asyncio.sleep(0.09)
    await back(nc, own_nats)
    await writer.final(finish_reason="length", usage=Usage(prompt_tokens=8, completion_tokens=0))
    await replies.settled()
    chunks = replies.chunks("r1")
    assert chunks[-1].final and chunks[-1].finish_reason == "length"
    assert svc.chunks_unsent >= 2  # heartbeats NATS refused
    # The refused heartbeats are kept: a router asking from seq 0 gets every chunk, in order.
    assert writer.resume(replies.inbox("again"), 0)
    await replies.settled()
    assert [c.seq for c in replies.chunks("again")] == list(range(chunks[-1].seq + 1))


async def test_a_stream_runs_on_through_an_outage_and_ends_with_its_final_chunk(
    nc: Nats, own_nats: NatsServer, replies: Replies, ns: str
) -> None:
    engine = FakeEngine(tokens=20, gap_s=0.005)
    engine.go.clear()
    engine.release.clear()
    svc = service(nc, engine)
    subject = await serving(svc, ns)
    await send(replies, subject, "s1", stream=True, heartbeat_s=0.02)
    await wait_for(lambda: "s1" in svc.inflight, what="the leg")
    await outage(nc, own_nats)
    engine.go.set()
    await asyncio.sleep(0.04)
    assert engine.outputs > 0 and svc.chunks_unsent > 0
    await back(nc, own_nats)
    engine.release.set()
    await ended(svc)
    assert engine.outputs == 20 and engine.finished == 1, "the engine request was aborted"
    await replies.settled()
    final = replies.chunks("s1")[-1]
    assert final.final and final.error is None and final.finish_reason == "length"
    assert svc.chunks_unsent > 0 and svc.failed == 0
    assert len(svc.contexts) == 0 and svc.prefill_tokens_queued == 0
    # Every token reaches a router that asks again from seq 0.
    again = await ask_again(replies, subject, "s1", "again")
    assert sum(len(c.token_ids) for c in again) == 20


async def test_a_prefilled_notice_refused_during_an_outage_leaks_no_bookkeeping(
    nc: Nats, own_nats: NatsServer, replies: Replies, ns: str
) -> None:
    engine = FakeEngine(tokens=0)  # a whole answer: no output until its end
    engine.release.clear()
    prefilled = [False]

    def cached(ids: list[int], _salt: str) -> int:  # nothing until the test says the prompt's blocks came
        return len(ids) if prefilled[0] else 0

    svc = service(nc, engine, cached)
    subject = await serving(svc, ns)
    await send(replies, subject, "whole", stream=False)  # whole answer: the watch sends `prefilled`
    await wait_for(lambda: "whole" in svc.inflight, what="the leg")
    await outage(nc, own_nats)
    prefilled[0] = True
    await asyncio.sleep(0.15)
    assert len(svc.contexts) == 1  # the watch saw the prefill done
    await back(nc, own_nats)
    engine.release.set()
    await ended(svc)
    await replies.settled()
    final = replies.chunks("whole")[-1]
    assert final.final and final.finish_reason == "length"
    assert svc.inflight == {} and len(svc.contexts) == 0 and svc.prefill_tokens_queued == 0
    assert "whole" in svc.recent and svc.chunks_unsent >= 1  # the `prefilled` notice among them


async def test_each_outage_is_logged_though_no_chunk_went_out_between_them(
    nc: Nats, own_nats: NatsServer, replies: Replies, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=request_service.__name__)
    svc = service(nc)
    data = encode_msg(ResponseChunk(request_id="a", seq=0, final=True))
    await outage(nc, own_nats)
    await svc.publish(replies.inbox("a"), data)  # a leg's final chunk refused: the leg ends, kept
    await back(nc, own_nats)  # nothing published before the next outage
    await asyncio.sleep(0.3)
    second = time.monotonic()
    await outage(nc, own_nats)
    for _ in range(3):
        await svc.publish(replies.inbox("b"), data)
    await back(nc, own_nats)
    await svc.publish(replies.inbox("c"), data)
    lasted = time.monotonic() - second
    assert svc.chunks_unsent == 4
    records = [r for r in caplog.records if r.name == request_service.__name__]
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("NATS refused a response chunk" in w for w in warnings), warnings
    [info] = [r.getMessage() for r in records if r.levelno == logging.INFO]
    took = re.search(r"again after ([\d.]+)s", info)
    assert took is not None and float(took[1]) <= lasted + 0.05, f"{info}: the second outage lasted {lasted:.2f}s"
    await replies.settled()
    assert len(replies.chunks("c")) == 1


# --- chunks kept for a resume -------------------------------------------------------------------


async def test_ended_legs_chunks_are_bounded_in_bytes_oldest_dropped_first(nc: Nats, replies: Replies, ns: str) -> None:
    svc = service(nc)
    subject = await serving(svc, ns)
    body = b"x" * (nc.max_payload - 8192)  # one chunk of ~1 MiB per leg
    legs = RECENT_BYTES // len(body) + 16
    for i in range(legs):  # to subjects nobody reads: only the kept copies matter here
        writer = ChunkWriter(svc, f"{ns}.bulk.r{i}", f"r{i}", "w1", "agg")
        await writer.final(finish_reason="stop", body=body)
        svc.remember(writer)
    held = sum(len(b) for w in svc.recent.values() for b in w.sent)
    assert held <= RECENT_BYTES
    assert f"r{legs - 1}" in svc.recent and "r0" not in svc.recent
    # A resume for dropped chunks gets 410 `gone`.
    [gone] = await ask_again(replies, subject, "r0", "gone")
    assert gone.error is not None and (gone.error.code, gone.error.kind) == (410, "gone")


async def test_a_leg_too_large_to_keep_pushes_out_no_other(nc: Nats, replies: Replies, ns: str) -> None:
    svc = service(nc)
    subject = await serving(svc, ns)
    for i in range(10):
        writer = ChunkWriter(svc, replies.inbox(f"r{i}"), f"r{i}", "w1", "agg")
        await writer.final(finish_reason="stop", body=b"x" * 1000)
        svc.remember(writer)
    big = ChunkWriter(svc, f"{ns}.bulk.big", "big", "w1", "agg")  # e.g. a long stream with logprobs
    await big.final(finish_reason="stop", body=b"y" * (RECENT_BYTES + (1 << 20)))
    assert big.sent_bytes > RECENT_BYTES  # all of it within its resume window
    svc.remember(big)
    assert list(svc.recent) == [f"r{i}" for i in range(10)], "the other legs' chunks were dropped"
    assert "big" not in svc.recent
    again = await ask_again(replies, subject, "r9", "again")
    assert [c.body for c in again] == [b"x" * 1000] and again[0].error is None


async def test_ended_legs_chunks_are_dropped_past_the_resume_window(nc: Nats, replies: Replies, ns: str) -> None:
    svc = service(nc)
    subject = await serving(svc, ns)
    writer = ChunkWriter(svc, replies.inbox("old"), "old", "w1", "agg")
    await writer.final(finish_reason="stop")
    svc.remember(writer)
    writer.ended = time.monotonic() - 60.0  # a minute ago: past any router's MAX_RESUMES x 3 heartbeats
    [again] = await ask_again(replies, subject, "old", "again")
    assert again.error is not None and again.error.kind == "gone"
    assert "old" not in svc.recent


# --- the cap on legs in flight ------------------------------------------------------------------


async def test_a_leg_past_the_cap_is_refused_at_once_with_a_retryable_503(
    nc: Nats, replies: Replies, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine(tokens=1)
    engine.release.clear()
    svc = service(nc, engine, max_legs=2)
    subject = await serving(svc, ns)
    for rid in ("a", "b", "c", "c2"):
        await send(replies, subject, rid)
    await replies.settled()
    await wait_for(lambda: len(replies.chunks("c2")) == 1, what="the second refusal")
    [refused] = replies.chunks("c")
    assert refused.final and refused.error is not None
    assert (refused.error.code, refused.error.kind) == (503, "overloaded")
    assert "--max-inflight-legs" in refused.error.message
    assert sorted(svc.inflight) == ["a", "b"] and svc.outcomes[("agg", "overloaded")] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "--max-inflight-legs" in warnings[0]  # once, not per refusal
    engine.release.set()
    await ended(svc)
    await send(replies, subject, "d")  # room again
    await wait_for(lambda: "d" in svc.inflight or bool(replies.chunks("d")), what="the leg d")
    await ended(svc)
    await replies.settled()
    assert replies.chunks("d")[-1].finish_reason == "length"


async def test_a_paced_resend_does_not_hold_back_the_next_request(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume's resend went out at the leg's pace inside the shim's generate handler, which NATS
    runs one call at a time: every request to the shim waited for it (a 60 MiB answer at 128 MiB/s
    past its 16 MiB burst: 245 ms; review of 2026-12-06). Now it runs in a task of its own, and the
    next request's chunks go out amid the resent ones."""
    monkeypatch.setattr(request_service, "BURST_BYTES_S", 32 << 20)  # the resend takes over a second
    svc = service(nc, FakeEngine(tokens=3, gap_s=0.001))
    subject = await serving(svc, ns)
    ended = ChunkWriter(svc, f"{ns}.nobody.big", "big", "w1", "agg", heartbeat_s=0.4)
    await ended.final(finish_reason="stop", body=b"z" * (48 << 20))
    svc.remember(ended)
    await asyncio.sleep(0.6)  # its burst allowance back
    resume = GenerateRequest(request_id="big", model="m", token_ids=[1], resume=0)
    await nc.publish(subject, encode_msg(resume), reply=replies.inbox("again"))
    await send(replies, subject, "r2")
    await wait_for(lambda: any(c.final for c in replies.chunks("again")), 20, what="the resend's end")
    await wait_for(lambda: any(c.final for c in replies.chunks("r2")), 10, what="r2's end")
    order = [s.rpartition(".")[2] for s, _ in replies.got]
    assert order.index("r2") < len(order) - 1 - order[::-1].index("again")  # r2 began before the resend ended


class UnencodableRefusal(FakeEngine):
    """A refusal whose Retry-After no chunk can carry (past msgpack's 2**64 - 1)."""

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        raise EngineError(429, "engine_rejected", "busy", retry_after_s=10**20)


async def test_a_final_chunk_that_cannot_go_ends_the_leg_with_an_error_said_with_its_traceback(
    nc: Nats, replies: Replies, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: OverflowError ended the leg's task ("Task exception was never retrieved"), no final
    chunk went and its heartbeats had stopped, so the router took the worker for unreachable. The
    outcome counted is the 500 sent (until 2026-12-07: the refusal that never went)."""
    svc = service(nc, UnencodableRefusal())
    subject = await serving(svc, ns)
    await send(replies, subject, "r1", heartbeat_s=0.2)
    await wait_for(lambda: bool(replies.chunks("r1")), what="the final chunk")
    await ended(svc)
    await replies.settled()
    [final] = replies.chunks("r1")
    assert final.final and final.seq == 0 and final.error is not None
    assert (final.error.code, final.error.kind) == (500, "internal") and "OverflowError" in final.error.message
    assert dict(svc.outcomes) == {("agg", "internal"): 1}
    said = [r for r in caplog.records if "its final chunk could not be sent" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None


class HeldUnencodableToken(FakeEngine):
    """Under load: a token, then at once one no chunk can carry (past msgpack's 2**64 - 1), held for
    the coalescing mark; its timer's flush fails. Then `more` tokens, and the answer's end."""

    def __init__(self, more: int) -> None:
        super().__init__()
        self.more = more

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        await on_output(1, [], [1])
        await on_output(1, [], [2**64])
        await asyncio.sleep(0.05)  # past the mark: the held chunk's timer has fired
        for i in range(self.more):
            await on_output(1, [], [3 + i])
        return LegOutcome("length", Usage(prompt_tokens=len(leg.token_ids), completion_tokens=2 + self.more))


async def held_leg_ended_by_overflow(nc: Nats, replies: Replies, ns: str, engine: FakeEngine) -> list[ResponseChunk]:
    """Leg r1 on `engine` under a service always busy (every output after the first is held), run to
    its end, which must be a 500 for the OverflowError of its one held chunk; r1's chunks."""
    svc = service(nc, engine, busy_legs=0)
    subject = await serving(svc, ns)
    await send(replies, subject, "r1")
    await wait_for(lambda: any(c.final for c in replies.chunks("r1")), what="the final chunk")
    await ended(svc)
    await replies.settled()
    chunks = replies.chunks("r1")
    final = chunks[-1]
    assert final.final and final.error is not None and final.finish_reason is None, final
    assert (final.error.code, final.error.kind) == (500, "internal") and "OverflowError" in final.error.message
    assert svc.held_chunks == 1 and svc.outcomes[("agg", "internal")] == 1
    return chunks


@pytest.mark.parametrize(("more", "said"), [(2, "request r1 failed"), (0, "a chunk of its answer could not be sent")])
async def test_a_held_chunk_that_cannot_go_ends_the_leg_with_an_error_not_a_truncated_answer(
    nc: Nats, replies: Replies, ns: str, caplog: pytest.LogCaptureFixture, more: int, said: str
) -> None:
    """The coalescing timer's flush had taken the held tokens when it failed: the error stayed in
    its task ("Task exception was never retrieved") and the leg ended with finish_reason "length",
    no error, its answer short of the lost tokens (review of 2026-12-06: 179 of 200). It now ends
    as a failed flush inline does, with a 500, at its next output (the engine's stream is cut) or
    at its end."""
    chunks = await held_leg_ended_by_overflow(nc, replies, ns, HeldUnencodableToken(more))
    assert [t for c in chunks for t in c.token_ids] == [1], "a token after the lost one went as if none were lost"
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and said in r.getMessage()]
    assert len(errors) == 1 and errors[0].exc_info is not None and isinstance(errors[0].exc_info[1], OverflowError)


class HeldOverTwoChunks(FakeEngine):
    """Under load: a token, then at once events filling a chunk nearly whole and 30 token ids, held
    for the coalescing mark. Their flush sends the leading ids in a chunk of their own, then the
    rest with the events, the last id one no chunk can carry (past msgpack's 2**64 - 1). The answer
    ends while the first of those two chunks is being published."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room
        self.held = False

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        await on_output(1, [], [1])
        await on_output(30, [b"e" * (self.room - 100)], [*range(2, 31), 2**64])
        self.held = True
        await asyncio.sleep(0.3)  # past the mark: the held chunk's flush is publishing
        return LegOutcome("length", Usage(prompt_tokens=len(leg.token_ids), completion_tokens=31))


async def test_a_leg_that_ends_while_a_held_chunk_is_published_waits_for_that_flush(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leg's end does not outrun the coalescing timer's flush: one still publishing when the
    answer ended failed after the final chunk had said the answer whole ("length", its last ids
    missing); final() now waits for it and ends the leg with a 500."""
    real = RequestService.publish

    async def slow(self: RequestService, subject: str, data: bytes) -> None:
        if engine.held:
            await asyncio.sleep(1.0)  # NATS taking a moment: the engine's answer ends meanwhile
        await real(self, subject, data)

    monkeypatch.setattr(RequestService, "publish", slow)
    monkeypatch.setattr(request_service, "COALESCE_S", 0.1)  # the second output is held on a slow host too
    engine = HeldOverTwoChunks(nc.max_payload - request_service._ENVELOPE)
    chunks = await held_leg_ended_by_overflow(nc, replies, ns, engine)
    assert [t for c in chunks for t in c.token_ids] == list(range(1, 13)), "the flush's first chunk went"


# --- the decode context -------------------------------------------------------------------------


class StreamsOnly(FakeEngine):
    """Its tokens to a streamed leg as they come; a whole answer's at its end. Each leg ends once
    `release` is set."""

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        for i in range(self.tokens if leg.stream else 0):
            await on_output(1, [], [i])
        await self.release.wait()
        return LegOutcome("length", Usage(prompt_tokens=len(leg.token_ids), completion_tokens=self.tokens))


async def test_a_whole_answer_of_n_sequences_counts_as_n_in_the_decode_context(
    nc: Nats, replies: Replies, ns: str
) -> None:
    """A non-streamed leg with n = 4 counted one sequence from its `prefilled` moment, where a
    streamed one counts its n (a review of 2026-12-07): beside a leg with a longer prompt, the
    mean context was that leg's and this one's, halved."""
    engine = StreamsOnly(tokens=1)
    engine.release.clear()
    held = [False]  # whether the engine's KV events hold the prompt
    svc = service(nc, engine, lambda ids, _salt: len(ids) if held[0] else 0)
    subject = await serving(svc, ns)
    await send(replies, subject, "whole", stream=False, params={"n": 4})
    await wait_for(lambda: "whole" in svc.inflight, what="the whole answer's leg")
    held[0] = True
    await wait_for(lambda: len(svc.contexts) == 1, what="its prefill seen done")
    streamed = GenerateRequest(request_id="s", model="m", token_ids=[1] * 40, stream=True)
    await replies.nc.publish(subject, encode_msg(streamed), reply=replies.inbox("s"))
    await wait_for(lambda: len(svc.contexts) == 2, what="the streamed leg's first token")
    # four sequences at the 8-token prompt, one at 40 and its token
    assert svc.contexts.mean() == pytest.approx((4 * 8 + 41) / 5)
    engine.release.set()
    await ended(svc)
    assert len(svc.contexts) == 0


# --- stop ---------------------------------------------------------------------------------------


class LosesOneCancel(FakeEngine):
    """An engine whose call never answers and swallows its first cancellation."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[str] = []
        self.calling = False

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        self.calling = True
        while True:
            await never_answers(self.lost, "generate")


async def test_a_stop_ends_a_leg_whose_engine_call_lost_its_cancellation(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop that cancelled the legs in flight once and waited waited for good on one whose
    cancellation was lost below it. A leg is now cancelled again until it ends, its client told
    the shim stopped."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)  # 10 s in service
    engine = LosesOneCancel()
    svc = service(nc, engine)
    await send(replies, await serving(svc, ns), "r1")
    await wait_for(lambda: engine.calling, what="the engine call")
    assert await ends_within(svc.drain(0), 5), "drain() still waits on its leg"
    assert engine.lost == ["generate"] and not svc.inflight
    await replies.settled()
    last = replies.chunks("r1")[-1]
    assert last.final and last.error is not None and last.error.kind == "shutdown", last


async def test_a_stop_tells_the_client_though_the_legs_heartbeat_lost_its_cancellation(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop within a stop: abort_all cancels the leg, whose final chunk waits on its heartbeat's
    end, the heartbeat's publish having lost its cancellation. abort_all cancelled the leg again
    past CANCEL_AGAIN_S, the heartbeat's wait (cancel_and_wait) raised at once, and the final chunk
    never went: the router waited on silence (a review of 2026-12-07). The cancellation now goes on
    to the heartbeat, and the final chunk goes; the WARNING names the heartbeat, not the leg."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.2)  # 10 s in service
    lost: list[str] = []

    async def beat(self: ChunkWriter, period: float) -> None:  # a heartbeat publish that never answers
        while True:
            await never_answers(lost, "heartbeat")

    monkeypatch.setattr(ChunkWriter, "_beat", beat)
    engine = FakeEngine(tokens=1)
    engine.release.clear()  # the engine call runs until the stop (cancellable as usual)
    svc = service(nc, engine)
    await send(replies, await serving(svc, ns), "r1", heartbeat_s=0.05)
    await wait_for(lambda: engine.outputs == 1, what="the first token")
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert await ends_within(svc.drain(0), 5), "drain() still waits on its leg"
    assert lost == ["heartbeat"] and not svc.inflight
    await replies.settled()
    last = replies.chunks("r1")[-1]
    assert last.final and last.error is not None and last.error.kind == "shutdown", last
    said = [r.getMessage() for r in caplog.records if r.name == "runtime"]
    assert said == [
        "task heartbeat-r1 ran on through its cancellation (lost below it): cancelled again 1 time(s) before it ended"
    ], said


@pytest.mark.parametrize("how", ["cancel", "stop"])
async def test_a_leg_cancelled_while_it_reaps_its_prefill_watch_still_ends_its_bookkeeping(
    nc: Nats, replies: Replies, ns: str, how: str
) -> None:
    """A whole answer's leg whose router's cancel (or a stop: abort_all) came after its final chunk
    went, as it reaped its prefill watch: the wait raised the cancel at once and the bookkeeping
    after it never ran. The leg stayed in flight for good (a --max-inflight-legs slot), its prompt
    counted queued, and a resume got 410 (a review of 2026-12-07). Now the cancel is raised after it."""
    engine = FakeEngine(tokens=0)  # a whole answer at once; its prompt never seen cached: the watch runs on
    stops: list[asyncio.Task[None]] = []

    def served(rid: str, _ids: list[int], _salt: str, _usage: Usage) -> None:
        # the final chunk went; the leg reaps its prefill watch next, and this lands meanwhile
        msg = cast(Msg, types.SimpleNamespace(data=encode_msg(CancelRequest(request_id=rid))))
        stops.append(asyncio.create_task(svc.on_cancel(msg) if how == "cancel" else svc.abort_all()))

    svc = service(nc, engine, on_served=served)
    subject = await serving(svc, ns)
    await send(replies, subject, "r1", stream=False)
    await wait_for(lambda: bool(stops) and stops[0].done(), what="the cancel")
    await ended(svc)
    assert svc.prefill_tokens_queued == 0 and len(svc.contexts) == 0
    await replies.settled()
    assert [c.finish_reason for c in replies.chunks("r1") if c.final] == ["length"]
    assert dict(svc.outcomes) == {("agg", "ok"): 1}
    again = await ask_again(replies, subject, "r1", "again")
    assert again[-1].final and again[-1].finish_reason == "length", again[-1]


class WholeBody(FakeEngine):
    """A pass-through leg's whole answer: an 8 MiB body."""

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        return LegOutcome("stop", Usage(prompt_tokens=len(leg.token_ids), completion_tokens=1), body=b"z" * (8 << 20))


@pytest.mark.parametrize(("how", "outcome"), [("cancel", "abort"), ("stop", "shutdown")])
async def test_a_leg_cancelled_while_its_whole_answer_is_paced_out_ends_with_one_final_chunk(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch, how: str, outcome: str
) -> None:
    """Its router's cancel (its client gone), or a stop, while the answer's pieces went at its
    router's pace: the leg ended with no final chunk, its heartbeats stopped and its outcome counted
    `ok`; a resume got the pieces and then silence (a review of 2026-12-07). Now the rest of the
    answer is dropped and a final chunk says why: an abort, or the stop's 503 shutdown."""
    monkeypatch.setattr(request_service, "BURST_BYTES", 2 << 20)
    monkeypatch.setattr(request_service, "BURST_BYTES_S", 4 << 20)  # the 6 MiB past the burst: 1.5 s
    svc = service(nc, WholeBody())
    subject = await serving(svc, ns)
    await send(replies, subject, "r1", stream=False, endpoint=ENDPOINT_COMPLETIONS, heartbeat_s=0.2)
    await wait_for(lambda: len(replies.chunks("r1")) >= 3, what="the answer's burst, and a piece at its pace")
    if how == "cancel":
        await svc.on_cancel(cast(Msg, types.SimpleNamespace(data=encode_msg(CancelRequest(request_id="r1")))))
    else:
        await svc.drain(0)
    await ended(svc)
    await wait_for(lambda: any(c.final for c in replies.chunks("r1")), what="the final chunk")
    await replies.settled()
    chunks = replies.chunks("r1")
    assert [c.seq for c in chunks] == list(range(len(chunks))) and [c.final for c in chunks].count(True) == 1
    last = chunks[-1]
    assert last.final and (last.error.kind if last.error is not None else last.finish_reason) == outcome, last
    assert sum(len(c.body) for c in chunks) < 8 << 20, "the answer went whole: no cancel cut it"
    assert dict(svc.outcomes) == {("agg", outcome): 1}
    again = await ask_again(replies, subject, "r1", "again")
    assert [c.seq for c in again] == list(range(len(chunks))) and again[-1] == last


async def test_a_cut_legs_final_chunk_goes_through_a_stop_cancels_it_again(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its router's cancel while a piece of the answer waited for its router's pace, then a stop
    (abort_all cancels the leg again): the cut leg waited that pace again for the piece under way,
    booking it a second time, and the stop's cancel cut that wait: its final chunk, numbered and
    counted, never went (a review of 2026-12-07). Now a cut leg's rest goes at once, unpaced."""
    monkeypatch.setattr(request_service, "BURST_BYTES", 2 << 20)
    monkeypatch.setattr(request_service, "BURST_BYTES_S", 256 << 10)  # a piece past the burst: ~4 s
    booked: list[int] = []
    book = request_service._Pace.delay

    def delay(pace: Any, now: float, size: int) -> float:
        booked.append(size)
        return book(pace, now, size)

    monkeypatch.setattr(request_service._Pace, "delay", delay)
    svc = service(nc, WholeBody())
    subject = await serving(svc, ns)
    await send(replies, subject, "r1", stream=False, endpoint=ENDPOINT_COMPLETIONS, heartbeat_s=0.2)
    await wait_for(lambda: len(booked) == 3, what="the answer's burst, and its next piece waiting for the pace")
    await svc.on_cancel(cast(Msg, types.SimpleNamespace(data=encode_msg(CancelRequest(request_id="r1")))))
    await asyncio.sleep(0.2)  # the cut leg's rest under way
    await svc.abort_all()  # a stop right after its router's cancel
    await ended(svc)
    await replies.settled()
    chunks = replies.chunks("r1")
    assert [c.seq for c in chunks] == list(range(len(chunks))) and [c.final for c in chunks].count(True) == 1
    assert chunks[-1].final and chunks[-1].finish_reason == "abort", chunks[-1]
    assert dict(svc.outcomes) == {("agg", "abort"): 1}
    assert len(booked) == len([c for c in chunks if c.body]), "a piece booked against the pace twice"


async def test_a_final_chunk_that_fails_to_publish_once_numbered_is_followed_by_no_error_chunk(
    nc: Nats, replies: Replies, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """final()'s 500 fallback read no `closed`: a final chunk numbered (its outcome counted) whose
    publish then failed was followed by a second final chunk, the 500, counted too (a review of
    2026-12-07). Now the failure is said, and the final chunk is kept for its router to ask for."""
    svc = service(nc)
    publish = svc.publish

    async def failing(subject: str, data: bytes) -> None:
        if decode_msg(data, ResponseChunk).final:
            raise RuntimeError("the publish failed")
        await publish(subject, data)

    monkeypatch.setattr(svc, "publish", failing)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg")
    await writer.final(finish_reason="stop", usage=Usage(prompt_tokens=1))
    kept = [decode_msg(data, ResponseChunk) for data in writer.sent]
    assert [(c.seq, c.final, c.finish_reason, c.error) for c in kept] == [(0, True, "stop", None)], kept
    assert dict(svc.outcomes) == {("agg", "ok"): 1}
    said = [r for r in caplog.records if "its final chunk could not be published" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None


class CallEngine(FakeEngine):
    async def call(self, endpoint: str, body: dict[str, Any]) -> bytes:
        await asyncio.sleep(0.15)  # its heartbeat beats meanwhile
        return b'{"tokens": [1, 2, 3]}'


async def test_a_cancel_during_a_utility_calls_final_chunk_sends_one_final_chunk(
    nc: Nats, replies: Replies, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's cancel while a utility call's final chunk reaps its heartbeat: the final chunk
    with the answer went (ChunkWriter.final raises the cancellation after it), and the call's own
    `except CancelledError` then sent a second final chunk, an abort (a review of 2026-12-07)."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 2.0)  # 10 s in service: the cancel comes first
    lost: list[str] = []

    async def beat(self: ChunkWriter, period: float) -> None:  # a heartbeat publish slow to take its cancel
        while True:
            await never_answers(lost, "heartbeat")

    monkeypatch.setattr(ChunkWriter, "_beat", beat)
    svc = service(nc, CallEngine())
    await send(replies, await serving(svc, ns), "r1", heartbeat_s=0.05, endpoint=ENDPOINT_TOKENIZE)
    await wait_for(lambda: lost == ["heartbeat"], what="the final chunk's reap of the heartbeat")
    await svc.on_cancel(cast(Msg, types.SimpleNamespace(data=encode_msg(CancelRequest(request_id="r1")))))
    await ended(svc)
    await replies.settled()
    finals = [(c.finish_reason, c.error, c.body) for c in replies.chunks("r1") if c.final]
    assert finals == [(None, None, b'{"tokens": [1, 2, 3]}')], finals
    assert dict(svc.outcomes) == {("agg", "ok"): 1}


async def test_a_second_final_chunk_is_refused(nc: Nats, replies: Replies) -> None:
    svc = service(nc)
    writer = ChunkWriter(svc, replies.inbox("r1"), "r1", "w1", "agg")
    await writer.final(finish_reason="length")
    with pytest.raises(RuntimeError, match="request r1: its final chunk went already"):
        await writer.final(finish_reason="abort")
    await replies.settled()
    assert [c.finish_reason for c in replies.chunks("r1") if c.final] == ["length"]
    assert dict(svc.outcomes) == {("agg", "ok"): 1}
