"""A fault in one worker never stops the fleet, and never passes silently (docs/router.md, "One
worker's fault never stops the fleet"): a worker whose replies do not decode, a worker whose load
reports are dropped, a worker record etcd holds but the router refuses. Each is counted in
/metrics, logged once per worker, and shown on /ready (and /debug/route) with its reason, while
every other worker serves. Real nats-server and etcd, in-process sims and shims (an audit
reproduced each: a garbage reply failed its requests with an unexplained 502, and a prefill
worker answering garbage got every request's prefill leg)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from discovery import Discovery
from protocol import LoadReport, WorkerInfo, encode_json, encode_msg, subjects
from protocol.config import EtcdSettings
from protocol.messages import load_report_problem
from router.dispatch import Dispatcher
from router.eligibility import MALFORMED_COOLDOWN_S, Eligibility, Exclusion
from router.leg import LegError
from router.load_view import Liveness
from router.service import RouterService
from runtime.nats_flush import flush
from tests.router.conftest import MODEL, Cluster, complete
from tests.router.polling import until

GARBAGE = b"\xc1\xc1 not msgpack"
SLOW = 0.05  # the garbage-answering worker's sim speedup: its real answer comes far behind the garbage


async def _ready(http: aiohttp.ClientSession, router: RouterService) -> tuple[int, dict[str, Any]]:
    async with http.get(router.url + "/ready") as r:
        return r.status, await r.json()


async def _listing(http: aiohttp.ClientSession, router: RouterService) -> dict[str, Any]:
    """/debug/workers: every worker, routable or not (/ready names only those left out)."""
    async with http.get(router.url + "/debug/workers") as r:
        assert r.status == 200
        return await r.json()  # type: ignore[no-any-return]


async def _metrics(http: aiohttp.ClientSession, router: RouterService) -> dict[str, float]:
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    return {
        name: float(value)
        for name, _, value in (ln.rpartition(" ") for ln in text.splitlines() if ln and not ln.startswith("#"))
    }


def _status_of(body: dict[str, Any], worker: str) -> dict[str, Any]:
    return next(w for w in body["worker_status"] if w["worker"] == worker)


def _said(caplog: pytest.LogCaptureFixture, *words: str, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level and all(w in r.getMessage() for w in words)]


async def _answer_garbage(nc: Client, subject: str) -> list[int]:
    """Answer every leg on `subject` with bytes that are no ResponseChunk, before the real shim can."""
    sent: list[int] = []

    async def garbage(msg: Msg) -> None:
        sent.append(1)
        await nc.publish(msg.reply, GARBAGE)

    await nc.subscribe(subject, cb=garbage)
    await flush(nc)
    return sent


# --- replies that do not decode ---------------------------------------------------------------


async def test_a_worker_answering_garbage_costs_no_request_and_is_left_out_with_its_reason(
    cluster: Cluster, http: aiohttp.ClientSession, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    good = await cluster.add_worker("agg")
    bad = await cluster.add_worker("agg", speedup=SLOW)
    router = await cluster.add_ready_router(disagg="never")
    sent = await _answer_garbage(nc, subjects.gen(cluster.ns, "agg", bad.id))
    caplog.set_level(logging.INFO)

    results = [await complete(http, router, list(range(i, i + 200))) for i in range(0, 4000, 200)]

    assert [s for s, _, _ in results] == [200] * 20, [b for s, b, _ in results if s != 200]
    assert {h["x-kvswitch-decode-worker"] for _, _, h in results} == {good.id}
    assert len(sent) == 1, "the worker that sent garbage got more requests"
    assert router.dispatcher.retries == 1
    await asyncio.sleep(1.5)  # its shim's load reports (every 0.1 s here) do not end the exclusion
    status, body = await _ready(http, router)
    assert status == 200 and body["routable"] == 1
    st = _status_of(body, bad.id)
    assert not st["routable"] and st["excluded"] == "malformed" and "malformed reply" in st["why"], st
    assert (await _metrics(http, router))[f'kvswitch_router_worker_malformed_replies_total{{worker="{bad.id}"}}'] == 1
    assert len(_said(caplog, bad.id, "malformed reply", "logged once per worker")) == 1
    async with http.post(router.url + "/debug/route", json={"model": MODEL, "prompt": list(range(64))}) as r:
        excluded = (await r.json())["excluded"]
    assert [e["excluded"] for e in excluded if e["worker"] == bad.id] == ["malformed"]


async def test_garbage_from_a_worker_is_logged_once_however_many_requests_it_fails(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    nc: Client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No other worker: each request fails (502); with no cooldown the worker gets the next one too.
    # The count goes on, the log line is said once.
    bad = await cluster.add_worker("agg", speedup=SLOW)
    router = await cluster.add_ready_router(disagg="never")
    await _answer_garbage(nc, subjects.gen(cluster.ns, "agg", bad.id))
    caplog.set_level(logging.INFO)
    monkeypatch.setattr("router.eligibility.MALFORMED_COOLDOWN_S", 0.0)
    for _ in range(3):
        status, body, _ = await complete(http, router, list(range(64)))
        assert status == 502, body
    monkeypatch.setattr("router.eligibility.MALFORMED_COOLDOWN_S", MALFORMED_COOLDOWN_S)
    assert (await _metrics(http, router))[f'kvswitch_router_worker_malformed_replies_total{{worker="{bad.id}"}}'] == 3
    assert len(_said(caplog, bad.id, "malformed reply")) == 1
    status, body, headers = await complete(http, router, list(range(64)))
    assert status == 503 and "malformed" in body["error"]["message"], body  # left out: named, not sent
    assert headers["Retry-After"] == "5"  # it may be back: a client that honours it tries again


async def test_a_prefill_worker_answering_garbage_is_left_out_and_logged_once(
    cluster: Cluster, http: aiohttp.ClientSession, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    bad = await cluster.add_worker("prefill", speedup=SLOW)
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    sent = await _answer_garbage(nc, subjects.gen(cluster.ns, "prefill", bad.id))
    caplog.set_level(logging.INFO)

    results = [await complete(http, router, list(range(i, i + 200))) for i in range(0, 2000, 200)]

    assert [s for s, _, _ in results] == [200] * 10
    assert len(sent) == 1, "the prefill worker that sent garbage kept getting prefill legs"
    assert router.dispatcher.fallbacks == 1
    assert (await _metrics(http, router))['kvswitch_router_fallbacks_total{cause="prefill_failed"}'] == 1
    assert not _said(caplog, "remote prefill failed")
    assert len(_said(caplog, bad.id, "malformed reply")) == 1
    st = _status_of((await _ready(http, router))[1], bad.id)
    assert st["excluded"] == "malformed" and "malformed reply" in st["why"], st


def test_a_malformed_mark_outlives_load_reports_and_ends_after_the_cooldown() -> None:
    now = [1000.0]
    elig = Eligibility(
        clock=lambda: now[0],
        sync_state=lambda worker: None,
        liveness=lambda worker: Liveness(0.0, 0.5, True, True, False),
        tokenizer=None,
    )
    info = WorkerInfo(worker="w1", model=MODEL, role="agg", engine="vllm", block_size=16)
    elig.added("w1")
    elig.mark_malformed("w1", "it sent a malformed reply: x")
    elig.reported("w1")
    now[0] += MALFORMED_COOLDOWN_S - 1
    st = elig.statuses([info])[0]
    assert st.exclusion is Exclusion.MALFORMED and "malformed reply" in st.detail
    now[0] += 1
    assert elig.statuses([info])[0].routable


# --- load reports dropped ---------------------------------------------------------------------


async def test_dropped_load_reports_are_in_metrics_and_each_worker_is_logged_once(
    cluster: Cluster,
    http: aiohttp.ClientSession,
    nc: Client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = await cluster.add_worker("agg")
    b = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    monkeypatch.setattr(router._first_heard, "grace_s", 0.0)  # its record missing since its first report
    caplog.set_level(logging.INFO)
    stranger = "1234abcd"  # registered nowhere
    negative = LoadReport(worker=b.id, ts=time.time(), running=-1)
    assert load_report_problem(negative) is not None
    for _ in range(5):
        await nc.publish(subjects.load(cluster.ns, a.id), b"\x92garbage")
        await nc.publish(subjects.load(cluster.ns, b.id), encode_msg(negative))
        await nc.publish(subjects.load(cluster.ns, stranger), encode_msg(LoadReport(worker=stranger, ts=time.time())))
    await flush(nc)
    await until(lambda: router.load_malformed >= 10 and router.load_unknown >= 5, what="every report dropped")

    figures = await _metrics(http, router)
    assert figures["kvswitch_router_load_malformed_total"] == 10
    assert figures["kvswitch_router_load_unknown_total"] >= 5
    for worker in (a.id, b.id):
        assert len(_said(caplog, "malformed load report", worker)) == 1, worker
    assert len(_said(caplog, "load reports from worker", stranger, level=logging.INFO)) == 1
    assert (await _ready(http, router))[0] == 200


# --- worker records refused in etcd -----------------------------------------------------------


async def test_refused_worker_records_are_counted_logged_by_key_and_on_ready_until_fixed(
    cluster: Cluster, http: aiohttp.ClientSession, etcd_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    caplog.set_level(logging.INFO)
    prefix = subjects.workers_prefix(cluster.ns)
    truncated, missing = "1234abcd", "1234abce"
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        zero = await d.register_worker(
            lambda wid: WorkerInfo(
                worker=wid, model=MODEL, role="agg", engine="vllm", block_size=0, tokenizer="builtin"
            ),
            ttl=10,
        )
        await d.put_raw(prefix + truncated, b'{"worker": "1234abcd", "model": ')
        await d.put_raw(prefix + missing, b'{"worker": "1234abce"}')
        await until(lambda: router.registry.refused == 3, what="three records refused")

        status, body = await _ready(http, router)
        assert status == 200 and body["workers"] == 1 and body["routable"] == 1
        bad = {w["worker"]: w for w in body["worker_status"] if w["excluded"] == "bad_record"}
        assert set(bad) == {zero.hex_id, truncated, missing} and not any(w["routable"] for w in bad.values())
        assert "block_size 0" in bad[zero.hex_id]["why"] and bad[zero.hex_id]["model"] == MODEL
        assert "truncated" in bad[truncated]["why"] and "model" in bad[missing]["why"]
        assert body["excluded_by_reason"] == {"bad_record": 3}
        assert good.id not in {w["worker"] for w in body["worker_status"]}
        assert _status_of(await _listing(http, router), good.id)["routable"]
        assert (await _metrics(http, router))["kvswitch_router_worker_records_refused_total"] == 3
        for key in (zero.hex_id, truncated, missing):
            assert len(_said(caplog, "worker record under key", repr(key), level=logging.ERROR)) == 1, key
        async with http.post(router.url + "/debug/route", json={"model": MODEL, "prompt": list(range(64))}) as r:
            excluded = (await r.json())["excluded"]
        assert {e["worker"] for e in excluded if e["excluded"] == "bad_record"} == {zero.hex_id, truncated, missing}
        status, _, _ = await complete(http, router, list(range(64)))
        assert status == 200

        # the same bad value again: counted, not logged again
        await d.put_raw(prefix + missing, b'{"worker": "1234abce"}')
        await until(lambda: router.registry.refused == 4, what="the record read again")
        assert len(_said(caplog, "worker record under key", repr(missing), level=logging.ERROR)) == 1
        # fixed, or deleted: no longer reported
        fixed = WorkerInfo(worker=truncated, model=MODEL, role="agg", engine="vllm", block_size=16)
        await d.put(prefix + truncated, encode_json(fixed), await d.grant(30))  # held by no lease: refused
        await d.delete(prefix + missing)
        await d.release(zero)
        await until(lambda: not router.registry.refusing(), what="every bad record fixed or gone")
        body = (await _ready(http, router))[1]
        assert not [w for w in body["worker_status"] if w["excluded"] == "bad_record"]
        assert "bad_record" not in body["excluded_by_reason"]
        assert _status_of(await _listing(http, router), truncated)["excluded"] != "bad_record"
        await d.delete(prefix + truncated)


async def test_a_record_nested_too_deeply_is_one_bad_record_not_a_dead_worker_watch(
    cluster: Cluster, http: aiohttp.ClientSession, etcd_url: str
) -> None:
    """Audit 2026-12-04: its RecursionError escaped the watch's `except ValueError` while it read the
    snapshot, so the watch failed on that key again and again: a router started meanwhile never read
    the worker set (503 to everything), and running ones saw no worker come or go."""
    good = await cluster.add_worker("agg")
    prefix = subjects.workers_prefix(cluster.ns)
    key = "1234abcd"
    deep = b'{"worker": "1234abcd", "model": "' + MODEL.encode() + b'", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        await d.put_raw(prefix + key, deep)
        try:
            router = await cluster.add_ready_router(disagg="never")
            await until(lambda: router.registry.refused >= 1, what="the record refused")
            status, body = await _ready(http, router)
            assert status == 200 and body["routable"] == 1, body
            bad = _status_of(body, key)
            assert bad["excluded"] == "bad_record" and "nested too deeply" in bad["why"], bad
            assert _status_of(await _listing(http, router), good.id)["routable"]
            status, _, _ = await complete(http, router, list(range(64)))
            assert status == 200
        finally:
            await d.delete(prefix + key)


async def test_when_every_record_is_refused_the_answers_name_them_not_the_namespace(
    cluster: Cluster, http: aiohttp.ClientSession, etcd_url: str
) -> None:
    """Review 2026-12-04: the cluster's only record refused (a schema skew: block_size 0), /ready
    said no worker was registered under the prefix and blamed --namespace, requests and
    /debug/route got a 404 saying the same, and /debug/route listed no bad_record."""
    router = await cluster.add_router(disagg="never")
    prefix = subjects.workers_prefix(cluster.ns)
    key = "1234abcd"
    bad = WorkerInfo(worker=key, model=MODEL, role="agg", engine="vllm", block_size=0, tokenizer="builtin")
    async with Discovery(EtcdSettings(endpoints=[etcd_url]), cluster.ns) as d:
        await d.put(prefix + key, encode_json(bad), await d.grant(30))  # held by no lease: refused for that
        try:
            await until(lambda: router.registry.refused >= 1, what="the record refused")
            status, body = await _ready(http, router)
            (problem,) = body["problems"]
            assert status == 503 and f"{key}: block_size 0" in problem and prefix in problem, problem
            assert "--namespace" not in problem, problem

            status, answer, _ = await complete(http, router, list(range(64)))
            said = answer["error"]["message"]
            assert status == 404 and f"{key}: block_size 0" in said and "--namespace" not in said, said
            status, answer, _ = await complete(http, router, list(range(64)), model=None)
            said = answer["error"]["message"]
            assert status == 400 and f"{key}: block_size 0" in said and "--namespace" not in said, said

            async with http.post(router.url + "/debug/route", json={"model": MODEL, "prompt": list(range(64))}) as r:
                status, answer = r.status, await r.json()
            assert status == 404 and key in answer["error"]["message"], answer
            assert [(e["worker"], e["excluded"]) for e in answer["excluded"]] == [(key, "bad_record")], answer
        finally:
            await d.delete(prefix + key)


def test_a_departed_workers_malformed_reply_leaves_no_state_behind() -> None:
    # its legs run on after it leaves; a bad reply from one re-created its per-worker series (and
    # exclusion), which nothing removed again
    marked: list[str] = []
    d = Dispatcher(
        None,  # type: ignore[arg-type]  # _blame touches no connection
        "ns",
        None,  # type: ignore[arg-type]
        on_malformed=lambda worker, why: marked.append(worker),
        on_unreachable=lambda worker, why: marked.append(worker),
        registered=lambda worker: worker != "w-old",
    )
    d.worker_gone("w-old")
    d._blame(LegError("w-old", 502, "malformed_chunk", "bad chunk", retryable=True))
    d._blame(LegError("w-old", 503, "worker_silent", "no heartbeat", retryable=True))
    assert (dict(d.malformed_replies), marked) == ({}, [])
    d._blame(LegError("w-new", 502, "malformed_chunk", "bad chunk", retryable=True))
    assert (dict(d.malformed_replies), marked) == ({"w-new": 1}, ["w-new"])
