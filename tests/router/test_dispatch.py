"""The dispatcher against workers played by the test over a real nats-server: heartbeats, silence,
no responders, an engine's refusal on the prefill leg, and the bookings each attempt holds."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import CancelRequest, GenerateRequest, ResponseChunk, TransferHandle, decode_msg, encode_msg, subjects
from protocol.config import RouterSettings
from protocol.messages import ErrorInfo
from router.api_errors import leg_error
from router.disagg import RoutePlan
from router.dispatch import CANCEL_AGAIN_S, DEADLINE_PASSED, Dispatcher, Job
from router.leg import MAX_RESUMES, LegError
from router.policies import Outcome, Path
from router.tracing import RequestTracer
from runtime.loop_watch import LoopWatch
from runtime.nats_flush import flush
from tests.router.builders import cand, ctx
from tests.router.polling import until

HB = 0.1  # heartbeat period asked of workers; a leg silent for 3 of them ends


class Books:
    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.served: list[str] = []  # bookings freed by their decode leg's clean final chunk

    def rebook_bypass(self, key: str, plan: RoutePlan) -> None:
        self.log.append(("rebook_bypass", key))

    def prefill_done(self, key: str, worker: str | None = None) -> None:
        self.log.append(("prefill_done", key) if worker is None else ("prefill_done", key, worker))

    def free(self, key: str, *, served: bool = False) -> None:
        self.log.append(("free", key))
        if served:
            self.served.append(key)


Behaviour = Callable[[Client, Msg, GenerateRequest], Coroutine[Any, Any, None]]


async def chunk(nc: Client, msg: Msg, req: GenerateRequest, seq: int, **fields: object) -> None:
    await nc.publish(msg.reply, encode_msg(ResponseChunk(request_id=req.request_id, seq=seq, **fields)))  # type: ignore[arg-type]


class Worker:
    """Serves {ns}.gen.{role}.{name} with a behaviour; records what it was asked."""

    def __init__(self, nc: Client, ns: str, name: str) -> None:
        self.nc, self.ns, self.name = nc, ns, name
        self.requests: list[GenerateRequest] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def serve(self, role: str, behaviour: Behaviour) -> None:
        async def on(msg: Msg) -> None:
            req = decode_msg(msg.data, GenerateRequest)
            self.requests.append(req)
            self.tasks.append(asyncio.create_task(behaviour(self.nc, msg, req)))

        await self.nc.subscribe(subjects.gen(self.ns, role, self.name), cb=on)
        await flush(self.nc)


async def answer(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    await chunk(nc, msg, req, 0, token_ids=[5])
    await chunk(nc, msg, req, 1, token_ids=[6], final=True, finish_reason="length")


def heartbeats_then_answer(seconds: float) -> Behaviour:
    async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        seq, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            await asyncio.sleep(req.heartbeat_s)
            await chunk(nc, msg, req, seq)
            seq += 1
        await chunk(nc, msg, req, seq, token_ids=[5], final=True, finish_reason="length")

    return run


async def one_token_then_die(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    await chunk(nc, msg, req, 0, token_ids=[5])


async def refuse(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    error = ErrorInfo(code=400, kind="BadRequestError", message="This model's maximum context length is 2048 tokens")
    await chunk(nc, msg, req, 0, final=True, error=error)


async def transfer(nc: Client, msg: Msg, req: GenerateRequest) -> None:
    handle = TransferHandle(engine="vllm", params={"remote_block_ids": [1]})
    await chunk(nc, msg, req, 0, final=True, finish_reason="length", transfer=handle)


World = tuple[Dispatcher, Books, list[tuple[str, str]]]


@pytest.fixture
async def world(nc: Client, ns: str) -> AsyncIterator[World]:
    books = Books()
    unreachable: list[tuple[str, str]] = []
    d = Dispatcher(
        nc, ns, books, settings=lambda: RouterSettings(stream_heartbeat_s=HB),
        on_unreachable=lambda w, why: unreachable.append((w, why)),
    )  # fmt: skip
    await d.start()
    yield d, books, unreachable
    await d.stop()


def job(*decode: str, prefill: str | None = None, replans: list[RoutePlan] | None = None) -> Job:
    c = ctx(64, [cand(w) for w in decode], [cand(prefill, "prefill")] if prefill else [])
    d = c.decode_pool[0]
    p = c.prefill_pool[0] if prefill else None
    path = Path.REMOTE if prefill else Path.BYPASS
    plan = RoutePlan(c, d, p, path, Outcome.DECLINED_POLICY, "", c.decode_pool, c.prefill_pool, key="r1#1")
    queue = list(replans or [])
    req = GenerateRequest(request_id="r1", model="m", token_ids=list(range(64)))
    return Job(
        request=req, plan=plan, replan=lambda ex: queue.pop(0) if queue else None, deadline=time.monotonic() + 30
    )


async def collect(d: Dispatcher, j: Job) -> list[ResponseChunk]:
    return [c async for c in d.run(j)]


async def test_heartbeats_keep_a_long_prefill_alive_and_are_not_passed_on(nc: Client, ns: str, world: World) -> None:
    d, books, unreachable = world
    w = Worker(nc, ns, "w1")
    await w.serve("decode", heartbeats_then_answer(6 * HB))  # twice the silence limit, in heartbeats
    chunks = await collect(d, job("w1"))
    assert [c.token_ids for c in chunks] == [[5]] and chunks[-1].final
    assert w.requests[0].heartbeat_s == HB
    assert unreachable == [] and books.log[-1] == ("free", "r1#1")


def _worker_on_its_own_loop(
    url: str, ns: str, behaviour: Behaviour, ready: threading.Event, stop: threading.Event
) -> None:
    async def main() -> None:
        nc = await nats.connect(url)
        await Worker(nc, ns, "w1").serve("decode", behaviour)
        ready.set()
        await asyncio.to_thread(stop.wait)
        await nc.close()

    asyncio.run(main())


@pytest.fixture
async def watch() -> AsyncIterator[LoopWatch]:
    w = LoopWatch()
    w.start()
    yield w
    await w.stop()


async def test_a_stall_of_the_routers_own_loop_is_no_silence_of_the_worker(
    nats_url: str, ns: str, world: World, watch: LoopWatch
) -> None:
    """The worker heartbeats from its own thread while the router's loop is blocked past the
    silence limit: its timer then runs before the loop reads the heartbeats in its socket, which
    ended a healthy leg as worker_silent and marked the worker unreachable."""
    d, _, unreachable = world
    d.awake_for = watch.awake_for
    ready, stop = threading.Event(), threading.Event()
    worker = threading.Thread(
        target=_worker_on_its_own_loop, args=(nats_url, ns, heartbeats_then_answer(12 * HB), ready, stop)
    )
    worker.start()
    try:
        assert await asyncio.to_thread(ready.wait, 5)
        first = asyncio.ensure_future(collect(d, job("w1")))
        await asyncio.sleep(2.5 * HB)  # the leg is open and heartbeats flow
        time.sleep(6 * HB)  # the router's loop stalls for twice the silence limit (a GC pause, a long step)
        chunks = await first
        assert [c.token_ids for c in chunks] == [[5]] and chunks[-1].final
        assert unreachable == []
    finally:
        stop.set()
        await asyncio.to_thread(worker.join)


async def test_deadlines_go_out_on_the_workers_clock(nc: Client, ns: str) -> None:
    """Workers whose clocks are 700 s ahead (past the request timeout) check each deadline on that
    clock, as the shim does: sent on the router's, every leg they got was a 504."""
    ahead = 700.0

    def checking(then: Behaviour) -> Behaviour:
        async def run(nc: Client, msg: Msg, req: GenerateRequest) -> None:
            if req.deadline is not None and req.deadline <= time.time() + ahead:
                error = ErrorInfo(code=504, kind="deadline", message="the request's deadline passed")
                await chunk(nc, msg, req, 0, final=True, error=error)
            else:
                await then(nc, msg, req)

        return run

    books = Books()
    d = Dispatcher(nc, ns, books, settings=lambda: RouterSettings(stream_heartbeat_s=HB), clock_offset=lambda w: ahead)
    await d.start()
    try:
        await Worker(nc, ns, "w1").serve("decode", checking(answer))
        await Worker(nc, ns, "p1").serve("prefill", checking(transfer))
        chunks = await collect(d, job("w1", prefill="p1"))
        assert [c.token_ids for c in chunks] == [[5], [6]]
        assert ("rebook_bypass", "r1#1") not in books.log  # the prefill leg served, no local fallback
        utility = GenerateRequest(request_id="u", model="m", token_ids=[], stream=False, endpoint="tokenize")
        assert await d.call("w1", "decode", utility, time.monotonic() + 30) == b""  # not a 504
    finally:
        await d.stop()


async def test_a_step_of_the_routers_wall_clock_ends_no_leg(
    nc: Client, ns: str, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's wall clock steps 60 s forward (NTP, a VM resumed) while a leg with 30 s left runs:
    timed on it, the leg ended at once with a 504."""
    d, _, _ = world
    w = Worker(nc, ns, "w1")
    await w.serve("decode", heartbeats_then_answer(4 * HB))
    wall = time.time
    stepped = asyncio.get_running_loop().call_later(HB, lambda: monkeypatch.setattr(time, "time", lambda: wall() + 60))
    try:
        chunks = await collect(d, job("w1"))
    finally:
        stepped.cancel()
    assert [c.token_ids for c in chunks] == [[5]] and chunks[-1].final
    assert w.requests[0].deadline == pytest.approx(wall() + 30, abs=1)  # the worker still gets Unix time


async def test_a_router_loop_that_keeps_stalling_still_finds_a_silent_worker(nc: Client, ns: str, world: World) -> None:
    """Its stalls excuse one more silence window at most: under overload (a tick late every time)
    a dead worker's leg would otherwise wait out the request's deadline."""
    d, _, unreachable = world
    d.awake_for = lambda: 0.0  # never awake for long
    w = Worker(nc, ns, "w1")

    async def say_nothing(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        return None

    await w.serve("decode", say_nothing)
    started = time.monotonic()
    with pytest.raises(LegError) as err:
        await collect(d, job("w1"))  # its deadline is 30 s away
    assert err.value.kind == "worker_silent" and time.monotonic() - started < 10 * 3 * HB
    assert [u[0] for u in unreachable] == ["w1"]


async def test_a_worker_silent_mid_stream_is_asked_again_then_ends_the_stream(
    nc: Client, ns: str, world: World
) -> None:
    # After the first token silence may be chunks lost on the way: each of MAX_RESUMES asks waits
    # three more periods (the docstring said three periods in all; the test allowed 13)
    d, books, unreachable = world
    await Worker(nc, ns, "w1").serve("decode", one_token_then_die)
    j = job("w1")
    seen: list[ResponseChunk] = []
    with pytest.raises(LegError) as err:
        async for c in d.run(j):
            seen.append(c)
            last = time.monotonic()
    waited = time.monotonic() - last
    assert [c.token_ids for c in seen] == [[5]]
    assert err.value.kind == "worker_silent" and not err.value.retryable  # a token went out already
    assert d.resumes == MAX_RESUMES
    assert (1 + MAX_RESUMES) * 3 * HB <= waited < (1 + MAX_RESUMES) * 3 * HB + 1.0
    assert unreachable and unreachable[0][0] == "w1"
    assert books.log == [("prefill_done", "r1#1"), ("free", "r1#1")]


async def test_a_lost_resend_is_asked_again_while_later_chunks_keep_coming(nc: Client, ns: str, world: World) -> None:
    """Chunk 2 is lost and so is the first ask for it: the later chunks, dropped while it waits,
    each restarted the silence, so the client got nothing until the worker had ended the leg."""
    d, _, _ = world
    total = 40
    sent: list[ResponseChunk] = []
    asks: list[float] = []

    async def streamer(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.resume is not None:
            asks.append(time.monotonic())
            if len(asks) > 1:  # the first ask is lost on the way
                for c in sent[req.resume :]:
                    await nc.publish(msg.reply, encode_msg(c))
            return
        for i in range(total):
            last = i == total - 1
            c = ResponseChunk(request_id=req.request_id, seq=i, token_ids=[100 + i], final=last,
                              finish_reason="length" if last else None)  # fmt: skip
            sent.append(c)
            if i != 2:
                await nc.publish(msg.reply, encode_msg(c))
            await asyncio.sleep(0.05)

    await Worker(nc, ns, "w1").serve("decode", streamer)
    arrivals: list[float] = []
    tokens: list[int] = []
    async for c in d.run(job("w1")):
        arrivals.append(time.monotonic())
        tokens += c.token_ids
    assert tokens == [100 + i for i in range(total)]
    assert len(asks) == 2
    stall = max(b - a for a, b in itertools.pairwise(arrivals))
    assert stall < 3 * HB + 0.5  # the second ask went out three periods after the first, not at the leg's end
    assert asks[1] - asks[0] < 3 * HB + 0.5


async def test_no_responder_marks_the_worker_and_retries_on_the_next_plan(nc: Client, ns: str, world: World) -> None:
    d, books, unreachable = world
    await Worker(nc, ns, "w2").serve("decode", answer)
    retry = job("w2").plan
    retry.key = "r1#2"
    chunks = await collect(d, job("dead", replans=[retry]))
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert unreachable == [("dead", "no responder on its subject")]
    assert ("free", "r1#1") in books.log and books.log[-1] == ("free", "r1#2")


async def test_a_body_nested_too_deeply_to_encode_is_the_clients_400(nc: Client, ns: str, world: World) -> None:
    """The HTTP layer's JSON decode took it just under the recursion limit; the leg's encode, a few
    frames deeper, raised RecursionError: a 500 with a traceback where the client's error is a 400."""
    d, books, _ = world
    w = Worker(nc, ns, "w1")
    await w.serve("decode", answer)
    deep: list[object] = []
    for _ in range(3000):
        deep = [deep]
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, params={"prompt": [1], "x": deep})
    with pytest.raises(LegError) as err:
        await collect(d, j)
    assert (err.value.code, err.value.kind, err.value.retryable) == (400, "bad_request", False)
    assert "nested too deeply" in err.value.message
    assert w.requests == [] and books.log == [("free", "r1#1")]


async def test_a_refusal_of_both_engines_is_the_decode_engines_answer(nc: Client, ns: str, world: World) -> None:
    d, books, _ = world
    await Worker(nc, ns, "p1").serve("prefill", refuse)
    decode = Worker(nc, ns, "d1")

    async def refuse_too(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        error = ErrorInfo(code=400, kind="BadRequestError", message="the decode engine's own words")
        await chunk(nc, msg, req, 0, final=True, error=error)

    await decode.serve("decode", refuse_too)
    j = job("d1", prefill="p1")
    with pytest.raises(LegError) as err:
        await collect(d, j)
    assert (err.value.code, err.value.worker, err.value.message) == (400, "d1", "the decode engine's own words")
    assert [r.annotations for r in decode.requests] == [["bypass_remote_prefill"]]  # asked once, as a bypass
    # nothing fell back: it keeps its plan's outcome, as a request refused on any path does
    assert j.outcome is Outcome.DECLINED_POLICY and (d.refusal_fallbacks, d.fallbacks) == (0, 0)
    assert ("rebook_bypass", "r1#1") in books.log and d.refusals_overruled == {}


async def test_a_request_the_prefill_engine_alone_refuses_is_served_by_the_decode_engine_and_said_once(
    nc: Client, ns: str, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    d, books, _ = world
    caplog.set_level(logging.WARNING, logger="router.dispatch")
    await Worker(nc, ns, "p1").serve("prefill", refuse)
    decode = Worker(nc, ns, "d1")
    await decode.serve("decode", answer)
    for _ in range(2):
        j = job("d1", prefill="p1")
        assert [c.token_ids for c in await collect(d, j)] == [[5], [6]]
        assert j.outcome is Outcome.FALLBACK_PREFILL_REFUSED and j.path is Path.BYPASS
    assert [r.annotations for r in decode.requests] == [["bypass_remote_prefill"]] * 2
    assert (d.refusal_fallbacks, d.fallbacks, d.refusals_overruled) == (2, 0, {"p1": 2})
    assert books.log.count(("rebook_bypass", "r1#1")) == 2
    said = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
    assert len(said) == 1 and "p1" in said[0] and "d1" in said[0] and "maximum context length" in said[0], said
    d.worker_gone("p1")  # its series goes with it
    assert d.refusals_overruled == {}


async def test_a_leg_past_its_requests_deadline_is_not_sent(nc: Client, ns: str, world: World) -> None:
    """A request whose deadline passed before its leg went out (this router's loop stalled) is a 504
    at once: until 2026-12-07 the leg went with a negative budget, for its shim to answer 504."""
    d, books, _ = world
    w = Worker(nc, ns, "w1")
    await w.serve("decode", answer)
    j = job("w1")
    j.deadline = time.monotonic() - 0.4
    with pytest.raises(LegError) as err:
        await collect(d, j)
    assert (err.value.code, err.value.kind, err.value.retryable) == (504, DEADLINE_PASSED, False)
    assert "deadline passed 0.4" in err.value.message
    assert leg_error(err.value).message == "the request's deadline passed"  # the client's, as any 504's
    await flush(nc)
    await asyncio.sleep(0.1)  # a leg sent would have reached its worker's callback by now
    assert w.requests == [] and books.log == [("free", "r1#1")]


async def test_a_retry_begun_past_the_deadline_is_not_sent(
    nc: Client, ns: str, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A leg that fails past its request's deadline ends the request with its own error: no retry
    is begun, counted or logged. Until 2026-12-07 (cf68c67) the retry was counted ("retrying on w2"),
    then refused as w2's `deadline_passed`, a worker sent nothing; this test asserted that count."""
    d, _, _ = world
    j = job("w1", replans=[job("w2").plan])

    async def stall_then_fail(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        j.deadline = time.monotonic() - 2.0  # a stall of the router's loop used the request's time up
        await chunk(nc, msg, req, 0, final=True, error=ErrorInfo(code=500, kind="engine_error", message="boom"))

    await Worker(nc, ns, "w1").serve("decode", stall_then_fail)
    second = Worker(nc, ns, "w2")
    await second.serve("decode", answer)
    caplog.set_level(logging.INFO, logger="router")
    with pytest.raises(LegError) as err:
        await collect(d, j)
    assert (err.value.code, err.value.kind, err.value.worker, err.value.role) == (500, "engine_error", "w1", "decode")
    await flush(nc)
    await asyncio.sleep(0.1)
    assert second.requests == [] and d.retries == 0
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


async def test_a_prefill_leg_that_runs_out_the_requests_time_is_the_clients_504_without_a_fallback(
    nc: Client, ns: str, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill leg that hangs until the request's deadline (under prefill_timeout_s) ends the
    request with its own 504, naming the prefill worker that used the time. Until 2026-12-07 a
    fallback was counted and logged ("falling back to local prefill on d1"), its decode leg then
    refused as d1's `deadline_passed`, a worker sent nothing."""
    d, books, _ = world
    await Worker(nc, ns, "p1").serve("prefill", heartbeats_then_answer(60))  # heartbeats, no answer
    decode = Worker(nc, ns, "d1")
    await decode.serve("decode", answer)
    j = job("d1", prefill="p1")
    j.deadline = time.monotonic() + 0.5  # well under prefill_timeout_s: the request's deadline ends the leg
    caplog.set_level(logging.INFO, logger="router")
    with pytest.raises(LegError) as err:
        await collect(d, j)
    assert (err.value.code, err.value.kind, err.value.worker, err.value.role) == (504, "timeout", "p1", "prefill")
    assert leg_error(err.value).code == 504
    await flush(nc)
    await asyncio.sleep(0.1)
    assert decode.requests == [] and d.fallbacks == 0 and d.retries == 0
    assert j.outcome is Outcome.DECLINED_POLICY and not j.fallback and j.path is Path.REMOTE
    assert ("rebook_bypass", "r1#1") not in books.log and books.log[-1] == ("free", "r1#1")
    assert not [r for r in caplog.records if "falling back" in r.getMessage()]


async def test_a_failed_kv_pull_past_the_deadline_is_judged_and_not_fallen_back_from(nc: Client, ns: str) -> None:
    books = Books()
    pulls: list[tuple[str, str, bool]] = []
    d = Dispatcher(
        nc, ns, books, settings=lambda: RouterSettings(stream_heartbeat_s=HB),
        on_transfer=lambda decode, prefill, ok: pulls.append((decode, prefill, ok)),
    )  # fmt: skip
    await d.start()
    await Worker(nc, ns, "p1").serve("prefill", transfer)
    j = job("d1", prefill="p1")

    async def stall_then_pull_fails(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        j.deadline = time.monotonic() - 2.0  # a stall of the router's loop used the request's time up
        error = ErrorInfo(code=500, kind="engine_error", message="KV load failed")
        await chunk(nc, msg, req, 0, final=True, error=error)

    decode = Worker(nc, ns, "d1")
    await decode.serve("decode", stall_then_pull_fails)
    try:
        with pytest.raises(LegError) as err:
            await collect(d, j)
    finally:
        await d.stop()
    assert (err.value.code, err.value.worker, err.value.message) == (500, "d1", "KV load failed")
    assert pulls == [("d1", "p1", False)] and len(decode.requests) == 1 and d.transfer_fallbacks == 0
    assert j.outcome is Outcome.DECLINED_POLICY and ("rebook_bypass", "r1#1") not in books.log


async def test_a_legs_timeout_says_its_own_deadline_not_the_last_wait(nc: Client, ns: str, world: World) -> None:
    d, _, _ = world
    await Worker(nc, ns, "w1").serve("decode", heartbeats_then_answer(60))  # heartbeats, no answer
    j = job("w1")
    j.deadline = time.monotonic() + 1.0
    with pytest.raises(LegError) as err:
        await collect(d, j)
    said = re.search(r"([0-9.]+)s", err.value.message)  # "no answer by its deadline, 1.00s after it was sent"
    assert err.value.code == 504 and said is not None and 0.95 <= float(said[1]) < 2.0, err.value.message
    assert (err.value.kind, err.value.role) == ("timeout", "decode")  # each read waited a heartbeat (0.1 s) at most


async def test_a_silent_prefill_worker_falls_back_to_local_prefill_within_three_heartbeats(
    nc: Client, ns: str, world: World
) -> None:
    d, books, unreachable = world

    async def hang(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await asyncio.sleep(60)

    await Worker(nc, ns, "p1").serve("prefill", hang)
    decode = Worker(nc, ns, "d1")
    await decode.serve("decode", answer)
    j = job("d1", prefill="p1")
    start = time.monotonic()
    chunks = await collect(d, j)
    assert time.monotonic() - start < 3 * HB + 1.0
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert j.outcome is Outcome.FALLBACK_PREFILL_FAILED and j.path is Path.BYPASS
    assert decode.requests[0].disagg is None and "bypass_remote_prefill" in decode.requests[0].annotations
    assert ("rebook_bypass", "r1#1") in books.log and unreachable[0][0] == "p1"


async def test_the_transfer_handle_reaches_the_decode_leg(nc: Client, ns: str, world: World) -> None:
    d, books, _ = world
    await Worker(nc, ns, "p1").serve("prefill", transfer)
    decode = Worker(nc, ns, "d1")
    await decode.serve("decode", answer)
    await collect(d, job("d1", prefill="p1"))
    assert decode.requests[0].disagg is not None and decode.requests[0].disagg.params == {"remote_block_ids": [1]}
    assert books.log[0] == ("prefill_done", "r1#1", "p1")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_remote_prefill_leg_ends_the_prefill_workers_part_only(
    nc: Client, ns: str, world: World, stream: bool
) -> None:
    """The decode worker's blocks count until its own first token, or a whole answer's `prefilled`:
    its engine may keep the request waiting for KV room long after the prefill worker is done
    (bookings audit, D1)."""
    d, books, _ = world
    await Worker(nc, ns, "p1").serve("prefill", transfer)
    at_decode_leg: list[list[tuple[str, ...]]] = []

    async def decode(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        at_decode_leg.append(list(books.log))
        first: dict[str, object] = {"token_ids": [5]} if stream else {"prefilled": True}  # a whole answer's mark
        await chunk(nc, msg, req, 0, **first)
        for _ in range(200):  # the router reads it: a final chunk ahead of that would free the booking first
            if len(books.log) > 1:
                break
            await asyncio.sleep(0.01)
        await chunk(nc, msg, req, 1, token_ids=[6], final=True, finish_reason="length")

    await Worker(nc, ns, "d1").serve("decode", decode)
    j = job("d1", prefill="p1")
    j.request = msgspec.structs.replace(j.request, stream=stream)
    await collect(d, j)
    assert at_decode_leg == [[("prefill_done", "r1#1", "p1")]], "the decode worker's booking outlives the prefill leg"
    assert books.log == [("prefill_done", "r1#1", "p1"), ("prefill_done", "r1#1"), ("free", "r1#1")]


class Replaying:
    """A worker that loses chunks on the way (as a dying NATS node would) and sends them again when
    asked (GenerateRequest.resume)."""

    def __init__(self, lose: set[int], stop_after: int | None = None) -> None:
        self.lose = lose
        self.stop_after = stop_after
        self.sent: list[ResponseChunk] = []
        self.resumes: list[int] = []

    def chunks(self, req: GenerateRequest) -> list[ResponseChunk]:
        toks = [ResponseChunk(request_id=req.request_id, seq=i, token_ids=[10 + i]) for i in range(5)]
        return [*toks, ResponseChunk(request_id=req.request_id, seq=5, final=True, finish_reason="length")]

    async def __call__(self, nc: Client, msg: Msg, req: GenerateRequest) -> None:
        all_chunks = self.chunks(req)
        if req.resume is not None:
            self.resumes.append(req.resume)
            for c in all_chunks[req.resume :]:
                await nc.publish(msg.reply, encode_msg(c))
            return
        for c in all_chunks[: self.stop_after]:
            if c.seq not in self.lose:
                await nc.publish(msg.reply, encode_msg(c))


async def test_a_chunk_lost_mid_stream_is_asked_for_again_and_the_stream_completes(
    nc: Client, ns: str, world: World
) -> None:
    d, _, unreachable = world
    worker = Replaying(lose={2})
    await Worker(nc, ns, "w1").serve("decode", worker)
    chunks = await collect(d, job("w1"))
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14] and chunks[-1].final
    assert worker.resumes == [2] and d.resumes == 1 and unreachable == []


async def test_lost_last_chunks_are_asked_for_after_silence(nc: Client, ns: str, world: World) -> None:
    d, _, _ = world
    worker = Replaying(lose=set(), stop_after=3)  # tokens 0-2 arrive, then nothing: the rest was lost
    await Worker(nc, ns, "w1").serve("decode", worker)
    chunks = await collect(d, job("w1"))
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert worker.resumes == [3]


class HeartbeatsThenWhole(Replaying):
    """A whole answer: heartbeats, of which a run longer than the silence limit is lost, then the body."""

    def chunks(self, req: GenerateRequest) -> list[ResponseChunk]:
        beats = [ResponseChunk(request_id=req.request_id, seq=i) for i in range(8)]
        body = b'{"choices": []}'
        return [*beats, ResponseChunk(request_id=req.request_id, seq=8, final=True, finish_reason="length", body=body)]

    async def __call__(self, nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.resume is not None:
            await super().__call__(nc, msg, req)
            return
        for c in self.chunks(req):
            if c.seq not in self.lose:
                await nc.publish(msg.reply, encode_msg(c))
            await asyncio.sleep(req.heartbeat_s)


async def test_a_whole_answer_that_lost_heartbeats_is_asked_again_not_failed(nc: Client, ns: str, world: World) -> None:
    d, _, unreachable = world
    worker = HeartbeatsThenWhole(lose={2, 3, 4, 5, 6, 7, 8})  # 0.7 s of chunks lost, the body among them
    await Worker(nc, ns, "w1").serve("decode", worker)
    j = job("w1")
    j.request = msgspec.structs.replace(j.request, stream=False)
    chunks = await collect(d, j)
    assert chunks[-1].final and chunks[-1].body == b'{"choices": []}'
    assert worker.resumes and unreachable == []


async def test_a_worker_that_no_longer_has_the_chunks_ends_the_stream_with_its_error(
    nc: Client, ns: str, world: World
) -> None:
    d, _, _ = world

    async def forgetful(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.resume is not None:
            error = ErrorInfo(code=410, kind="gone", message="no chunks from 1 to send again")
            await chunk(nc, msg, req, req.resume, final=True, error=error)
            return
        await chunk(nc, msg, req, 0, token_ids=[5])
        await chunk(nc, msg, req, 2, token_ids=[7])  # chunk 1 lost

    await Worker(nc, ns, "w1").serve("decode", forgetful)
    with pytest.raises(LegError) as err:
        await collect(d, job("w1"))
    assert err.value.code == 410 and not err.value.refused


async def test_a_failed_kv_pull_falls_back_and_its_rebooked_booking_is_freed(nc: Client, ns: str, world: World) -> None:
    """The decode engine's 500 for a failed pull comes as a final error chunk: freeing the booking
    there (the early free at a leg's final chunk) left the fallback's re-booking held for good
    (review of 2026-12-04)."""
    d, books, _ = world
    await Worker(nc, ns, "p1").serve("prefill", transfer)

    async def pull_fails_then_bypass(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.disagg is not None:  # the engine's 500 as the shim sends it: a final error chunk
            error = ErrorInfo(code=500, kind="engine_error", message="KV load failed")
            await chunk(nc, msg, req, 0, final=True, error=error)
        else:
            await answer(nc, msg, req)

    await Worker(nc, ns, "d1").serve("decode", pull_fails_then_bypass)
    j = job("d1", prefill="p1")
    chunks = await collect(d, j)
    assert [c.token_ids for c in chunks] == [[5], [6]] and j.outcome is Outcome.FALLBACK_TRANSFER_FAILED
    rebook = books.log.index(("rebook_bypass", "r1#1"))
    assert ("free", "r1#1") in books.log[rebook:], books.log  # freed after the rebook, not only before it


async def test_a_cancel_lost_on_the_way_is_sent_again_on_the_legs_late_chunks(
    nc: Client, ns: str, world: World
) -> None:
    """The client leaves while the worker's shim has no subscription on its cancel subject (after a
    NATS outage nats-py sends the router's reconnect buffer, the cancel in it, before the shim has
    subscribed again): NATS drops the cancel. The leg's later chunks were dropped here as late, so
    its engine generated for nobody until the deadline (outage audit: ~37 s of 8000 tokens). They
    now send the cancel again, once per CANCEL_AGAIN_S however many come, not stopped by a
    no-responder answer on the leg's subject, and no more once the leg's final chunk has come."""
    d, _, _ = world
    cancels: list[str] = []
    sent = [0]
    ended = asyncio.Event()
    replies: list[str] = []

    async def streams_until_told(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        replies.append(msg.reply)
        while not ended.is_set():
            await chunk(nc, msg, req, sent[0], token_ids=[sent[0]])
            sent[0] += 1
            await asyncio.sleep(0.01)
        await chunk(nc, msg, req, sent[0], final=True, finish_reason="abort")
        for seq in range(sent[0] + 1, sent[0] + 50):  # copies after its end (a resend's): no cancel
            await chunk(nc, msg, req, seq, token_ids=[seq])
            await asyncio.sleep(0.01)
        sent[0] = -1

    w = Worker(nc, ns, "w1")
    await w.serve("decode", streams_until_told)
    async with contextlib.aclosing(d.run(job("w1"))) as stream:
        async for first in stream:
            assert first.token_ids == [0]
            break  # the client leaves: the leg is cancelled, on a subject nobody serves yet
    # an ask for lost chunks, sent in the outage, reaches NATS before the worker is back: NATS
    # answers no-responders to the leg's reply subject, which says nothing of the leg
    await nc.publish(subjects.gen(ns, "decode", "w1-not-back"), b"", reply=replies[0])

    async def on_cancel(msg: Msg) -> None:
        cancels.append(decode_msg(msg.data, CancelRequest).request_id)

    await nc.subscribe(subjects.cancel(ns, "w1"), cb=on_cancel)  # the shim back on NATS
    await flush(nc)
    await until(lambda: bool(cancels), timeout=5 * CANCEL_AGAIN_S, what="the cancel sent again")
    before = sent[0]
    await asyncio.sleep(1.5 * CANCEL_AGAIN_S)
    assert sent[0] - before > 50  # a flood of late chunks meanwhile...
    assert cancels == ["r1", "r1"]  # ...sent it once per CANCEL_AGAIN_S
    ended.set()  # the engine aborts the request: its final chunk comes
    await until(lambda: sent[0] == -1, what="the worker's copies after the final chunk")
    await flush(nc)
    await asyncio.sleep(CANCEL_AGAIN_S)
    assert cancels == ["r1", "r1"] and d.cancels_again == 2
    assert not d._cancelled  # forgotten at its final chunk


async def test_a_stream_cut_over_the_budget_after_its_final_chunk_came_ends_once_and_is_not_cancelled(
    nc: Client, ns: str, world: World
) -> None:
    """A stream whose final chunk came, unread, is cut over the client buffer budget (its client
    reads nothing): its reader gets the 408 and its queue goes, but the engine, done with it, is
    sent no cancel and its `on_end` runs no second time. Until 2026-12-07 both happened."""
    d, _, _ = world
    ends: list[bool] = []
    cancels: list[str] = []

    async def on_cancel(msg: Msg) -> None:
        cancels.append(decode_msg(msg.data, CancelRequest).request_id)

    await nc.subscribe(subjects.cancel(ns, "w1"), cb=on_cancel)
    await Worker(nc, ns, "w1").serve("decode", answer)
    req = GenerateRequest(request_id="r1", model="m", token_ids=[1, 2, 3])
    async with await d._open("w1", "decode", req, time.monotonic() + 30, ends.append) as leg:
        await until(lambda: ends == [True], what="the final chunk, unread")
        d.buffers.budget = leg.queued - 1  # over the budget by this stream's queue alone
        await d.buffers.make_room()
        with pytest.raises(LegError) as cut:
            await leg.next(5.0, 5.0)
        assert cut.value.slow_reader and d.slow_readers == 1
    await flush(nc)  # a cancel, had one gone, is back on this connection before the flush's PONG
    await asyncio.sleep(0.05)  # and through its callback
    assert ends == [True] and cancels == [] and not d._cancelled


async def test_a_leg_ended_by_its_final_chunk_frees_its_booking_as_served_and_a_refused_one_does_not(
    nc: Client, ns: str, world: World
) -> None:
    """A clean final chunk says the decode worker prefilled the prompt, even where it carries the
    first output (a whole answer; the booking is freed as it arrives, before it is read): its
    pending prefixes stay (router.ledger). A refused leg prefilled nothing: they are withdrawn."""
    d, books, _ = world

    async def whole(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, token_ids=[5, 6], final=True, finish_reason="length")

    await Worker(nc, ns, "w1").serve("decode", whole)
    await Worker(nc, ns, "w2").serve("decode", refuse)
    await collect(d, job("w1"))
    with pytest.raises(LegError):
        await collect(d, job("w2"))
    assert books.served == ["r1#1"] and books.log.count(("free", "r1#1")) == 2


@pytest.mark.parametrize(
    ("before", "end", "served"),
    [
        ([], {"finish_reason": "abort"}, False),  # SGLang's abort before prefill, the shim's early cancel
        ([{"token_ids": [5]}], {"finish_reason": "abort"}, True),
        ([], {"finish_reason": "abort", "prefilled": True}, True),
        ([{"prefilled": True}], {"finish_reason": "abort"}, True),  # a whole answer's, read or not
        ([], {"finish_reason": "stop"}, True),  # an EOS first: its prefill was done
    ],
)
async def test_a_leg_aborted_before_any_output_frees_its_booking_unserved(
    nc: Client, ns: str, world: World, before: list[dict[str, object]], end: dict[str, object], served: bool
) -> None:
    """An engine that aborted the request with nothing out and no prefill said done may never have
    prefilled it: its retry must not be told the worker holds the prompt (router.ledger withdraws
    its pending prefixes there)."""
    d, books, _ = world

    async def answer(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        for seq, fields in enumerate(before):
            await chunk(nc, msg, req, seq, **fields)
        await chunk(nc, msg, req, len(before), final=True, **end)

    await Worker(nc, ns, "w1").serve("decode", answer)
    chunks = await collect(d, job("w1"))
    assert chunks[-1].final and chunks[-1].finish_reason == end["finish_reason"]
    assert books.served == (["r1#1"] if served else []) and books.log.count(("free", "r1#1")) == 1


async def test_a_reader_gone_after_its_streams_final_chunk_came_unread_sends_no_cancel(
    nc: Client, ns: str, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine ended the leg (its final chunk came) before its reader left without reading it
    (a client gone, a failed write): nothing is left to cancel, and no cancel is kept for it."""
    d, _, _ = world
    ends: list[bool] = []
    cancels: list[str] = []

    async def on_cancel(msg: Msg) -> None:
        cancels.append(decode_msg(msg.data, CancelRequest).request_id)

    await nc.subscribe(subjects.cancel(ns, "w1"), cb=on_cancel)
    await Worker(nc, ns, "w1").serve("decode", answer)
    failed: list[str] = []
    monkeypatch.setattr(RequestTracer, "failed", staticmethod(lambda span, why: failed.append(why)))
    req = GenerateRequest(request_id="r1", model="m", token_ids=[1, 2, 3], stream=True)
    leg = await d._open("w1", "decode", req, time.monotonic() + 30, ends.append)

    async def reader() -> AsyncGenerator[None]:  # a client's stream, its generator closed by its writer
        async with leg:
            yield None

    stream = reader()
    await anext(stream)
    await until(lambda: ends == [True], what="the final chunk, unread")
    assert leg.finished and not leg.done
    await stream.aclose()  # GeneratorExit inside the leg
    await flush(nc)
    await asyncio.sleep(0.05)
    assert cancels == [] and not d._cancelled and ends == [True]
    assert failed == [], "the leg's span was failed though its engine ended it"
