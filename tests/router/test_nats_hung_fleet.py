"""A hung NATS (SIGSTOP) silences every worker's load reports while this router's own connection
stays up until nats-py's PINGs go unanswered (5 s): the fleet was said silent, its workers at fault,
and the clients' 503s read "silent (last load report 4.8s ago ...)" (log-quality audit of
2026-12-07). Now the router asks its own NATS for a round trip when most workers go silent, and
names NATS when it does not answer (router.fleet_news)."""

from __future__ import annotations

import logging

import aiohttp
import nats
import pytest

from kvswitch.servers import NatsServer
from runtime.nats_flush import nats_answers
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until
from tests.runtime.frozen import frozen, stopped


async def test_a_frozen_nats_server_does_not_answer_the_probe_and_a_live_one_does() -> None:
    with NatsServer() as server:
        assert server.proc is not None
        pid = server.proc.pid
        nc = await nats.connect(server.url)
        try:
            assert await nats_answers(nc, 1)
            with frozen(pid):
                await until(lambda: stopped(pid), what="nats-server stopped")  # SIGSTOP lands late
                assert not await nats_answers(nc, 1)
            assert await nats_answers(nc, 1)  # the late PONG did not break the connection's reading
        finally:
            await nc.close()


async def test_a_connection_down_or_reconnecting_is_no_answer() -> None:
    """nats-py's flush returns at once, no round trip, on a connection that is not connected: a
    killed NATS, and a hung one once nats-py's PINGs dropped the connection, read as answering."""
    with NatsServer() as server:
        assert server.proc is not None
        pid = server.proc.pid
        nc = await nats.connect(server.url, ping_interval=1, max_outstanding_pings=1, reconnect_time_wait=0.2)
        try:
            with frozen(pid):
                await until(lambda: not nc.is_connected, timeout=8.0, what="the stale connection dropped")
                assert not await nats_answers(nc, 1)
            await until(lambda: nc.is_connected, what="reconnected")
            assert await nats_answers(nc, 1)
            server.proc.kill()
            server.proc.wait()
            await until(lambda: not nc.is_connected, what="the connection lost")
            assert not await nats_answers(nc, 1)
        finally:
            await nc.close()


async def test_a_fleet_silent_under_a_killed_nats_is_said_to_be_nats(
    etcd_url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    with NatsServer() as server:
        assert server.proc is not None
        cluster = Cluster(ns, server.url, etcd_url)
        try:
            for _ in range(2):
                await cluster.add_worker("agg")
            await cluster.add_ready_router(disagg="never")
            caplog.set_level(logging.WARNING, logger="router.fleet_news")
            caplog.clear()
            server.proc.kill()
            server.proc.wait()
            await until(
                lambda: any("can take requests" in r.getMessage() for r in caplog.records),
                timeout=8.0,
                what="the fleet said down",
            )
            (line,) = [r.getMessage() for r in caplog.records if "can take requests" in r.getMessage()]
            assert "(silent: 2); this router's own NATS connection did not answer a round trip" in line, line
        finally:
            await cluster.close()


async def test_a_fleet_silent_under_a_hung_nats_is_said_to_be_nats(
    etcd_url: str, ns: str, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    with NatsServer() as server:
        assert server.proc is not None
        pid = server.proc.pid
        cluster = Cluster(ns, server.url, etcd_url)
        try:
            for _ in range(2):
                await cluster.add_worker("agg")
            router = await cluster.add_ready_router(disagg="never")
            caplog.set_level(logging.WARNING, logger="router.fleet_news")
            caplog.clear()
            with frozen(pid):  # load reports stop at 0.5 s periods: silent after 1.5 s
                await until(
                    lambda: any("can take requests" in r.getMessage() for r in caplog.records),
                    timeout=8.0,  # before nats-py's own PINGs (5 s, two unanswered) drop the connection
                    what="the fleet said down",
                )
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
                async with http.post(router.url + "/v1/completions", json=body) as resp:
                    status, text = resp.status, await resp.text()
            (line,) = [r.getMessage() for r in caplog.records if "can take requests" in r.getMessage()]
            assert (
                "(silent: 2); this router's own NATS connection did not answer a round trip within 1s either: " in line
            )
            assert "NATS (hung, or the network to it), not the workers, is the likely cause" in line, line
            assert status == 503 and "this router's own NATS connection does not answer either" in text, text
        finally:
            await cluster.close()
