"""The dispatcher with pass-through legs, against workers played by the test over a real
nats-server: events with tokens and body pieces are output (no retry after them, passed on in
order); token-less events before them (a chat stream's role chunk) are held until they come, or
dropped for the retry or the KV-transfer fallback that takes over from a failed leg; a whole
answer's `prefilled` chunk books its prefill as done, an event cut into pieces is passed on whole (a
stream ending inside one is a 502), and a leg NATS cannot carry is refused before it is sent (413
naming the payload limit, 400 for an integer no 64-bit field holds)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import GenerateRequest
from protocol.config import RouterSettings
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS, ENDPOINT_TOKENIZE, ErrorInfo
from router.dispatch import MAX_HELD_BYTES, Dispatcher
from router.leg import LegError
from router.policies import Outcome
from tests.router.test_dispatch import HB, Behaviour, Books, Worker, World, chunk, collect, job, transfer

answer_now = asyncio.Event()


@pytest.fixture
async def world(nc: Client, ns: str) -> AsyncIterator[World]:
    books = Books()
    d = Dispatcher(nc, ns, books, settings=lambda: RouterSettings(stream_heartbeat_s=HB))
    await d.start()
    yield d, books, []
    await d.stop()


async def whole_answer_in_pieces(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    await chunk(nc, msg, req, 0)  # a heartbeat
    await chunk(nc, msg, req, 1, prefilled=True)
    await asyncio.wait_for(answer_now.wait(), 5)
    await chunk(nc, msg, req, 2, body=b'{"choices":')
    await chunk(nc, msg, req, 3, body=b"[]}", final=True, finish_reason="length")


ROLE = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
TOKEN = b'{"choices":[{"index":0,"delta":{"content":"hi"}}]}'


async def event_then_die(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    await chunk(nc, msg, req, 0, events=[TOKEN], tokens=1)


def roles_then(then: str, n: int = 1) -> Behaviour:
    """A chat stream's role chunk per choice (no token), a heartbeat, then: `die` (silent), `fail`
    (vLLM's 500 for a failed KV pull, as the shim sends it), or `answer` (a token, the end)."""

    async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        roles = [ROLE.replace(b'"index":0', b'"index":%d' % i) for i in range(n)]
        await chunk(nc, msg, req, 0, events=roles)
        await chunk(nc, msg, req, 1)
        if then == "fail" and req.disagg is not None:
            await chunk(nc, msg, req, 2, final=True, error=ErrorInfo(code=500, kind="engine_error", message="x"))
        elif then != "die":
            await chunk(nc, msg, req, 2, events=[TOKEN], tokens=1)
            await chunk(nc, msg, req, 3, final=True, finish_reason="length")

    return run


async def test_a_whole_answer_books_its_prefill_done_when_told_and_comes_in_pieces(
    nc: Client, ns: str, world: World
) -> None:
    d, books, _ = world
    w = Worker(nc, ns, "w1")
    await w.serve("decode", whole_answer_in_pieces)
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, stream=False, endpoint=ENDPOINT_COMPLETIONS)
    answer_now.clear()
    running = asyncio.create_task(collect(d, j))
    for _ in range(200):
        if books.log:
            break
        await asyncio.sleep(0.01)
    assert books.log == [("prefill_done", "r1#1")], "booked on the prefilled chunk, before any answer"
    answer_now.set()
    chunks = await running
    assert b"".join(c.body for c in chunks) == b'{"choices":[]}'
    assert books.log[-1] == ("free", "r1#1")
    assert w.requests[0].stream is False, "the leg streams only when the client asked"


async def test_an_event_with_output_is_output_so_a_death_after_it_is_not_retried(
    nc: Client, ns: str, world: World
) -> None:
    d, _, _ = world
    await Worker(nc, ns, "w1").serve("decode", event_then_die)
    other = Worker(nc, ns, "w2")
    await other.serve("decode", event_then_die)
    j = job("w1", replans=[job("w2").plan])
    seen = []
    try:
        async for c in d.run(j):
            seen.append(c)
    except LegError as exc:
        assert exc.worker_silent
    assert len(seen) == 1 and other.requests == [], "a client that saw a token must not see it twice"


async def test_a_leg_that_dies_after_token_less_events_is_retried_and_its_events_dropped(
    nc: Client, ns: str, world: World
) -> None:
    """Before: a chat stream's role chunks (n=2) read as output, so the dead leg was not retried
    and the client got a role chunk and an error."""
    d, _, _ = world
    await Worker(nc, ns, "w1").serve("decode", roles_then("die", n=2))
    await Worker(nc, ns, "w2").serve("decode", roles_then("answer", n=2))
    j = job("w1", replans=[job("w2").plan])
    j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_CHAT, stream=True)
    chunks = await collect(d, j)
    roles = [ROLE, ROLE.replace(b'"index":0', b'"index":1')]
    assert [c.events for c in chunks if c.events] == [roles, [TOKEN]], "the retry's role chunks, once"
    assert j.attempts == 2 and j.first_token_at is not None


async def test_a_failed_kv_pull_after_the_role_chunk_falls_back_and_the_client_gets_one_role_chunk(
    nc: Client, ns: str
) -> None:
    """Before: vLLM 0.32's chat stream sends its role chunk before the 500 of a failed pull; the
    router took it for the first token: the pull counted as a success and nothing fell back."""
    books = Books()
    pulls: list[tuple[str, str, bool]] = []
    d = Dispatcher(
        nc, ns, books, settings=lambda: RouterSettings(stream_heartbeat_s=HB),
        on_transfer=lambda dw, pw, ok: pulls.append((dw, pw, ok)),
    )  # fmt: skip
    await d.start()
    try:
        await Worker(nc, ns, "p1").serve("prefill", transfer)
        await Worker(nc, ns, "d1").serve("decode", roles_then("fail"))
        j = job("d1", prefill="p1")
        j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_CHAT, stream=True)
        chunks = await collect(d, j)
    finally:
        await d.stop()
    assert [c.events for c in chunks if c.events] == [[ROLE], [TOKEN]]
    assert j.outcome is Outcome.FALLBACK_TRANSFER_FAILED and pulls == [("d1", "p1", False)]
    assert d.transfer_fallbacks == 1


async def test_a_leg_that_fails_after_its_role_chunk_with_nothing_to_take_over_sends_it_before_the_error(
    nc: Client, ns: str, world: World
) -> None:
    """As the engine answered: the role chunk, then the error (a 200 stream with an error event)."""
    d, _, _ = world
    await Worker(nc, ns, "w1").serve("decode", roles_then("die"))
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_CHAT, stream=True)
    seen = []
    with pytest.raises(LegError) as err:
        async for c in d.run(j):
            seen.append(c)
    assert err.value.worker_silent and [c.events for c in seen] == [[ROLE]]


async def test_a_leg_nats_cannot_carry_is_refused_before_it_is_sent(nc: Client, ns: str, world: World) -> None:
    d, books, _ = world
    w = Worker(nc, ns, "w1")
    await w.serve("decode", whole_answer_in_pieces)
    big = job("w1")
    big.request = msgspec.structs.replace(big.request, token_ids=[70000] * (nc.max_payload // 4))
    try:
        await collect(d, big)
        raise AssertionError("a leg over max_payload was sent")
    except LegError as exc:
        assert exc.code == 413 and str(nc.max_payload) in exc.message and exc.refused
    answer_now.set()
    huge = job("w1")
    huge.request = msgspec.structs.replace(huge.request, params={"logit_bias": {"5": 2**70}})
    try:
        await collect(d, huge)
        raise AssertionError("an integer beyond 64 bits was sent")
    except LegError as exc:
        assert exc.code == 400 and exc.refused
    assert w.requests == [] and books.log == [("free", "r1#1"), ("free", "r1#1")]


def event_in_pieces(final: asyncio.Event) -> Behaviour:
    async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, events=[b'{"a":'], tokens=2, continued=True)
        await chunk(nc, msg, req, 1)  # a heartbeat between the pieces
        await chunk(nc, msg, req, 2, events=[b'"bc'], continued=True)
        await chunk(nc, msg, req, 3, events=[b'd"}', b'{"e":1}'], tokens=1)
        await asyncio.wait_for(final.wait(), 5)
        await chunk(nc, msg, req, 4, final=True, finish_reason="length")

    return run


async def cut_then_final(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    await chunk(nc, msg, req, 0, events=[b'{"a":'], tokens=1, continued=True)
    await chunk(nc, msg, req, 1, final=True, finish_reason="stop")


async def test_an_event_cut_into_pieces_is_passed_on_whole_with_its_tokens(nc: Client, ns: str, world: World) -> None:
    d, books, _ = world
    final = asyncio.Event()  # held back: its arrival frees the booking (the engine is done with it)
    await Worker(nc, ns, "w1").serve("decode", event_in_pieces(final))
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_COMPLETIONS, stream=True)
    chunks = []
    async for c in d.run(j):
        chunks.append(c)
        if c.events:
            assert books.log == [("prefill_done", "r1#1")], "the first token is when the whole event arrives"
            final.set()
    assert [(c.events, c.tokens) for c in chunks if c.events] == [([b'{"a":"bcd"}', b'{"e":1}'], 3)]
    assert not any(c.continued for c in chunks)
    assert books.log == [("prefill_done", "r1#1"), ("free", "r1#1")]


async def test_a_stream_that_ends_inside_a_cut_event_is_an_error(nc: Client, ns: str, world: World) -> None:
    d, _, _ = world
    await Worker(nc, ns, "w1").serve("decode", cut_then_final)
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_COMPLETIONS, stream=True)
    with pytest.raises(LegError) as err:
        await collect(d, j)
    assert err.value.code == 502 and err.value.kind == "malformed_chunk"


def endless(**fields: object) -> Behaviour:
    """A worker that sends chunks of `fields` and never the last: an event every chunk continues,
    or a whole answer whose last piece never comes."""

    async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        seq = 0
        while True:
            await chunk(nc, msg, req, seq, **fields)
            seq += 1
            await asyncio.sleep(0.001)

    return run


async def test_an_event_that_never_ends_is_an_error_not_a_growing_buffer(
    nc: Client, ns: str, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The router keeps a cut event until its end comes: a worker that never sends it grew the
    # replica's memory until the request's deadline.
    monkeypatch.setattr("router.leg.MAX_ANSWER_BYTES", 1 << 20)
    d, _, _ = world
    served = Worker(nc, ns, "w1")
    await served.serve("decode", endless(events=[b"x" * 65536], tokens=0, continued=True))
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_COMPLETIONS, stream=True)
    try:
        with pytest.raises(LegError) as err:
            await asyncio.wait_for(collect(d, j), 10)
        assert (
            err.value.code == 502 and err.value.kind == "malformed_chunk" and "cut across chunks" in err.value.message
        )
    finally:
        for t in served.tasks:
            t.cancel()


async def test_a_utility_answer_that_never_ends_is_an_error_not_a_growing_buffer(
    nc: Client, ns: str, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("router.dispatch.MAX_ANSWER_BYTES", 1 << 20)
    d, _, _ = world
    served = Worker(nc, ns, "w1")
    await served.serve("agg", endless(body=b"x" * 65536))
    req = GenerateRequest(request_id="t1", model="m", token_ids=[], endpoint=ENDPOINT_TOKENIZE)
    try:
        with pytest.raises(LegError) as err:
            await d.call("w1", "agg", req, time.time() + 10)
        assert err.value.code == 502 and err.value.kind == "answer_too_large"
    finally:
        for t in served.tasks:
            t.cancel()


ROLE = b'{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
EMPTY = b'{"choices":[{"index":0,"delta":{"content":""}}]}' + b" " * 1000  # no text: counted 0 tokens


async def test_token_less_events_are_held_only_up_to_a_bound(nc: Client, ns: str, world: World) -> None:
    """Before: an engine streaming empty deltas (text held back for a stop string) had every one held
    until its first token, past the slow-reader bound (1 GB in a repro) and with the client waiting."""
    d, _, _ = world

    async def empty_deltas(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, events=[ROLE])
        for seq in range(1, 201):  # 200 kB of token-less events
            await chunk(nc, msg, req, seq, events=[EMPTY])
        await chunk(nc, msg, req, 201, events=[b'{"choices":[{"index":0,"delta":{"content":"hi"}}]}'], tokens=1)
        await chunk(nc, msg, req, 202, final=True, finish_reason="length")

    await Worker(nc, ns, "w1").serve("decode", empty_deltas)
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_CHAT, stream=True)
    stream = d.run(j)
    first = await anext(stream)
    assert first.events == [ROLE] and j.first_token_at is not None
    assert j.held_bytes <= MAX_HELD_BYTES + len(EMPTY)  # held up to the bound, not to the first token
    rest = [c async for c in stream]
    assert sum(len(c.events) for c in [first, *rest]) == 202  # nothing lost, nothing twice


async def test_a_stream_ending_with_no_counted_token_reports_its_pull(nc: Client, ns: str) -> None:
    """Before: an EOS-first chat stream (role chunk, an empty delta with finish_reason, the end)
    never told transfer health its pull worked, as the same request unstreamed does."""
    pulls: list[tuple[str, str, bool]] = []
    d = Dispatcher(
        nc, ns, Books(), settings=lambda: RouterSettings(stream_heartbeat_s=HB),
        on_transfer=lambda dw, pw, ok: pulls.append((dw, pw, ok)),
    )  # fmt: skip
    await d.start()
    try:

        async def eos_first(nc: Client, msg: Msg, req: GenerateRequest) -> None:
            await chunk(nc, msg, req, 0, events=[ROLE])
            await chunk(
                nc, msg, req, 1, events=[b'{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}']
            )
            await chunk(nc, msg, req, 2, final=True, finish_reason="stop")

        await Worker(nc, ns, "p1").serve("prefill", transfer)
        await Worker(nc, ns, "d1").serve("decode", eos_first)
        j = job("d1", prefill="p1")
        j.request = msgspec.structs.replace(j.request, endpoint=ENDPOINT_CHAT, stream=True)
        chunks = await collect(d, j)
        assert sum(len(c.events) for c in chunks) == 2 and pulls == [("d1", "p1", True)]
    finally:
        await d.stop()
