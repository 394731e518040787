"""What a shim says of etcd failing it (worker_shim.etcd_episodes), against a real etcd behind a
relay that refuses or freezes this shim's connections while etcd serves everyone else.

Audit of 2026-12-07: registering with etcd down was a WARNING every try (about 3,000 lines an hour
per shim) naming no flag and no end, each try a whole new session that asked the engine for a full
replay; a shim cut off from a live etcd past its lease TTL said "serving" and nothing else."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import cast

import grpc
import pytest
from etcd3aio import EtcdConnectionError

from discovery import SAID_EVERY_S, Discovery, DiscoveryError, KeyTaken, Registration, RegistrationState
from discovery import registration as registration_module
from discovery.advice import NO_SPACE, UNANSWERED
from discovery.lease import said
from engine_sim.server import SimServer
from kvswitch.servers import EtcdServer
from protocol import WorkerInfo, encode_json, subjects
from protocol.config import EtcdSettings
from tests.etcd_alarm import nospace_alarm
from tests.relay import Relay
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from tests.worker_shim.test_http_server import health, scrape
from worker_shim.adapters import EngineHealth
from worker_shim.etcd_episodes import CutOff, RegisterFailures
from worker_shim.shim import WorkerShim

UNRENEWED = ("kvswitch_shim_lease_unrenewed_seconds", ())


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def wait_for_etcd(shim: WorkerShim, timeout: float = 20.0) -> None:
    """Until the shim's own etcd client answers a read."""
    assert shim._discovery is not None
    async with asyncio.timeout(timeout):
        while True:
            try:
                await shim._discovery.held("/kvswitch-test/none")
                return
            except DiscoveryError:
                await asyncio.sleep(0.1)


def _failed(cause: BaseException) -> DiscoveryError:
    """A DiscoveryError raised from an etcd call's error, as Discovery raises it."""
    try:
        raise DiscoveryError(f"lease grant failed: {said(cause)}") from cause
    except DiscoveryError as exc:
        return exc


UNAVAILABLE = _failed(EtcdConnectionError("Lease.Grant failed after 3 attempts: UNAVAILABLE"))
WHY = "lease grant failed: EtcdConnectionError: Lease.Grant failed after 3 attempts: UNAVAILABLE"
FULL = _failed(
    grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="etcdserver: mvcc: database space exceeded",
    )
)


def test_a_registration_failing_is_said_once_then_counted_every_30_s_then_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    clock = _Clock()
    failures = RegisterFailures(clock)
    for _ in range(25):  # 25 tries, 1.2 s apart: 28.8 s
        failures.failed(UNAVAILABLE, 1.2)
        clock.now += 1.2
    [first] = [r.getMessage() for r in caplog.records]
    assert first.startswith(f"registering with etcd failed ({WHY}: {UNANSWERED}): retrying in 1.2s")
    assert failures.trouble() == f"registering with etcd fails for 30 s (25 tries): {WHY}: {UNANSWERED}"
    failures.failed(UNAVAILABLE, 1.2)  # 30 s after the first
    assert caplog.records[-1].getMessage() == (
        f"registering with etcd still fails after 30s (26 tries; the last: {WHY}: check --etcd-endpoints and the "
        "server)"
    )
    clock.now += SAID_EVERY_S / 2
    failures.registered()
    assert caplog.records[-1].getMessage() == "registered after 45.0s of etcd failing (26 tries)"
    assert len(caplog.records) == 3 and failures.trouble() == ""
    failures.registered()  # no episode: nothing to say
    failures.failed(UNAVAILABLE, 1.2)  # a new episode is said at once
    assert len(caplog.records) == 4 and caplog.records[-1].getMessage().startswith("registering with etcd failed")


def test_etcd_answering_and_refusing_is_said_in_its_words_without_blaming_the_endpoints(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full etcd (its NOSPACE alarm) was a five-line gRPC repr and "check --etcd-endpoints"."""
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    failures = RegisterFailures(_Clock())
    failures.failed(FULL, 0.2)
    [first] = [r.getMessage() for r in caplog.records]
    why = f"lease grant failed: RESOURCE_EXHAUSTED: etcdserver: mvcc: database space exceeded: {NO_SPACE}"
    assert first.startswith(f"registering with etcd failed ({why}): retrying in 0.2s"), first
    assert "--etcd-endpoints" not in first and "\n" not in first
    assert failures.trouble().endswith(why)


def test_an_episode_ends_with_its_session(caplog: pytest.LogCaptureFixture) -> None:
    """The next session's registration is timed from its own tries (it said "registered after 51.7s
    of etcd failing" where etcd was down 12 s, the engine down between the sessions)."""
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    clock = _Clock()
    failures = RegisterFailures(clock)
    failures.session_ended(False)  # no episode: nothing to say
    for _ in range(3):
        failures.failed(UNAVAILABLE, 1.0)
        clock.now += 1.0
    failures.session_ended(False)
    assert caplog.records[-1].getMessage() == (
        f"registering with etcd failed for 3.0s (3 tries; the last: {WHY}: {UNANSWERED}) until the session ended: "
        "the next one tries anew"
    )
    assert failures.trouble() == ""
    clock.now += 40.0  # the engine down, no session
    failures.registered()  # the next session's first try: no episode to end
    assert len(caplog.records) == 2
    failures.failed(UNAVAILABLE, 1.0)  # a new one is said at once
    assert caplog.records[-1].getMessage().startswith("registering with etcd failed (")


def test_an_episode_under_way_as_the_shim_stops_says_it_stopped(caplog: pytest.LogCaptureFixture) -> None:
    """A SIGTERM during an episode said "... until the session ended: the next one tries anew"."""
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    clock = _Clock()
    failures = RegisterFailures(clock)
    failures.failed(UNAVAILABLE, 1.0)
    clock.now += 2.0
    failures.session_ended(True)
    assert caplog.records[-1].getMessage() == (
        f"registering with etcd failed for 2.0s (1 tries; the last: {WHY}: {UNANSWERED}) until the shim stopped"
    )


class _Reg:
    """What CutOff reads of a Registration."""

    def __init__(self, lease: int, unrenewed_s: float | None) -> None:
        self.ttl = 2
        self.id = f"{lease:x}"
        self.lease = SimpleNamespace(hex_id=f"{lease:x}")
        self.unrenewed_s = unrenewed_s
        self.state = RegistrationState.UNKNOWN if unrenewed_s is not None else RegistrationState.REGISTERED


def test_a_cut_off_ends_unsaid_with_its_session(caplog: pytest.LogCaptureFixture) -> None:
    """A later session's lease was said to end the cut-off of an earlier one ("lease X was gone,
    registered anew"), though that session had ended and its lease with it."""
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    cut_off = CutOff()
    cut_off.check(cast(Registration, _Reg(0xA, 5.0)))
    [warned] = [r.getMessage() for r in caplog.records]
    assert warned.startswith("etcd has not renewed this worker's lease for 5 s (TTL 2 s)")
    cut_off.session_ended()
    cut_off.check(cast(Registration, _Reg(0xB, None)))  # the next session's lease
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(
    ("stalled", "said"),
    [
        (
            4.0,
            "this process stalled 4.0 s of the 5 s etcd has not renewed this worker's lease (TTL 2 s), not etcd or "
            "the network: its renewals waited unsent; where routers still reach etcd its key is gone and no new "
            "request comes here; the legs in flight run on (its event loop's WARNING says so)",
        ),
        (  # awake 4 s, past two renewals (1.33 s): etcd's silence, whatever the stall
            1.0,
            "etcd has not renewed this worker's lease for 5 s (TTL 2 s): where routers still reach etcd its key is "
            "gone and no new request comes here; the legs in flight run on (check the network to --etcd-endpoints)",
        ),
    ],
)
def test_a_cut_off_this_process_stalled_through_names_the_stall_not_the_network(
    stalled: float, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shim stopped 10 s woke to "etcd has not renewed this worker's lease for 13 s ... (check the
    network to --etcd-endpoints)" (audit of 2026-12-07)."""
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    cut_off = CutOff(lambda seconds: min(seconds, stalled))
    reg = cast(Registration, _Reg(0xA, 5.0))
    cut_off.check(reg)
    assert [r.getMessage() for r in caplog.records] == [said]
    assert cut_off.trouble(reg) == said[: said.rindex(" (")]  # /health's etcd_why


async def test_registering_with_etcd_down_retries_within_the_session_saying_it_once(
    etcd_relay: Relay, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, f"http://127.0.0.1:{etcd_relay.port}")
        async with shim:
            # start() connected to etcd; its session has not run yet: every registration meets etcd gone
            etcd_relay.accepting = False
            etcd_relay.cut()
            checks = 0  # of the engine's health: one a try, whether a session starts or goes on
            checked = shim.adapter.health

            async def counted() -> EngineHealth:
                nonlocal checks
                checks += 1
                return await checked()

            shim.adapter.health = counted  # type: ignore[method-assign]
            await wait_for(lambda: checks >= 8, what="8 tries")
            status, body = await health(shim.http.url)
            etcd_relay.accepting = True
            await wait_for(shim.registered.is_set, what="registered once etcd is back")
    warned = [r for r in caplog.records if r.name == "worker_shim.shim" and r.levelno >= logging.WARNING]
    assert not any("registration failed" in r.getMessage() for r in warned), "the old line, once per try"
    [said] = _said(caplog, "registering with etcd failed")
    assert "--etcd-endpoints" in said.getMessage()
    assert len(_said(caplog, "registered after")) == 1
    # One session: the engine was not asked for its limits, tokenizer and whole state again at each try.
    assert shim.sessions == 1
    assert status == 503 and str(body["etcd_why"]).startswith("registering with etcd fails for"), body


async def test_a_shim_cut_off_from_a_live_etcd_past_its_ttl_says_its_key_is_gone_and_serves_on(
    etcd_relay: Relay, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with (
        SimServer(sim_config()) as sim,
        shim_for(sim, ns, nats_url, f"http://127.0.0.1:{etcd_relay.port}", lease_ttl=2) as shim,
    ):
        await wait_for(shim.registered.is_set, what="registered")
        first = shim.worker_id
        etcd_relay.frozen.set()  # etcd serves everyone else: the key goes with the lease's TTL
        warning = "etcd has not renewed this worker's lease"
        await wait_for(lambda: bool(_said(caplog, warning)), 15, "the warning")
        status, body = await health(shim.http.url)
        # still 200 "serving": it serves what it is sent (a router cut off too, the legs in flight)
        assert status == 200 and body["status"] == "serving", body
        assert str(body["etcd_why"]).startswith(warning) and "its key is gone" in str(body["etcd_why"]), body
        unrenewed = body["lease_unrenewed_s"]
        assert isinstance(unrenewed, float) and unrenewed >= 2, body  # past 2 s, rounded to 0.1
        assert (await scrape(shim.http.url))[UNRENEWED] > 2
        await wait_for(lambda: shim.lease_unrenewed_s is not None and shim.lease_unrenewed_s > 4, 15, "4 s")
        [said] = _said(caplog, warning)  # once per episode, not once per check
        assert said.levelno == logging.WARNING and "(TTL 2 s)" in said.getMessage()
        etcd_relay.frozen.clear()
        etcd_relay.cut()  # the frozen connections go; new ones are relayed
        await wait_for(lambda: bool(_said(caplog, "etcd answers this worker again")), 20, "the end")
        [back] = _said(caplog, "etcd answers this worker again")
        assert back.getMessage().endswith(f"was gone, registered anew as {shim.worker_id}")
        assert shim.worker_id != first
        status, body = await health(shim.http.url)
        assert status == 200 and body["etcd_why"] == "" and body["lease_unrenewed_s"] is None, body
        assert (await scrape(shim.http.url))[UNRENEWED] == 0


async def test_registering_anew_into_a_full_etcd_is_one_episode_on_health(
    ns: str, nats_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lost lease that etcd would not let register anew (its quota full) was a WARNING each try,
    0.2 s doubling to 5 s, and /health said "reregistering" and nothing of etcd (22 lines in 90 s);
    its `status` said "registered" on the 503 until 2026-12-07."""
    monkeypatch.setattr(registration_module, "RETRY_MAX_S", 0.1)  # many tries in a short test
    caplog.set_level(logging.INFO)
    with EtcdServer() as etcd:  # its own: the alarm refuses every client's writes
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd.url) as shim:
            await wait_for(shim.registered.is_set, what="registered")
            first = shim.worker_id
            assert shim.registration is not None and shim.registration.lease is not None
            nospace_alarm(etcd, "ACTIVATE")
            async with Discovery(EtcdSettings(endpoints=[etcd.url]), ns) as d:
                assert d.client.lease is not None
                await d.client.lease.revoke(shim.registration.lease.id)  # the lease lost (etcd takes a revoke)
            await wait_for(lambda: shim.register_failures.tries >= 8, 15, "8 tries")
            status, body = await health(shim.http.url)
            nospace_alarm(etcd, "DEACTIVATE")
            await wait_for(lambda: shim.registered.is_set() and shim.worker_id != first, 15, "registered anew")
            anew = await health(shim.http.url)
    assert status == 503 and body["registration"] == "reregistering" and body["status"] == "waiting_etcd", body
    assert anew[0] == 200 and anew[1]["status"] == "serving" and anew[1]["registration"] == "registered", anew
    why = str(body["etcd_why"])
    assert why.startswith("registering with etcd fails for") and "database space exceeded" in why, body
    assert why.endswith(NO_SPACE) and "--etcd-endpoints" not in why, body
    assert not _said(caplog, "again failed"), "the old line, once per try"
    [said_once] = _said(caplog, "registering with etcd failed")
    assert said_once.levelno == logging.WARNING and "\n" not in said_once.getMessage()
    assert len(_said(caplog, "registered after")) == 1


async def test_registering_failing_ends_with_its_session(
    etcd_relay: Relay, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd down, then the engine down (the session ends), etcd back, the engine back: /health said
    "registering with etcd fails for 49 s" while etcd was up and the engine down, and the next
    session "registered after 51.7s of etcd failing" where etcd was down 12 s."""
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, f"http://127.0.0.1:{etcd_relay.port}")
        async with shim:
            etcd_relay.accepting = False  # etcd gone for this shim before its session registers
            etcd_relay.cut()
            up = True
            checked = shim.adapter.health

            async def engine_health() -> EngineHealth:
                return await checked() if up else EngineHealth.DOWN

            shim.adapter.health = engine_health  # type: ignore[method-assign]
            await wait_for(lambda: shim.register_failures.tries >= 3, what="3 tries")
            up = False  # the engine goes down: the session ends
            await wait_for(lambda: bool(_said(caplog, "waiting for the vllm engine")), what="the session's end")
            etcd_relay.accepting = True  # etcd back while the engine is down
            status, body = await health(shim.http.url)
            # back for the shim too: its client out of gRPC's reconnect backoff, which each session's read
            # of the engine's claim (_keys_free) may lengthen while etcd is gone
            await wait_for_etcd(shim)
            up = True
            await wait_for(shim.registered.is_set, what="registered by the next session")
    assert status == 503 and body["etcd_why"] == "" and body["status"] == "waiting_engine", body
    [ended] = _said(caplog, "until the session ended")
    assert ended.getMessage().startswith("registering with etcd failed for ") and ended.levelno == logging.INFO
    assert not _said(caplog, "registered after"), "the next session registered at its first try"
    assert shim.sessions == 2


async def test_a_shim_stopped_while_registering_fails_says_it_stopped_not_that_the_next_session_tries(
    etcd_relay: Relay, ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, f"http://127.0.0.1:{etcd_relay.port}")
        async with shim:
            etcd_relay.accepting = False  # etcd gone for this shim before its session registers
            etcd_relay.cut()
            await wait_for(lambda: shim.register_failures.tries >= 2, what="2 tries")
        # the shim's stop (a SIGTERM's) ends the episode with the session
    [ended] = _said(caplog, "until the shim stopped")
    assert ended.getMessage().startswith("registering with etcd failed for ") and ended.levelno == logging.INFO
    assert not _said(caplog, "the next one tries anew")


async def test_a_healthy_engine_whose_shim_etcd_refuses_is_said_waiting_etcd_not_waiting_engine(
    ns: str, nats_url: str
) -> None:
    """etcd refusing the registration (its quota full) of a shim whose engine is up and answering:
    /health said `waiting_engine`, and an operator reading it blamed the engine (review of 2026-12-07)."""
    with EtcdServer() as etcd:  # its own: the alarm refuses every client's writes
        async with SimServer(sim_config()) as sim:
            nospace_alarm(etcd, "ACTIVATE")
            async with shim_for(sim, ns, nats_url, etcd.url) as shim:
                await wait_for(lambda: shim.register_failures.tries >= 3, 15, "3 tries")
                status, body = await health(shim.http.url)
                assert await shim.adapter.health() is EngineHealth.UP
                nospace_alarm(etcd, "DEACTIVATE")
                await wait_for(shim.registered.is_set, 15, "registered once etcd takes writes")
                serving = await health(shim.http.url)
    assert status == 503 and body["status"] == "waiting_etcd" and body["registration"] == "new", body
    why = str(body["etcd_why"])
    assert why.startswith("registering with etcd fails for") and why.endswith(NO_SPACE), body
    assert serving[0] == 200 and serving[1]["status"] == "serving" and serving[1]["etcd_why"] == "", serving


async def test_etcd_answering_with_the_worker_name_held_ends_the_episode_and_says_registering(
    ns: str, nats_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd refusing writes, then answering that --worker-name is held by a live lease (waited
    out): /health said `waiting_etcd` and "registering with etcd fails for N s" for as long as the
    wait lasted, etcd answering all along (review of 2026-12-07)."""

    async def not_proven(self: WorkerShim, exc: KeyTaken) -> bool:
        return False  # as under NATS credentials: the holder's lease is waited out

    async def read_before_the_holders_create(self: WorkerShim) -> bool:
        return True  # the session's read of the name (_keys_free) raced the holder's create: the registration meets it

    monkeypatch.setattr(WorkerShim, "_took_over", not_proven)
    monkeypatch.setattr(WorkerShim, "_keys_free", read_before_the_holders_create)
    caplog.set_level(logging.INFO, logger="worker_shim.etcd_episodes")
    with EtcdServer() as etcd:  # its own: the alarm refuses every client's writes
        async with (
            SimServer(sim_config()) as sim,
            Discovery(EtcdSettings(endpoints=[etcd.url]), ns) as d,
        ):
            holder = await d.grant(30)
            info = WorkerInfo(worker="w", model="m", role="agg", engine="vllm", block_size=16)
            await d.create(subjects.worker_key(ns, "w"), encode_json(info), holder)
            nospace_alarm(etcd, "ACTIVATE")
            async with shim_for(sim, ns, nats_url, etcd.url, worker_name="w", lease_ttl=30) as shim:
                await wait_for(lambda: shim.register_failures.tries >= 2, 15, "2 tries")
                failing = await health(shim.http.url)
                nospace_alarm(etcd, "DEACTIVATE")
                await wait_for(lambda: shim._held_since is not None, 15, "the held name found")
                status, body = await health(shim.http.url)
                assert not shim.registered.is_set()
    assert failing[1]["status"] == "waiting_etcd", failing
    assert status == 503 and body["status"] == "registering" and body["etcd_why"] == "", body
    [ended] = _said(caplog, "until etcd answered")
    assert ended.getMessage().startswith("registering with etcd failed for ") and ended.levelno == logging.INFO


async def test_a_re_put_etcd_keeps_failing_is_said_on_health_while_the_shim_serves(ns: str, nats_url: str) -> None:
    """A registered worker's update() that etcd refuses (its quota full) is retried each keep-alive
    check, its key holding the value last put: only the log said it, /health read serving, etcd
    alive and etcd_why "" (review of 2026-12-07)."""
    with EtcdServer() as etcd:  # its own: the alarm refuses every client's writes
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd.url) as shim:
            await wait_for(shim.registered.is_set, what="registered")
            reg = shim.registration
            assert reg is not None
            nospace_alarm(etcd, "ACTIVATE")
            reg.update()  # as a state flip does
            await wait_for(lambda: (t := reg.put_trouble) is not None and t.tries >= 2, 15, "2 failed re-puts")
            status, body = await health(shim.http.url)
            nospace_alarm(etcd, "DEACTIVATE")
            await wait_for(lambda: reg.put_trouble is None, 15, "a re-put that works")
            after = await health(shim.http.url)
    assert status == 200 and body["status"] == "serving" and body["etcd"] == "alive", body
    why = str(body["etcd_why"])
    assert why.startswith("re-putting this worker's key fails for ") and "database space exceeded" in why, body
    assert why.endswith(NO_SPACE) and "--etcd-endpoints" not in why, body
    assert after[0] == 200 and after[1]["etcd_why"] == "", after


async def test_etcd_answering_that_the_lost_lease_still_holds_the_worker_name_ends_the_episode(
    ns: str, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Registering anew after the lease's loss, etcd refusing writes, then answering that the lost
    lease (its revoke failed) still holds --worker-name (waited out, retries at most 5 s apart):
    /health said "registering with etcd fails for N s", N growing, etcd answering all along, until
    the key came free (review of 2026-12-07); its `status` said "registered" throughout."""
    caplog.set_level(logging.INFO)
    with EtcdServer() as etcd:  # its own: the alarm refuses every client's writes
        async with (
            SimServer(sim_config()) as sim,
            shim_for(sim, ns, nats_url, etcd.url, worker_name="w", lease_ttl=30) as shim,
        ):
            await wait_for(shim.registered.is_set, what="registered")
            reg = shim.registration
            assert reg is not None and reg.lease is not None
            old = reg.lease
            nospace_alarm(etcd, "ACTIVATE")
            # Taken as lost with etcd still holding it: a keep-alive's defect whose revoke failed (a
            # lost lease's release revokes nothing), so its key stays until its TTL.
            old._mark_lost("its keep-alive failed: a defect")
            await wait_for(lambda: shim.register_failures.tries >= 2, 15, "2 tries")
            failing = await health(shim.http.url)
            nospace_alarm(etcd, "DEACTIVATE")
            await wait_for(lambda: bool(_said(caplog, "its own lost lease, to expire")), 15, "the lost lease found")
            status, body = await health(shim.http.url)
            async with Discovery(EtcdSettings(endpoints=[etcd.url]), ns) as d:
                assert await d.holder(subjects.worker_key(ns, "w")) == old.id, "the lost lease holds it still"
    assert str(failing[1]["etcd_why"]).startswith("registering with etcd fails for"), failing
    assert failing[1]["status"] == "waiting_etcd", failing
    assert status == 503 and body["registration"] == "reregistering" and body["etcd_why"] == "", body
    assert body["status"] == "registering", body
    [ended] = _said(caplog, "until etcd answered")
    assert ended.levelno == logging.INFO and ended.getMessage().startswith("registering with etcd failed for ")
    assert ended.getMessage().endswith(f"the key is held by this shim's lost lease {old.hex_id}, waited out")
