"""The shim's ZMQ sockets on the endpoints it validates: IPv6 addresses (zmq.IPV6 set, `::`
reached at the engine host) and a bind this host can never make (a ConfigError naming the setting,
not a new session each second for ever)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from protocol import ConfigError
from protocol.vllm_events import END_SEQ, BlockStored, encode_batch
from tests.worker_shim.cluster import wait_for
from worker_shim import EngineBatch
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
        ("tcp://*:5557", "fd00::5", "tcp://[fd00::5]:5557"),
        ("tcp://[::1]:5557", "10.0.0.5", "tcp://[::1]:5557"),  # an address of its own: as given
    ],
)
def test_a_bind_all_ipv6_host_is_reached_at_the_engine_host(endpoint: str, host: str, address: str) -> None:
    assert resolve_endpoint(endpoint, "auto", host, "vllm") == (address, False)
    assert ZmqEventSource("vllm", endpoint, "auto", "kv", endpoint, host).replay_address == address


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://192.0.2.1:5557",  # TEST-NET-1, no address of this host: "Cannot assign requested address"
        "tcp://engine-0.invalid:5557",  # resolves to nothing: "No such device"
    ],
)
@pytest.mark.parametrize("setting", ["kv_events", "kv_events_config"])
async def test_an_address_this_host_cannot_bind_is_a_config_error_naming_the_setting(
    endpoint: str, setting: str
) -> None:
    # Each session failed on the bind and the next began: 55 sessions in 6 s, never registered,
    # naming no flag (review of 2b1eb3c, 2026-12-07).
    source = ZmqEventSource("vllm", endpoint, "auto", "kv-events", None, "127.0.0.1", setting=setting)
    assert source.bind

    async def sink(batch: EngineBatch) -> None:
        raise AssertionError("nothing is delivered")

    with pytest.raises(ConfigError) as err:
        await asyncio.wait_for(source.run(sink, asyncio.Event()), 5)
    assert err.value.setting == setting
    assert f"the shim binds {endpoint} (where the engine connects) and this host cannot" in str(err.value)
