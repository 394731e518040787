"""A prefill leg whose transfer handle comes before its end (an SGLang prefill: its engine waits for
its decode peer), against workers played by the test over a real nats-server: the decode leg goes
with the handle at once, and a prefill that fails before the decode leg shows output cancels that
leg and takes the bypass path (router.prefill_watch)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from protocol import CancelRequest, GenerateRequest, TransferHandle, decode_msg, subjects
from protocol.config import RouterSettings
from protocol.messages import ANNOTATION_BYPASS, ErrorInfo
from router.dispatch import Dispatcher, Job
from router.leg import NO_LOCAL_PREFILL, LegError
from router.policies import Outcome, Path
from runtime.nats_flush import flush
from tests.router.test_dispatch import HB, Behaviour, Books, Worker, answer, chunk, collect, job

TRIPLE = {"bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 77}
PREFILL_TIMEOUT_S = 2.0


class Pair:
    """Prefill worker p1 and decode worker w1 playing SGLang's P/D: p1 sends the bootstrap triple at
    once, then waits for w1 to get the decode leg that carries it (SGLang's prefill waits for its
    decode peer) and ends with `prefill_end` (ResponseChunk fields; None: silence). w1's leg with
    the triple waits for its KV, heartbeating, until it streams (`kv` set) or is cancelled (then the
    shim's answer to a cancel, an abort); its bypass leg prefills and answers two tokens."""

    def __init__(
        self, nc: Client, ns: str, prefill_end: dict[str, Any] | None, decode: Behaviour | None = None
    ) -> None:
        self.nc, self.ns = nc, ns
        self.prefill_end = prefill_end
        self.prefill = Worker(nc, ns, "p1")
        self.decode = Worker(nc, ns, "w1")
        self._decode_behaviour = decode or self._decode
        self.peer = asyncio.Event()  # w1 got the decode leg with the triple
        self.kv = asyncio.Event()
        self.cancelled: list[str] = []
        self._cancel = asyncio.Event()
        self.prefill_ended = asyncio.Event()

    async def start(self) -> None:
        await self.prefill.serve("prefill", self._prefill)
        await self.decode.serve("decode", self._decode_behaviour)

        async def on_cancel(msg: Msg) -> None:
            self.cancelled.append(decode_msg(msg.data, CancelRequest).request_id)
            self._cancel.set()

        await self.nc.subscribe(subjects.cancel(self.ns, "w1"), cb=on_cancel)
        await flush(self.nc)

    async def _prefill(self, nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, transfer=TransferHandle(engine="sglang", params=TRIPLE))
        await asyncio.wait_for(self.peer.wait(), 10)
        if self.prefill_end is not None:
            await asyncio.sleep(HB)
            await chunk(nc, msg, req, 1, final=True, **self.prefill_end)
        self.prefill_ended.set()

    async def _decode(self, nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.disagg is None:
            await chunk(nc, msg, req, 0, token_ids=[5])
            await chunk(nc, msg, req, 1, token_ids=[6], final=True, finish_reason="length")
            return
        self.peer.set()
        seq = 0
        while not (self._cancel.is_set() or self.kv.is_set()):
            await _either(self._cancel.wait(), self.kv.wait(), req.heartbeat_s)
            await chunk(nc, msg, req, seq)
            seq += 1
        if self._cancel.is_set():
            await chunk(nc, msg, req, seq, final=True, finish_reason="abort")
            return
        await chunk(nc, msg, req, seq, token_ids=[5])
        await self.prefill_ended.wait()
        await chunk(nc, msg, req, seq + 1, token_ids=[6], final=True, finish_reason="length")


async def _either(a: Coroutine[Any, Any, Any], b: Coroutine[Any, Any, Any], timeout: float) -> None:
    tasks = [asyncio.ensure_future(a), asyncio.ensure_future(b)]
    await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for t in tasks:
        t.cancel()


Verdicts = list[tuple[str, str | None, bool]]


@pytest.fixture
async def router(nc: Client, ns: str) -> AsyncIterator[tuple[Dispatcher, Books, Verdicts]]:
    books = Books()
    verdicts: Verdicts = []  # (prefill worker, its fault, serves whole requests) per prefill leg judged
    d = Dispatcher(
        nc, ns, books,
        settings=lambda: RouterSettings(stream_heartbeat_s=HB, prefill_timeout_s=PREFILL_TIMEOUT_S),
        on_prefill=lambda w, fault, whole, ago_s: verdicts.append((w, fault, whole)),
    )  # fmt: skip
    await d.start()
    yield d, books, verdicts
    await d.stop()


async def test_the_decode_leg_goes_with_a_handle_that_comes_before_the_prefill_ends(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts]
) -> None:
    """SGLang's prefill ends only once its decode peer has its request: read as the end of the
    prefill, its handle arrived with the final chunk that never came, and every remote prefill ran
    out prefill_timeout_s before it fell back."""
    d, books, verdicts = router
    pair = Pair(nc, ns, {"finish_reason": "length", "transfer": TransferHandle(engine="sglang", params=TRIPLE)})
    await pair.start()
    pair.kv.set()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert [r.early_transfer for r in pair.prefill.requests] == [True]
    assert [r.disagg.params if r.disagg else None for r in pair.decode.requests] == [TRIPLE]
    assert (j.outcome, j.path, d.fallbacks) == (Outcome.DECLINED_POLICY, Path.REMOTE, 0)
    assert verdicts == [("p1", None, True)] and pair.cancelled == []
    assert ("rebook_bypass", "r1#1") not in books.log


@pytest.mark.parametrize(
    "prefill_end",
    [
        {"error": ErrorInfo(code=500, kind="engine_error", message="KV transfer failed")},
        {"finish_reason": "abort"},  # the engine's own abort, no error
        None,  # the prefill worker goes silent
    ],
    ids=["engine_error", "aborted", "silent"],
)
async def test_a_prefill_that_fails_after_its_handle_cancels_the_decode_leg_and_prefills_there(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts], prefill_end: dict[str, Any] | None
) -> None:
    """Until 2026-12-07 the handle was the prefill's end: its failure was never heard of, and the
    decode leg waited for KV that never came, to the client's deadline."""
    d, books, _ = router
    pair = Pair(nc, ns, prefill_end)
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]  # the bypass leg's, nothing of the cancelled one
    assert pair.cancelled == ["r1"]
    assert [(r.disagg is not None, r.annotations) for r in pair.decode.requests] == [
        (True, []),
        (False, [ANNOTATION_BYPASS]),
    ]
    assert (j.outcome, j.path, d.fallbacks) == (Outcome.FALLBACK_PREFILL_FAILED, Path.BYPASS, 1)
    # The cancelled leg's abort freed nothing: the attempt's booking went on with its bypass leg,
    # freed once, at that leg's end.
    assert books.log[0] == ("rebook_bypass", "r1#1") and books.log[-1] == ("free", "r1#1")
    assert books.log.count(("free", "r1#1")) == 1


async def test_a_prefill_refused_after_its_handle_is_the_decode_engines_to_serve(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts]
) -> None:
    d, _, verdicts = router
    refused = ErrorInfo(code=400, kind="engine_rejected", message="The input (9000 tokens) is longer than 8192")
    pair = Pair(nc, ns, {"error": refused})
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert pair.cancelled == ["r1"]
    assert (j.outcome, d.refusal_fallbacks, d.fallbacks) == (Outcome.FALLBACK_PREFILL_REFUSED, 1, 0)
    assert d.refusals_overruled == {"p1": 1} and verdicts == []


async def test_a_prefill_past_prefill_timeout_after_its_handle_runs_on_to_the_requests_deadline(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts]
) -> None:
    """Its engine waits on its decode peer too: the time is the pair's, the request's to its
    deadline, not prefill_timeout_s. Until 2026-12-07 (20d8bb4) it was called failed there, its
    decode leg cut and a bypass sent, which an SGLang decode server cannot serve."""
    d, _, verdicts = router
    pair = Pair(nc, ns, None)
    await pair.start()

    async def heartbeats_after_the_handle(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, transfer=TransferHandle(engine="sglang", params=TRIPLE))
        for seq in range(1, 100):
            await asyncio.sleep(HB)
            await chunk(nc, msg, req, seq)
            if seq == 5 * PREFILL_TIMEOUT_S / HB // 4:  # past prefill_timeout_s: its KV went
                pair.kv.set()
                pair.prefill_ended.set()

    pair.prefill = Worker(nc, ns, "p2")
    await pair.prefill.serve("prefill", heartbeats_after_the_handle)
    j = job("w1", prefill="p2")
    chunks = await asyncio.wait_for(collect(d, j), 3 * PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert pair.cancelled == [] and j.outcome is Outcome.DECLINED_POLICY and d.fallbacks == 0
    assert verdicts == [("p2", None, True)]  # its decode leg ended well: the KV came


async def test_a_prefill_that_fails_after_the_decode_leg_streams_changes_nothing(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts]
) -> None:
    """The decode engine has the KV once it streams: the prefill leg's later end is no reason to
    cut the stream."""
    d, _, _ = router

    async def stream_first(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, token_ids=[5])
        pair.peer.set()
        await pair.prefill_ended.wait()
        for seq in (1, 2, 3):  # heartbeats, the prefill leg's error in meanwhile
            await asyncio.sleep(HB)
            await chunk(nc, msg, req, seq)
        await chunk(nc, msg, req, 4, token_ids=[6], final=True, finish_reason="length")

    pair = Pair(nc, ns, {"error": ErrorInfo(code=500, kind="engine_error", message="late")}, stream_first)
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert len(pair.decode.requests) == 1 and pair.cancelled == []
    assert j.outcome is Outcome.DECLINED_POLICY and d.fallbacks == 0


class _OneBatch:
    """p1 sends its handle, then fails (a 500) in the same reply batch as w1's decode leg ends with
    `decode_end` (ResponseChunk fields), `prefill_first` or not: SGLang ends a decode request
    whose prefill peer failed (an abort with a 500 status, or without). w1's bypass leg, or a later
    leg fed by another prefill worker's handle, answers two tokens."""

    def __init__(self, nc: Client, ns: str, decode_end: dict[str, Any], *, prefill_first: bool) -> None:
        self.prefill, self.decode = Worker(nc, ns, "p1"), Worker(nc, ns, "w1")
        self._decode_end, self._prefill_first = decode_end, prefill_first
        self._prefill_leg: asyncio.Future[tuple[Msg, GenerateRequest]] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        await self.prefill.serve("prefill", self._on_prefill)
        await self.decode.serve("decode", self._on_decode)

    async def _on_prefill(self, nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, transfer=TransferHandle(engine="sglang", params=TRIPLE))
        self._prefill_leg.set_result((msg, req))

    async def _on_decode(self, nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.disagg is None or len(self.decode.requests) > 1:
            await chunk(nc, msg, req, 0, token_ids=[5])
            await chunk(nc, msg, req, 1, token_ids=[6], final=True, finish_reason="length")
            return
        pmsg, preq = await self._prefill_leg
        failed = ErrorInfo(code=500, kind="engine_error", message="KV transfer failed")
        ends = [
            chunk(nc, pmsg, preq, 1, final=True, error=failed),
            chunk(nc, msg, req, 0, final=True, **self._decode_end),
        ]
        for end in ends if self._prefill_first else reversed(ends):
            await end  # no flush between: one batch on the router's side


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill_error_first", "decode_abort_first"])
async def test_a_decode_leg_aborted_with_its_failed_prefill_falls_back_and_frees_its_booking_once(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts], prefill_first: bool
) -> None:
    """Module-read audit of 2026-12-07: the decode leg's abort in the prefill failure's batch freed
    the attempt's booking before the cut, and the fallback booked it again, never freed (a phantom
    load on w1 for good); the abort first was the client's empty answer, the prefill's 500 never
    judged. Now either order falls back, its bypass leg holding the booking to its end."""
    d, books, verdicts = router
    pair = _OneBatch(nc, ns, {"finish_reason": "abort"}, prefill_first=prefill_first)
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert (j.outcome, j.path, d.fallbacks) == (Outcome.FALLBACK_PREFILL_FAILED, Path.BYPASS, 1)
    assert books.log[0] == ("rebook_bypass", "r1#1") and books.log[-1] == ("free", "r1#1")
    assert books.log.count(("free", "r1#1")) == 1
    assert [(w, fault is not None) for w, fault, _ in verdicts] == [("p1", True)]  # its 500, put down once served


async def test_a_decode_leg_that_ends_well_with_its_prefills_failure_is_the_answer(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts]
) -> None:
    """An EOS-first stream (a clean final chunk, no token) had its KV: the prefill leg's failure in
    the same batch, read first, cut it all the same, and the fallback booked again the booking its
    end had freed, never freed."""
    d, books, _ = router
    pair = _OneBatch(nc, ns, {"finish_reason": "stop"}, prefill_first=True)
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([], "stop")]
    assert (j.outcome, d.fallbacks, len(pair.decode.requests)) == (Outcome.DECLINED_POLICY, 0, 1)
    assert ("rebook_bypass", "r1#1") not in books.log and books.log.count(("free", "r1#1")) == 1


_DECODE_500 = {"error": ErrorInfo(code=500, kind="engine_error", message="Decode transfer failed for request")}


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill_error_first", "decode_error_first"])
async def test_a_decode_legs_server_error_with_its_failed_prefill_falls_back_as_the_prefills_failure(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts], prefill_first: bool
) -> None:
    """Review of f51606a: SGLang's decode server ends a request whose prefill peer failed with a 500
    (an abort with a status: the shim's error chunk), not a plain abort. Read after the prefill's
    failure, the watch no longer cut that finished leg, and read before it nothing asked the watch:
    either way the 500 was a failed KV pull (fallback_transfer_failed, the pair blamed) and the
    prefill worker's 500 never judged. Now both orders fall back for the prefill's failure."""
    d, books, verdicts = router
    pair = _OneBatch(nc, ns, _DECODE_500, prefill_first=prefill_first)
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert (j.outcome, j.path, d.fallbacks) == (Outcome.FALLBACK_PREFILL_FAILED, Path.BYPASS, 1)
    assert d.transfer_fallbacks == 0
    assert books.log[0] == ("rebook_bypass", "r1#1") and books.log.count(("free", "r1#1")) == 1
    assert [(w, fault is not None) for w, fault, _ in verdicts] == [("p1", True)]  # its 500, put down once served
    assert not d.legs_failed  # w1's 500 was its prefill peer's


async def test_a_decode_leg_that_failed_after_its_prefills_failure_was_read_falls_back(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts]
) -> None:
    """Review of f51606a: the watch skipped a decode leg whose final chunk had come, an error's too,
    so one that failed without an engine's 5xx (its shim lost the engine) once the prefill's failure
    was read was its own failure, retried elsewhere, and not the fallback a prefill failure before
    output takes. Only a clean end (the KV came) is left uncut now."""
    d, books, verdicts = router
    lost = ErrorInfo(code=502, kind="engine_unavailable", message="connection to the engine lost")
    pair = _OneBatch(nc, ns, {"error": lost}, prefill_first=True)
    await pair.start()
    j = job("w1", prefill="p1")
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert (j.outcome, j.path, d.fallbacks, d.retries) == (Outcome.FALLBACK_PREFILL_FAILED, Path.BYPASS, 1, 0)
    assert books.log[0] == ("rebook_bypass", "r1#1") and books.log.count(("free", "r1#1")) == 1
    assert [(w, fault is not None) for w, fault, _ in verdicts] == [("p1", True)]


def _no_local(j: Job) -> Job:
    """`j` planned on decode worker w1 registered as an SGLang decode server: no local prefill."""
    d = j.plan.decode
    d.info = msgspec.structs.replace(d.info, local_prefill=False)
    return j


@pytest.mark.parametrize("another_prefill_worker", [True, False])
async def test_a_failed_remote_prefill_for_a_decode_worker_that_cannot_prefill_locally_sends_no_bypass(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts], another_prefill_worker: bool
) -> None:
    """The review of 20d8bb4, finding 1: the bypass a failed prefill fell back to waited on an
    SGLang decode server for KV that never came, to the client's deadline. Now the remote prefill
    is tried again on another prefill worker, the same decode worker kept; with none, the client's
    503 at once, naming why."""
    d, _, _ = router

    async def fails(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        await chunk(nc, msg, req, 0, final=True, error=ErrorInfo(code=500, kind="engine_error", message="boom"))

    async def prefills(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        handle = TransferHandle(engine="sglang", params=TRIPLE)
        await chunk(nc, msg, req, 0, final=True, finish_reason="length", transfer=handle)

    async def decodes_with_kv_only(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        if req.disagg is not None:  # a bypass leg is held, as an SGLang decode server holds it
            await answer(nc, msg, req)

    p1, p2, w1 = Worker(nc, ns, "p1"), Worker(nc, ns, "p2"), Worker(nc, ns, "w1")
    await p1.serve("prefill", fails)
    await p2.serve("prefill", prefills)
    await w1.serve("decode", decodes_with_kv_only)
    replans = [_no_local(job("w1", prefill="p2")).plan] if another_prefill_worker else []
    j = _no_local(job("w1", prefill="p1", replans=replans))
    if another_prefill_worker:
        chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
        assert [c.token_ids for c in chunks] == [[5], [6]]
        assert (j.path, d.retries, d.fallbacks) == (Path.REMOTE, 1, 0)
    else:
        with pytest.raises(LegError) as caught:
            await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
        assert (caught.value.code, caught.value.kind) == (503, NO_LOCAL_PREFILL)
        assert "cannot prefill locally" in caught.value.message and "boom" in caught.value.message
        assert d.fallbacks == 0
    assert all(r.disagg is not None for r in w1.requests)  # no bypass leg


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill_error_first", "decode_end_first"])
@pytest.mark.parametrize("decode_end", [{"finish_reason": "abort"}, _DECODE_500], ids=["abort", "error_500"])
async def test_an_sglang_decode_leg_ended_with_its_failed_prefill_is_retried_without_that_prefill_worker(
    nc: Client, ns: str, router: tuple[Dispatcher, Books, Verdicts], decode_end: dict[str, Any], prefill_first: bool
) -> None:
    """Review of f51606a: on an SGLang decode server (no local prefill) the decode engine's 500 for
    its failed prefill peer was its own failed pull, and the retry left out the decode worker w1
    instead of p1. Now the prefill's failure is the attempt's, however w1 ended its leg: the retry
    goes to another prefill worker with w1 kept, and p1's 500 is judged once it serves."""
    d, _, verdicts = router
    pair = _OneBatch(nc, ns, decode_end, prefill_first=prefill_first)
    await pair.start()
    p2 = Worker(nc, ns, "p2")

    async def prefills(nc: Client, msg: Msg, req: GenerateRequest) -> None:
        handle = TransferHandle(engine="sglang", params=TRIPLE)
        await chunk(nc, msg, req, 0, final=True, finish_reason="length", transfer=handle)

    await p2.serve("prefill", prefills)
    j = _no_local(job("w1", prefill="p1", replans=[_no_local(job("w1", prefill="p2")).plan]))
    chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert (sorted(j.tried), j.path, d.retries, d.transfer_fallbacks) == (["p1", "w1"], Path.REMOTE, 1, 0)
    assert len(p2.requests) == 1 and all(r.disagg is not None for r in pair.decode.requests)  # no bypass leg
    # p1's 500 held, put down once p2's retry served (review of f06144e: raised before it was held);
    # with w1's 500 too it is the pair's alone (review of 47fbaa6)
    held = [("p1", True)] if decode_end.get("finish_reason") == "abort" else []
    assert [(w, fault is not None) for w, fault, _ in verdicts] == [("p2", False), *held]
    assert not d.legs_failed


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill_error_first", "decode_error_first"])
async def test_an_sglang_pair_whose_legs_both_fail_with_500_is_blamed_as_a_pair_and_neither_worker_alone(
    nc: Client, ns: str, prefill_first: bool
) -> None:
    """Review of f06144e: SGLang ends both legs of a failed KV transfer with a 500. Taken for the
    prefill's failure, on a decode server with no local prefill the retry was raised before anything
    was put down: the pair never blamed in transfer health (its only pair signal for SGLang), and
    the prefill's 500 never held, so never judged when the retry served. Now both orders blame the
    pair (w1, p1), and neither worker alone: held and put down once p2's retry served, p1's 500 took
    p1 out for every decode worker (prefill_failing) for a fault of one link (review of 47fbaa6)."""
    transfers: list[tuple[str, str, bool]] = []
    verdicts: Verdicts = []
    d = Dispatcher(
        nc, ns, Books(),
        settings=lambda: RouterSettings(stream_heartbeat_s=HB, prefill_timeout_s=PREFILL_TIMEOUT_S),
        on_transfer=lambda decode, prefill, ok: transfers.append((decode, prefill, ok)),
        on_prefill=lambda w, fault, whole, ago_s: verdicts.append((w, fault, whole)),
    )  # fmt: skip
    await d.start()
    try:
        pair = _OneBatch(nc, ns, _DECODE_500, prefill_first=prefill_first)
        await pair.start()

        async def prefills(nc: Client, msg: Msg, req: GenerateRequest) -> None:
            handle = TransferHandle(engine="sglang", params=TRIPLE)
            await chunk(nc, msg, req, 0, final=True, finish_reason="length", transfer=handle)

        await Worker(nc, ns, "p2").serve("prefill", prefills)
        j = _no_local(job("w1", prefill="p1", replans=[_no_local(job("w1", prefill="p2")).plan]))
        chunks = await asyncio.wait_for(collect(d, j), PREFILL_TIMEOUT_S)
    finally:
        await d.stop()
    assert [c.token_ids for c in chunks] == [[5], [6]]
    assert (sorted(j.tried), d.retries) == (["p1", "w1"], 1)
    assert transfers == [("w1", "p1", False), ("w1", "p2", True)]
    assert [(w, fault is not None) for w, fault, _ in verdicts] == [("p2", False)]
    assert not d.legs_failed  # w1's 500 was the pair's transfer, not its engine's own
