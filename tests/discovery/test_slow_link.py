"""Connecting to etcd over a long link, against a real etcd behind a relay that delays every chunk.
`grpc.min_reconnect_backoff_ms` is also gRPC core's least connect timeout: at the 100 ms it was set
to, no etcd 150 ms away (one way) ever connected, and the process exited blaming --etcd-endpoints
(audit of 2026-12-07)."""

from __future__ import annotations

import pytest

from discovery import Discovery, DiscoveryError
from kvswitch.servers import free_port
from protocol.config import EtcdSettings
from tests.relay import Relay


def _through(etcd_relay: Relay) -> EtcdSettings:
    return EtcdSettings(endpoints=[f"http://127.0.0.1:{etcd_relay.port}"])


async def test_an_etcd_150_ms_away_connects_and_answers(etcd_relay: Relay, ns: str) -> None:
    etcd_relay.delay_s = 0.15  # one way: every answer comes 0.3 s after its question
    async with Discovery(_through(etcd_relay), ns) as d:
        await d.put_raw(f"/{ns}/probe", b"1")
        assert await d.holder(f"/{ns}/probe") == 0


async def test_attempts_that_time_out_are_said_to_have(etcd_relay: Relay, ns: str) -> None:
    """A server that answers nothing (or a link slower than the connect's time) fails the connect
    saying its attempts timed out, which a wrong address would not explain alone."""
    etcd_relay.frozen.set()
    with pytest.raises(DiscoveryError) as caught:
        await Discovery(_through(etcd_relay), ns).connect(timeout=2.0)
    said = str(caught.value)
    assert "the attempts timed out: a link too slow to connect within 2 s, or a TLS handshake" in said, said


async def test_a_refused_connection_is_not_said_to_have_timed_out(ns: str) -> None:
    with pytest.raises(DiscoveryError) as caught:
        await Discovery(EtcdSettings(endpoints=[f"http://127.0.0.1:{free_port()}"]), ns).connect(timeout=2.0)
    said = str(caught.value)
    assert "is not reachable" in said and "timed out" not in said, said
