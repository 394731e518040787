"""One budget for the bytes a replica holds for all its clients (router.client_buffers,
--client-buffer-mib). Before (slow-consumer audit, 2026-12-07), only each stream was bounded (8 MiB):
100 streaming clients that stopped reading held 8.2 MB each, 30 whole answers 818 MB until their
deadline with the engines idle, nothing refused or showed it, and kvswitch_router_inflight_requests
read 0 while the answers were still held. Then (bufrev audit) the most bytes went first and a whole
answer counted whole until its last byte was taken: an answer its client was reading was the first
cut, for streams and newcomers that read nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from router.client_buffers import SPARE_BYTES, ClientBuffers, HeldAnswer
from router.dispatch import Dispatcher
from router.http_api import _slices
from router.leg import Leg
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until
from tests.router.test_slow_readers import clean, counted, cut_short, stalled_stream, stalled_whole

BUDGET = 256 << 10
STALLED_S = 2.0  # router.client_buffers': a client that took nothing this long is behind (checked below)
# stalled_whole's request: an answer of several MB
WHOLE = {"model": MODEL, "prompt": list(range(1, 4001)), "max_tokens": 1, "prompt_logprobs": 20}


def sample(router: RouterService, name: str, labels: dict[str, str] | None = None) -> float:
    value = router.metrics.registry.get_sample_value(name, labels or {})
    assert value is not None, name
    return value


async def read_to_end(sock: socket.socket) -> bytes:
    got = b""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        with contextlib.suppress(ConnectionResetError):
            while not got.endswith(b"0\r\n\r\n") and (part := await loop.sock_recv(sock, 1 << 16)):
                got += part
    return got


async def test_slow_streams_are_held_under_one_budget_the_furthest_behind_cut_first(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The most held for clients after any chunk came, and at each cut the cut stream's queue with
    # the longest of the others'.
    peak = chunk = 0
    push = Leg.push

    def recording(leg: Leg, item: Any, size: int = 0) -> None:
        nonlocal peak, chunk
        push(leg, item, size)
        peak, chunk = max(peak, leg.owner.buffers.held), max(chunk, size)

    monkeypatch.setattr(Leg, "push", recording)
    at_cut: list[tuple[int, int]] = []
    over_budget = Dispatcher._over_budget

    async def cutting(d: Dispatcher, leg: Leg) -> None:
        at_cut.append((leg.queued, max(other.queued for other in d._streams())))
        await over_budget(d, leg)

    monkeypatch.setattr(Dispatcher, "_over_budget", cutting)
    await cluster.add_worker("agg", speedup=50.0, num_gpu_blocks=8192)
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": BUDGET})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    slow = [await stalled_stream(router, 30_000) for _ in range(3)]
    try:
        await until(lambda: buffers.held > BUDGET // 2, timeout=10.0, what="the slow clients' chunks held")
        # the gauge reads what is held (no chunk comes between the two reads: no await between them)
        assert sample(router, "kvswitch_router_client_buffered_bytes") == buffers.held > 0
        assert sample(router, "kvswitch_router_client_buffer_budget_bytes") == BUDGET
        # a client that reads, beside them, is served whole
        body = {"model": MODEL, "prompt": "hi " * 10, "max_tokens": 300, "stream": True, "ignore_eos": True}
        async with http.post(f"{router.url}/v1/completions", json={**body, "logprobs": 5}) as resp:
            lines = [line async for line in resp.content if line.startswith(b"data: ")]
        assert resp.status == 200 and lines[-1] == b"data: [DONE]\n", lines[-2:]
        assert len(lines) == 301 and not any(b'"error"' in line for line in lines)
        await until(lambda: router.dispatcher.slow_readers == 3, timeout=15.0, what="the three slow streams cut")
        cut = {"what": "stream"}
        assert sample(router, "kvswitch_router_client_buffer_cuts_total", cut) == 3
        assert b"kvswitch_router_slow_readers_total 3.0" in router.metrics.render()
        assert at_cut and all(mine == most for mine, most in at_cut), at_cut
        assert peak <= BUDGET + chunk, (peak, chunk)
        for sock in slow:
            events = (await read_to_end(sock)).split(b"\r\n\r\n", 1)[1]
            assert events.rstrip(b"\r\n0").endswith(b"data: [DONE]"), events[-300:]
            error = json.loads(events.rsplit(b"data: ", 2)[1].split(b"\n")[0])["error"]
            assert error["code"] == 408 and "read the stream too slowly" in error["message"], error
            assert "--client-buffer-mib" in error["message"], error
    finally:
        for sock in slow:
            sock.close()
    await until(lambda: clean(router), what="the requests ended")
    assert counted(router, 408) == 3 and counted(router, 200) == 1
    assert buffers.held == 0 and sample(router, "kvswitch_router_client_buffered_bytes") == 0


async def test_an_answer_still_being_written_counts_in_flight(cluster: Cluster) -> None:
    """The engine is done and the leg ended, but the answer is still being written to a client that
    reads nothing: until 2026-12-07 the gauge read 0 then."""
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    router = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(router)
    sock = await stalled_whole(router)
    try:
        await until(lambda: router.dispatcher.inflight_legs == 1, what="its leg sent")
        await until(lambda: not router.dispatcher.inflight_legs, timeout=10.0, what="its leg ended")
        assert counted(router, 200) == counted(router, 504) == 0  # not answered yet
        assert router.path.inflight == 1 and sample(router, "kvswitch_router_inflight_requests") == 1
    finally:
        sock.close()
    await until(lambda: clean(router), what="the request ended")
    assert sample(router, "kvswitch_router_inflight_requests") == 0


async def answer_size(router: RouterService, http: aiohttp.ClientSession) -> int:
    """The size of stalled_whole's answer, read whole."""
    async with http.post(f"{router.url}/v1/completions", json=WHOLE) as resp:
        assert resp.status == 200
        return len(await resp.read())


def _headers(head: bytes) -> dict[bytes, bytes]:
    lines = head.split(b"\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}


async def reading_whole(router: RouterService, rate: int) -> tuple[bytes, int, int]:
    """stalled_whole's answer, read steadily at `rate` bytes a second: its status line, its
    Content-Length and the bytes of its body the client got."""
    host, port = router.url.split("//")[1].split(":")
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, int(port)))
    data = json.dumps(WHOLE).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    await loop.sock_sendall(sock, head.encode() + b"\r\n\r\n" + data)
    got, length = b"", -1
    try:
        with contextlib.suppress(ConnectionResetError):
            async with asyncio.timeout(30):
                while part := await loop.sock_recv(sock, rate // 20):
                    got += part
                    top, ended, body = got.partition(b"\r\n\r\n")
                    if length < 0 and ended:
                        length = int(_headers(top).get(b"content-length", b"0"))
                    if length >= 0 and len(body) >= length:
                        break
                    await asyncio.sleep(0.05)
    finally:
        sock.close()
    top, _, body = got.partition(b"\r\n\r\n")
    return top.split(b"\r\n")[0], length, len(body)


async def refused(sock: socket.socket) -> tuple[dict[bytes, bytes], bytes]:
    """The head and body of an answer refused before its head went out: a 503."""
    got = b""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(10):
        while b"\r\n\r\n" not in got:
            got += await loop.sock_recv(sock, 1 << 16)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), got[:500]
    return _headers(head), body


def idle_answer(router: RouterService) -> bool:
    """A whole answer being written whose client has taken nothing for STALLED_S."""
    answers = router.dispatcher.buffers._answers
    return any(a.admitted and time.monotonic() - a.taken_at > STALLED_S + 0.1 for a in answers)


async def test_a_whole_answer_its_client_reads_is_not_cut_for_streams_that_read_nothing(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Counted whole until its last byte was taken, a 5.9 MB answer held more than any stream can
    (8 MiB at most, less here): its client, reading, was cut 70% through while the streams that
    read nothing lived on (bufrev audit)."""
    await cluster.add_worker("agg", speedup=50.0, num_gpu_blocks=8192)
    probe = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(probe)
    size = await answer_size(probe, http)
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": size + (256 << 10)})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    reader = asyncio.create_task(reading_whole(router, 1 << 20))
    await until(lambda: bool(buffers._answers), timeout=10.0, what="the answer being written")
    slow = [await stalled_stream(router, 30_000) for _ in range(2)]
    try:
        status, length, got = await reader
        assert status == b"HTTP/1.1 200 OK" and got == length > 0, (status, got, length, buffers.cuts)
        assert buffers.cuts["stream"] >= 1 and buffers.cuts["answer"] == 0, buffers.cuts
    finally:
        for sock in slow:
            sock.close()
    await until(lambda: clean(router), timeout=20.0, what="the requests ended")
    assert buffers.held == 0


async def test_a_whole_answer_its_client_reads_is_not_ended_for_a_newcomer_that_reads_nothing(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The newest answer held ended the one before, whose client was reading it (bufrev audit): now
    the newcomer is refused before its head goes out, a 503 with Retry-After."""
    await cluster.add_worker("agg", speedup=50.0, num_gpu_blocks=8192)
    probe = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(probe)
    size = await answer_size(probe, http)
    # room for one answer and 512 KiB of another
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": size + (512 << 10)})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    reader = asyncio.create_task(reading_whole(router, 1 << 20))
    await until(lambda: bool(buffers._answers), timeout=10.0, what="the answer being written")
    staller = await stalled_whole(router)
    try:
        headers, body = await refused(staller)
        assert headers[b"retry-after"] == b"1" and b"--client-buffer-mib" in body, (headers, body)
        status, length, got = await reader
        assert status == b"HTTP/1.1 200 OK" and got == length > 0, (status, got, length, buffers.cuts)
        assert buffers.cuts == {"refused": 1}
        assert sample(router, "kvswitch_router_client_buffer_cuts_total", {"what": "refused"}) == 1
    finally:
        staller.close()
    await until(lambda: clean(router), timeout=20.0, what="the requests ended")
    assert counted(router, 503) == 1 and counted(router, 200) == 1 and buffers.held == 0


async def test_a_whole_answer_whose_client_took_nothing_for_a_while_is_ended_for_a_newcomer(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Two answers whose clients read nothing, over the budget together: the second is refused while
    the first's client may still read, and once it has taken nothing for STALLED_S a third ends it
    (until 2026-12-07 the newest ended the one before at once, read or not)."""
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    probe = await cluster.add_router(config={"request_timeout_s": 30.0})
    await cluster.ready(probe)
    size = await answer_size(probe, http)
    # room for one answer and a quarter of another
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": size * 5 // 4})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    first = await stalled_whole(router)
    socks = [first]
    try:
        await until(lambda: bool(buffers._answers), timeout=10.0, what="the first answer held")
        socks.append(second := await stalled_whole(router))
        await refused(second)  # the first's client may be about to read
        assert buffers.cuts == {"refused": 1} and counted(router, 408) == 0
        await until(lambda: idle_answer(router), timeout=10.0, what="the first answer's client idle")
        socks.append(await stalled_whole(router))
        await until(lambda: counted(router, 408) == 1, timeout=10.0, what="the first answer ended")
        await cut_short(first)
        assert buffers.cuts == {"refused": 1, "answer": 1}
        assert sample(router, "kvswitch_router_client_buffer_cuts_total", {"what": "answer"}) == 1
        assert router.path.inflight == 1 and counted(router, 504) == 0 and len(buffers._answers) == 1
    finally:
        for sock in socks:
            sock.close()
    await until(lambda: clean(router), what="the requests ended")
    assert buffers.held == 0


async def test_a_client_that_leaves_while_room_is_made_for_its_answer_leaves_nothing_counted(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its answer was counted, then the handler awaited the cut of another (the cancel's publish, as
    nats-py's does while its pending buffer is full), and a client that left then cancelled it
    before its release was set up: its bytes stayed counted for good (bufrev audit)."""
    publish = Dispatcher._publish_cancel

    async def slow_publish(d: Dispatcher, worker: str, request_id: str) -> None:
        await asyncio.sleep(1.0)
        await publish(d, worker, request_id)

    monkeypatch.setattr(Dispatcher, "_publish_cancel", slow_publish)
    await cluster.add_worker("agg", speedup=50.0, num_gpu_blocks=8192)
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": 7 << 20})
    await cluster.ready(router)
    buffers = router.dispatcher.buffers
    stream = await stalled_stream(router, 12_000)  # ~6 MB, whole: under the budget alone
    try:
        await until(lambda: buffers.held > 2 << 20, timeout=10.0, what="the stream's chunks held")
        await asyncio.sleep(STALLED_S + 1)  # its client took nothing meanwhile: the answer may end it
        whole = await stalled_whole(router)  # ~5.9 MB: over 7 MiB with the stream's, which is cut
        await until(lambda: buffers.cuts["stream"] == 1, timeout=10.0, what="the stream cut")
        whole.close()  # while its handler awaits that cut's cancel
    finally:
        stream.close()
    await until(lambda: clean(router), timeout=20.0, what="the requests ended")
    assert buffers.held == 0 and not buffers._answers
    assert sample(router, "kvswitch_router_client_buffered_bytes") == 0


async def test_a_whole_answer_larger_than_the_budget_is_a_400_saying_what_the_client_can_change(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Not a 503, which OpenAI's SDK retries twice, the engine doing the work again each time."""
    await cluster.add_worker("agg", num_gpu_blocks=1024)
    router = await cluster.add_router(config={"request_timeout_s": 30.0, "client_buffer_bytes": 64 << 10})
    await cluster.ready(router)
    body = {"model": MODEL, "prompt": list(range(1, 2001)), "max_tokens": 1, "prompt_logprobs": 20}
    async with http.post(f"{router.url}/v1/completions", json=body) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 400 and error["type"] == "BadRequestError" and "Retry-After" not in resp.headers, error
    for advice in ("--client-buffer-mib", "prompt_logprobs", "max_tokens", "stream=true"):
        assert advice in error["message"], error
    assert router.dispatcher.buffers.cuts == {"refused": 1} and router.dispatcher.buffers.held == 0
    assert counted(router, 400) == 1


# --- the rule, alone ------------------------------------------------------------------------------


def test_the_stall_the_tests_wait_for_is_the_routers() -> None:
    from router import client_buffers

    assert client_buffers.STALLED_S == STALLED_S


def stream_leg(queued: int, idle_s: float) -> Leg:
    return cast(Leg, SimpleNamespace(queued=queued, taken_at=time.monotonic() - idle_s))


def buffers_with(budget: int, legs: list[Leg], cut: list[Leg]) -> ClientBuffers:
    async def cutting(leg: Leg) -> None:  # as Dispatcher._slow_reader: its queue dropped, then the cancel
        cut.append(leg)
        buffers.held -= leg.queued
        legs.remove(leg)
        await asyncio.sleep(0)

    buffers = ClientBuffers(budget, lambda: legs, cutting)
    buffers.held = sum(leg.queued for leg in legs)
    return buffers


async def admitted(buffers: ClientBuffers, size: int, idle_s: float = 0.0, *, read: bool = True) -> HeldAnswer:
    """An answer admitted whose client took its last slice `idle_s` ago (none yet unless `read`)."""
    answer = buffers.hold(size)
    assert await buffers.admit(answer)
    if read:
        buffers.taken(answer, 0)  # a slice drained
    answer.taken_at -= idle_s
    return answer


async def test_over_budget_the_idle_go_first_the_most_held_first_and_an_answer_being_read_never() -> None:
    reading, idle_small, idle_big = (
        stream_leg(1 << 20, 0.0),
        stream_leg(100, STALLED_S + 3),
        stream_leg(50_000, STALLED_S),
    )
    legs, cut = [reading, idle_small, idle_big, stream_leg(900, 0.1)], list[Leg]()
    buffers = buffers_with((11 << 20) + 100_000 + SPARE_BYTES, legs, cut)
    answer = await admitted(buffers, 10 << 20)  # its client reads: its last slice just drained
    stale = await admitted(buffers, 1000, idle_s=STALLED_S + 1)
    buffers.held += 99_050 + SPARE_BYTES  # a chunk comes: 51,050 bytes over, all three idle ones to end
    assert await buffers.make_room()
    assert cut == [idle_big, idle_small] and stale.ended and not answer.ended
    assert buffers.cuts == {"stream": 2, "answer": 1} and buffers.held == buffers.budget - 50
    # none idle: the stream furthest behind its worker goes, never the answer being read
    buffers.held += 600 << 10
    assert await buffers.make_room()
    assert cut[2:] == [reading] and not answer.ended


async def test_a_newcomer_ends_only_holders_that_took_nothing_for_a_while_or_is_refused() -> None:
    idle = stream_leg(3 << 20, STALLED_S + 1)
    cut = list[Leg]()
    buffers = buffers_with(8 << 20, [idle, stream_leg(1 << 20, 0.0)], cut)
    reading = await admitted(buffers, 2 << 20)
    newcomer = buffers.hold(4 << 20)
    assert await buffers.admit(newcomer) and cut == [idle]  # 10 MiB over 8: the idle stream goes
    late = buffers.hold(2 << 20)
    assert not await buffers.admit(late) and not reading.ended and not newcomer.ended
    assert buffers.cuts == {"stream": 1, "refused": 1}
    buffers.release(late)
    assert buffers.held == 7 << 20


async def test_a_newcomer_is_admitted_only_with_room_to_spare_and_ended_before_a_stream_being_read() -> None:
    """Admitted when it filled the budget to the brim, it left no room for the next chunk of a
    stream whose client read, and with nothing stalled (the newcomer itself just admitted) that
    stream was cut, its client "had taken none for 0.0s" (newcomer_brim audit)."""
    legs, cut = [stream_leg(256 << 10, 0.0) for _ in range(4)], list[Leg]()
    buffers = buffers_with(8 << 20, legs, cut)
    brim = buffers.hold(buffers.budget - buffers.held)
    assert not await buffers.admit(brim) and buffers.cuts == {"refused": 1}
    buffers.release(brim)
    assert buffers.held == 1 << 20
    newcomer = await admitted(buffers, buffers.budget - buffers.held - SPARE_BYTES, read=False)
    for _ in range(2):  # chunks of a stream whose client reads: the spare room takes them
        legs[0].queued += 64 << 10
        buffers.held += 64 << 10
        assert await buffers.make_room() and not newcomer.ended
    legs[0].queued += 4096  # over: the newcomer's client has taken none of it yet, it goes first
    buffers.held += 4096
    assert await buffers.make_room() and newcomer.ended and not cut
    # one whose client took a slice is ended no more: the stream furthest behind goes
    reading, furthest = await admitted(buffers, buffers.budget - buffers.held - SPARE_BYTES), legs[0]
    furthest.queued += SPARE_BYTES + 1
    buffers.held += SPARE_BYTES + 1
    assert await buffers.make_room() and cut == [furthest] and not reading.ended
    assert buffers.cuts == {"refused": 1, "answer": 1, "stream": 1}


async def test_a_newcomer_counts_only_once_admitted() -> None:
    """While it waited for a stalled stream's cut its bytes counted already: a chunk that came then
    took the total over, and the stream whose client read was cut (newcomer_brim audit)."""
    idle, reading = stream_leg(1 << 20, STALLED_S + 1), stream_leg(4 << 20, 0.0)
    legs, cut = [idle, reading], list[Leg]()

    async def cutting(leg: Leg) -> None:  # its queue dropped, then a chunk of the other during the cancel
        cut.append(leg)
        buffers.held -= leg.queued
        legs.remove(leg)
        reading.queued += 4096
        buffers.held += 4096
        if buffers.held > buffers.budget:  # as Dispatcher._on_chunk
            await buffers.make_room()

    buffers = ClientBuffers(8 << 20, lambda: legs, cutting)
    buffers.held = 5 << 20
    newcomer = buffers.hold((4 << 20) - 2048)  # with the chunk, over the budget after the idle stream's cut
    assert not await buffers.admit(newcomer)
    assert cut == [idle] and buffers.held == reading.queued == (4 << 20) + 4096


async def test_a_whole_answer_counts_only_what_is_left_to_write() -> None:
    buffers = ClientBuffers(1 << 30, tuple, lambda leg: asyncio.sleep(0))
    answer = buffers.hold(1000)
    assert buffers.held == 0  # not before it is admitted
    assert await buffers.admit(answer)
    buffers.taken(answer, 300)
    assert buffers.held == answer.queued == 700
    buffers.release(answer)
    buffers.taken(answer, 300)  # a slice that drained as it was ended counts no more
    assert buffers.held == 0


def test_a_whole_answer_goes_out_in_slices_each_piece_let_go_once_written() -> None:
    from router.client_buffers import SLICE_BYTES

    pieces = [b"a" * 10, b"b" * 20, b"c" * (3 * SLICE_BYTES + 5), b"d" * 7, b"e" * (SLICE_BYTES - 1), b"f"]
    whole = b"".join(pieces)
    out = []
    for piece in _slices(pieces):
        assert len(piece) <= SLICE_BYTES
        out.append(bytes(piece))
    assert b"".join(out) == whole and not pieces
    # the two small ones joined, the large one cut in four, then the small ones joined up to a slice
    assert [len(p) for p in out] == [30, SLICE_BYTES, SLICE_BYTES, SLICE_BYTES, 5, 7, SLICE_BYTES]
