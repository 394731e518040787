"""A vLLM given `"endpoint": "tcp://*:0"` binds its node IP and lists the resolved `tcp://IP:PORT` on
/kv_event_sources (vllm/distributed/kv_events.py ZmqEventPublisher._bind), which reads by vLLM's
rule as an address the engine connects to. The shim reads the rule on the endpoint the engine was
given; not knowing it and unable to bind the listed address, it refuses naming --kv-events-mode.
Before, it bound the engine's own port and retried for ever."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from engine_sim.config import KVEventsConfig
from engine_sim.server import SimServer
from kvswitch.servers import free_ports
from protocol import ConfigError
from tests.worker_shim.cluster import engine_set, shim_for, sim_config, wait_for
from tests.worker_shim.test_zmq_endpoints import needs_ipv6
from worker_shim.adapters import zmq_bind
from worker_shim.adapters.zmq_bind import NAME_GRACE_S, BindFailures, BindPending
from worker_shim.event_health import EventProblem
from worker_shim.kv_events_config import listed_mode

URL = "http://127.0.0.1:8000"
STAR0 = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


@pytest.mark.parametrize(
    ("listed", "given", "mode", "side"),
    [
        ("tcp://10.0.0.5:43655", "tcp://*:0", "auto", "connect"),  # vLLM's resolved *:0
        ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5557", "auto", "bind"),  # the engine connects
        ("tcp://*:5557", None, "auto", "connect"),
        ("tcp://[::]:5557", None, "auto", "connect"),
        ("ipc:///tmp/ev", None, "auto", "connect"),
        ("tcp://10.0.0.5:43655", None, "connect", "connect"),
        ("tcp://10.0.0.5:43655", None, "bind", "bind"),
    ],
)
async def test_the_side_follows_vllms_rule_on_the_endpoint_it_was_given(
    listed: str, given: str | None, mode: str, side: str
) -> None:
    assert await listed_mode(listed, given, mode, URL, BindFailures()) == side  # type: ignore[arg-type]


async def test_a_free_concrete_address_is_one_the_engine_connects_to() -> None:
    """vLLM given `tcp://127.0.0.1:P` connects there and lists it so (the dp2 capture): nothing
    holds it, so the shim binds it."""
    assert await listed_mode(f"tcp://127.0.0.1:{free_ports(1)}", None, "auto", URL, BindFailures()) == "bind"


@pytest.mark.parametrize("held", [True, False])
async def test_a_concrete_address_this_host_cannot_bind_is_refused_naming_the_flag(held: bool) -> None:
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    with pub:
        if held:  # the engine's own PUB, bound on this host
            pub.bind("tcp://127.0.0.1:0")
            listed = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:  # another host's address (TEST-NET-1)
            listed = "tcp://192.0.2.1:43655"
        with pytest.raises(ConfigError) as caught:
            await listed_mode(listed, None, "auto", URL, BindFailures())
    assert caught.value.setting == "kv_events_mode"
    assert "Give --kv-events-mode connect" in str(caught.value) and listed in str(caught.value)
    said = "Address already in use" if held else "no interface of this host has 192.0.2.1"
    assert said in str(caught.value), caught.value


async def test_a_listed_port_a_connection_holds_is_looked_at_again() -> None:
    """A connection's local port (open, or in TIME_WAIT for a minute) fails the bind with the
    EADDRINUSE of a listener's, and may free itself: the shim's own bind tries again there, and since
    2026-12-07 so does the look at a listed one (c50eac9 made it final, exit 2); for how long,
    tests/worker_shim/test_port_holders.py."""
    with socket.socket() as listener, socket.socket() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held.bind(("127.0.0.1", 0))
        held.connect(listener.getsockname())
        listed = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(BindPending) as caught:
            await listed_mode(listed, None, "auto", URL, BindFailures())
    assert f"lists its KV events at {listed}, which this host cannot bind yet" in str(caught.value)
    port = listed.rpartition(":")[2]
    assert f"a connection's local end holds port {port} (127.0.0.1 (ESTABLISHED))" in str(caught.value)


def _resolving(monkeypatch: pytest.MonkeyPatch, host: str, code: int) -> None:
    """getaddrinfo of `host` fails with EAI_ `code` (zmq_bind's diagnosis asks it; ZMQ's own lookup
    of a .invalid name fails with "No such device" either way)."""
    real = socket.getaddrinfo

    def getaddrinfo(name: object, *args: Any, **kwargs: Any) -> Any:
        if name == host:
            raise socket.gaierror(code, f"EAI {code}")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


async def test_a_listed_name_that_does_not_resolve_yet_is_looked_at_again_until_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM given `tcp://shim-0.svc:5557` connects there and lists it so; a DNS record that appears
    seconds after the pod is no reason to stop. Until 2026-12-07 the first failed bind exited 2."""
    listed = "tcp://shim-0.invalid:5557"
    _resolving(monkeypatch, "shim-0.invalid", socket.EAI_NONAME)
    now = [0.0]
    binds = BindFailures(clock=lambda: now[0])
    for at in (0.0, NAME_GRACE_S - 0.1):
        now[0] = at
        with pytest.raises(ConnectionError) as again:
            await listed_mode(listed, None, "auto", URL, binds)
        assert "cannot bind yet" in str(again.value) and "the name shim-0.invalid does not resolve" in str(again.value)
    now[0] = NAME_GRACE_S
    with pytest.raises(ConfigError) as caught:
        await listed_mode(listed, None, "auto", URL, binds)
    assert caught.value.setting == "kv_events_mode" and "binds failed for 15 s" in str(caught.value), caught.value


async def test_a_temporary_dns_failure_of_a_listed_name_is_looked_at_again_past_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _resolving(monkeypatch, "shim-0.invalid", socket.EAI_AGAIN)
    now = [0.0]
    binds = BindFailures(clock=lambda: now[0])
    for at in (0.0, 10 * NAME_GRACE_S):
        now[0] = at
        with pytest.raises(ConnectionError, match="does not resolve for now"):
            await listed_mode("tcp://shim-0.invalid:5557", None, "auto", URL, binds)


@needs_ipv6
@pytest.mark.parametrize(("flags", "outcome"), [("40", ConnectionError), ("48", ConfigError)])
async def test_a_listed_tentative_ipv6_address_is_looked_at_again(
    flags: str, outcome: type[Exception], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written out in full: vLLM's rule reads any `::` as a PUB that binds. Tentative (DAD, 1-2 s):
    the next session looks again; DAD failed: final, as before."""
    listing = tmp_path / "if_inet6"
    listing.write_text(f"fd000077000000000000000000000005 02 40 00 {flags}     eth0\n")
    monkeypatch.setattr(zmq_bind, "IF_INET6", str(listing))
    with pytest.raises(outcome) as caught:
        await listed_mode("tcp://[fd00:77:0:0:0:0:0:5]:5557", None, "auto", URL, BindFailures())
    assert "fd00:77:0:0:0:0:0:5 on eth0" in str(caught.value), caught.value


def _star0_sim() -> SimServer:
    return SimServer(sim_config(kv_events=KVEventsConfig(**STAR0, topic="kv-events")))  # type: ignore[arg-type]


async def test_a_shim_given_no_endpoints_refuses_a_resolved_port_0_at_startup(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    async with _star0_sim() as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=None, kv_replay=None, kv_events_mode="auto")
        async with shim:
            await wait_for(shim.done.is_set, 10, "the shim refuses")
            assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "kv_events_mode"
            assert "--kv-events-mode connect" in str(shim.failure)
            assert not shim.registered.is_set()


@pytest.mark.parametrize(
    "shim_kw",
    [
        {"kv_events": None, "kv_replay": None, "kv_events_mode": "connect"},
        # The engine's own config: the shim reads the bound ports on /kv_event_sources and connects.
        {
            "kv_events": None,
            "kv_replay": None,
            "kv_events_mode": "auto",
            "kv_events_config": {**STAR0, "topic": "kv-events"},
        },
    ],
)
async def test_a_shim_that_knows_the_engine_binds_follows_its_resolved_port_0(
    shim_kw: dict[str, object], ns: str, nats_url: str, etcd_url: str
) -> None:
    async with _star0_sim() as sim:
        listed = sim.event_sources()["0"]
        shim = shim_for(sim, ns, nats_url, etcd_url, **shim_kw)
        async with shim:
            await wait_for(shim.registered.is_set, 10, "the shim registers")
            c = shim.config
            assert (c.kv_events, c.kv_replay, c.kv_events_mode) == (
                listed["endpoint"],
                listed["replay_endpoint"],
                "connect",
            )
            async with aiohttp.ClientSession() as http:
                body = {"model": sim.config.model, "prompt": list(range(100, 300)), "max_tokens": 1}
                async with http.post(sim.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            await wait_for(lambda: shim.canonical_hashes() == engine_set(sim) != set(), 5, "the engine's events")


async def test_a_shim_whose_event_address_another_process_listens_on_exits_naming_kv_events(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    # It logged "engine event stream failed: Address already in use" each second and never registered,
    # while `kvswitch up` with no router called the cluster ready (ports audit, 2026-12-06).
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        endpoint = f"tcp://127.0.0.1:{holder.getsockname()[1]}"  # the engine connects there: the shim binds
        async with SimServer(sim_config()) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=endpoint, kv_events_mode="auto")  # as `up` runs it
            async with shim:
                await wait_for(shim.done.is_set, 10, "the shim refuses")
    assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "kv_events", shim.failure
    assert f"the shim binds {endpoint} (where the engine connects) and this host cannot" in str(shim.failure)
    assert "another process listens there (127.0.0.1 (LISTEN)): stop it" in str(shim.failure)
    assert shim.registration_count == 0 and shim.session_failures == 0


@pytest.mark.parametrize("from_json", [False, True], ids=["kv-events", "kv-events-config"])
async def test_a_shim_whose_event_address_is_no_address_of_this_host_exits_naming_its_setting(
    from_json: bool, ns: str, nats_url: str, etcd_url: str
) -> None:
    # "Cannot assign requested address": 55 sessions in 6 s, never registered, naming no flag (review
    # of 2b1eb3c, 2026-12-07). The engine connects to 192.0.2.1 (TEST-NET-1): the shim binds it.
    endpoint = "tcp://192.0.2.1:5557"
    given: dict[str, object] = (
        {
            "kv_events": None,
            "kv_replay": None,
            "kv_events_config": {**STAR0, "endpoint": endpoint, "replay_endpoint": None},
        }
        if from_json
        else {"kv_events": endpoint, "kv_replay": None}
    )
    async with SimServer(sim_config()) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events_mode="auto", **given)
        async with shim:
            await wait_for(shim.done.is_set, 10, "the shim refuses")
    setting = "kv_events_config" if from_json else "kv_events"
    assert isinstance(shim.failure, ConfigError) and shim.failure.setting == setting, shim.failure
    assert f"the shim binds {endpoint} (where the engine connects) and this host cannot" in str(shim.failure)
    assert shim.registration_count == 0 and shim.session_failures == 0


def _resolving_late(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """libzmq fails the bind of a name it cannot resolve yet with "No such device", as for one that
    never will. Here ZMQ and getaddrinfo both fail `late-engine` (temporarily, EAI_AGAIN) until the
    flag returned is set, then give 127.0.0.1."""
    resolved = [False]
    real_bind, real_getaddrinfo = zmq.asyncio.Socket.bind, socket.getaddrinfo

    def bind(sock: zmq.asyncio.Socket, addr: str) -> Any:
        if "late-engine" in addr:
            if not resolved[0]:
                raise zmq.ZMQError(errno.ENODEV)
            addr = addr.replace("late-engine", "127.0.0.1")
        return real_bind(sock, addr)

    def getaddrinfo(host: object, *args: Any, **kwargs: Any) -> Any:
        if host == "late-engine":
            if not resolved[0]:
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            host = "127.0.0.1"
        return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zmq.asyncio.Socket, "bind", bind)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return resolved


async def test_a_shim_whose_event_name_resolves_late_tries_again_and_registers_once_it_does(
    ns: str, nats_url: str, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 61acade exited 2 at 0.0 s where the code before registered 2.4 s later (review's LD_PRELOAD
    # run, the name resolving after 2 s). The engine connects to 127.0.0.1.
    port = free_ports(1)
    resolved = _resolving_late(monkeypatch)
    kv = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}")
    async with SimServer(sim_config(kv_events=kv)) as sim:
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=f"tcp://late-engine:{port}", kv_events_mode="bind")
        async with shim:
            await asyncio.sleep(1.5)  # a second session's bind too
            assert not shim.done.is_set() and shim.registration_count == 0, shim.failure
            resolved[0] = True
            await wait_for(shim.registered.is_set, 10, "the shim registers once the name resolves")
    assert shim.failure is None


@pytest.mark.parametrize("listed", [False, True], ids=["kv-events", "listed"])
async def test_a_late_name_is_said_once_naming_its_setting_and_each_session_without_a_traceback(
    listed: bool,
    ns: str,
    nats_url: str,
    etcd_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given, or listed by vLLM (`tcp://late-engine:P`, the shim started with no endpoint), alike:
    one WARNING naming the setting, then a line a session, at WARNING once a minute (INFO between).
    Until 2026-12-07 the listed one was an ERROR with its traceback every session, counted as a
    session no rule expected; then each session's was a WARNING (one a second)."""
    port = free_ports(1)
    resolved = _resolving_late(monkeypatch)
    kv = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}")
    async with SimServer(sim_config(kv_events=kv)) as sim:
        if listed:
            sources = sim.event_sources

            def late() -> dict[str, dict[str, Any]]:
                out = sources()
                out["0"]["endpoint"] = f"tcp://late-engine:{port}"
                return out

            monkeypatch.setattr(sim, "event_sources", late)
        given = {"kv_events": None, "kv_replay": None} if listed else {"kv_events": f"tcp://late-engine:{port}"}
        shim = shim_for(sim, ns, nats_url, etcd_url, kv_events_mode="auto", **given)
        with caplog.at_level(logging.INFO, logger="worker_shim"):
            async with shim:
                await asyncio.sleep(1.5)  # sessions enough to say it twice
                assert not shim.done.is_set() and shim.registration_count == 0, shim.failure
                resolved[0] = True
                await wait_for(shim.registered.is_set, 10, "the shim registers once the name resolves")
    assert shim.failure is None and shim.session_failures == 0
    setting = "kv_events_mode auto" if listed else f"kv_events tcp://late-engine:{port}"
    said = [r for r in caplog.records if "trying again each session" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said
    assert said[0].getMessage().startswith(f"{setting}: "), said[0].getMessage()
    assert "the name late-engine does not resolve for now" in said[0].getMessage()
    sessions = [r for r in caplog.records if "trying again in the next session" in r.getMessage()]
    assert len(sessions) >= 2 and [r.levelno for r in sessions] == [logging.WARNING] + [logging.INFO] * (
        len(sessions) - 1
    ), sessions
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


async def test_a_shim_whose_event_port_a_connection_holds_tries_again_and_registers_once_it_is_freed(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    # A port that is some connection's local end (open, or in TIME_WAIT for a minute) fails the bind
    # with the same EADDRINUSE but frees itself: the shim exited with status 2 there (review, 2026-12-06).
    with socket.socket() as listener, socket.socket() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held.bind(("127.0.0.1", 0))
        held.connect(listener.getsockname())
        endpoint = f"tcp://127.0.0.1:{held.getsockname()[1]}"
        accepted, _ = listener.accept()
        async with SimServer(sim_config()) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=endpoint, kv_events_mode="auto")
            async with shim:
                await asyncio.sleep(1.5)  # a second session's bind too
                assert not shim.done.is_set() and shim.registration_count == 0, shim.failure
                # Reset, not closed: no TIME_WAIT left on the port.
                held.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                held.close()
                accepted.close()
                await wait_for(shim.registered.is_set, 10, "the shim registers once the port is free")


async def test_a_wildcard_bind_whose_port_a_listener_holds_on_another_local_address_exits_naming_the_flag(
    ns: str, nats_url: str, etcd_url: str
) -> None:
    # `tcp://*:P` meets a listener on any address; the shim connected to 127.0.0.1 only, so one on
    # 127.0.0.2 (or the pod IP) read as a connection's port and the shim tried again for ever.
    with socket.socket() as listener:
        listener.bind(("127.0.0.2", 0))
        listener.listen()
        endpoint = f"tcp://*:{listener.getsockname()[1]}"
        async with SimServer(sim_config()) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=endpoint, kv_events_mode="bind")
            async with shim:
                await wait_for(shim.done.is_set, 10, "the shim exits")
    assert isinstance(shim.failure, ConfigError) and shim.failure.setting == "kv_events", shim.failure
    assert "another process listens there (127.0.0.2 (LISTEN))" in str(shim.failure)


async def test_a_bind_a_connection_holds_is_said_naming_the_setting_and_on_health_until_it_binds(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # ZmqEventSource._bind raised a plain ConnectionError for it: no line named --kv-events, /health
    # said waiting_engine with no why, and a WARNING came each session (review, 2026-12-07).
    with socket.socket() as listener, socket.socket() as held:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        held.bind(("127.0.0.1", 0))
        held.connect(listener.getsockname())
        port = held.getsockname()[1]
        endpoint = f"tcp://127.0.0.1:{port}"
        accepted, _ = listener.accept()
        async with SimServer(sim_config()) as sim:
            shim = shim_for(sim, ns, nats_url, etcd_url, kv_events=endpoint, kv_events_mode="bind")
            with caplog.at_level(logging.INFO, logger="worker_shim"):
                async with shim:
                    await asyncio.sleep(1.0)  # sessions enough to say it more than once
                    _, health = shim.health_report()
                    assert health["status"] == "waiting_engine" and not health["events_ok"], health
                    assert f"holds port {port} (127.0.0.1 (ESTABLISHED))" in health["events_why"], health
                    assert EventProblem.BIND_PENDING in shim.events.problems
                    held.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    held.close()  # reset: no TIME_WAIT left on the port
                    accepted.close()
                    await wait_for(shim.registered.is_set, 10, "the shim registers once the port is free")
                    assert shim.health_report()[1]["events_why"] == "" and not shim.events.problems
    said = [r for r in caplog.records if "trying again each session" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said
    assert said[0].getMessage().startswith(f"kv_events {endpoint}: "), said[0].getMessage()
    assert "for up to 15 s" in said[0].getMessage()
    sessions = [r for r in caplog.records if "the session does not start" in r.getMessage()]
    assert len(sessions) >= 2 and [r.levelno for r in sessions] == [logging.WARNING] + [logging.INFO] * (
        len(sessions) - 1
    ), sessions
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
