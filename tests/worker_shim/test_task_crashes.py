"""A task of the shim's that crashes is said and acted on, never left dead behind a worker that
looks well: the worker id's KV publisher or load reporter (the session ends as failed and a new one
registers; the legs it leaves running are still cancelled on the old id, and drained by a stop in
the wait before the next session; a session that served a while starts the wait before the next
over, a step before the next that keeps failing backs off again; with --worker-name the next session
takes over the cancels; an old id's publisher in its grace is counted too), the
orphaned-leg watchdog (a failing check is said, throttled, and the next one runs),
the old worker id's retirement (its id leaves /health, the teardown still ends with Cleared) and
the endpoint probe. Each fault is injected into one method, against real nats, etcd and the sim;
until 2026-12-06 each left the shim serving with one line, or none, as the audit showed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp
import pytest
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from discovery import Discovery
from engine_sim.config import SimConfig
from engine_sim.server import SimServer
from protocol import (
    CancelRequest,
    Cleared,
    GenerateRequest,
    KvEventBatch,
    LoadReport,
    ResponseChunk,
    SamplingParams,
    decode_msg,
    encode_msg,
    subjects,
)
from protocol.config import EtcdSettings
from runtime.loop_watch import LoopWatch
from runtime.nats_flush import flush
from tests.worker_shim.cluster import connect, shim_for, sim_config, wait_for
from tests.worker_shim.test_shim_lifecycle import registered_workers
from worker_shim import ShimStatus, WorkerShim, orphaned_legs
from worker_shim import shim as shim_module
from worker_shim.adapters.base import EngineLimits
from worker_shim.endpoint_probe import EndpointProbe
from worker_shim.event_health import EventHealth
from worker_shim.kv_publisher import KvPublisher
from worker_shim.load_reporter import LoadReporter

RESTART_S = 10.0  # a new session comes within a few health intervals (0.1 s here)

T = TypeVar("T")


def _failures(shim: WorkerShim, task: str) -> float:
    line = f'kvswitch_shim_task_failures_total{{task="{task}"}} '
    values = [float(x.removeprefix(line)) for x in shim.metrics_text().decode().splitlines() if x.startswith(line)]
    assert len(values) == 1, f"{line.strip()} not exported once"
    return values[0]


def _errors(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.ERROR and text in r.getMessage()]


async def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    await wait_for(lambda: bool(_errors(caplog, text)), 5.0, f"an ERROR {text!r}")
    return _errors(caplog, text)


async def _leg(shim: WorkerShim, ns: str, rid: str, first: int, max_tokens: int = 2, reply: str = "") -> None:
    req = GenerateRequest(
        request_id=rid,
        model="sim-llama",
        token_ids=list(range(first, first + 70)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    nc = shim.nc
    assert shim.worker_id is not None
    await nc.publish(subjects.gen(ns, "agg", shim.worker_id), encode_msg(req), reply=reply or nc.new_inbox())
    await flush(nc)


async def _new_session(shim: WorkerShim, old: str | None) -> None:
    """Waits for a session registered under another worker id than `old`, serving."""
    await wait_for(lambda: shim.worker_id not in (None, old) and shim.serving, RESTART_S, "a new session, registered")


@contextlib.asynccontextmanager
async def _registered_shim(
    ns: str, nats_url: str, etcd_url: str, sim: SimConfig | None = None, **shim_kw: Any
) -> AsyncIterator[WorkerShim]:
    """A shim (`shim_kw`: shim_for's) on a sim of `sim` (sim_config()'s by default), registered."""
    async with SimServer(sim or sim_config()) as server, shim_for(server, ns, nats_url, etcd_url, **shim_kw) as shim:
        await asyncio.wait_for(shim.registered.wait(), 20)
        yield shim


@contextlib.asynccontextmanager
async def _received(nats_url: str, kind: type[T], subject: str = "") -> AsyncIterator[tuple[Nats, str, list[T]]]:
    """A connection of its own subscribed to `subject` (a new inbox of its own if none): the
    connection, the subject, and the messages of `kind` that come there."""
    got: list[T] = []
    nc = await connect(nats_url)
    try:

        async def on_msg(msg: Msg) -> None:
            got.append(decode_msg(msg.data, kind))

        subject = subject or nc.new_inbox()
        await nc.subscribe(subject, cb=on_msg)
        await flush(nc)
        yield nc, subject, got
    finally:
        await nc.close()


def _crash_when_armed(monkeypatch: pytest.MonkeyPatch, owner: type, method: str, what: str) -> asyncio.Event:
    """Set, the next call of the coroutine method `owner.method` raises ("a bug in `what`"), once."""
    real = getattr(owner, method)
    armed = asyncio.Event()

    async def once_bad(self: object) -> None:
        if armed.is_set():
            armed.clear()
            raise RuntimeError(f"injected: a bug in {what}")
        await real(self)

    monkeypatch.setattr(owner, method, once_bad)
    return armed


def _crash_kv_publisher_when_armed(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set, the next send of a KV publisher raises, once."""
    return _crash_when_armed(monkeypatch, KvPublisher, "_send_outbox", "the KV publisher")


async def _crash_under_a_leg(shim: WorkerShim, ns: str, armed: asyncio.Event, rid: str, first: int, **leg: Any) -> None:
    """Arms the KV publisher's crash and sends a leg (`leg`: _leg's), whose KV events meet it."""
    armed.set()
    await _leg(shim, ns, rid, first, **leg)


async def test_a_crashed_kv_publisher_ends_the_session_and_a_new_one_registers_and_publishes(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    armed = _crash_kv_publisher_when_armed(monkeypatch)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url) as shim:
        old = shim.worker_id
        await _crash_under_a_leg(shim, ns, armed, "a", 1000)  # its KV events wake the publisher, whose send raises
        await _new_session(shim, old)
        assert shim.sessions == 2 and shim.session_failures == 1
        new = shim.worker_id
        assert new is not None and await registered_workers(etcd_url, ns) == {new}
        assert _failures(shim, "kv_publisher") == 1 and _failures(shim, "load_reporter") == 0
        assert [r for r in _errors(caplog, "task kv-publisher-") if r.name == "runtime"]  # said as it crashed
        assert _errors(caplog, f"the kv_publisher task kv-publisher-{old} crashed (RuntimeError")  # the session's end
        # The new id's stream runs: a new leg's blocks are published there.
        async with _received(nats_url, KvEventBatch, subjects.kv(ns, new)) as (_, _, batches):
            await _leg(shim, ns, "b", 2000)
            await wait_for(lambda: any(b.events for b in batches), what="a KV batch of the new worker id")


async def test_a_leg_left_running_by_a_crash_ended_session_is_still_cancelled_on_its_old_id(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's end unsubscribed the old id's cancel subject while its legs ran on (a healthy
    engine): a router cancels a leg on the subject of the id it sent it to (router.dispatch), so a
    client that left had the engine decode for nobody up to the request's deadline (review of
    2026-12-06). The subject is now kept until those legs end, as an old id's retirement does."""
    armed = _crash_kv_publisher_when_armed(monkeypatch)
    async with (
        _received(nats_url, ResponseChunk) as (nc, inbox, chunks),
        _registered_shim(ns, nats_url, etcd_url, sim_config(speedup=1.0)) as shim,
    ):
        old = shim.worker_id
        assert old is not None
        await _crash_under_a_leg(shim, ns, armed, "long", 1000, max_tokens=4000, reply=inbox)
        await _new_session(shim, old)
        assert shim.requests is not None and "long" in shim.requests.inflight
        assert not any(c.final for c in chunks)
        assert shim.health_report()[1]["retired_workers"] == [old]
        await nc.publish(subjects.cancel(ns, old), encode_msg(CancelRequest(request_id="long")))
        await wait_for(lambda: any(c.final for c in chunks), 5.0, "the cancelled leg's final chunk")
        assert chunks[-1].finish_reason == "abort" and chunks[-1].error is None
        await wait_for(lambda: not shim.health_report()[1]["retired_workers"], 5.0, "the old id closed")
        with pytest.raises(NoRespondersError):  # its leg ended: nothing is left on the old id
            await nc.request(subjects.cancel(ns, old), b"", timeout=2.0)


async def test_a_session_that_served_a_while_starts_the_wait_after_its_crash_over(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions that fail in a row wait twice as long each time; one that served SESSION_SERVED_S
    first waits one health interval again. The count was reset only by a session that ended well,
    which a crash never is: rare crashes days apart added up to 30 s out of routing (review of
    2026-12-06)."""
    monkeypatch.setattr(shim_module, "SESSION_SERVED_S", 2.0)
    armed = _crash_kv_publisher_when_armed(monkeypatch)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url, health_interval_s=0.2) as shim:
        for i, served_s in enumerate((2.5, 0.0, 2.5)):  # the second crash comes at once: a streak
            await asyncio.sleep(served_s)
            old = shim.worker_id
            await _crash_under_a_leg(shim, ns, armed, f"r{i}", 1000 + 100 * i)
            await _new_session(shim, old)
        waits = [r.getMessage().rpartition("a new one starts in ")[2] for r in _errors(caplog, "a new one starts in")]
        assert waits == ["0.2s", "0.4s", "0.2s"]


async def test_steps_before_a_session_that_keep_failing_after_one_that_served_still_back_off(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The served session's registration time was cleared only as the next session began: a step
    before it (the engine's limits, its event endpoints, its progress) that kept failing read it at
    each failure, took itself for a session that served and waited one health interval, so an
    engine that kept answering oddly got an ERROR with its traceback every interval for good,
    never the backoff (review of 2026-12-06)."""
    monkeypatch.setattr(shim_module, "SESSION_SERVED_S", 1.0)
    armed = _crash_kv_publisher_when_armed(monkeypatch)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url, health_interval_s=0.2) as shim:
        await asyncio.sleep(1.5)  # served past SESSION_SERVED_S
        real = shim._check_limits
        fails = 0

        async def odd_answer() -> EngineLimits:
            nonlocal fails
            if fails < 3:
                fails += 1
                raise RuntimeError("injected: an engine's odd answer")
            return await real()

        monkeypatch.setattr(shim, "_check_limits", odd_answer)
        old = shim.worker_id
        await _crash_under_a_leg(shim, ns, armed, "r0", 1000)
        await _new_session(shim, old)
        waits = [r.getMessage().rpartition("a new one starts in ")[2] for r in _errors(caplog, "a new one starts in")]
        assert fails == 3 and waits == ["0.2s", "0.4s", "0.8s", "1.6s"]


async def test_a_stop_in_the_wait_after_a_failed_session_drains_the_legs_it_left_running(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop between sessions aborted the legs a crash-ended session left running on a well engine
    at once (503 shutdown), past --drain-grace-s, which a stop during a session gives them (review
    of 2026-12-06)."""
    armed = _crash_kv_publisher_when_armed(monkeypatch)
    caplog.set_level(logging.INFO)
    async with _received(nats_url, ResponseChunk) as (_, inbox, chunks):
        async with SimServer(sim_config(speedup=1.0)) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, health_interval_s=1.0, drain_grace_s=20.0)
            async with shim:
                await asyncio.wait_for(shim.registered.wait(), 20)
                await _crash_under_a_leg(
                    shim, ns, armed, "long", 1000, max_tokens=1000, reply=inbox
                )  # a few seconds' decode
                await _said(caplog, "a new one starts in 1.0s")  # the stop comes in that wait
                assert shim.requests is not None and "long" in shim.requests.inflight
            assert shim.sessions == 1
        await wait_for(lambda: any(c.final for c in chunks), 5.0, "the leg's final chunk")
        final = chunks[-1]
        assert final.final and final.error is None and final.finish_reason == "length", final
        assert sum(len(c.token_ids) for c in chunks) == 1000


async def test_a_worker_names_next_session_takes_over_the_cancels_the_last_one_kept(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --worker-name each session has the same id: a session end that left legs running kept
    the id's cancel subject for them, and the next session subscribed it too, so one cancel was
    handled twice (a malformed one counted twice) and /health listed the live id in
    retired_workers until those legs ended (review of 2026-12-06)."""
    armed = _crash_kv_publisher_when_armed(monkeypatch)
    async with (
        _received(nats_url, ResponseChunk) as (nc, inbox, chunks),
        _registered_shim(ns, nats_url, etcd_url, sim_config(speedup=1.0), worker_name="w1") as shim,
    ):
        await _crash_under_a_leg(shim, ns, armed, "long", 1000, max_tokens=4000, reply=inbox)
        await wait_for(lambda: shim.sessions == 2 and shim.serving, RESTART_S, "the second session registered")
        requests = shim.requests
        assert requests is not None and "long" in requests.inflight
        assert shim.health_report()[1]["retired_workers"] == []
        cancel = subjects.cancel(ns, "w1")
        await nc.publish(cancel, b"not msgpack")
        await nc.publish(cancel, encode_msg(CancelRequest(request_id="long")))
        await wait_for(lambda: any(c.final for c in chunks), 5.0, "the cancelled leg's final chunk")
        assert chunks[-1].finish_reason == "abort" and chunks[-1].error is None
        await asyncio.sleep(0.2)  # a second handling of the malformed one would have come by now
        assert requests.malformed["cancel"] == 1


async def test_a_crashed_kv_publisher_of_an_old_id_in_its_grace_is_counted_and_said_truly(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Serving an old id for its grace, the session goes on: the crash's ERROR said "the shim ends
    the session and starts a new one", which nothing did, and it was not counted (review of
    2026-12-06)."""
    real = KvPublisher._send_outbox
    crash: dict[str, str | None] = {"worker": None}

    async def send(self: KvPublisher) -> None:
        if self.log.worker == crash["worker"] and self._outbox:
            crash["worker"] = None
            raise RuntimeError("injected: a bug in the old id's KV publisher")
        await real(self)

    monkeypatch.setattr(KvPublisher, "_send_outbox", send)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url, reregister_grace_s=3.0) as shim:
        old = shim.worker_id
        assert old is not None
        async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            await d.revoke(int(old, 16))
        await wait_for(lambda: old in shim.health_report()[1]["retired_workers"], 10.0, "the old id retired")
        crash["worker"] = old
        nc = shim.nc
        req = GenerateRequest(
            request_id="x", model="sim-llama", token_ids=list(range(1000, 1070)),
            sampling=SamplingParams(max_tokens=2, ignore_eos=True),
        )  # fmt: skip
        await nc.publish(subjects.gen(ns, "agg", old), encode_msg(req), reply=nc.new_inbox())
        await wait_for(lambda: crash["worker"] is None, 5.0, "the old id's publisher crashed")
        [said] = await _said(caplog, f"task kv-publisher-{old} crashed")
        assert "an old id in its re-registration grace serves on" in said.getMessage()
        assert _failures(shim, "kv_publisher") == 1
        await wait_for(lambda: not shim.health_report()[1]["retired_workers"], 10.0, "the grace over")
        assert shim.sessions == 1 and shim.session_failures == 0


async def test_a_crashed_load_reporter_ends_the_session_and_the_new_worker_id_reports(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    armed = _crash_when_armed(monkeypatch, LoadReporter, "_publish_if_due", "the load report")
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url) as shim:
        old = shim.worker_id
        armed.set()
        await _new_session(shim, old)
        new = shim.worker_id
        assert new is not None and await registered_workers(etcd_url, ns) == {new}
        assert _failures(shim, "load_reporter") == 1 and _failures(shim, "kv_publisher") == 0
        assert _errors(caplog, f"the load_reporter task load-{old} crashed (RuntimeError")
        async with _received(nats_url, LoadReport, subjects.load(ns, new)) as (_, _, reports):
            await wait_for(lambda: len(reports) >= 2, what="load reports of the new worker id")


async def test_a_failing_orphan_check_is_said_once_per_kind_counted_and_checked_again(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = orphaned_legs.OrphanedLegs.check
    calls = 0

    def check(self: orphaned_legs.OrphanedLegs) -> None:
        nonlocal calls
        calls += 1
        if calls in (2, 3):
            raise RuntimeError("injected: a bug in OrphanedLegs.check")
        real(self)

    monkeypatch.setattr(orphaned_legs.OrphanedLegs, "check", check)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url) as shim:
        await wait_for(lambda: calls >= 5, 10.0, "checks after the failing ones")  # ORPHAN_CHECK_S = 1
        said = _errors(caplog, "checking the legs of routers gone from etcd failed")
        assert len(said) == 1 and said[0].exc_info is not None  # the second, within a minute, held back
        assert _failures(shim, "orphan_check") == 2
        assert shim._orphans_task is not None and not shim._orphans_task.done()


async def test_a_crashed_loop_watch_is_said_counted_and_started_again_the_session_going_on(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop watch is the process's, not the session's: until a review of 2026-12-07 one that
    crashed lay dead after its ERROR, and each later cut-off was named this shim's stall."""
    real = LoopWatch._run
    crashes: list[Exception] = []

    async def run(self: LoopWatch) -> None:
        if crashes:
            raise crashes.pop()
        await real(self)

    monkeypatch.setattr(LoopWatch, "_run", run)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url) as shim:
        worker = shim.worker_id
        crashes.append(RuntimeError("injected: a bug in the loop watch"))
        await shim.loop_watch.stop()
        shim.loop_watch.start()  # the same watch, started again: its loop now crashes at once
        assert await _said(caplog, "task loop-watch crashed")
        await wait_for(lambda: _failures(shim, "loop_watch") == 1, 5.0, "the crash counted")
        task = shim.loop_watch.task
        assert task is not None and not task.done(), "started again"
        await asyncio.sleep(0.3)  # a few health checks
        assert task is shim.loop_watch.task and not task.done() and _failures(shim, "loop_watch") == 1
        assert shim.worker_id == worker and shim.serving and shim.session_failures == 0  # the session went on


async def test_a_loop_watch_crashing_at_each_start_is_started_again_at_most_once_a_period(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started again at every health check (0.1 s here), it logged an ERROR with its traceback each
    time: 49 in 5 s (final read of 2026-12-07)."""

    async def run(self: LoopWatch) -> None:
        raise RuntimeError("injected: a loop watch that cannot run")

    monkeypatch.setattr(shim_module, "LOOP_WATCH_AGAIN_S", 0.5)
    caplog.set_level(logging.INFO)
    async with _registered_shim(ns, nats_url, etcd_url) as shim:
        monkeypatch.setattr(LoopWatch, "_run", run)
        await shim.loop_watch.stop()
        started = time.monotonic()
        shim.loop_watch.start()
        await asyncio.sleep(1.2)  # 12 health checks
        crashed = [r for r in caplog.records if r.levelno == logging.ERROR and "loop-watch crashed" in r.getMessage()]
        # This start's crash, then one start a period at most over the time the sleep really took:
        # 4 in 1.2 s, but on a loaded box the sleep wakes late and a fifth start fits in.
        most = 2 + math.floor((time.monotonic() - started) / shim_module.LOOP_WATCH_AGAIN_S)
        assert 2 <= len(crashed) <= most, (len(crashed), most)
        assert shim.serving


async def test_a_crashed_retirement_drops_the_old_id_and_the_teardown_still_ends_with_cleared(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = shim_module.WorkerShim._end_epoch
    crash: dict[str, str | None] = {"worker": None}

    async def end_epoch(self: WorkerShim, presence: shim_module._Presence, *, cleared: bool) -> None:
        if presence.worker == crash["worker"]:
            crash["worker"] = None
            raise RuntimeError("injected: ending the old id's epoch failed")
        await real(self, presence, cleared=cleared)

    monkeypatch.setattr(shim_module.WorkerShim, "_end_epoch", end_epoch)
    caplog.set_level(logging.INFO)
    cleared: list[int] = []
    nc = await connect(nats_url)
    try:
        async with SimServer(sim_config()) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, reregister_grace_s=0.5)
            async with shim:
                await asyncio.wait_for(shim.registered.wait(), 20)
                old = crash["worker"] = shim.worker_id
                assert old is not None
                async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
                    await d.revoke(int(old, 16))
                await wait_for(lambda: shim.worker_id not in (None, old) and shim.serving, what="re-registered")
                new = shim.worker_id
                assert new is not None

                async def on_kv(msg: Msg) -> None:
                    batch = decode_msg(msg.data, KvEventBatch)
                    cleared.extend(batch.seq for e in batch.events if isinstance(e, Cleared))

                await nc.subscribe(subjects.kv(ns, new), cb=on_kv)
                await flush(nc)
                await wait_for(lambda: crash["worker"] is None and not shim._retired, 10.0, "the retirement ended")
                async with aiohttp.ClientSession() as s, s.get(shim.http.url + "/health") as r:
                    assert (await r.json())["retired_workers"] == []
                assert _errors(caplog, f"task retire-{old} crashed")
                assert _failures(shim, "retire") == 1
            # The stop did not raise the crash out of the teardown: the new id's stream ends with Cleared.
            assert shim.status is ShimStatus.STOPPED
            await wait_for(lambda: bool(cleared), 5.0, "Cleared on the new worker id at stop")
    finally:
        await nc.close()


async def test_an_endpoint_probe_that_crashes_is_said_at_once(caplog: pytest.LogCaptureFixture) -> None:
    async def serve(prompt: list[int], request_id: str) -> int:
        raise TypeError("injected: a bug in the probe request")

    probe = EndpointProbe(
        EventHealth(timeout_s=0.05), serve, block_size=lambda: 4, prefix_caching=lambda: True,
        where=lambda: "--kv-events tcp://x:1", on_foreign=lambda _: None, engine_url="http://e",
    )  # fmt: skip
    with caplog.at_level(logging.ERROR):
        probe.connected()
        await wait_for(lambda: bool(_errors(caplog, "task endpoint-probe crashed")), 5.0, "the crash said")
    probe.close()
