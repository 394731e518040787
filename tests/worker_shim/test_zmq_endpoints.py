"""The shim's ZMQ sockets on the endpoints it validates: IPv6 addresses (zmq.IPV6 set, `::`
reached at the engine host, `*` at an IPv6 engine host refused), a bind this host can never make (a
ConfigError naming the setting, not a new session each second for ever) and one a later session
may make (a name not resolving yet, a tentative IPv6 address: tried again)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from protocol import ConfigError
from protocol.vllm_events import END_SEQ, BlockStored, encode_batch
from tests.worker_shim.cluster import wait_for
from worker_shim import EngineBatch
from worker_shim.adapters import zmq_bind
from worker_shim.adapters.zmq_bind import NAME_GRACE_S, BindFailures
from worker_shim.adapters.zmq_events import ZmqEventSource, resolve_endpoint


def _ipv6_loopback() -> str | None:
    """Why ::1 cannot be bound here; None if it can."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError as exc:
        return f"this host cannot bind ::1 ({exc})"
    return None


needs_ipv6 = pytest.mark.skipif(_ipv6_loopback() is not None, reason=_ipv6_loopback() or "")


@contextlib.asynccontextmanager
async def ipv6_publisher(pub_binds: bool) -> AsyncIterator[tuple[zmq.asyncio.Socket, str, int]]:
    """A publisher that opens IPv6 (zmq.IPV6 set; vLLM's and SGLang's set none): (PUB, replay
    endpoint, port). Its PUB binds [::1]:port, or (pub_binds False) is left for the caller to
    connect; its ROUTER on [::1] answers every replay with the end marker."""
    ctx = zmq.asyncio.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
    rport = router.bind_to_random_port("tcp://[::1]")
    port = pub.bind_to_random_port("tcp://[::1]") if pub_binds else _free_ipv6_port()

    async def answer() -> None:
        while True:
            ident, _, _ = await router.recv_multipart()
            await router.send_multipart([ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""])

    task = asyncio.create_task(answer())
    try:
        yield pub, f"tcp://[::1]:{rport}", port
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close()
        router.close()
        ctx.term()


def _free_ipv6_port() -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::1", 0))
        return int(sock.getsockname()[1])


async def _delivered(source: ZmqEventSource, pub: zmq.asyncio.Socket) -> int:
    """How many of 20 batches the source delivers while `pub` sends them."""
    got: list[EngineBatch] = []

    async def sink(batch: EngineBatch) -> None:
        got.append(batch)

    live = asyncio.Event()
    run = asyncio.create_task(source.run(sink, live))
    try:
        await asyncio.wait_for(live.wait(), 5)  # the replay from 0 answered: the DEALER reached [::1]
        stored = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 16, block_size=16)
        for seq in range(20):
            await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), encode_batch(time.time(), [stored])])
            await asyncio.sleep(0.05)
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: sum(bool(b.events) for b in got) >= 15, 3, "batches delivered")
        return sum(bool(b.events) for b in got)
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run


@needs_ipv6
@pytest.mark.parametrize(
    ("given", "engine_host"),
    [
        ("tcp://[::1]:{port}", "127.0.0.1"),  # `::` in it: the engine binds, the shim connects there
        ("tcp://[::]:{port}", "::1"),  # the engine binds every address: the shim connects to its host
    ],
)
async def test_a_shim_connecting_to_an_ipv6_publisher_receives_its_events(given: str, engine_host: str) -> None:
    # 0 of 30 batches: the SUB and the replay DEALER set no zmq.IPV6, and `[::]` was connected
    # literally (review of 2b1eb3c, 2026-12-07).
    async with ipv6_publisher(pub_binds=True) as (pub, replay, port):
        source = ZmqEventSource("vllm", given.format(port=port), "auto", "kv-events", replay, engine_host)
        assert (source.address, source.bind) == (f"tcp://[::1]:{port}", False)
        assert await _delivered(source, pub) >= 15


@needs_ipv6
async def test_a_shim_binding_an_ipv6_address_receives_the_events_of_the_publisher_that_connects() -> None:
    async with ipv6_publisher(pub_binds=False) as (pub, replay, port):
        endpoint = f"tcp://[::1]:{port}"
        source = ZmqEventSource("vllm", endpoint, "bind", "kv-events", replay, "::1")
        pub.connect(endpoint)  # retried by ZMQ until the shim has bound
        assert await _delivered(source, pub) >= 15


@pytest.mark.parametrize(
    ("endpoint", "host", "address"),
    [
        ("tcp://[::]:5557", "fd00::5", "tcp://[fd00::5]:5557"),
        ("tcp://[::]:5557", "10.0.0.5", "tcp://10.0.0.5:5557"),
        ("tcp://*:5557", "::ffff:10.0.0.5", "tcp://[::ffff:10.0.0.5]:5557"),  # opened as its IPv4
        ("tcp://[::1]:5557", "10.0.0.5", "tcp://[::1]:5557"),  # an address of its own: as given
    ],
)
def test_a_bind_all_ipv6_host_is_reached_at_the_engine_host(endpoint: str, host: str, address: str) -> None:
    assert resolve_endpoint(endpoint, "auto", host, "vllm") == (address, False)
    assert ZmqEventSource("vllm", endpoint, "auto", "kv", endpoint, host).replay_address == address


@pytest.mark.parametrize(
    ("engine", "events", "replay", "setting", "fix"),
    [
        ("vllm", "tcp://*:5557", None, "kv_events", "--kv-events tcp://<engine IPv4>:5557 --kv-events-mode connect"),
        ("sglang", "tcp://0.0.0.0:5557", None, "kv_events", "--kv-events tcp://<engine IPv4>:5557 --kv-events-mode"),
        ("vllm", "tcp://10.0.0.7:5557", "tcp://*:5558", "kv_replay", "--kv-replay tcp://<engine IPv4>:5558"),
    ],
)
@pytest.mark.parametrize("from_json", [False, True], ids=["flags", "kv-events-config"])
def test_an_ipv4_wildcard_reached_at_an_ipv6_engine_host_is_a_config_error_naming_the_flags(
    engine: str, events: str, replay: str | None, setting: str, fix: str, from_json: bool
) -> None:
    # vLLM's and SGLang's PUB and ROUTER bind `*` (and SGLang's `0.0.0.0`) without zmq.IPV6: IPv4
    # only. Reached at tcp://[fd00::5]:5557 they never answered: "replay endpoint ... does not
    # answer" each session for ever, or with no replay no events at all (review of 61acade).
    given = "kv_events_config" if from_json else setting
    with pytest.raises(ConfigError) as err:
        ZmqEventSource(
            engine, events, "auto", "kv", replay, "fd00::5", setting="kv_events_config" if from_json else "kv_events"
        )
    assert err.value.setting == given
    assert "listens on IPv4 only" in str(err.value) and "--engine-url" in str(err.value), err.value
    assert fix in str(err.value)


def test_an_ipv4_wildcard_the_shim_binds_itself_is_not_refused_at_an_ipv6_engine_host() -> None:
    # vLLM's rule: it connects to 0.0.0.0, so the shim binds it; nothing is reached at the engine host.
    source = ZmqEventSource("vllm", "tcp://0.0.0.0:5557", "auto", "kv", None, "fd00::5")
    assert (source.address, source.bind) == ("tcp://0.0.0.0:5557", True)


async def _bind_once(endpoint: str, setting: str = "kv_events", failures: BindFailures | None = None) -> Exception:
    """What one session's ZmqEventSource raises binding `endpoint` (its engine connects there;
    `bind`: vLLM's rule reads any `::` in it as the engine binding)."""
    source = ZmqEventSource(
        "vllm", endpoint, "bind", "kv-events", None, "127.0.0.1", setting=setting, bind_failures=failures
    )
    assert source.bind

    async def sink(batch: EngineBatch) -> None:
        raise AssertionError("nothing is delivered")

    with pytest.raises((ConfigError, ConnectionError)) as err:
        await asyncio.wait_for(source.run(sink, asyncio.Event()), 5)
    return err.value


def _resolving(monkeypatch: pytest.MonkeyPatch, host: str, answer: str | int) -> None:
    """getaddrinfo of `host` gives `answer`'s address, or fails with that EAI_ code."""
    real = socket.getaddrinfo

    def getaddrinfo(name: object, *args: Any, **kwargs: Any) -> Any:
        if name != host:
            return real(name, *args, **kwargs)  # type: ignore[arg-type]
        if isinstance(answer, int):
            raise socket.gaierror(answer, f"EAI {answer}")
        return real(answer, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize("setting", ["kv_events", "kv_events_config"])
async def test_an_address_no_interface_has_is_a_config_error_naming_the_setting_at_once(setting: str) -> None:
    # Each session failed on the bind and the next began: 55 sessions in 6 s, never registered,
    # naming no flag (review of 2b1eb3c, 2026-12-07). TEST-NET-1: "Cannot assign requested address".
    endpoint = "tcp://192.0.2.1:5557"
    err = await _bind_once(endpoint, setting)
    assert isinstance(err, ConfigError) and err.setting == setting, err
    assert f"the shim binds {endpoint} (where the engine connects) and this host cannot" in str(err)
    assert "no interface of this host has 192.0.2.1" in str(err)


@pytest.mark.parametrize("setting", ["kv_events", "kv_events_config"])
async def test_a_name_that_does_not_resolve_is_tried_again_and_a_config_error_after_the_grace(
    setting: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # libzmq says "No such device" for a name it cannot resolve yet, as for one that never will:
    # 61acade made both exit 2 at once, where a DNS record appearing 2 s later registered before.
    endpoint = "tcp://engine-0.invalid:5557"
    _resolving(monkeypatch, "engine-0.invalid", socket.EAI_NONAME)
    now = [0.0]
    failures = BindFailures(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="worker_shim.adapters.zmq_bind"):
        for at in (0.0, 5.0, NAME_GRACE_S - 0.1):
            now[0] = at
            err = await _bind_once(endpoint, setting, failures)
            assert isinstance(err, ConnectionError) and "does not resolve" in str(err), err
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"{setting} {endpoint}: "), said  # once, naming the setting
    now[0] = NAME_GRACE_S
    err = await _bind_once(endpoint, setting, failures)
    assert isinstance(err, ConfigError) and err.setting == setting, err
    assert "the name engine-0.invalid does not resolve" in str(err)


async def test_a_name_that_resolves_now_starts_the_grace_over(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    failures = BindFailures(clock=lambda: now[0])
    _resolving(monkeypatch, "engine-0.invalid", socket.EAI_NONAME)
    assert isinstance(await _bind_once("tcp://engine-0.invalid:5557", failures=failures), ConnectionError)
    failures.bound()  # a session bound it
    now[0] = 2 * NAME_GRACE_S
    assert isinstance(await _bind_once("tcp://engine-0.invalid:5557", failures=failures), ConnectionError)


async def test_a_temporary_dns_failure_is_tried_again_past_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    _resolving(monkeypatch, "engine-0.invalid", socket.EAI_AGAIN)
    now = [0.0]
    failures = BindFailures(clock=lambda: now[0])
    for at in (0.0, 10 * NAME_GRACE_S):
        now[0] = at
        err = await _bind_once("tcp://engine-0.invalid:5557", failures=failures)
        assert isinstance(err, ConnectionError) and "does not resolve for now" in str(err), err


async def test_a_name_that_resolves_only_to_ipv6_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # Said as "no interface of this host has that address, or the name does not resolve" (review of 61acade).
    _resolving(monkeypatch, "v6only-engine.invalid", "::1")
    err = await _bind_once("tcp://v6only-engine.invalid:5557", failures=BindFailures(grace_s=0))
    assert isinstance(err, ConfigError), err
    assert "the name v6only-engine.invalid resolves only to IPv6 (::1); names are opened as IPv4" in str(err)
    assert "give an IPv4 address or name" in str(err)


@needs_ipv6
@pytest.mark.parametrize(
    ("flags", "outcome", "said"),
    [
        ("40", ConnectionError, "fd00:77::5 on eth0 is tentative (duplicate-address detection"),
        ("48", ConfigError, "fd00:77::5 on eth0 failed duplicate-address detection: another host has it"),
        (None, ConfigError, "no interface of this host has fd00:77::5"),
    ],
)
async def test_a_tentative_ipv6_address_is_tried_again(
    flags: str | None, outcome: type[Exception], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A new IPv6 address is "tentative" for 1-2 s (DAD), failing a bind with EADDRNOTAVAIL as one
    # no interface has: 61acade exited 2 on it (review's dad.py: bound 1.5 s later).
    listing = tmp_path / "if_inet6"
    rows = ["00000000000000000000000000000001 01 80 10 80       lo"]
    if flags is not None:
        rows.append(f"fd000077000000000000000000000005 02 40 00 {flags}     eth0")
    listing.write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(zmq_bind, "IF_INET6", str(listing))
    err = await _bind_once("tcp://[fd00:77::5]:5557")
    assert isinstance(err, outcome) and said in str(err), err
