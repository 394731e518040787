"""A shim whose namespace no router serves says so (worker_shim.router_presence; real etcd, nats,
sim). The operator walkthrough's case: a router in `kvswitch`, a shim given `--namespace kvswich`
that registered with nothing but INFO "registered worker ... at /kvswich/workers/...", neither side
warning."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from discovery import Discovery, session
from discovery.session import RouterNamespaces
from engine_sim.server import SimServer
from kvswitch.servers import EtcdServer
from protocol import RouterInfo
from protocol.config import EtcdSettings
from tests.worker_shim.cluster import shim_for, sim_config, wait_for
from worker_shim import router_presence


def _router(rid: str) -> RouterInfo:
    return RouterInfo(router=rid, http_url="http://127.0.0.1:1", started_at=1.0)


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if text in r.getMessage()]


async def test_a_worker_whose_namespace_no_router_serves_is_said_once_naming_namespace_and_where_routers_are(
    ns: str, nats_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_presence, "NO_ROUTER_GRACE_S", 0.5)
    caplog.set_level(logging.INFO, logger="worker_shim.router_presence")
    router_ns = ns + "r"  # the namespace the operator meant
    # An etcd of its own: the suite's shared one gathers a namespace per test, past the read's caps.
    with EtcdServer() as etcd:
        await _said_once(ns, router_ns, nats_url, etcd.url, caplog)


async def _said_once(ns: str, router_ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with (
        Discovery(EtcdSettings(endpoints=[etcd_url]), router_ns) as meant,
        Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as given,
    ):
        await meant.register_router(_router)
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
            await wait_for(shim.registered.is_set, 20, "registered")
            await wait_for(lambda: bool(_said(caplog, "no router is registered")), 10, "the warning")
            await asyncio.sleep(2.5)  # checks enough to say it again, were it said each check
            [warned] = _said(caplog, "no router is registered")
            said = warned.getMessage()
            assert warned.levelno == logging.WARNING
            assert f"no router is registered in namespace {ns} (no key under /{ns}/routers/" in said
            assert f"while worker {shim.worker_id} is registered" in said and "check --namespace" in said
            assert "routers are registered in namespace(s) " in said and router_ns in said.split("namespace(s) ")[1]
            await given.register_router(_router)
            await wait_for(lambda: bool(_said(caplog, "a router is registered in namespace")), 10, "the router seen")
            [seen] = _said(caplog, "a router is registered in namespace")
            assert seen.levelno == logging.INFO and f"namespace {ns} now" in seen.getMessage()


async def test_a_worker_whose_namespace_has_a_router_says_nothing_of_it(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(router_presence, "NO_ROUTER_GRACE_S", 0.5)
    caplog.set_level(logging.INFO, logger="worker_shim.router_presence")
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        await d.register_router(_router)
        async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
            await wait_for(shim.registered.is_set, 20, "registered")
            await asyncio.sleep(2.5)  # past the grace, a check each second
    assert not _said(caplog, "router is registered")


async def test_a_user_that_may_not_read_other_namespaces_is_told_to_check_namespace_alone(
    ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def denied() -> None:
        return None  # Discovery.router_namespaces under a role of one namespace

    caplog.set_level(logging.INFO, logger="worker_shim.router_presence")
    now = [0.0]
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        monkeypatch.setattr(d, "router_namespaces", denied)
        presence = router_presence.RouterPresence(d, ns, 30.0, clock=lambda: now[0])
        async for event in d.watch_routers():
            presence.update(event)  # the snapshot: no router
            break
        await presence.check(None)  # not registered: nothing judged
        now[0] = 100.0
        await presence.check("w")
        now[0] = 129.0
        await presence.check("w")
        assert not presence.said
        now[0] = 130.0
        await presence.check("w")
    [warned] = _said(caplog, "no router is registered")
    assert f"no key under /{ns}/routers/ for 30s while worker w" in warned.getMessage()
    assert warned.getMessage().endswith("this etcd user may not read other namespaces to say which have one")


async def test_router_namespaces_reads_the_namespaces_with_a_router_key(ns: str) -> None:
    # An etcd of its own: the suite's shared one gathers a namespace per test, past the read's cap.
    with EtcdServer() as etcd:
        async with Discovery(EtcdSettings(endpoints=[etcd.url]), ns) as d:
            await d.register_router(_router)
            await d.put_raw(f"/{ns}x/routers", b"")  # no router id: not a router's key
            await d.put_raw(f"/{ns}y/routers/a/b", b"")  # deeper: not one either
            found = await d.router_namespaces()
    assert found is not None and ns in found.found and ns + "x" not in found.found and ns + "y" not in found.found


async def test_router_namespaces_reads_a_keyspace_larger_than_one_grpc_answer_a_key_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One keys-only read of the whole keyspace overflowed gRPC's answer on a large shared etcd
    # (4 MiB of key names); here the answer may be 64 KiB, and the keys' names are 150 KiB.
    options = [*session._RECONNECT_OPTIONS, ("grpc.max_receive_message_length", 64 * 1024)]
    monkeypatch.setattr(session, "_RECONNECT_OPTIONS", options)
    with EtcdServer() as etcd:
        async with Discovery(EtcdSettings(endpoints=[etcd.url]), "ab") as d:
            kv = d.client.kv
            assert kv is not None
            name = "/other/blocks/" + "k" * 180
            for start in range(0, 800, 100):
                await asyncio.gather(*(kv.put(f"{name}{i:04d}", b"") for i in range(start, start + 100)))
            await d.register_router(_router)  # /ab/routers/{id}
            for key in ("/", "/ab", "//routers/r", "/ab-c/routers/r", "/deep/routers/a/b", "/zz/routers/r"):
                await d.put_raw(key, b"")
            await d.put_raw("/other/routers/r", b"")  # after 800 keys of /other/
            found = await d.router_namespaces()
            assert found is not None and found.found == ["ab-c", "ab", "other", "zz"] and found.cut is None
            cut = await d.router_namespaces(most=2)
            assert cut is not None and cut.found == ["ab-c", "ab"]
            assert cut.cut == "the read stopped at its most, 2 namespaces: from /deep on unread"
            late = await d.router_namespaces(within_s=0.0)
            assert (
                late is not None
                and late.found == []
                and late.cut == "the read stopped at its most, 0 s: from / on unread"
            )


@pytest.mark.parametrize(
    ("read_s", "keys", "found", "unread"),
    [
        # each read slow under its 5 s timeout: the reads of /a ran on to 5 s, /b's to 7.5 s
        (2.5, ["/a/routers/r", "/b/routers/r", "/c/routers/r"], [], "from /a on"),
        # the next namespace's read timed out at the cap
        (1.2, ["/a/routers/r", "/b/routers/r"], ["a"], "after /a"),
        # many keys under one namespace's /routers/, none a router's: its reads ran on past the cap
        (
            0.5,
            ["/a/routers/r", "/b/routers/x/1", "/b/routers/y/1", "/b/routers/z/1", "/c/routers/r"],
            ["a"],
            "from /b on",
        ),
    ],
)
async def test_a_slow_etcd_holds_the_read_of_the_namespaces_no_longer_than_its_cap(
    ns: str,
    etcd_url: str,
    monkeypatch: pytest.MonkeyPatch,
    read_s: float,
    keys: list[str],
    found: list[str],
    unread: str,
) -> None:
    """The read runs in the shim's loop that cancels the legs of a router that died
    (worker_shim.orphaned_legs): each read's timeout ends within the cap, and the read of one
    namespace stops at it too, so a slow etcd holds it the cap and one short read at most (on a
    clock of the reads' own), not ~13 s."""
    now = [0.0]
    monkeypatch.setattr(session, "time", SimpleNamespace(monotonic=lambda: now[0]))

    async def get(start: bytes, end: bytes, *, keys_only: bool, limit: int, timeout: float) -> SimpleNamespace:
        if timeout < read_s:  # as etcd3aio's timeout of the call ends it
            now[0] += timeout
            raise TimeoutError
        now[0] += read_s
        first = next((k for k in map(str.encode, keys) if start <= k < end), None)
        return SimpleNamespace(kvs=[SimpleNamespace(key=first)] if first is not None else [])

    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        monkeypatch.setattr(d.client.kv, "get", get)
        read = await d.router_namespaces()
    assert read == RouterNamespaces(found, f"the read stopped at its most, 3 s: {unread} unread")
    assert now[0] <= session._NAMESPACES_READ_S + session._LAST_READ_S, now


async def test_a_read_of_the_namespaces_cut_short_says_so(
    ns: str, etcd_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def cut() -> RouterNamespaces:
        return RouterNamespaces([], "the read stopped at its most, 3 s: from /m on unread")

    caplog.set_level(logging.INFO, logger="worker_shim.router_presence")
    now = [0.0]
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
        monkeypatch.setattr(d, "router_namespaces", cut)
        presence = router_presence.RouterPresence(d, ns, 30.0, clock=lambda: now[0])
        async for event in d.watch_routers():
            presence.update(event)
            break
        await presence.check("w")
        now[0] = 30.0
        await presence.check("w")
    [warned] = _said(caplog, "no router is registered")
    assert warned.getMessage().endswith(
        "; none is registered in any namespace read either (the read stopped at its most, 3 s: from /m on unread)"
    )
