"""A cause the whole fleet shares is said for the first NAMED_AT_MOST workers and counted for the
rest (router.fleet_lines), at each site that logged it once per worker: the KV digest check, gap
repair, the tokenizer and build checks, a KV index ahead of its shim, malformed KV events, malformed
replies, the service's clock steps and malformed load reports (its unregistered load reports are in
test_isolation_peers), calibration's three warnings, a failed KV pull and a prefill worker's failing
legs, and the ends of those two and of the KV ERRORs, KV batches held past their bound, and refused
worker records. One worker alone is named as before. Log-volume audit of 2026-12-06."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import time
import types
from collections import deque
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client

from discovery import Discovery, Snapshot
from protocol import WorkerInfo, encode_msg, subjects
from protocol.config import EtcdSettings
from protocol.messages import LoadReport, Stored
from protocol.timing import DEFAULT_PROFILE
from router.block_index import BlockIndex
from router.calibration import DROPPED_WARN_AFTER, NO_CONTEXT_WARN_AFTER, Calibration
from router.dispatch import Dispatcher
from router.eligibility import NAMED_AT_MOST, PREFILL_COOLDOWN_S, Eligibility, Exclusion
from router.fleet_lines import (
    RECORD_GRACE_S,
    UNREGISTERED_SAID,
    UNREGISTERED_SAID_S,
    FirstHeard,
    FleetEpisodes,
    FleetLines,
    FleetLog,
)
from router.gap_repair import FailureKind, GapRepair
from router.kv_ingest import KvIngest
from router.leg import LegError
from router.tokenization import FingerprintWatch
from router.transfer_health import TransferHealth
from router.worker_registry import WorkerRegistry
from router.worker_versions import WorkerVersions
from runtime.nats_flush import flush
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until
from tests.router.test_calibration import SharedPrefixEngine, SyntheticEngine, _polled
from tests.router.test_calibration import _info as _timed_info
from tests.router.test_kv_ingest import FakeShim, _bad_hash

FLEET = 20
WORKERS = [f"w{i:04d}" for i in range(FLEET)]


def _lines(caplog: pytest.LogCaptureFixture, logger: str, level: int, marker: str) -> tuple[list[str], list[str]]:
    """(lines naming a worker and holding `marker`, summary lines) of `logger` at `level`."""
    said = [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]
    return [m for m in said if marker in m and not m.startswith("and ")], [m for m in said if m.startswith("and ")]


async def test_the_first_workers_are_named_and_the_rest_counted_by_the_loop_timer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("tests.fleet_lines")
    lines = FleetLines(log, logging.WARNING, "the cause", window_s=0.2)
    with caplog.at_level(logging.WARNING, logger="tests.fleet_lines"):
        for worker in WORKERS:
            lines.say(worker, "worker %s hit it", worker)
        lines.say(WORKERS[-1], "worker %s hit it", WORKERS[-1])  # held again: one worker, two lines
        lines.say(WORKERS[0], "worker %s hit it", WORKERS[0])  # named again: it is one of the few
        assert lines.held() == FLEET - NAMED_AT_MOST
        await until(lambda: lines.held() == 0, what="the window's summary said by the loop's timer")
    named, summary = _lines(caplog, "tests.fleet_lines", logging.WARNING, "hit it")
    assert len(named) == NAMED_AT_MOST + 1 and named[0] == named[-1] == "worker w0000 hit it"
    assert summary == [f"and {FLEET - NAMED_AT_MOST} more workers ({FLEET - NAMED_AT_MOST + 1} lines): the cause"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tests.fleet_lines"):
        await asyncio.sleep(0.25)  # a new window names again
        lines.say("w0019", "worker %s hit it", "w0019")
    assert [r.getMessage() for r in caplog.records] == ["worker w0019 hit it"]


async def test_a_clock_stepped_back_opens_a_new_window(caplog: pytest.LogCaptureFixture) -> None:
    """TransferHealth's lines read the planner's clock, time.time by default: a host stepped back an
    hour (NTP) left the window open for the hour, naming no worker, and set the summary's timer an
    hour and the window ahead (review of 2026-12-06, /tmp/audit/revA_step.py)."""
    wall = [1_000_000.0]
    lines = FleetLines(logging.getLogger("tests.fleet_lines"), logging.WARNING, "the cause", window_s=0.2,
                       clock=lambda: wall[0])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="tests.fleet_lines"):
        for worker in WORKERS[:NAMED_AT_MOST]:
            lines.say(worker, "worker %s hit it", worker)
        wall[0] -= 3600
        said = [lines.say(worker, "worker %s hit it", worker) for worker in WORKERS[NAMED_AT_MOST:]]
        assert said == [True] * NAMED_AT_MOST + [False] * (FLEET - 2 * NAMED_AT_MOST)
        await until(lambda: lines.held() == 0, timeout=2.0, what="the summary within the window, on the loop's time")
    named, summary = _lines(caplog, "tests.fleet_lines", logging.WARNING, "hit it")
    assert named == [f"worker {w} hit it" for w in WORKERS[: 2 * NAMED_AT_MOST]]
    assert summary == [f"and {FLEET - 2 * NAMED_AT_MOST} more workers: the cause"]


def test_more_senders_with_no_record_than_the_table_holds_are_each_past_grace_in_time() -> None:
    """Evicted oldest first, 1,025 senders with no record reporting in turn each left the table
    before its next report, and none was ever said (review of 2026-12-07)."""
    now = [0.0]
    heard = FirstHeard(clock=lambda: now[0])
    senders = [f"w{i:05d}" for i in range(UNREGISTERED_SAID + 1)]
    past = set()
    while now[0] <= RECORD_GRACE_S:
        past |= {s for s in senders if heard.past_grace(s)}
        now[0] += 0.5
    assert past == set(senders)


def test_a_sender_with_no_record_is_past_grace_under_a_flood_of_minted_names() -> None:
    now = [0.0]
    heard = FirstHeard(clock=lambda: now[0])
    assert not heard.past_grace("stranger")  # in its grace
    minted = (f"forged{i}" for i in range(10**6))
    for _ in range(UNREGISTERED_SAID):
        heard.past_grace(next(minted))
    assert heard.past_grace(next(minted))  # the table full: no grace to give
    now[0] = RECORD_GRACE_S
    assert heard.past_grace("stranger")


def test_names_heard_once_leave_the_table_so_a_later_sender_has_its_grace() -> None:
    now = [0.0]
    heard = FirstHeard(clock=lambda: now[0])
    for i in range(UNREGISTERED_SAID):
        heard.past_grace(f"forged{i}")
    now[0] = UNREGISTERED_SAID_S + 1
    assert not heard.past_grace("registering")  # its record may still land
    heard.forget("registering")  # it landed
    assert not heard.past_grace("registering")  # its next record-less report starts the grace again


def test_an_episode_named_as_it_began_is_named_as_it_ends_unless_its_worker_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("tests.fleet_lines")
    episodes = FleetEpisodes(FleetLines(log, logging.WARNING, "failed"), FleetLines(log, logging.INFO, "recovered"))
    with caplog.at_level(logging.INFO, logger="tests.fleet_lines"):
        for worker in WORKERS:
            episodes.began(worker, "worker %s failed", worker)
        episodes.forget("w0000")  # it left, its episode unended: back, it is a worker as any other
        for worker in WORKERS[::-1]:
            episodes.ended(worker, "worker %s recovered", worker)
        episodes._end.flush()
    said = [r for r in caplog.records if r.levelno == logging.INFO]
    assert {r.getMessage().split()[1] for r in said[:-1]} == set(WORKERS[1:NAMED_AT_MOST] + WORKERS[-NAMED_AT_MOST:])
    assert said[-1].getMessage() == f"and {FLEET - 2 * NAMED_AT_MOST + 1} more workers: recovered"
    assert {r.pathname for r in caplog.records if "worker w" in r.getMessage()} == {__file__}  # put down to here


def test_a_stopping_router_says_what_it_held(caplog: pytest.LogCaptureFixture) -> None:
    # RouterService.stop flushes its FleetLog: the window's timer would never fire after it.
    held_by = FleetLog()
    lines = FleetLines(
        logging.getLogger("tests.fleet_lines"),
        logging.WARNING,
        "the cause",
        window_s=3600,
        fleet_log=held_by,
    )
    with caplog.at_level(logging.WARNING, logger="tests.fleet_lines"):
        for worker in WORKERS:
            lines.say(worker, "worker %s hit it", worker)
        held_by.flush()
    assert _lines(caplog, "tests.fleet_lines", logging.WARNING, "hit it")[1] == [
        f"and {FLEET - NAMED_AT_MOST} more workers: the cause"
    ]


async def test_a_stopping_router_says_its_own_held_lines_and_no_other_routers(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Two routers in one process (tests, the embedded local cluster): stopping one said every
    router's held lines (a process-wide flush), the other's before its window ended."""
    first, second = await cluster.add_router(), await cluster.add_router()
    fault = "its prefill legs return no transfer handle"
    caplog.set_level(logging.WARNING, logger="router.eligibility")
    for router, fleet in ((first, FLEET), (second, FLEET + 10)):
        for worker in [f"w{i:04d}" for i in range(fleet)]:
            router.eligibility.prefill_leg(worker, fault)
    await first.stop()

    def summaries() -> list[str]:
        return _lines(caplog, "router.eligibility", logging.WARNING, fault)[1]

    assert summaries() == [f"and {FLEET - NAMED_AT_MOST} more workers: failed prefill legs through their own fault"
                           f" (one cause for many prefill workers at once: a configuration they share, such as no "
                           "--kv-transfer-config; the named workers' lines say what failed). Their requests prefill "
                           "elsewhere for 30s after each such failure"]  # fmt: skip
    await second.stop()
    assert [m.split(":")[0] for m in summaries()] == [
        f"and {FLEET - NAMED_AT_MOST} more workers",
        f"and {FLEET + 10 - NAMED_AT_MOST} more workers",
    ]


def _reachable_fleet_lines(root: object, *, besides: object) -> list[FleetLines]:
    """Every FleetLines reachable from `root` through the attributes of kvswitch's objects (their
    containers and bound methods too), but not through `besides`."""
    ours = ("router", "runtime", "discovery", "protocol")
    containers = (dict, list, tuple, set, frozenset, deque)
    seen: set[int] = {id(besides)}
    found: list[FleetLines] = []
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, FleetLines):
            found.append(obj)
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif isinstance(obj, containers) or type(obj).__module__.split(".")[0] in ours:
            todo.extend(gc.get_referents(obj))
    return found


async def test_every_per_worker_line_of_a_router_is_said_as_it_stops(cluster: Cluster) -> None:
    """A part made without the router's FleetLog would keep what it holds past the router's stop."""
    router = await cluster.add_router()
    reachable = _reachable_fleet_lines(router, besides=router.fleet_log)  # the parts' own, not the log's list
    owned = {id(lines) for lines in router.fleet_log._lines}
    assert [lines._cause for lines in reachable if id(lines) not in owned] == []
    assert {id(lines) for lines in reachable} == owned  # and the walk reached every part that makes one


@pytest.fixture
async def fleet_ingest(nc: Client, ns: str) -> AsyncIterator[tuple[KvIngest, list[FakeShim]]]:
    ing = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.5, retry_max_s=0.2)
    await ing.start()
    shims = [FakeShim(nc, ns, w) for w in WORKERS]
    for shim in shims:
        await shim.start()
        ing.add_worker(shim.worker, shim.epoch)
    assert await ing.wait_synced(20.0)
    yield ing, shims
    await ing.stop()


def _wrong_digest(shim: FakeShim) -> LoadReport:
    """A report at the index's seq whose digest the index cannot have (the shim's dump holds nothing)."""
    return LoadReport(worker=shim.worker, ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=1, kv_xor=1)


async def test_a_fleet_whose_digests_disagree_is_said_once_per_worker_and_capped(
    fleet_ingest: tuple[KvIngest, list[FakeShim]], caplog: pytest.LogCaptureFixture
) -> None:
    ingest, shims = fleet_ingest
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    for _ in range(3):  # a lasting disagreement: a resync, then (no dump fixes it) a back-off
        for shim in shims:
            ingest.check_digest(_wrong_digest(shim))
        assert await ingest.wait_synced(20.0)
    assert ingest.stats.digest_mismatches == FLEET  # every resync counted
    assert ingest.stats.digest_unfixed == FLEET
    ingest._digest_lines.flush()
    named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "disagrees at seq")
    assert len(named) == NAMED_AT_MOST
    assert len(summary) == 1 and summary[0].startswith(f"and {FLEET - NAMED_AT_MOST} more workers: their KV digests")
    ingest._unfixed_lines.flush()
    named, summary = _lines(caplog, "router.kv_ingest", logging.ERROR, "right after a full dump")
    assert len(named) == NAMED_AT_MOST
    assert len(summary) == 1 and "another kvswitch build" in summary[0]


async def test_one_worker_whose_digest_disagrees_is_named_once_per_episode(
    fleet_ingest: tuple[KvIngest, list[FakeShim]], caplog: pytest.LogCaptureFixture
) -> None:
    ingest, shims = fleet_ingest
    shim = shims[0]
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    for _ in range(2):  # a resync, then a back-off: the dump did not make it agree
        ingest.check_digest(_wrong_digest(shim))
        assert await ingest.wait_synced(20.0)
    agrees = LoadReport(worker=shim.worker, ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq, kv_blocks=0, kv_xor=0)
    ingest.check_digest(agrees)  # the episode ends, and its back-off
    ingest.check_digest(_wrong_digest(shim))
    assert await ingest.wait_synced(20.0)
    ingest._digest_lines.flush()
    named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "disagrees at seq")
    assert (
        named
        == [f"KV digest of worker {shim.worker} disagrees at seq 0: index 0 blocks xor 0, shim 1 xor 1; resyncing"] * 2
    )
    assert summary == [] and ingest.stats.digest_mismatches == 2


async def test_a_fleet_whose_kvstate_goes_unanswered_is_capped_and_called_shared(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No shim answers (nobody subscribes: what a NATS permission change looks like to the router)."""
    caplog.set_level(logging.INFO, logger="router.gap_repair")
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.1)
    await ingest.start()
    try:
        for worker in WORKERS:
            ingest.add_worker(worker, 1)
        await until(lambda: all(ingest.repairs.failures(w) >= 4 for w in WORKERS), what="every worker's ERROR")
        ingest.repairs._error_lines.flush()
        ingest.repairs._retry_lines.flush()
    finally:
        await ingest.stop()
    named, summary = _lines(caplog, "router.gap_repair", logging.ERROR, "cannot be repaired")
    assert len(named) == NAMED_AT_MOST
    assert len(summary) == 1 and summary[0].startswith(f"and {FLEET - NAMED_AT_MOST} more workers: KV state cannot")
    assert f"{FLEET} of the {FLEET} workers being repaired fail alike" in summary[0]
    assert "likely shared" in summary[0] and f"{ns}.kvstate.*" in summary[0]
    retried, _ = _lines(caplog, "router.gap_repair", logging.INFO, "; retrying")
    assert len({m.split()[3] for m in retried}) <= NAMED_AT_MOST


async def test_a_fleet_of_hung_shims_of_several_sizes_fails_alike(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every shim hears its kvstate request and never answers; half hold 2 M blocks, so each waits
    longer (0.2 s, then 0.4 s). The verdict grouped failures by their text and said nothing shared."""
    caplog.set_level(logging.ERROR, logger="router.gap_repair")

    async def hung(msg: object) -> None:
        pass

    await nc.subscribe(f"{ns}.kvstate.*", cb=hung)
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.1)
    await ingest.start()
    try:
        for i, worker in enumerate(WORKERS):
            blocks = 2_000_000 if i % 2 else 0
            ingest.add_worker(worker, 1, blocks)
            ingest.check_digest(LoadReport(worker=worker, ts=0.0, kv_blocks=blocks, kv_total_blocks=blocks))
        await until(lambda: all(ingest.repairs.failures(w) >= 4 for w in WORKERS), what="every worker's ERROR")
        texts = {loop.last_failure for loop in ingest.repairs._loops.values()}
        assert texts == {"no reply within 0.2s", "no reply within 0.4s"}
        ingest.repairs._error_lines.flush()
    finally:
        await ingest.stop()
    _, summary = _lines(caplog, "router.gap_repair", logging.ERROR, "cannot be repaired")
    assert len(summary) == 1 and f"{FLEET} of the {FLEET} workers being repaired fail alike (timed out" in summary[0]
    assert "likely shared" in summary[0], summary


async def test_one_worker_whose_kvstate_goes_unanswered_is_named_as_before(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.gap_repair")
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.1)
    await ingest.start()
    try:
        ingest.add_worker("w0000", 1)
        await until(lambda: ingest.repairs.failures("w0000") >= 4, what="the worker's ERROR")
        ingest.repairs._error_lines.flush()
    finally:
        await ingest.stop()
    named, summary = _lines(caplog, "router.gap_repair", logging.ERROR, "cannot be repaired")
    assert len(named) == 1 and named[0].startswith("KV state of worker w0000 cannot be repaired (3 failures in a row")
    assert summary == []


def _info(worker: str, tokenizer: str = "tok-other", version: str = "9.9.9") -> WorkerInfo:
    return WorkerInfo(worker=worker, model="m", role="agg", engine="vllm", block_size=16, tokenizer=tokenizer,
                      version=version)  # fmt: skip


def test_a_fleet_of_another_tokenizer_is_named_for_a_few_and_counted_and_a_restart_is_no_news(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = FingerprintWatch("builtin")
    with caplog.at_level(logging.ERROR, logger="router.tokenization"):
        for worker in WORKERS:
            watch.check(_info(worker))
        watch._lines.flush()
        for worker in WORKERS:  # a fleet restart: every key deleted, then registered again
            watch.forget(worker)
        assert watch.summary()["text_refused_total"] == 0
        for worker in WORKERS:
            watch.check(_info(worker))
        watch._lines.flush()
    named, summary = _lines(caplog, "router.tokenization", logging.ERROR, "gets no text prompts")
    assert len(named) == NAMED_AT_MOST and named[0].startswith("worker w0000 (model m) gets no text prompts")
    assert len(summary) == 1 and summary[0].startswith(f"and {FLEET - NAMED_AT_MOST} more workers: get no text")
    assert watch.summary()["text_refused_total"] == FLEET


def test_one_worker_of_another_tokenizer_is_named_as_before(caplog: pytest.LogCaptureFixture) -> None:
    watch = FingerprintWatch("builtin")
    with caplog.at_level(logging.ERROR, logger="router.tokenization"):
        watch.check(_info("w0000"))
        watch.check(_info("w0000", tokenizer="builtin"))  # it is fixed, then breaks again: news
        watch.check(_info("w0000"))
        watch._lines.flush()
    named, summary = _lines(caplog, "router.tokenization", logging.ERROR, "gets no text prompts")
    assert len(named) == 2 and all(m.startswith("worker w0000 (model m) gets no text prompts") for m in named)
    assert summary == []


def test_a_router_of_another_build_than_its_fleet_is_said_to_be_the_odd_one_out_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    versions = WorkerVersions("1.0.0")
    with caplog.at_level(logging.INFO, logger="router.worker_versions"):
        for worker in WORKERS:
            versions.check(_info(worker))
        versions._lines.flush()
        for worker in WORKERS:  # a fleet restart
            versions.forget(worker)
        for worker in WORKERS:
            versions.check(_info(worker))
        versions._lines.flush()
    named, summary = _lines(caplog, "router.worker_versions", logging.WARNING, "was left behind")
    assert len(named) == NAMED_AT_MOST and named[0].startswith("worker w0000 runs kvswitch 9.9.9, this router 1.0.0")
    assert len(summary) == 1 and summary[0].startswith(f"and {FLEET - NAMED_AT_MOST} more workers: run another")
    said = f"{FLEET} of the {FLEET} registered workers run kvswitch 9.9.9: this router differs from most of the fleet"
    assert said in summary[0]
    assert "go on with the shims" in summary[0] and "upgrade it (or roll" not in summary[0]
    assert len(versions.others()) == FLEET


def test_one_worker_of_another_build_is_named_as_before(caplog: pytest.LogCaptureFixture) -> None:
    versions = WorkerVersions("1.0.0")
    with caplog.at_level(logging.INFO, logger="router.worker_versions"):
        for worker in WORKERS[1:4]:
            versions.check(_info(worker, version="1.0.0"))
        versions.check(_info("w0000"))
        versions.check(_info("w0000", version="1.0.0"))
        versions._lines.flush()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "worker w0000 runs kvswitch 9.9.9, this router 1.0.0: a rolling upgrade is in progress, or w0000 was left "
        "behind; docs/deployment.md, Upgrades",
        "worker w0000 runs kvswitch 1.0.0, as this router does, again",
    ]


def test_a_fleet_failing_alike_is_pointed_at_what_that_kind_of_failure_shares() -> None:
    # Only a reply that never comes points at NATS permissions or the shims: this router's own
    # byte limit and an unreadable reply (another build) did too (review of the 2026-12-06 work).
    repair = GapRepair(None, "ns", None)  # type: ignore[arg-type]  # never fetches here
    for kind in (FailureKind.TIMED_OUT, FailureKind.NO_RESPONDERS):
        assert "NATS permissions on ns.kvstate.*" in repair._shared_cause(kind)
    assert "this router repairing more workers at once" in repair._shared_cause(FailureKind.BYTE_LIMIT)
    assert "another kvswitch build" in repair._shared_cause(FailureKind.MALFORMED)
    assert "NATS permissions" not in repair._shared_cause(FailureKind.BYTE_LIMIT) + repair._shared_cause(
        FailureKind.MALFORMED
    )


def _summarised(summary: list[str], n: int, *causes: str) -> bool:
    """Whether `summary` is what `n` workers hitting each cause get: a line per cause (in any order:
    a FleetLog's) counting those past NAMED_AT_MOST, none while it names them all."""
    heads = [f"and {n - NAMED_AT_MOST} more workers: {cause}" for cause in causes] if n > NAMED_AT_MOST else []
    return len(summary) == len(heads) and all(any(m.startswith(h) for m in summary) for h in heads)


@pytest.mark.parametrize("fleet", [1, FLEET])
async def test_a_fleet_whose_index_runs_ahead_of_its_shims_is_capped(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture, fleet: int
) -> None:
    held_by = FleetLog()
    ingest = KvIngest(
        nc,
        ns,
        BlockIndex(),
        request_timeout_s=0.5,
        retry_max_s=0.2,
        behind_grace_s=1.0,
        fleet_log=held_by,
    )
    await ingest.start()
    try:
        shims = [FakeShim(nc, ns, w) for w in WORKERS[:fleet]]
        for shim in shims:
            await shim.start()
            ingest.add_worker(shim.worker, shim.epoch)
        assert await ingest.wait_synced(20.0)
        for shim in shims:
            await shim.publish()
        await until(lambda: ingest.stats.batches_applied == fleet, what="every worker's batch applied")
        caplog.set_level(logging.WARNING, logger="router.kv_ingest")
        for ts in (10.0, 11.0):  # made after seq 1 went, still at seq 0, for the grace: the index is ahead
            for shim in shims:
                ingest.check_digest(LoadReport(worker=shim.worker, ts=ts, kv_epoch=shim.epoch, kv_seq=0))
        assert ingest.stats.digest_mismatches == fleet  # every resync counted
        held_by.flush()
    finally:
        await ingest.stop()
    named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "which its shim has not reached")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0] == (
        "KV index of worker w0000 is at seq 1, which its shim has not reached in 1.0s of its reports (it is at 0); "
        "resyncing"
    )
    assert _summarised(summary, fleet, "their KV index")


@pytest.mark.parametrize("fleet", [1, FLEET])
async def test_a_fleet_sending_malformed_kv_events_is_capped(
    fleet_ingest: tuple[KvIngest, list[FakeShim]], nc: Client, ns: str, caplog: pytest.LogCaptureFixture, fleet: int
) -> None:
    ingest, shims = fleet_ingest
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    for shim in shims[:fleet]:
        await _bad_hash(nc, ns, shim)
    await until(lambda: ingest.stats.malformed == fleet, what="every bad batch counted")
    ingest._malformed_lines.flush()
    named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "dropping malformed KV events from")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0].startswith("dropping malformed KV events from worker w0000 (logged once per worker and kind): ")
    assert _summarised(summary, fleet, "dropping malformed KV events")


@pytest.mark.parametrize("fleet", [1, FLEET])
async def test_a_fleet_replaying_short_is_capped_on_lines_of_its_own(
    fleet_ingest: tuple[KvIngest, list[FakeShim]], caplog: pytest.LogCaptureFixture, fleet: int
) -> None:
    ingest, shims = fleet_ingest
    caplog.set_level(logging.WARNING, logger="router.kv_ingest")
    for shim in shims[:fleet]:  # a gap: its replay carries seq 1 alone, the shim at seq 2
        shim.short_replays = 1
        await shim.publish(Stored(hashes=[1]), drop=True)
        await shim.publish(Stored(hashes=[2], parent=1))
    await until(lambda: ingest.stats.malformed == fleet and ingest.synced, what="every short replay, then a dump")
    ingest._short_replay_lines.flush()
    named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "KV replay")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0] == (
        "applied worker w0000's KV replay, which stops at seq 1, short of its own seq 2; a full dump is next, the "
        "worker out of routing until it is in (logged once per worker)"
    )
    assert _summarised(summary, fleet, "their KV replays were applied but stop short of their shims' own seq")


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_sending_malformed_replies_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    held_by = FleetLog()
    d = Dispatcher(None, "ns", None, fleet_log=held_by)  # type: ignore[arg-type]  # _blame touches no connection
    with caplog.at_level(logging.WARNING, logger="router.dispatch"):
        for _ in range(2):  # a second reply each: counted, not said
            for worker in WORKERS[:fleet]:
                d._blame(LegError(worker, 502, "malformed_chunk", "bad chunk", retryable=True))
        held_by.flush()
    assert sum(d.malformed_replies.values()) == 2 * fleet
    named, summary = _lines(caplog, "router.dispatch", logging.WARNING, "sent a malformed reply")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0] == (
        "worker w0000 sent a malformed reply (bad chunk): its requests go to other workers, and it is left out of "
        "routing for 30s after each such reply (logged once per worker, counted in "
        "kvswitch_router_worker_malformed_replies_total)"
    )
    assert _summarised(summary, fleet, "sent malformed replies,")


@pytest.mark.parametrize("fleet", [1, FLEET])
async def test_a_fleet_whose_clocks_step_back_or_whose_load_reports_are_malformed_is_capped(
    cluster: Cluster, nc: Client, caplog: pytest.LogCaptureFixture, fleet: int
) -> None:
    """Records alone (no shim): this router takes the load reports the test publishes as theirs."""
    router = await cluster.add_router()
    caplog.set_level(logging.WARNING, logger="router.service")
    info = WorkerInfo(worker="", model=MODEL, role="agg", engine="vllm", block_size=16)
    async with Discovery(EtcdSettings(endpoints=[cluster.etcd_url]), cluster.ns) as disc:
        record = lambda wid: msgspec.structs.replace(info, worker=wid)  # noqa: E731
        leases = [await disc.register_worker(record, ttl=10) for _ in range(fleet)]
        workers = [lease.hex_id for lease in leases]
        try:
            await until(lambda: all(router.registry.get(w) is not None for w in workers), what="every record read")
            now = time.time()
            for stamp in (now, now - 60.0):  # every host stepped back a minute at once (an NTP correction)
                for w in workers:
                    await nc.publish(subjects.load(cluster.ns, w), encode_msg(LoadReport(worker=w, ts=stamp)))
            for w in workers:  # malformed: a negative count
                await nc.publish(subjects.load(cluster.ns, w), encode_msg(LoadReport(worker=w, ts=now, running=-1)))
            await flush(nc)
            await until(lambda: router.load_malformed == fleet, what="every report read")
            router.fleet_log.flush()
        finally:
            for lease in leases:
                await disc.release(lease)
    stepped, summary = _lines(caplog, "router.service", logging.WARNING, "clock stepped back")
    assert len(stepped) == min(fleet, NAMED_AT_MOST)
    assert stepped[0].startswith(f"worker {workers[0]}'s clock stepped back: a load report stamped 60.0 s before")
    malformed, _ = _lines(caplog, "router.service", logging.WARNING, "malformed load report")
    assert len(malformed) == min(fleet, NAMED_AT_MOST)
    assert malformed[0].startswith(f"malformed load report from worker {workers[0]} dropped (logged once per worker")
    assert _summarised(summary, fleet, "their clocks stepped back", "malformed load reports")


def _as(worker: str, report: LoadReport) -> LoadReport:
    return msgspec.structs.replace(report, worker=worker)


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_whose_busy_stretches_are_dropped_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    """Readings every 0.25 s, but the reports of the first 1.5 s after each stop lost on a path
    every worker shares: no stretch of any can be read."""
    held_by = FleetLog()
    cal, reports = Calibration(fleet_log=held_by), _polled(2.0, latency=0.0, bursty=True, seconds=40.0)
    with caplog.at_level(logging.WARNING, logger="router.calibration"):
        for worker in WORKERS[:fleet]:
            stopped = None
            for r in reports:
                if r.running:
                    stopped = None
                else:
                    stopped = r.engine_ts if stopped is None else stopped
                    if r.engine_ts < stopped + 1.5:
                        continue  # lost
                cal.observe(_timed_info(worker), _as(worker, r))
        held_by.flush()
    dropped = cal.dropped()
    assert sorted(dropped) == WORKERS[:fleet] and min(dropped.values()) >= DROPPED_WARN_AFTER
    assert len(set(dropped.values())) == 1  # every one counted alike: the cap holds no count back
    named, summary = _lines(caplog, "router.calibration", logging.WARNING, "busy stretches of its engine")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0].startswith(
        f"worker w0000: {DROPPED_WARN_AFTER} busy stretches of its engine were dropped and none fitted, so its "
        "timing stays the prior (its profile's times x1); the last was dropped because its engine started or went "
        "idle between two readings"
    )
    assert _summarised(summary, fleet, "busy stretches of their engines dropped")


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_fitted_past_the_bounds_of_its_profile_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    """Every engine 8x slower than the default profile, registered by none of them another (one
    wrong profile for the fleet)."""
    held_by = FleetLog()
    cal = Calibration(fleet_log=held_by)
    with caplog.at_level(logging.WARNING, logger="router.calibration"):
        for worker in WORKERS[:fleet]:
            engine, info = SyntheticEngine(8.0, 8.0), _timed_info(worker, profile=None)
            cal.observe(info, _as(worker, engine.report(running=1, context=4096)))
            for _ in range(120):
                running = engine.rng.randrange(1, 64)
                prefill = engine.rng.choice([0, 0, 4096, 16384, 40000])
                context = engine.rng.randrange(512, 16384)
                report = engine.interval(running=running, context=context, prefill_tokens=prefill)
                cal.observe(info, msgspec.structs.replace(report, worker=worker, decode_context=float(context)))
        held_by.flush()
    assert sorted(cal.factors()) == WORKERS[:fleet] and all(k_d == 5.0 for k_d, _, _ in cal.factors().values())
    named, summary = _lines(caplog, "router.calibration", logging.WARNING, "'s engine fits")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0].startswith("worker w0000's engine fits k_d=") and DEFAULT_PROFILE in named[0]
    assert "outside [0.2, 5], so it is predicted at the bound, wrongly" in named[0]
    assert _summarised(summary, fleet, "fit outside [0.2, 5] against their timing profiles")


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_of_shims_without_decode_context_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    held_by = FleetLog()
    cal = Calibration(fleet_log=held_by)
    with caplog.at_level(logging.WARNING, logger="router.calibration"):
        for worker in WORKERS[:fleet]:
            old_shim, info = SharedPrefixEngine(shared=4096, with_context=False), _timed_info(worker)
            cal.observe(info, _as(worker, old_shim.report(running=1, context=4608)))
            for _ in range(NO_CONTEXT_WARN_AFTER * 2):
                cal.observe(info, _as(worker, old_shim.interval(running=16, context=6000, prefill_tokens=0)))
        held_by.flush()
    named, summary = _lines(caplog, "router.calibration", logging.WARNING, "carry no decode_context")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0] == (
        "worker w0000 decodes but its load reports carry no decode_context (a shim that does not count it, or "
        "requests that bypass the shim): its decode timing is fitted against KV use, which counts a prefix its "
        "requests share once, so it may read slow"
    )
    assert _summarised(summary, fleet, "decode but their load reports carry no decode_context")


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_failing_to_load_kv_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    """Every decode worker fails its pulls from both prefill workers (a KV connector misconfigured
    fleet-wide): a named decode worker is named for each of its pairs, the rest counted."""
    held_by = FleetLog()
    transfers = TransferHealth(clock=lambda: 100.0, fleet_log=held_by)
    with caplog.at_level(logging.WARNING, logger="router.transfer_health"):
        for prefill in ("p1", "p2"):
            for worker in WORKERS[:fleet]:
                transfers.failed(worker, prefill)
                transfers.failed(worker, prefill)  # within its episode: counted, not said
        held_by.flush()
    assert transfers.failures == 4 * fleet and transfers.workers() == WORKERS[:fleet]
    named, summary = _lines(caplog, "router.transfer_health", logging.WARNING, "failed to load KV prefilled on")
    assert len(named) == 2 * min(fleet, NAMED_AT_MOST)
    assert named[0].startswith(
        "decode worker w0000 failed to load KV prefilled on p1: for the next 30s its requests pair with other "
        "prefill workers than p1 (bypass_transfer_failing when no prefill worker is left), then it is tried again."
    )
    held = fleet - NAMED_AT_MOST
    heads = [f"and {held} more workers ({2 * held} lines): decode workers failed to load KV"] if held > 0 else []
    assert len(summary) == len(heads) and all(m.startswith(h) for m, h in zip(summary, heads, strict=True))


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_prefill_fleet_failing_its_legs_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    """Every prefill engine started without a KV connector."""
    now = 1000.0
    held_by = FleetLog()
    elig = Eligibility(
        clock=lambda: now,
        sync_state=lambda w: None,
        liveness=lambda w: None,
        tokenizer=None,
        fleet_log=held_by,
    )
    fault = "its prefill legs return no transfer handle: its engine most likely runs without a KV connector"
    with caplog.at_level(logging.WARNING, logger="router.eligibility"):
        for _ in range(2):  # a second failure in its episode: not said
            for worker in WORKERS[:fleet]:
                elig.added(worker)
                elig.prefill_leg(worker, fault, serves_whole=True)
        held_by.flush()
    infos = [WorkerInfo(worker=w, model="m", role="prefill", engine="vllm", block_size=16) for w in WORKERS[:fleet]]
    assert {s.exclusion for s in elig.statuses(infos)} == {Exclusion.PREFILL_FAILING}
    named, summary = _lines(caplog, "router.eligibility", logging.WARNING, "failed a prefill leg through its own")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0] == (
        f"prefill worker w0000 failed a prefill leg through its own fault: {fault}. Its requests prefill on other "
        "prefill workers (or on their decode worker when none is left) for 30s after each such failure, then one "
        "request tries it again (logged once per episode)"
    )
    assert _summarised(summary, fleet, "failed prefill legs through their own fault")


def _recovered(fleet: int) -> tuple[int, int]:
    """(workers named, workers counted) of `fleet` recovering in one window: those named failing,
    then as many again of the rest, the others counted."""
    rest = fleet - min(fleet, NAMED_AT_MOST)
    return fleet - rest + min(rest, NAMED_AT_MOST), rest - min(rest, NAMED_AT_MOST)


@pytest.mark.parametrize("order", ["as they failed", "reversed"])
@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_loading_kv_again_is_capped_but_names_each_pair_named_failing(
    caplog: pytest.LogCaptureFixture, fleet: int, order: str
) -> None:
    """The KV connector fixed fleet-wide: every pair's probe works at once, and each said its
    recovery (1,000 INFO lines at 1,000 decode workers). The probes need not end in the order the
    failures began: capped on their own, the recoveries named the first eight to recover, so a
    decode worker named failing could be counted recovering, its log ending on the WARNING (review
    of 2026-12-06, /tmp/audit/revA_recover.py)."""
    now = [100.0]
    transfers = TransferHealth(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="router.transfer_health"):
        for worker in WORKERS[:fleet]:
            for prefill in ("p1", "p2"):
                transfers.failed(worker, prefill)
    failing = _pairs(_lines(caplog, "router.transfer_health", logging.WARNING, "failed to load KV")[0])
    assert failing == {(w, p) for w in WORKERS[:NAMED_AT_MOST][:fleet] for p in ("p1", "p2")}
    caplog.clear()
    now[0] += transfers.cooldown_s
    with caplog.at_level(logging.INFO, logger="router.transfer_health"):
        for worker in WORKERS[:fleet] if order == "as they failed" else WORKERS[:fleet][::-1]:
            for prefill in ("p1", "p2"):
                transfers.succeeded(worker, prefill)
        transfers._recovered_lines.flush()
    assert not transfers.any
    named, summary = _lines(caplog, "router.transfer_health", logging.INFO, "loads KV from")
    assert failing <= _pairs(named)
    workers, held = _recovered(fleet)
    assert len(named) == len(_pairs(named)) == 2 * workers
    assert summary == ([f"and {held} more workers ({2 * held} lines): decode workers load KV from their prefill "
                        "workers again"] if held > 0 else [])  # fmt: skip


def _pairs(lines: list[str]) -> set[tuple[str, str]]:
    """The (decode, prefill) pairs TransferHealth's lines name."""
    found = [re.match(r"decode worker (\S+) (?:failed to load KV prefilled on|loads KV from) (\w+)", m) for m in lines]
    return {(m[1], m[2]) for m in found if m is not None}


@pytest.mark.parametrize("order", ["as they failed", "reversed"])
@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_prefill_fleet_serving_its_legs_again_is_capped_but_names_each_one_named_failing(
    caplog: pytest.LogCaptureFixture, fleet: int, order: str
) -> None:
    """Every prefill engine restarted with its KV connector: each one's probe works at once, in any
    order (review of 2026-12-06, as for TransferHealth above)."""
    now = [1000.0]
    elig = Eligibility(clock=lambda: now[0], sync_state=lambda w: None, liveness=lambda w: None, tokenizer=None)
    with caplog.at_level(logging.WARNING, logger="router.eligibility"):
        for worker in WORKERS[:fleet]:
            elig.added(worker)
            elig.prefill_leg(worker, "its prefill legs return no transfer handle", serves_whole=True)
            elig.prefill_leg(worker, "its prefill legs return no transfer handle")  # its episode goes on
    failing = {m.split()[2] for m in _lines(caplog, "router.eligibility", logging.WARNING, "failed a prefill leg")[0]}
    assert failing == set(WORKERS[:NAMED_AT_MOST][:fleet])
    caplog.clear()
    now[0] += PREFILL_COOLDOWN_S
    with caplog.at_level(logging.INFO, logger="router.eligibility"):
        for worker in WORKERS[:fleet] if order == "as they failed" else WORKERS[:fleet][::-1]:
            elig.prefill_leg(worker, None)
        elig._prefill_again_lines.flush()
    infos = [WorkerInfo(worker=w, model="m", role="prefill", engine="vllm", block_size=16) for w in WORKERS[:fleet]]
    assert Exclusion.PREFILL_FAILING not in {s.exclusion for s in elig.statuses(infos)}
    named, summary = _lines(caplog, "router.eligibility", logging.INFO, "serves prefill legs again")
    assert failing <= {m.split()[2] for m in named}
    workers, held = _recovered(fleet)
    assert len(named) == len(set(named)) == workers
    assert summary == ([f"and {held} more workers: prefill workers serve prefill legs again"] if held > 0 else [])


async def test_a_fleet_repaired_in_another_order_than_it_failed_names_each_one_named_failing(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """No shim answers its kvstate request, then each answers again, the last to fail first: the
    successes, capped on their own, named the first eight to succeed, so a worker whose ERROR was
    named was counted when it was repaired (review of 2026-12-06)."""
    caplog.set_level(logging.WARNING, logger="router.gap_repair")
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.1)
    await ingest.start()
    shims = [FakeShim(nc, ns, w) for w in WORKERS]
    try:
        for shim in shims:
            ingest.add_worker(shim.worker, shim.epoch)
        await until(lambda: all(ingest.repairs.failures(w) >= 3 for w in WORKERS), what="every worker's ERROR")
        for shim in reversed(shims):
            await shim.start()
            await until(lambda: not ingest.needs_repair(shim.worker), what=f"{shim.worker} repaired")  # noqa: B023
        ingest.repairs._recovered_lines.flush()
    finally:
        await ingest.stop()
    failing = {m.split()[4] for m in _lines(caplog, "router.gap_repair", logging.ERROR, "cannot be repaired")[0]}
    assert len(failing) == NAMED_AT_MOST
    named, summary = _lines(caplog, "router.gap_repair", logging.WARNING, "succeeded after")
    assert failing <= {m.split()[4] for m in named}
    workers, held = _recovered(FLEET)
    assert len(named) == workers
    assert summary == [f"and {held} more workers: KV repair succeeded after 3 or more failures"]


@pytest.mark.parametrize("order", ["as they failed", "reversed"])
async def test_a_fleet_whose_digests_agree_again_names_each_one_named_unfixed(
    fleet_ingest: tuple[KvIngest, list[FakeShim]], caplog: pytest.LogCaptureFixture, order: str
) -> None:
    """Every digest disagrees right after its dump (shims of another build), then each agrees again
    (the fleet upgraded), in any order: capped on their own, the agreements named the first eight
    to agree, so a worker whose ERROR was named was counted agreeing (review of 2026-12-06)."""
    ingest, shims = fleet_ingest
    caplog.set_level(logging.INFO, logger="router.kv_ingest")
    for _ in range(2):  # a resync, then its dump did not make it agree
        for shim in shims:
            ingest.check_digest(_wrong_digest(shim))
        assert await ingest.wait_synced(20.0)
    assert ingest.stats.digest_unfixed == FLEET
    for shim in shims if order == "as they failed" else shims[::-1]:
        ingest.check_digest(LoadReport(worker=shim.worker, ts=0.0, kv_epoch=shim.epoch, kv_seq=shim.seq))
    ingest._agrees_lines.flush()
    assert ingest.stats.digest_unfixed == 0
    failing = {m.split()[4] for m in _lines(caplog, "router.kv_ingest", logging.ERROR, "right after a full dump")[0]}
    assert failing == set(WORKERS[:NAMED_AT_MOST])
    named, summary = _lines(caplog, "router.kv_ingest", logging.INFO, "agrees with the index again")
    assert failing <= {m.split()[4] for m in named}
    workers, held = _recovered(FLEET)
    assert len(named) == len(set(named)) == workers
    assert summary == [f"and {held} more workers: KV digests agree with the index again (their shims' and this "
                       "router's)"]  # fmt: skip


@pytest.mark.parametrize("fleet", [1, FLEET])
async def test_a_fleet_whose_held_kv_batches_overflow_is_capped(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture, fleet: int
) -> None:
    """No shim answers its kvstate request (a NATS permission change): every worker's batches are
    held while it repairs, past the bound, and each said so."""
    ingest = KvIngest(nc, ns, BlockIndex(), request_timeout_s=0.2, retry_max_s=0.2, held_limit=2)
    await ingest.start()
    shims = [FakeShim(nc, ns, w) for w in WORKERS[:fleet]]
    try:
        for shim in shims:
            shim.answering = False
            await shim.start()
            ingest.add_worker(shim.worker, shim.epoch)
        with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
            for i in range(4):
                for shim in shims:
                    await shim.publish(Stored(hashes=[i + 1]))
            await flush(nc)
            await until(lambda: ingest.stats.dropped_overflow >= 2 * fleet, what="every worker's batches dropped")
            ingest._overflow_lines.flush()
    finally:
        await ingest.stop()
    named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "held KV batches, past")
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert named[0].startswith("worker w0000: dropped 2 held KV batches, past its own bound")
    assert _summarised(summary, fleet, "dropped held KV batches past a bound")


@pytest.mark.parametrize("fleet", [1, FLEET])
def test_a_fleet_of_records_this_router_cannot_read_is_capped(caplog: pytest.LogCaptureFixture, fleet: int) -> None:
    """Shims of a build whose records do not decode here: every record refused, each said."""
    registry = WorkerRegistry(None, lambda info: None, lambda worker: None)  # type: ignore[arg-type]  # fed here
    why = "it does not decode as a WorkerInfo: Object missing required field `worker`"
    with caplog.at_level(logging.ERROR, logger="router.worker_registry"):
        for _ in range(2):  # the second watch snapshot says nothing: once per key and problem
            registry.apply(Snapshot(items={}, revision=1, skipped=dict.fromkeys(WORKERS[:fleet], why)))
        registry._refused_lines.flush()
    assert registry.refused == 2 * fleet and len(registry.refusing()) == fleet
    named, summary = _lines(caplog, "router.worker_registry", logging.ERROR, "ignored: it does not decode")
    assert named[0] == f"worker record under key 'w0000' ignored: {why}"
    assert len(named) == min(fleet, NAMED_AT_MOST)
    assert _summarised(summary, fleet, "worker records ignored")


async def test_a_fleet_past_its_kv_capacity_is_summarised_with_the_capacity_hint(
    nc: Client, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A fleet sharing one large offload tier goes past its capacity together: the summary named
    # another build as the cause, where the named lines said to raise --index-limit-per-worker.
    held_by = FleetLog()
    ingest = KvIngest(
        nc, ns, BlockIndex(), request_timeout_s=0.5, retry_max_s=0.2, min_entry_limit=4, fleet_log=held_by
    )
    await ingest.start()
    shims = [FakeShim(nc, ns, w) for w in WORKERS]
    try:
        for shim in shims:
            await shim.start()
            ingest.add_worker(shim.worker, shim.epoch)
        assert await ingest.wait_synced(20.0)
        with caplog.at_level(logging.WARNING, logger="router.kv_ingest"):
            for shim in shims:
                await shim.publish(Stored(hashes=list(range(1, 7))))
            await until(lambda: ingest.stats.malformed >= FLEET, what="every worker past its capacity")
            held_by.flush()
        named, summary = _lines(caplog, "router.kv_ingest", logging.WARNING, "more than its KV capacity allows")
        assert len(named) == NAMED_AT_MOST and len(summary) == 1, summary
        assert summary[0].startswith(f"and {FLEET - NAMED_AT_MOST} more workers: holding more blocks")
        assert "--index-limit-per-worker" in summary[0] and "another build" not in summary[0]
    finally:
        await ingest.stop()
