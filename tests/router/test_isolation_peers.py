"""One worker's or one peer router's bad word never steers the fleet (docs/router.md, "One worker's
fault never stops the fleet"): a load report naming another worker, a negative count, a worker
record that cannot be true (a key that is not UTF-8 or no worker id, block size 0), a record that
never bootstraps, a peer's booking no request makes, a transfer handle naming another prefill
worker. Each is dropped (and counted, logged once) or outvoted; watches that crash start again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from discovery import Discovery, Lease, WatchEvent
from protocol import (
    GenerateRequest,
    LoadReport,
    RouterInfo,
    RouterSync,
    SyncEntry,
    TransferHandle,
    WorkerInfo,
    encode_json,
    encode_msg,
    subjects,
)
from protocol.config import EtcdSettings, RouterSettings
from protocol.messages import MAX_KV_TOTAL_BLOCKS, ErrorInfo
from router.dispatch import Dispatcher
from router.eligibility import NAMED_AT_MOST, Eligibility, Exclusion
from router.load_view import LoadView
from router.replica_sync import ReplicaSync
from router.transfer_health import TransferHealth
from router.worker_registry import WorkerRegistry
from runtime.nats_flush import flush
from tests.router.conftest import MODEL, Cluster, complete
from tests.router.polling import until
from tests.router.test_dispatch import HB, Books, Worker, chunk, collect, job

# --- load reports --------------------------------------------------------------------------------


async def _publish_for(seconds: float, nc: Client, subject: str, report: Any) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await nc.publish(subject, encode_msg(report(time.time())))
        await asyncio.sleep(0.05)
    await flush(nc)


async def test_a_load_report_naming_another_worker_is_dropped_and_counted(
    cluster: Cluster, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    a = await cluster.add_worker("agg")
    b = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    caplog.set_level(logging.WARNING, logger="router.service")

    def forged(ts: float) -> LoadReport:  # on A's own subject (all NATS lets A publish on), naming B
        return LoadReport(worker=b.id, ts=ts, healthy=False, draining=True, kv_epoch=1, kv_seq=10**9)

    await _publish_for(1.0, nc, subjects.load(cluster.ns, a.id), forged)
    status = {st.worker: st for st in router.eligibility.statuses(router.registry.workers())}
    assert status[b.id].routable, status[b.id].detail
    live = router.view.liveness(b.id)
    assert live is not None and live.healthy and not live.draining
    assert router.load_malformed >= 10
    said = [r.getMessage() for r in caplog.records if "malformed load report" in r.getMessage()]
    assert len(said) == 1 and b.id in said[0] and a.id in said[0]


async def test_senders_with_no_record_cannot_silence_the_warnings_of_registered_workers(
    cluster: Cluster, nc: Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reports from ids with no record (anyone may publish them; a shim that lost its lease sends
    them under its old id) are said once each, for a while, and at most 1,024 at a time (the first
    few named, the rest counted in one line: a fleet restart sends every worker's); they
    used to share one bound with the registered workers' warnings and, once it filled, stopped
    those for good."""
    w = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    monkeypatch.setattr(router._first_heard, "grace_s", 0.0)  # each said at its first report
    caplog.set_level(logging.INFO, logger="router.service")
    before = router.load_unknown
    for i in range(1100):
        sender = f"gone{i:05d}"
        await nc.publish(subjects.load(cluster.ns, sender), encode_msg(LoadReport(worker=sender, ts=time.time())))
    await flush(nc)
    await until(lambda: router.load_unknown >= before + 1100, what="every report from an id with no record dropped")
    router._unregistered_lines.flush()
    unknown = [r.getMessage() for r in caplog.records if "dropped: it has no usable record" in r.getMessage()]
    # the first few named, the rest of the 1,024 said counted in one line (router.fleet_lines)
    assert len(unknown) == NAMED_AT_MOST
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("and ")] == [
        f"and {1024 - NAMED_AT_MOST} more workers: load reports dropped: no usable record under "
        f"{subjects.workers_prefix(cluster.ns)} (counted in kvswitch_router_load_unknown_total)"
    ]

    forged = LoadReport(worker="someone-else", ts=time.time())  # malformed: another name on w's subject
    await nc.publish(subjects.load(cluster.ns, w.id), encode_msg(forged))
    await flush(nc)
    await until(
        lambda: any("malformed load report from worker " + w.id in r.getMessage() for r in caplog.records),
        what="the registered worker's malformed report logged",
    )

    monkeypatch.setattr(router._load_said, "every_s", 0.0)  # each said long ago: room again
    await nc.publish(subjects.load(cluster.ns, "gone00001"), encode_msg(LoadReport(worker="gone00001", ts=time.time())))
    await flush(nc)
    await until(
        lambda: sum("gone00001" in r.getMessage() for r in caplog.records) == 2, what="an id logged again later"
    )


async def test_a_sender_with_no_record_is_said_only_once_it_has_had_none_for_the_grace(
    cluster: Cluster, nc: Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shim publishes its first load reports before its registration's put lands: "no usable
    record" was said at every worker's (re)registration (log-quality audit of 2026-12-07)."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    caplog.set_level(logging.INFO, logger="router.service")
    before = router.load_unknown

    async def report(sender: str) -> None:
        await nc.publish(subjects.load(cluster.ns, sender), encode_msg(LoadReport(worker=sender, ts=time.time())))
        await flush(nc)

    def said(sender: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if f"from worker {sender} dropped: it has no" in r.getMessage()]

    for _ in range(3):
        await report("early")  # within its grace: its record may still land
    await until(lambda: router.load_unknown >= before + 3, what="its reports dropped")
    assert said("early") == [] and router.load_unknown == before + 3  # counted all the same
    monkeypatch.setattr(router._first_heard, "grace_s", 0.2)  # its record missing past the grace
    await asyncio.sleep(0.25)
    await report("early")
    await until(lambda: said("early") != [], what="a record missing past the grace said")
    assert len(said("early")) == 1


async def test_more_senders_with_no_record_than_the_grace_table_holds_are_said(
    cluster: Cluster, nc: Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,100 senders with no record reporting in turn, their grace kept: the table of when each was
    first heard held 1,024, evicted oldest first, each gone before its next report, and none was
    said (review of 2026-12-07). Now those heard while it is full are said at once, as many as
    FirstSaid holds (1,024: the first few named, the rest counted)."""
    await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    monkeypatch.setattr(router._first_heard, "grace_s", 0.2)  # a shorter grace, not none
    caplog.set_level(logging.INFO, logger="router.service")
    before = router.load_unknown
    senders = [f"stray{i:05d}" for i in range(1100)]
    for n in (1, 2):
        for sender in senders:
            await nc.publish(subjects.load(cluster.ns, sender), encode_msg(LoadReport(worker=sender, ts=time.time())))
        await flush(nc)
        dropped = before + n * len(senders)
        await until(lambda: router.load_unknown >= dropped, what="each report dropped")  # noqa: B023
        await asyncio.sleep(0.25)  # every sender past the grace
    router._unregistered_lines.flush()
    named = [r.getMessage() for r in caplog.records if "dropped: it has no usable record" in r.getMessage()]
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("and ")]
    assert len(named) == NAMED_AT_MOST
    assert [m.split(":")[0] for m in summaries] == [f"and {1024 - NAMED_AT_MOST} more workers"], summaries


async def test_a_load_report_with_a_negative_count_is_dropped_and_counted(
    cluster: Cluster, nc: Client, http: aiohttp.ClientSession
) -> None:
    w1 = await cluster.add_worker("agg")
    w2 = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    prefix = list(range(1000, 1000 + 1024))
    _, _, headers = await complete(http, router, prefix)
    holder = headers["x-kvswitch-decode-worker"]
    liar = w2.id if holder == w1.id else w1.id
    await until(lambda: len(router.index.worker_hashes(holder)) >= 60, what="the prefix indexed")

    def lie(ts: float) -> LoadReport:  # its own subject, its own name: a shim bug, total - free gone wrong
        return LoadReport(worker=liar, ts=ts, period_s=0.5, kv_used_blocks=-(2**62), kv_total_blocks=512)

    await _publish_for(0.5, nc, subjects.load(cluster.ns, liar), lie)
    assert router.view.load(liar).active_blocks >= 0
    assert router.load_malformed >= 5
    results = await asyncio.gather(*(complete(http, router, [*prefix, i, i + 3]) for i in range(4)))
    assert [h["x-kvswitch-decode-worker"] for _, _, h in results] == [holder] * 4  # where the prefix is
    before, fields = router.load_malformed, ("running", "waiting", "kv_total_blocks", "prefill_tokens_queued")
    for field in fields:
        report = LoadReport(worker=liar, ts=time.time(), **{field: -1})  # type: ignore[arg-type]
        await nc.publish(subjects.load(cluster.ns, liar), encode_msg(report))
    await flush(nc)
    await until(lambda: router.load_malformed == before + len(fields), what="each negative count dropped")
    load = router.view.load(liar)
    assert min(load.running, load.waiting, load.prefill_tokens_queued, load.kv_total_blocks or 0) >= 0


async def test_a_load_report_claiming_a_kv_capacity_no_engine_has_is_dropped(cluster: Cluster, nc: Client) -> None:
    # Its kv_total_blocks sizes the worker's index bound (router.kv_ingest): 2**60 lifted that bound,
    # and the byte budget of the worker's kvstate replies with it, past any memory.
    w = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    limit = router.ingest.reply_limit(w.id)

    def lie(ts: float) -> LoadReport:  # its own subject, its own name
        return LoadReport(worker=w.id, ts=ts, period_s=0.5, kv_total_blocks=2**60)

    await _publish_for(0.5, nc, subjects.load(cluster.ns, w.id), lie)
    assert router.load_malformed >= 5
    assert router.ingest.reply_limit(w.id) == limit == 1 << 22


# --- worker records ------------------------------------------------------------------------------


def info(worker: str, block_size: int = 16, **kw: Any) -> WorkerInfo:
    return WorkerInfo(worker=worker, model=MODEL, role="agg", engine="vllm", block_size=block_size, **kw)


@pytest.fixture
async def disc(etcd_url: str, ns: str) -> AsyncIterator[Discovery]:
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        yield d


class Seen:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.removed: list[str] = []

    def registry(self, disc: Discovery) -> WorkerRegistry:
        return WorkerRegistry(disc, lambda i: self.added.append(i.worker), self.removed.append)

    @contextlib.asynccontextmanager
    async def watching(self, disc: Discovery) -> AsyncIterator[WorkerRegistry]:
        """A registry over `disc`, started and ready; stopped on leaving."""
        reg = self.registry(disc)
        await reg.start()
        try:
            assert await reg.wait_ready(10.0)
            yield reg
        finally:
            await reg.stop()


async def _put_raw(disc: Discovery, key: bytes, value: WorkerInfo) -> None:
    assert disc.client.kv is not None
    await disc.client.kv.put(key, encode_json(value), timeout=5.0)


async def test_records_that_cannot_be_true_are_refused_and_the_watch_goes_on(
    disc: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    seen = Seen()
    async with seen.watching(disc) as reg:
        prefix = subjects.workers_prefix(disc.ns).encode()
        await _put_raw(disc, prefix + b"\xff\xfe", info("x"))  # not UTF-8
        await _put_raw(disc, prefix + b"a.b", info("a.b"))  # no subject token: no NATS subject names it
        zero = await disc.register_worker(lambda wid: info(wid, block_size=0), ttl=10)
        good = await disc.register_worker(info, ttl=10)
        await until(lambda: reg.get(good.hex_id) is not None, timeout=10.0, what="a good worker seen after bad ones")
        assert [i.worker for i in reg.workers()] == [good.hex_id] and seen.added == [good.hex_id]
        assert reg.refused == 3
        said = sorted(r.getMessage() for r in caplog.records if "ignored" in r.getMessage())
        assert len(said) == 3
        assert any(zero.hex_id in m and "block_size 0" in m for m in said)
        assert any("\\\\xff\\\\xfe" in m for m in said)
        assert not reg._task.done()  # type: ignore[union-attr]


async def test_a_record_claiming_a_kv_capacity_no_engine_has_is_refused(
    disc: Discovery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    seen = Seen()
    async with seen.watching(disc) as reg:
        liar = await disc.register_worker(lambda wid: info(wid, kv_total_blocks=2**60), ttl=10)
        most = await disc.register_worker(lambda wid: info(wid, kv_total_blocks=MAX_KV_TOTAL_BLOCKS), ttl=10)
        await until(lambda: reg.get(most.hex_id) is not None, timeout=10.0, what="the largest plausible record")
        assert reg.get(liar.hex_id) is None and seen.added == [most.hex_id] and reg.refused == 1
        said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        assert len(said) == 1 and liar.hex_id in said[0] and "kv_total_blocks" in said[0]


async def test_a_record_that_turns_bad_goes_and_is_said_once(disc: Discovery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="router.worker_registry")
    seen = Seen()
    async with seen.watching(disc) as reg:
        lease = await disc.register_worker(info, ttl=10)
        w = lease.hex_id
        await until(lambda: reg.get(w) is not None)
        await disc.update_worker(lease, info(w, max_model_len=0))
        await until(lambda: seen.removed == [w], what="the worker gone with its bad record")
        await disc.update_worker(lease, info(w, max_model_len=0, version="again"))
        await until(lambda: reg.refused == 2)
        assert reg.get(w) is None
        assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == 1
        await disc.update_worker(lease, info(w))
        await until(lambda: reg.get(w) is not None, what="the worker back with a good record")


async def test_a_zero_block_size_record_first_does_not_stop_its_model(
    cluster: Cluster, disc: Discovery, http: aiohttp.ClientSession
) -> None:
    bad = await disc.register_worker(lambda wid: info(wid, block_size=0, tokenizer="builtin"), ttl=10)
    router = await cluster.add_router(disagg="never")
    assert await router.registry.wait_ready(10.0)  # the bad record came first, in the snapshot
    good = await cluster.add_worker("agg")
    await until(lambda: router.registry.get(good.id) is not None and router.ingest.sync_state(good.id) is None)
    for prompt in (list(range(64)), "hello there"):
        status, body, _ = await complete(http, router, prompt)
        assert status == 200, body
    assert router.registry.get(bad.hex_id) is None and router.registry.refused == 1


def test_a_worker_still_bootstrapping_does_not_decide_its_models_block_size() -> None:
    # A record with no shim behind it (or a shim not yet synced) registered first with another block
    # size used to win the tie, and the worker that serves was excluded as `block_size`.
    sync = {"ghost": ("bootstrapping", "no state from its shim yet")}
    elig = Eligibility(clock=lambda: 0.0, sync_state=sync.get, liveness=lambda w: None, tokenizer="builtin")
    elig.added("ghost")
    elig.added("real")
    infos = [info("ghost", block_size=32), info("real")]
    assert elig.block_sizes(infos) == {MODEL: 16}
    real = elig.statuses(infos)[1]
    assert real.routable, real.detail
    # Once both serve, the tie goes to the size the model is served with (router.fleet_vote, since
    # the third review of 2026-12-07; before, to the greater size, and the real worker was left out)
    sync.clear()
    assert elig.block_sizes(infos) == {MODEL: 16}
    assert elig.statuses(infos)[0].exclusion is Exclusion.BLOCK_SIZE
    # and a replica with none yet (started now), keys created alike, gives it to the greater size
    fresh = Eligibility(clock=lambda: 0.0, sync_state=sync.get, liveness=lambda w: None, tokenizer="builtin")
    assert fresh.block_sizes(infos) == {MODEL: 32}
    assert fresh.statuses(infos)[1].exclusion is Exclusion.BLOCK_SIZE


# --- watches that crash --------------------------------------------------------------------------


def _crashing_once(watch: Any) -> Any:
    """`watch` (a Discovery method) whose first watch raises after its snapshot."""
    calls = 0

    async def crash_after_snapshot(events: AsyncGenerator[WatchEvent[Any], None]) -> AsyncGenerator[Any, None]:
        yield await anext(events)
        await events.aclose()
        raise RuntimeError("a bug in the watch")

    def watched(*args: Any) -> AsyncGenerator[Any, None]:
        nonlocal calls
        calls += 1
        return crash_after_snapshot(watch(*args)) if calls == 1 else watch(*args)

    return watched


async def test_the_worker_watch_starts_again_after_a_crash(
    disc: Discovery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="discovery.watch")
    monkeypatch.setattr(disc, "watch_workers", _crashing_once(disc.watch_workers))
    seen = Seen()
    async with seen.watching(disc) as reg:
        lease = await disc.register_worker(info, ttl=10)
        await until(lambda: reg.get(lease.hex_id) is not None, timeout=10.0, what="a worker seen after the crash")
        assert any("the worker watch crashed" in r.getMessage() for r in caplog.records)


async def test_the_router_watch_starts_again_after_a_crash(
    nc: Client, ns: str, disc: Discovery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disc, "watch_routers", _crashing_once(disc.watch_routers))
    sync = ReplicaSync(nc, ns, "rb", LoadView(), flush_ms=1.0, discovery=disc)
    await sync.start()
    try:
        await until(lambda: sync.registered("nobody") is False, what="the first snapshot")
        peer: Lease = await disc.register_router(lambda rid: RouterInfo(router=rid, http_url="", started_at=0.0))
        await until(lambda: sync.registered(peer.hex_id) is True, timeout=10.0, what="a peer seen after the crash")
    finally:
        await sync.stop()


# --- peer bookings -------------------------------------------------------------------------------


async def test_a_peer_booking_no_request_makes_is_refused_counted_and_said_once(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.replica_sync")
    view = LoadView()
    view.update(LoadReport(worker="w1", ts=time.time() - 1, kv_total_blocks=512))
    sync = ReplicaSync(nc, ns, "rb", view, flush_ms=1.0)
    await sync.start()
    try:
        entries = [
            SyncEntry(request_id="over-capacity", worker="w1", kind="add", blocks=513),
            SyncEntry(request_id="huge-blocks", worker="w2", kind="add", blocks=2**63),  # w2's capacity unknown
            SyncEntry(request_id="huge-prompt", worker="w2", kind="add", tokens=2**31 + 1),
            SyncEntry(request_id="fits", worker="w1", kind="add", tokens=8000, blocks=512),
        ]
        await nc.publish(subjects.sync(ns), encode_msg(RouterSync(router="ra", entries=entries)))
        await until(lambda: sync.stats.entries_received == len(entries))
        assert sync.stats.malformed == 3
        assert view.bookings("w1") == 1 and view.bookings("w2") == 0
        assert view.load("w1").active_blocks == 512
        assert len([r for r in caplog.records if "malformed router sync" in r.getMessage()]) == 1
    finally:
        await sync.stop()


# --- transfers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("named", ["", "p2"])
async def test_a_transfer_is_put_down_to_the_prefill_worker_the_router_chose(
    nc: Client, ns: str, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.dispatch")
    health = TransferHealth()
    calls: list[tuple[str, str, bool]] = []

    def on_transfer(decode: str, prefill: str, ok: bool) -> None:
        calls.append((decode, prefill, ok))
        (health.succeeded if ok else health.failed)(decode, prefill)

    d = Dispatcher(nc, ns, Books(), settings=lambda: RouterSettings(stream_heartbeat_s=HB), on_transfer=on_transfer)
    await d.start()

    async def prefill(nc_: Client, msg: Msg, req: GenerateRequest) -> None:  # its handle names `named`
        handle = TransferHandle(engine="vllm", params={"x": 1}, prefill_worker=named)
        await chunk(nc_, msg, req, 0, final=True, finish_reason="length", transfer=handle)

    def decode(pull_fails: bool) -> Any:
        async def run(nc_: Client, msg: Msg, req: GenerateRequest) -> None:
            if pull_fails and req.disagg is not None:  # vLLM's 500 when the KV load fails
                error = ErrorInfo(code=500, kind="engine_error", message="KV load failed")
                await chunk(nc_, msg, req, 0, final=True, error=error)
                return
            await chunk(nc_, msg, req, 0, token_ids=[5], final=True, finish_reason="length")

        return run

    try:
        await Worker(nc, ns, "p1").serve("prefill", prefill)
        await Worker(nc, ns, "d1").serve("decode", decode(pull_fails=True))
        await Worker(nc, ns, "d2").serve("decode", decode(pull_fails=False))
        await collect(d, job("d1", prefill="p1"))
        await collect(d, job("d2", prefill="p1"))
    finally:
        await d.stop()
    assert calls == [("d1", "p1", False), ("d2", "p1", True)]
    assert health.failing("d1", "p1") and not health.failing("d1", "p3")
    mismatch = [r for r in caplog.records if "transfer handle names" in r.getMessage()]
    assert len(mismatch) == (1 if named else 0)
