"""`Registration` keeps one leased key registered: through etcd outages, after loss, under a name."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import pytest

import runtime
from discovery import Discovery, DiscoveryError, KeyTaken, Registration, RegistrationState
from discovery.lease import MIN_LEASE_TTL, Lease
from kvswitch.servers import EtcdServer
from protocol import ConfigError, RouterInfo, WorkerInfo, decode_json, subjects
from protocol.config import EtcdSettings
from runtime import cancel_and_wait
from tests.lost_cancellation import ends_within, never_answers


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _get(d: Discovery, key: str) -> bytes | None:
    assert d.client.kv is not None
    resp = await d.client.kv.get(key, timeout=5)
    return resp.kvs[0].value if resp.kvs else None


def _worker_reg(d: Discovery, ns: str, **kw: object) -> Registration:
    return Registration(
        d,
        key=lambda wid: subjects.worker_key(ns, wid),
        value=lambda wid: WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16),
        **kw,  # type: ignore[arg-type]
    )


async def test_etcd_outage_keeps_the_id_and_the_key(ns: str) -> None:
    etcd = EtcdServer().start()
    try:
        settings = EtcdSettings(endpoints=[etcd.url])
        async with Discovery(settings, ns) as d:
            healthy = [True]
            reg = Registration(
                d,
                key=lambda wid: subjects.worker_key(ns, wid),
                value=lambda wid: WorkerInfo(
                    worker=wid, model="m", role="agg", engine="vllm", block_size=16, events_ok=healthy[0]
                ),
                ttl=2,
            )
            wid = await reg.start()
            await asyncio.to_thread(etcd.stop)
            await _until(lambda: reg.state is RegistrationState.UNKNOWN, 5, "state unknown")
            healthy[0] = False
            reg.update()  # made during the outage: must land once etcd is back
            await asyncio.sleep(3.5)  # past the TTL
            await asyncio.to_thread(etcd.start)
            await _until(lambda: reg.state is RegistrationState.REGISTERED, 5, "registered again")
            async with Discovery(settings, ns) as obs:

                async def value() -> WorkerInfo | None:
                    raw = await _get(obs, subjects.worker_key(ns, wid))
                    return decode_json(raw, WorkerInfo) if raw is not None else None

                deadline = time.monotonic() + 5
                while (info := await value()) is None or info.events_ok:
                    assert time.monotonic() < deadline, f"the update made during the outage never landed: {info}"
                    await asyncio.sleep(0.05)
            assert reg.id == wid and reg.registrations == 1
            await reg.stop()
    finally:
        etcd.close()


@pytest.mark.parametrize("kind", ["worker", "router"])
async def test_lost_lease_registers_anew_and_tells_the_owner(etcd_url: str, ns: str, kind: str) -> None:
    key: Callable[[str], str]
    value: Callable[[str], msgspec.Struct]
    if kind == "worker":
        key = lambda wid: subjects.worker_key(ns, wid)  # noqa: E731
        value = lambda wid: WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16)  # noqa: E731
    else:
        key = lambda rid: subjects.router_key(ns, rid)  # noqa: E731
        value = lambda rid: RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=1.0)  # noqa: E731
    heard: list[tuple[str, str]] = []

    async def on_lost(old: str) -> None:
        heard.append(("lost", old))

    async def on_registered(new: str) -> None:
        heard.append(("registered", new))

    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = Registration(d, key=key, value=value, ttl=5, on_lost=on_lost, on_registered=on_registered)
        first = await reg.start()
        assert reg.lease is not None and d.client.lease is not None
        await d.client.lease.revoke(reg.lease.id)  # behind its back: etcd now says the lease is gone
        await _until(lambda: len(heard) == 2, 10, "re-registration")
        second = reg.id
        assert heard == [("lost", first), ("registered", second)] and second != first
        assert reg.state is RegistrationState.REGISTERED and reg.registrations == 2
        raw = await _get(d, key(second))
        assert raw is not None and second in raw.decode()
        assert await _get(d, key(first)) is None
        await reg.stop()
        await reg.stop()  # safe twice
        assert await _get(d, key(second)) is None, "stop must revoke at once"


@pytest.mark.parametrize("when", ["registering", "registering anew"])
async def test_an_update_made_while_the_key_is_created_is_put(etcd_url: str, ns: str, when: str) -> None:
    """A shim finds its tokenizer's fingerprint (a probe retried) and calls update() while the key's
    create is in flight: the record gets it. After a lost lease it was dropped for good, the record
    keeping "" while the shim logged it registered (review of 2026-12-07)."""
    found = [""]
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = Registration(
            d,
            key=lambda wid: subjects.worker_key(ns, wid),
            value=lambda wid: WorkerInfo(
                worker=wid, model="m", role="agg", engine="vllm", block_size=16, tokenizer=found[0]
            ),
            ttl=5,
        )
        real_create = d.create

        async def create(key: str, value: bytes, lease: Lease) -> None:
            if not found[0]:  # value() was read for this create: the fingerprint is found during it
                found[0] = "tok-found"
                reg.update()
                await asyncio.sleep(0.05)
            await real_create(key, value, lease)

        if when == "registering anew":
            first = await reg.start()
        d.create = create  # type: ignore[method-assign]
        if when == "registering":
            await reg.start()
        else:
            assert reg.lease is not None and d.client.lease is not None
            await d.client.lease.revoke(reg.lease.id)
            await _until(lambda: reg.id != first and reg.registrations == 2, 10, "re-registration")
        deadline = time.monotonic() + 5  # an update is put at once; the checks (every ttl/3) never put it
        while (raw := await _get(d, reg.key)) is None or decode_json(raw, WorkerInfo).tokenizer != "tok-found":
            assert time.monotonic() < deadline, f"the update made while {when} was never put: {raw!r}"
            await asyncio.sleep(0.05)
        assert not reg.failed.is_set()
        await reg.stop()


async def test_a_name_is_the_id_and_a_second_holder_fails_loudly(etcd_url: str, ns: str) -> None:
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as other,
    ):
        reg = _worker_reg(d, ns, ttl=5, name="gpu-07")
        assert await reg.start() == "gpu-07"
        rival = _worker_reg(other, ns, ttl=5, name="gpu-07")
        with pytest.raises(KeyTaken, match="gpu-07"):
            await rival.start()
        # The rival's lease was revoked on failure; the first holder's record is untouched.
        assert d.client.lease is not None and reg.lease is not None
        first_lease = reg.lease.id
        await d.client.lease.revoke(first_lease)
        await _until(lambda: reg.registrations == 2, 10, "re-registration under the name")
        assert reg.id == "gpu-07" and reg.lease.id != first_lease
        raw = await _get(d, subjects.worker_key(ns, "gpu-07"))
        assert raw is not None
        await reg.stop()


async def test_a_name_taken_while_lost_fails_the_registration(etcd_url: str, ns: str) -> None:
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as other,
    ):
        rival = _worker_reg(other, ns, ttl=5, name="gpu-08")

        async def on_lost(_old: str) -> None:
            await rival.start()  # someone else takes the name before we register again

        reg = _worker_reg(d, ns, ttl=5, name="gpu-08", on_lost=on_lost)
        await reg.start()
        assert reg.lease is not None and d.client.lease is not None
        await d.client.lease.revoke(reg.lease.id)
        await asyncio.wait_for(reg.failed.wait(), 10)
        assert reg.state is RegistrationState.FAILED and isinstance(reg.failure, KeyTaken)
        await reg.stop()
        await rival.stop()


async def test_before_create_runs_with_the_id_before_the_key_exists(etcd_url: str, ns: str) -> None:
    seen: list[tuple[str, bytes | None]] = []
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:

        async def before_create(wid: str) -> None:
            seen.append((wid, await _get(d, subjects.worker_key(ns, wid))))

        reg = _worker_reg(d, ns, ttl=5, before_create=before_create)
        first = await reg.start()
        assert seen == [(first, None)]
        assert await _get(d, subjects.worker_key(ns, first)) is not None
        assert reg.lease is not None and d.client.lease is not None
        await d.client.lease.revoke(reg.lease.id)  # re-registration runs it again, for the new id
        await _until(lambda: reg.registrations == 2, 10, "re-registration")
        assert seen == [(first, None), (reg.id, None)] and reg.id != first
        await reg.stop()


async def test_a_failing_before_create_releases_the_lease_and_creates_no_key(etcd_url: str, ns: str) -> None:
    ids: list[str] = []
    calls = 0
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:

        async def before_create(wid: str) -> None:
            nonlocal calls
            calls += 1
            ids.append(wid)
            if calls != 2:
                raise RuntimeError("not ready")

        reg = _worker_reg(d, ns, ttl=5, before_create=before_create)
        with pytest.raises(RuntimeError, match="not ready"):
            await reg.start()
        assert d.client.lease is not None
        leases = await d.client.lease.leases()  # each a LeaseStatus: `ID`, not `id`
        assert int(ids[0], 16) not in {lease.ID for lease in leases.leases}, "the lease outlived the failure"
        assert await _get(d, subjects.worker_key(ns, ids[0])) is None
        # During re-registration the owner hears it through `failed`.
        second = await reg.start()
        assert reg.lease is not None
        await d.client.lease.revoke(reg.lease.id)
        await asyncio.wait_for(reg.failed.wait(), 10)
        assert reg.state is RegistrationState.FAILED and "not ready" in str(reg.failure)
        assert await _get(d, subjects.worker_key(ns, ids[2])) is None and ids[1] == second
        await reg.stop()


async def test_a_second_registration_under_a_held_name_never_runs_before_create(etcd_url: str, ns: str) -> None:
    """before_create subscribes to the name's subjects and publishes under it: a second shim started
    by mistake with a live worker's name must fail before it, not after (KeyTaken from create)."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        first = _worker_reg(d, ns, ttl=5, name="fixed")
        assert await first.start() == "fixed"
        assert first.lease is not None and await d.holder(first.key) == first.lease.id
        calls: list[str] = []

        async def before_create(wid: str) -> None:
            calls.append(wid)

        second = _worker_reg(d, ns, ttl=5, name="fixed", before_create=before_create)
        with pytest.raises(KeyTaken) as taken:
            await second.start()
        assert calls == [] and taken.value.holder == first.lease.id
        assert second.lease is None
        await first.stop()
        assert await d.holder(first.key) is None
        # The name free again: the second one registers, before_create first.
        assert await second.start() == "fixed" and calls == ["fixed"]
        await second.stop()


@pytest.mark.parametrize("kind", ["worker", "router"])
async def test_a_key_deleted_while_its_lease_lives_is_put_back(
    etcd_url: str, ns: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's `etcdctl del` (or a broad prefix delete) took a live owner out of every
    router for good: nothing put the key back until its value happened to change."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        if kind == "worker":
            reg = _worker_reg(d, ns, ttl=3)
        else:
            reg = Registration(
                d,
                key=lambda rid: subjects.router_key(ns, rid),
                value=lambda rid: RouterInfo(router=rid, http_url="http://r", started_at=0.0),
                ttl=3,
            )
        await reg.start()
        assert reg.lease is not None
        lease = reg.lease.id
        with caplog.at_level(logging.WARNING, logger="discovery.registration"):
            await d.delete(reg.key)
            await _until(lambda: any(reg.key in r.getMessage() for r in caplog.records), 3, "the key put back")
        assert await d.holder(reg.key) == lease and reg.lease.id == lease  # the same lease: no re-registration
        assert reg.state is RegistrationState.REGISTERED and reg.registrations == 1
        await reg.stop()


async def test_a_supervisor_tick_that_raises_is_an_error_and_the_next_tick_still_puts_the_key_back(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One raise in the supervisor ended it for good (audit of 2026-12-06): a key deleted after it
    stayed deleted while its owner's /health said registered, and nothing was logged."""
    real = Registration._check_key
    raised: list[bool] = []

    async def check_once_bad(self: Registration, lease: object) -> None:
        if not raised:
            raised.append(True)
            raise RuntimeError("injected: a bug in the supervisor")
        await real(self, lease)  # type: ignore[arg-type]

    monkeypatch.setattr(Registration, "_check_key", check_once_bad)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=MIN_LEASE_TTL)
        await reg.start()
        assert reg.lease is not None
        lease = reg.lease.id
        with caplog.at_level(logging.WARNING, logger="discovery.registration"):
            await _until(lambda: bool(raised), 3, "the tick that raises")
            await d.delete(reg.key)
            await _until(lambda: any("put it back" in r.getMessage() for r in caplog.records), 5, "the key put back")
        assert await d.holder(reg.key) == lease
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert reg.key in errors[0].getMessage() and errors[0].exc_info is not None  # its traceback
        assert not reg.failed.is_set() and reg.state is RegistrationState.REGISTERED
        await reg.stop()


async def test_a_supervisor_that_ends_fails_the_registration(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever ends the supervisor (it runs until stop()), the owner hears it through `failed`."""

    async def supervise(self: Registration) -> None:
        raise RuntimeError("injected: the supervisor ended")

    monkeypatch.setattr(Registration, "_supervise", supervise)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns)
        with caplog.at_level(logging.ERROR, logger="discovery.registration"):
            await reg.start()
            await asyncio.wait_for(reg.failed.wait(), 3)
        assert reg.state is RegistrationState.FAILED
        assert reg.failure is not None and "supervisor" in str(reg.failure) and reg.key in str(reg.failure)
        assert any("no longer kept registered" in r.getMessage() for r in caplog.records)
        await reg.stop()


async def test_the_state_is_lost_once_etcd_says_the_lease_is_gone(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the supervisor registers anew, the state says so: "registered" with the lease gone
    told a shim's /health it was still routed."""
    supervising = asyncio.Event()

    async def idle(self: Registration) -> None:  # a supervisor that has not acted on the loss (yet)
        supervising.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(Registration, "_supervise", idle)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=2)
        await reg.start()
        await supervising.wait()
        assert reg.lease is not None
        before = reg.state
        await d.revoke(reg.lease.id)
        await _until(lambda: reg.lease is not None and reg.lease.lost.is_set(), 5, "the lease lost")
        assert (before, reg.state) == (RegistrationState.REGISTERED, RegistrationState.LOST)
        await reg.stop()


async def test_an_update_whose_value_raises_once_is_put_by_a_later_round(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """update()'s flag was cleared before value() ran: a value() that raised once lost the update
    for good, etcd keeping the old value (review of 2026-12-06)."""
    version = [1]
    bad = [False]

    def value(wid: str) -> WorkerInfo:
        if bad[0]:
            bad[0] = False
            raise RuntimeError("injected: value() raises once")
        return WorkerInfo(worker=wid, model="m", role="agg", engine="vllm", block_size=16, events_ok=version[0] == 1)

    async def stored() -> bool:
        raw = await _get(d, reg.key)
        return raw is not None and decode_json(raw, WorkerInfo).events_ok

    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = Registration(d, key=lambda wid: subjects.worker_key(ns, wid), value=value, ttl=3)
        await reg.start()
        with caplog.at_level(logging.ERROR, logger="discovery.registration"):
            version[0], bad[0] = 2, True
            reg.update()
            await _until(lambda: any(r.exc_info for r in caplog.records), 3, "the round whose value() raised")
            deadline = time.monotonic() + 5  # the next round: at most ttl/3 = 1 s after the backoff's 0.2 s
            while await stored() and time.monotonic() < deadline:  # noqa: ASYNC110 (a value in etcd)
                await asyncio.sleep(0.05)
        assert not await stored(), "the update() was lost: etcd still holds the old value"
        await reg.stop()


async def test_stop_says_whether_the_lease_went(etcd_url: str, ns: str) -> None:
    """stop() with etcd gone returned as if the lease went, a WARNING its only word (review of
    2026-12-06): an owner whose peers act on the key (a router's bookings) could not say so."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns)
        await reg.start()
        assert await reg.stop() is True and await reg.stop() is True  # stopped: no lease left to revoke
    etcd = EtcdServer().start()
    try:
        async with Discovery(EtcdSettings(endpoints=[etcd.url]), ns) as d:
            reg = _worker_reg(d, ns, ttl=5)
            await reg.start()
            await asyncio.to_thread(etcd.stop)
            assert await reg.stop() is False
            assert reg.state is RegistrationState.STOPPED
    finally:
        etcd.stop()


async def test_a_key_put_again_without_a_lease_is_put_back_under_its_owners(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """`etcdctl put KEY "$(etcdctl get --print-value-only KEY)"` left the key held by no lease: the
    check saw it there and passed it, so it outlived its shim for good, a dead worker listed by
    every router (audit of 2026-12-07)."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=3)
        await reg.start()
        assert reg.lease is not None
        lease = reg.lease.id
        with caplog.at_level(logging.ERROR, logger="discovery.registration"):
            await d.put_raw(reg.key, await _get(d, reg.key) or b"")
            assert await d.holder(reg.key) == 0
            await _until(lambda: any(reg.key in r.getMessage() for r in caplog.records), 3, "the key put back")
        said = [r.getMessage() for r in caplog.records if reg.key in r.getMessage()]
        assert len(said) == 1 and "held by no lease" in said[0] and reg.lease.hex_id in said[0], said
        assert await d.holder(reg.key) == lease and reg.registrations == 1
        assert await reg.stop()
        assert await d.holder(reg.key) is None  # gone with its owner


async def _mod_revision(d: Discovery, key: str) -> int:
    assert d.client.kv is not None
    resp = await d.client.kv.get(key, timeout=5)
    return int(resp.kvs[0].mod_revision) if resp.kvs else 0


async def test_two_owners_of_one_name_after_a_delete_one_fails_and_the_record_stops_changing(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A second shim under a held --worker-name registered the moment the key was deleted by hand;
    from then both put the key back under their own lease every tick, an ERROR each, for good: both
    served "registered", and routers saw the worker's epoch flip each time (review of 2026-12-07)."""
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as other,
    ):
        first = _worker_reg(d, ns, ttl=3, name="w1")
        await first.start()
        second = _worker_reg(other, ns, ttl=3, name="w1")
        with caplog.at_level(logging.ERROR, logger="discovery.registration"):
            for _ in range(5):  # the first's check (every 1 s) may put it back in between: delete again
                await d.delete(first.key)
                try:
                    await second.start()
                    break
                except KeyTaken:
                    await asyncio.sleep(0.1)
            assert second.lease is not None, "the second owner never registered"
            await asyncio.wait_for(first.failed.wait(), 5)
        assert first.state is RegistrationState.FAILED and isinstance(first.failure, KeyTaken)
        assert "w1" in str(first.failure) and first.failure.holder == second.lease.id
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and "same name" in said[0], said
        revision = await _mod_revision(d, second.key)
        await asyncio.sleep(2.5)  # two more ticks of each
        assert await _mod_revision(d, second.key) == revision, "the record is still being put back"
        assert await d.holder(second.key) == second.lease.id
        assert not second.failed.is_set() and second.state is RegistrationState.REGISTERED
        await first.stop()
        await second.stop()


async def test_putting_back_a_key_held_by_no_lease_never_overwrites_an_owners_create_in_between(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put-back of a key put by hand (no lease) was a plain put: another owner's create between
    the check's read and it was overwritten (review of 2026-12-07)."""
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as other,
    ):
        reg = _worker_reg(d, ns, ttl=3, name="w2")
        await reg.start()
        assert reg.lease is not None
        rival = await other.grant(30)
        read = d.holder

        async def holder_then_a_create(key: str) -> int | None:
            held = await read(key)
            if key == reg.key and held == 0:  # between the read and the put-back: another owner's create
                await other.delete(key)
                await other.create(key, b'{"rival": true}', rival)
            return held

        monkeypatch.setattr(d, "holder", holder_then_a_create)
        await d.put_raw(reg.key, await _get(d, reg.key) or b"")
        await asyncio.wait_for(reg.failed.wait(), 5)
        assert isinstance(reg.failure, KeyTaken) and reg.failure.holder == rival.id
        assert await _get(d, reg.key) == b'{"rival": true}' and await read(reg.key) == rival.id
        await reg.stop()
        await other.release(rival)


async def test_a_key_put_by_hand_between_the_checks_read_of_it_gone_and_its_put_back_is_put_back(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`etcdctl del` then `etcdctl put` (no lease) racing the check: its put-back was a create, which
    found the key held by lease 0 and failed the owner as if a live second shim held the name (a
    shim exited 2 naming --worker-name with no other owner; review of 2026-12-07)."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=3, name="w3")
        await reg.start()
        assert reg.lease is not None
        read = d.holder
        put: list[bool] = []

        async def holder_then_a_put_by_hand(key: str) -> int | None:
            held = await read(key)
            if key == reg.key and held is None:  # between the read and the put-back
                await d.put_raw(key, b'{"by": "hand"}')
                put.append(True)
            return held

        monkeypatch.setattr(d, "holder", holder_then_a_put_by_hand)
        await d.delete(reg.key)
        await _until(lambda: bool(put), 3, "the check's read")
        deadline = time.monotonic() + 3
        while not reg.failed.is_set() and await read(reg.key) != reg.lease.id:
            assert time.monotonic() < deadline, "never put back"
            await asyncio.sleep(0.05)
        assert not reg.failed.is_set(), reg.failure
        assert await read(reg.key) == reg.lease.id and reg.state is RegistrationState.REGISTERED
        await reg.stop()


async def _twin(d: Discovery, other: Discovery, ns: str, name: str) -> tuple[Registration, Registration]:
    """A registration under `name` with checks 10 s apart, and a second one under the same name
    that took the key once it was deleted by hand."""
    first = _worker_reg(d, ns, ttl=30, name=name)
    await first.start()
    await d.delete(first.key)
    second = _worker_reg(other, ns, ttl=3, name=name)
    await second.start()
    return first, second


async def test_an_update_after_a_twin_took_the_key_fails_this_owner_and_leaves_the_twins_key(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An update() (a state flip) was a plain put: one coming before the check that would fail this
    owner overwrote the twin's key under its own lease, and the twin's check then failed the twin,
    the owner holding the key (review of 2026-12-07)."""
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as other,
    ):
        first, second = await _twin(d, other, ns, "w3")
        assert second.lease is not None
        twins = await _get(d, second.key)
        with caplog.at_level(logging.ERROR, logger="discovery.registration"):
            first.update()  # before its next check, 10 s on
            await asyncio.wait_for(first.failed.wait(), 5)
        assert isinstance(first.failure, KeyTaken) and first.failure.holder == second.lease.id
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(said) == 1 and "same name" in said[0] and "w3" in said[0], said
        assert await d.holder(second.key) == second.lease.id and await _get(d, second.key) == twins
        await asyncio.sleep(1.5)  # a check of the twin's
        assert not second.failed.is_set() and second.state is RegistrationState.REGISTERED
        await first.stop()
        await second.stop()


async def test_an_update_after_the_key_was_deleted_puts_it_back_with_the_new_value(etcd_url: str, ns: str) -> None:
    """The put of an update() is conditioned on the lease holding the key; a key gone (deleted by
    hand) is put back all the same, as a check would, with the value of now."""
    model = ["m"]
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = Registration(
            d,
            key=lambda wid: subjects.worker_key(ns, wid),
            value=lambda wid: WorkerInfo(worker=wid, model=model[0], role="agg", engine="vllm", block_size=16),
            ttl=30,  # checks 10 s apart: the update puts it back
        )
        await reg.start()
        assert reg.lease is not None
        await d.delete(reg.key)
        model[0] = "m2"
        reg.update()
        deadline = time.monotonic() + 5
        while (raw := await _get(d, reg.key)) is None:
            assert time.monotonic() < deadline, "the key was never put back"
            await asyncio.sleep(0.05)
        assert decode_json(raw, WorkerInfo).model == "m2"
        assert await d.holder(reg.key) == reg.lease.id and not reg.failed.is_set()
        await reg.stop()


async def test_a_keep_alive_that_fails_registers_its_name_anew(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keep-alive loop failing on anything unforeseen takes the lease as lost: the lease, still
    held by etcd, was left to its TTL, so registering anew found the name under it and failed as if
    another process held it (review of 2026-12-07)."""
    from discovery.lease import Lease

    real = Lease._stream
    failed_once = False

    async def fails_once(self: Lease, interval: float) -> bool:
        nonlocal failed_once
        if not failed_once:
            failed_once = True
            await asyncio.sleep(0.5)
            raise RuntimeError("an unforeseen defect")
        return await real(self, interval)

    monkeypatch.setattr(Lease, "_stream", fails_once)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=10, name="gpu-07")
        await reg.start()
        assert reg.lease is not None
        first = reg.lease.id
        await _until(lambda: reg.registrations == 2, 5, "the name registered anew")
        assert reg.state is RegistrationState.REGISTERED and reg.failure is None
        assert reg.lease.id != first and await d.holder(reg.key) == reg.lease.id
        assert await reg.stop()


@pytest.mark.parametrize("fails", ["times out", "raises"])
async def test_a_keep_alive_that_fails_with_its_revoke_waits_out_its_own_lease_and_registers_anew(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fails: str
) -> None:
    """Its revoke failing too, the old lease held the name until its TTL: registering anew found the
    name under it and failed for good, blaming "another process" (final read of 2026-12-07). Its
    revokes all fail here: the lost lease's release revokes it again (review of 2026-12-08). A revoke
    that raises (the keep-alive's defect in its way too) went out of that release each round: the
    registration stayed "reregistering" for good, etcd long rid of the lease (review of 2026-12-08)."""
    real_stream, real_revoke = Lease._stream, Lease._revoke
    failed: set[str] = set()
    broken: list[int] = []

    async def fails_once(self: Lease, interval: float) -> bool:
        if "stream" not in failed:
            failed.add("stream")
            broken.append(self.id)
            await asyncio.sleep(0.5)
            raise RuntimeError("an unforeseen defect")
        return await real_stream(self, interval)

    async def revoke_fails(self: Lease, timeout: float) -> BaseException | None:
        if self.id in broken:
            if fails == "raises":
                raise RuntimeError("the same defect")
            return TimeoutError()
        return await real_revoke(self, timeout)

    monkeypatch.setattr(Lease, "_stream", fails_once)
    monkeypatch.setattr(Lease, "_revoke", revoke_fails)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=3, name="gpu-07")
        await reg.start()
        assert reg.lease is not None
        first = reg.lease
        await _until(lambda: reg.registrations == 2 or reg.failed.is_set(), 10, "the name registered anew")
        assert reg.state is RegistrationState.REGISTERED and reg.failure is None, reg.failure
        assert reg.lease.id != first.id and await d.holder(reg.key) == reg.lease.id
        why = "RuntimeError: the same defect" if fails == "raises" else "TimeoutError"
        assert f"lease {first.hex_id}: revoke failed ({why})" in caplog.text
        assert await reg.stop()


async def test_a_lost_lease_whose_revoke_failed_is_revoked_by_registering_anew(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its keep-alive's revoke failing once, the lost lease read as gone: its release before
    registering anew tried nothing, and the name waited out the lease's TTL (review of 2026-12-08)."""
    real_stream, real_revoke = Lease._stream, Lease._revoke
    failed: set[str] = set()

    async def fails_once(self: Lease, interval: float) -> bool:
        if "stream" not in failed:
            failed.add("stream")
            await asyncio.sleep(0.5)
            raise RuntimeError("an unforeseen defect")
        return await real_stream(self, interval)

    async def revoke_fails_once(self: Lease, timeout: float) -> BaseException | None:
        if "revoke" not in failed:
            failed.add("revoke")
            return TimeoutError()
        return await real_revoke(self, timeout)

    monkeypatch.setattr(Lease, "_stream", fails_once)
    monkeypatch.setattr(Lease, "_revoke", revoke_fails_once)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=30, name="gpu-07")
        await reg.start()
        assert reg.lease is not None
        first = reg.lease.id
        await _until(lambda: reg.registrations == 2 or reg.failed.is_set(), 10, "the name registered anew")
        assert reg.state is RegistrationState.REGISTERED and reg.lease.id != first
        assert await d.time_to_live(first) is None
        assert "to expire" not in caplog.text  # not waited out
        assert await reg.stop()


@pytest.mark.parametrize("fails", ["times out", "raises"])
async def test_stop_says_a_lost_lease_etcd_did_not_revoke_is_not_gone(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """A lost lease whose revoke failed read as gone: stop() said True (`revoked` too) while etcd held
    it and its key until its TTL (review of 2026-12-08); a revoke that raised went out of stop()."""
    real_revoke = Lease._revoke
    refusing = True

    async def broken(self: Lease, interval: float) -> bool:
        await asyncio.sleep(0.3)
        raise RuntimeError("an unforeseen defect")

    async def refused(self: Lease, timeout: float) -> BaseException | None:
        if refusing and fails == "raises":
            raise RuntimeError("the same defect")
        return TimeoutError() if refusing else await real_revoke(self, timeout)

    registering_anew = asyncio.Event()

    async def on_lost(old: str) -> None:  # holds the supervisor after the lost lease's release
        registering_anew.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(Lease, "_stream", broken)
    monkeypatch.setattr(Lease, "_revoke", refused)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=30, on_lost=on_lost)
        await reg.start()
        lease = reg.lease
        assert lease is not None
        await asyncio.wait_for(registering_anew.wait(), timeout=5.0)
        assert await reg.stop() is False and reg.revoked is False
        assert await d.holder(subjects.worker_key(ns, lease.hex_id)) == lease.id
        refusing = False
        assert await lease.revoke() is True and await d.time_to_live(lease.id) is None


async def test_revoke_now_revokes_a_lease_whose_stop_is_revoking_it(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second SIGTERM while stop() waited on a slow etcd's revoke revoked nothing and said nothing:
    stop() had let go of the lease, and the lease took a revoke begun as done (review of 2026-12-08)."""
    real_revoke = Lease._revoke
    revoking, answer = asyncio.Event(), asyncio.Event()

    async def slow(self: Lease, timeout: float) -> BaseException | None:  # a member slow to answer
        revoking.set()
        await answer.wait()
        return await real_revoke(self, timeout)

    monkeypatch.setattr(Lease, "_revoke", slow)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=30)
        await reg.start()
        assert reg.lease is not None
        lease_id = reg.lease.id
        stopping = asyncio.create_task(reg.stop())
        await asyncio.wait_for(revoking.wait(), timeout=5.0)
        try:
            reg.revoke_now(1.0)  # on the loop's thread, as runtime.run_service's on_abort runs it
            assert await d.time_to_live(lease_id) is None and await d.holder(reg.key) is None
        finally:
            answer.set()
        assert await stopping is True


async def test_a_ttl_etcd_refuses_while_registering_anew_fails_naming_the_setting(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd's least TTL risen above the owner's (its --election-timeout raised) while registering
    anew: the grant's ConfigError was blamed on "the owner's hook" (review of 2026-12-08)."""
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=3)
        await reg.start()
        assert reg.lease is not None
        refused = ConfigError("lease_ttl", 3, "etcd grants no lease under 5 s (its least TTL); give at least 5")

        async def grant(self: Discovery, ttl: int = 10, *, setting: str | None = "lease_ttl") -> Lease:
            raise refused

        monkeypatch.setattr(Discovery, "grant", grant)
        await d.revoke(reg.lease.id)
        await _until(reg.failed.is_set, 10, "the registration failed")
        assert reg.failure is refused and reg.state is RegistrationState.FAILED
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [f"registering {reg.key} again failed: {refused}"]
        monkeypatch.undo()
        await reg.stop()


@pytest.mark.parametrize("hook", ["on_answered", "on_failing"])
async def test_a_synchronous_hook_that_raises_fails_the_registration_once(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    """A synchronous owner's hook (on_answered, on_failing) raised inside an except clause went past the
    registration's own handling: the round ended as a failed tick, the next began the loss anew
    (on_lost told again, every round) and `failed` was never set (review of f03192a)."""
    from discovery.lease import Lease

    real_stream = Lease._stream
    failed: set[str] = set()

    async def fails_once(self: Lease, interval: float) -> bool:
        if "stream" not in failed:
            failed.add("stream")
            await asyncio.sleep(0.5)
            raise RuntimeError("an unforeseen defect")
        return await real_stream(self, interval)

    async def revoke_fails(self: Lease, timeout: float) -> BaseException | None:
        return TimeoutError()  # the old lease keeps the name: registering anew is answered KeyTaken

    real_register = Registration._register

    async def etcd_fails(self: Registration) -> None:  # on_failing's case: etcd fails the try
        if self.registrations:
            raise DiscoveryError("etcd does not answer")
        await real_register(self)

    lost: list[str] = []

    async def on_lost(rid: str) -> None:
        lost.append(rid)

    def defect(*args: object) -> None:
        raise RuntimeError("the owner's defect")

    monkeypatch.setattr(Lease, "_stream", fails_once)
    monkeypatch.setattr(Lease, "_revoke", revoke_fails)
    if hook == "on_failing":
        monkeypatch.setattr(Registration, "_register", etcd_fails)
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=30, name="gpu-07", on_lost=on_lost, **{hook: defect})
        await reg.start()
        await _until(reg.failed.is_set, 10, "the registration failed")
        await asyncio.sleep(1.0)  # rounds after it would tell on_lost again
        assert reg.state is RegistrationState.FAILED and "the owner's hook failed" in str(reg.failure)
        assert len(lost) == 1, lost
        await reg.stop()


async def test_a_stop_cancelled_while_its_supervisor_runs_on_still_revokes_the_lease(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop within a stop: a registration stopped in a task's cleanup (a router's start that a
    SIGTERM cancelled), which the stop waiting on that task cancels again past CANCEL_AGAIN_S while
    the supervisor, its cancellation lost, runs on. That cancellation came in stop()'s wait on the
    supervisor and the revoke after it never ran: the key stayed to its TTL (a review of
    2026-12-07). The lease is revoked, then the cancellation raised."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.3)  # 10 s in service
    lost: list[str] = []

    async def tick() -> bool:  # a call below the supervisor that drops one cancellation
        await never_answers(lost, "tick")
        return True

    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=30)
        await reg.start()
        reg._tick = tick  # type: ignore[method-assign]
        reg._wake.set()  # its next tick now
        await asyncio.sleep(0.1)

        async def owner() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                await reg.stop()

        task = asyncio.create_task(owner())
        await asyncio.sleep(0.05)
        assert await ends_within(cancel_and_wait(task), 10), "the stop still waits on its registration"
        assert lost == ["tick"] and task.cancelled()
        assert await d.holder(reg.key) is None, "its lease was kept"
        assert reg.revoked is True, "the revoke that went is not said"


async def test_a_stop_ends_a_supervisor_that_lost_its_cancellation(
    etcd_url: str, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full test run of 2026-12-07 hung for good in a shim's stop: its registration's supervisor
    lost stop()'s cancellation below it (a call that swallowed it) and ticked on, and stop() waited
    on it without end. It is now cancelled again until it ends."""
    monkeypatch.setattr(runtime, "CANCEL_AGAIN_S", 0.5)  # 10 s in service: longer than a revoke
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        reg = _worker_reg(d, ns, ttl=3)
        await reg.start()
        tick = reg._tick
        lost: list[int] = []

        async def losing_one() -> bool:
            try:
                return await tick()
            except asyncio.CancelledError:
                if lost:
                    raise
                lost.append(1)  # as a call below it that swallowed it would
                return True

        reg._tick = losing_one  # type: ignore[method-assign]
        reg._wake.set()  # its next tick now
        await asyncio.sleep(0.1)
        assert await ends_within(reg.stop(), 10), "stop() still waits on its supervisor"
        assert reg.revoked is True
        assert lost == [1]
