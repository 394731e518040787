"""The shim's own /health and /metrics, scraped over HTTP (real nats, etcd, sim)."""

from __future__ import annotations

import contextlib
import logging

import aiohttp
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from discovery import Discovery
from engine_sim.server import SimServer
from protocol import WorkerInfo, decode_json, subjects
from protocol.config import EtcdSettings
from runtime.nats_flush import flush
from tests.worker_shim.cluster import connect, shim_for, sim_config, wait_for
from tests.worker_shim.test_request_service import Collector, gen
from worker_shim.http_server import ShimHttpServer


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_name_the_text_format_they_are_written_in() -> None:
    """generate_latest writes the 0.0.4 text format (as the router's /metrics names it); the shim
    named prometheus_client's CONTENT_TYPE_LATEST, version 1.0.0 with the pinned 0.26."""
    server = ShimHttpServer("127.0.0.1", 0, lambda: (True, {}), lambda: b"kvswitch_shim_up 1.0\n")
    await server.start()
    try:
        async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert await r.read() == b"kvswitch_shim_up 1.0\n"
    finally:
        await server.stop()


async def health(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        return r.status, await r.json()


async def test_health_and_metrics_of_a_serving_shim(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
        await shim.registered.wait()
        assert shim.worker_id is not None
        url = shim.http.url
        assert url.startswith("http://127.0.0.1:") and shim.http.port > 0
        async with Discovery(EtcdSettings(endpoints=[etcd_url]), ns) as d:
            assert d.client.kv is not None
            resp = await d.client.kv.get(subjects.worker_key(ns, shim.worker_id), timeout=5)
            assert decode_json(resp.kvs[0].value, WorkerInfo).shim_url == url

        status, body = await health(url)
        assert status == 200
        assert body["status"] == "serving" and body["registration"] == "registered" and body["etcd"] == "alive"
        assert body["worker"] == shim.worker_id and body["events_ok"] is True and body["nats"] == "connected"

        nc = await connect(nats_url)
        col = Collector(nc)
        await col.start()
        subject = subjects.gen(ns, "agg", shim.worker_id)
        for i in range(3):
            await col.send(subject, gen(f"ok{i}", [3] * 40, max_tokens=3, heartbeat_s=0.05))
        await col.send(subject, gen("bad", [], max_tokens=3))
        for rid in ("ok0", "ok1", "ok2", "bad"):
            await col.final(rid)
        await nc.close()
        await wait_for(lambda: shim.kv_counters.batches >= 2, what="KV batches published")

        m = await scrape(url)
        assert m[("kvswitch_shim_requests_total", (("outcome", "ok"), ("role", "agg")))] == 3
        assert m[("kvswitch_shim_requests_total", (("outcome", "bad_request"), ("role", "agg")))] == 1
        assert m[("kvswitch_shim_kv_batches_published_total", ())] >= 2
        assert m[("kvswitch_shim_kv_events_received_total", ())] > 0
        assert m[("kvswitch_shim_nats_connected", ())] == 1
        assert m[("kvswitch_shim_etcd_lease_state", (("state", "alive"),))] == 1
        assert m[("kvswitch_shim_etcd_lease_state", (("state", "unknown"),))] == 0
        assert m[("kvswitch_shim_events_ok", ())] == 1 and m[("kvswitch_shim_serving", ())] == 1
        assert m[("kvswitch_shim_heartbeats_total", ())] == shim.requests.heartbeats  # type: ignore[union-attr]
        assert m[("kvswitch_shim_chunks_held_total", ())] == shim.requests.held_chunks  # type: ignore[union-attr]
        assert m[("kvswitch_shim_kv_transport_replays_total", ())] >= 1  # the startup replay
        assert ("kvswitch_shim_kv_transport_gaps_total", ()) in m
        assert m[("kvswitch_shim_kv_other_group_events_total", ())] == 0  # the sim has one full-attention group
        assert m[("kvswitch_shim_kv_full_groups_folded_total", ())] == 0
        assert m[("kvswitch_shim_kvstate_requests_total", (("reply", "failed"),))] == 0
        assert m[("kvswitch_shim_registrations_total", ())] == 1
        assert m[("kvswitch_shim_session_failures_total", ())] == 0
        # The engine's load as the reports carry it (the Grafana dashboard charts these).
        report = shim.load_reporter.report()  # type: ignore[union-attr]
        assert m[("kvswitch_shim_kv_total_blocks", ())] == report.kv_total_blocks and report.kv_total_blocks > 0
        assert (m[("kvswitch_shim_running_requests", ())], m[("kvswitch_shim_waiting_requests", ())]) == (0, 0)
        assert m[("kvswitch_shim_kv_used_blocks", ())] == report.kv_used_blocks


async def test_garbage_on_a_workers_subjects_is_counted_by_kind_and_logged_once_each(
    ns: str, nats_url: str, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Anyone who may publish on a worker's subjects can send any number of these: each kind is
    counted on /metrics and logged once, not once per message (900 WARNINGs for 900 messages)."""
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
        await shim.registered.wait()
        assert shim.worker_id is not None and shim.requests is not None
        nc = await connect(nats_url)
        gen_subject = subjects.gen(ns, "agg", shim.worker_id)
        for _ in range(5):
            await nc.publish(subjects.cancel(ns, shim.worker_id), b"\xc1")
            await nc.publish(gen_subject, b"\xc1")  # no reply subject
            await nc.publish(subjects.kvstate(ns, shim.worker_id), b"\xc1", reply=nc.new_inbox())
            await nc.publish(subjects.kvstate(ns, shim.worker_id), b"\xc1")  # no reply subject
        for _ in range(3):
            with contextlib.suppress(nats.errors.TimeoutError):  # answered with a 400 chunk
                await nc.request(gen_subject, b"\xc1", timeout=2)
        await flush(nc)
        requests = shim.requests
        await wait_for(
            lambda: sum(requests.malformed.values()) == 13 and sum(shim.kv_counters.malformed.values()) == 10,
            what="every message read",
        )
        await nc.close()
        m = await scrape(shim.http.url)
        kinds = ("cancel", "no_reply", "generate")
        counted = {kind: m.get(("kvswitch_shim_requests_malformed_total", (("kind", kind),))) for kind in kinds}
        assert counted == {"cancel": 5, "no_reply": 5, "generate": 3}
        assert m[("kvswitch_shim_kvstate_requests_total", (("reply", "malformed"),))] == 5
        assert m[("kvswitch_shim_kvstate_requests_total", (("reply", "no_reply"),))] == 5  # was dropped unsaid
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        said = (
            "malformed cancel",
            "has no reply subject",
            "malformed generate",
            "malformed kvstate",
            "without a reply",
        )
        for what in said:
            assert sum(what in w for w in warned) == 1, (what, warned)


async def test_health_is_503_while_the_engine_is_down(ns: str, nats_url: str, etcd_url: str) -> None:
    async with SimServer(sim_config()) as sim, shim_for(sim, ns, nats_url, etcd_url) as shim:
        await shim.registered.wait()
        await sim.crash()
        await wait_for(lambda: not shim.registered.is_set(), what="deregistered")
        status, body = await health(shim.http.url)
        assert status == 503 and body["status"] == "waiting_engine"
        m = await scrape(shim.http.url)
        assert m[("kvswitch_shim_serving", ())] == 0
