"""P/D like vLLM's NixlConnector: prefill on one sim, decode on another with the returned params."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from engine_sim import SimServer, disagg
from engine_sim.request import SimRequest
from tests.engine_sim.conftest import connected_subscriber, events_of, sim_config
from worker_shim.adapters.vllm import load_from_metrics

# Wall-clock latencies: run serially, away from the parallel suite's CPU load (see Makefile).
pytestmark = pytest.mark.timing

PROMPT = list(range(3000, 3000 + 16384))


async def complete(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json(), time.perf_counter() - t0


async def stream_ttft(url: str, body: dict[str, Any]) -> float:
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
            await r.content.readline()
            ttft = time.perf_counter() - t0
            await r.read()
            return ttft


@pytest.mark.parametrize("cross_process", [False, True])
async def test_prefill_then_decode_on_another_sim(cross_process: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The prefill sim runs fast (its timing is not under test); the decode sim runs in real time over
    # a 10 GB/s link so that its TTFT, transfer (215 ms) plus one decode step (6 ms), dwarfs the
    # event loop's jitter on a busy 2-core machine.
    async with (
        SimServer(sim_config(role="prefill", num_gpu_blocks=2048, speedup=50)) as p,
        SimServer(sim_config(role="decode", num_gpu_blocks=2048, speedup=1, kv_transfer_gbps=10.0)) as d,
    ):
        if cross_process:  # force the HTTP pull path a separate process would take
            monkeypatch.setattr(disagg, "_registry", weakref.WeakValueDictionary())
        pre, _ = await complete(
            p.url, {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        params = pre["kv_transfer_params"]
        assert pre["usage"]["completion_tokens"] == 1
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == p.engine.engine_id
        assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", p.port, 1)
        n_blocks = len(PROMPT) // 16
        (group,) = params["remote_block_ids"]
        assert len(group) == n_blocks and p.engine.num_blocks_in_use == n_blocks  # pinned
        # the rest of vLLM 0.32's NixlConnector params (nixl/pull_scheduler.py request_finished)
        assert {k: params[k] for k in ("dcp_size", "pp_size", "remote_blocks_expiry_time", "transfer_mode")} == {
            "dcp_size": 1, "pp_size": 1, "remote_blocks_expiry_time": None, "transfer_mode": "pull"
        }  # fmt: skip
        assert params["remote_num_tokens"] == len(PROMPT)

        gc.collect()  # earlier tests' garbage (a virtual replay's heap) must not be collected in the request
        ttft = await stream_ttft(d.url, {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params})
        assert d.engine.prefill_tokens_computed == 0  # the decode side did no prefill work
        assert d.engine.stats.external_kv_tokens == len(PROMPT)
        assert p.engine.num_blocks_in_use == 0 and not p.engine.pins  # the pull freed the pin
        expected = d.timing.transfer(len(PROMPT), 10.0) + d.timing.decode(1, len(PROMPT))
        engine_ttft = d.engine.stats.ttft.sum  # what vllm:time_to_first_token_seconds reports
        assert abs(engine_ttft - expected) < 0.1 * expected, (engine_ttft, expected)
        # Seen by the client it is never less, and more by the HTTP and JSON work on a 16k-token
        # body (a few ms here) and any time the OS deschedules a loaded CI machine: a loose bound.
        assert expected * 0.9 < ttft < expected + 0.2, (ttft, expected)
        # The pulled blocks are now cached on the decode side too.
        assert len(d.engine.cached_block_prefixes()) >= n_blocks - 1
        # vLLM counts the pull as a connector hit from "p2p"; a shim's credit check leaves it out.
        async with aiohttp.ClientSession() as s, s.get(d.url + "/metrics") as r:
            text = await r.text()
        pulled = [f"{name}_total{{{labels}}} {len(PROMPT)}.0" for name, labels in (
            ("vllm:external_prefix_cache_queries", 'engine="0",model_name="sim-llama"'),
            ("vllm:external_prefix_cache_hits", 'engine="0",model_name="sim-llama"'),
            ("vllm:prompt_tokens_cached_by_source", 'engine="0",model_name="sim-llama",source="p2p"'),
        )]  # fmt: skip
        assert all(line in text.splitlines() for line in pulled), text
        assert load_from_metrics(text).reused_tokens == 0


async def test_without_params_a_decode_sim_prefills_locally() -> None:
    async with SimServer(sim_config(role="decode")) as d:
        await complete(d.url, {"prompt": PROMPT[:500], "max_tokens": 2})
        assert d.engine.prefill_tokens_computed == 500


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        await asyncio.sleep(0.01)


async def test_a_prefill_request_runs_to_its_own_max_tokens() -> None:
    """vLLM forces no limit on a `do_remote_decode` request (its P/D proxies ask for one token).
    Until 2026-12-06 the sim made every such request one token, so no test saw a prefill leg that
    kept the client's limit generate the whole answer."""
    async with SimServer(sim_config(role="prefill")) as p:
        pre, _ = await complete(
            p.url, {"prompt": PROMPT[:200], "max_tokens": 5, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert (pre["usage"]["completion_tokens"], pre["choices"][0]["finish_reason"]) == (5, "length")
        assert pre["kv_transfer_params"]["do_remote_prefill"] is True and p.engine.pins


async def test_an_unpulled_pin_is_freed_when_its_lease_runs_out() -> None:
    async with SimServer(sim_config(kv_lease_duration=0.05)) as p:
        await complete(
            p.url, {"prompt": PROMPT[:200], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        assert p.engine.num_blocks_in_use > 0
        await until(lambda: not p.engine.pins, "the lease ran out", timeout=1.0)
        assert p.engine.num_blocks_in_use == 0


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


@contextlib.asynccontextmanager
async def prefill_and_one_seat_decode(
    lease: float | None = None,
) -> AsyncIterator[tuple[SimServer, SimServer, aiohttp.ClientSession]]:
    """A prefill sim, a real-time decode sim that runs one request at a time (for
    `queue_behind_a_busy_request`), both on `lease` (kv_lease_duration) if given, and a client."""
    lease_changes = {} if lease is None else {"kv_lease_duration": lease}
    async with (
        SimServer(sim_config(role="prefill", **lease_changes)) as p,
        SimServer(sim_config(role="decode", speedup=1, max_num_seqs=1, num_gpu_blocks=512, **lease_changes)) as d,
        aiohttp.ClientSession() as s,
    ):
        yield p, d, s


async def queue_behind_a_busy_request(
    s: aiohttp.ClientSession, p: SimServer, d: SimServer
) -> tuple[asyncio.Task[Any], asyncio.Task[tuple[int, Any]], dict[str, Any]]:
    """A long request running on `d` (max_num_seqs=1), and behind it, waiting on `d`, a decode
    request whose KV `p` prefilled and pins: (busy, queued, its kv_transfer_params)."""
    busy = asyncio.create_task(post(s, d.url, {"prompt": list(range(100, 116)), "max_tokens": 2000}))
    await until(lambda: len(d.engine.running) == 1, "the busy request running on d")
    status, pre = await post(
        s, p.url, {"prompt": PROMPT[:400], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200
    params = pre["kv_transfer_params"]
    queued = asyncio.create_task(
        post(s, d.url, {"prompt": PROMPT[:400], "max_tokens": 2, "kv_transfer_params": params})
    )
    await until(lambda: len(d.engine.waiting) == 1, "the decode request waiting on d")
    assert list(p.engine.pins) == [params["remote_request_id"]]
    return busy, queued, params


@pytest.mark.parametrize("cross_process", [False, True])
async def test_a_decode_request_aborted_before_its_pull_frees_the_prefill_pin_at_once(
    cross_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32 (nixl pull_scheduler.request_finished): a decode request aborted before its pull
    (the client gone, a deadline, a router's cancel) tells the prefill engine to free the blocks
    now, not when their lease runs out."""
    async with prefill_and_one_seat_decode() as (p, d, s):
        if cross_process:  # the release goes over HTTP, as between processes
            monkeypatch.setattr(disagg, "_registry", weakref.WeakValueDictionary())
        busy, queued, _ = await queue_behind_a_busy_request(s, p, d)
        queued.cancel()  # the client goes away
        await until(lambda: not d.engine.waiting, "the decode request aborted on d")
        await until(lambda: not p.engine.pins, "the prefill pin freed", timeout=1.0)
        assert p.engine.num_blocks_in_use == 0 and d.engine.stats.failed_transfers == 0
        busy.cancel()
        await asyncio.gather(busy, queued, return_exceptions=True)


WORDS = " ".join(f"word{i}" for i in range(300))


@pytest.mark.parametrize("cross_process", [False, True])
@pytest.mark.parametrize(("path", "bad"), [
    ("/v1/completions", {"prompt": WORDS, "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": WORDS}], "max_tokens": -1}),
    ("/v1/completions", {"prompt": WORDS, "model": "no-such-model"}),  # vLLM's 404, from its endpoint too
])  # fmt: skip
async def test_a_decode_request_refused_frees_the_prefill_pin_at_once(
    cross_process: bool, path: str, bad: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32's _with_kv_transfer_rejection_cleanup: an error answer to a request whose
    kv_transfer_params pin prefill blocks (do_remote_prefill) submits it pre-aborted
    (notify_kv_transfer_request_rejected), and the connector frees those blocks at once. The sim
    answered the 400 and left them pinned for the whole 30 s lease."""
    async with (
        SimServer(sim_config(role="prefill")) as p,
        SimServer(sim_config(role="decode")) as d,
        aiohttp.ClientSession() as s,
    ):
        if cross_process:  # the release goes over HTTP, as between processes
            monkeypatch.setattr(disagg, "_registry", weakref.WeakValueDictionary())
        first = {k: v for k, v in bad.items() if k not in ("max_tokens", "model")}
        async with s.post(
            p.url + path, json={**first, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        ) as r:
            assert r.status == 200, await r.text()
            params = (await r.json())["kv_transfer_params"]
        assert list(p.engine.pins) == [params["remote_request_id"]] and p.engine.num_blocks_in_use > 0
        async with s.post(d.url + path, json={**bad, "kv_transfer_params": params}) as r:
            assert r.status in (400, 404), await r.text()
        await until(lambda: not p.engine.pins, "the prefill pin freed", timeout=1.0)  # its lease: 30 s
        assert p.engine.num_blocks_in_use == 0 and not d.engine.running and not d.engine.waiting


async def test_a_body_vllms_validation_refuses_frees_no_pin_as_in_vllm() -> None:
    """vLLM's pydantic refuses such a body before its endpoint runs, where the cleanup is: the
    blocks stay pinned for their lease, and a good request's pull still finds them."""
    async with (
        SimServer(sim_config(role="prefill")) as p,
        SimServer(sim_config(role="decode")) as d,
        aiohttp.ClientSession() as s,
    ):
        pre = {"prompt": PROMPT[:400], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        status, out = await post(s, p.url, pre)
        params = out["kv_transfer_params"]
        status, out = await post(s, d.url, {"prompt": PROMPT[:400], "max_tokens": "two", "kv_transfer_params": params})
        assert (status, out["error"]["type"]) == (400, "Bad Request"), out
        status, out = await post(s, d.url, {"prompt": PROMPT[:400], "max_tokens": 2, "kv_transfer_params": params})
        assert status == 200 and d.engine.stats.external_kv_tokens == 400 and d.engine.stats.failed_transfers == 0
        assert not p.engine.pins


@pytest.mark.parametrize("cross_process", [False, True])
async def test_a_decode_sim_holding_the_request_renews_the_lease_until_it_pulls(
    cross_process: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.32's heartbeats: however long the decode request waits in the decode engine's queue,
    its KV stays pinned on the prefill engine, and the pull finds it."""
    lease = 2  # vLLM's smallest integer lease a heartbeat extends (by 2 * 2 // 3 = 1 s)
    async with prefill_and_one_seat_decode(lease) as (p, d, s):
        if cross_process:  # heartbeats and the pull go over HTTP, as between processes
            monkeypatch.setattr(disagg, "_registry", weakref.WeakValueDictionary())
        busy, queued, params = await queue_behind_a_busy_request(s, p, d)
        await asyncio.sleep(lease + 0.5)
        assert list(p.engine.pins) == [params["remote_request_id"]]  # renewed: pinned past its lease
        busy.cancel()  # the decode engine frees up, and schedules the waiting request
        status, body = await queued
        assert (status, body["usage"]["completion_tokens"]) == (200, 2), body
        assert d.engine.stats.failed_transfers == 0 and d.engine.stats.external_kv_tokens == 400
        assert not p.engine.pins
        await asyncio.gather(busy, return_exceptions=True)


@pytest.mark.parametrize("gone", ["crashed", "hung"])
async def test_a_lease_no_decode_sim_renews_runs_out(gone: str) -> None:
    """A decode engine that died or hung sends no heartbeat: the prefill engine frees the KV at most
    `lease * 2 // 3` after the last heartbeat."""
    lease = 2  # each heartbeat extends the lease by 1 s
    async with prefill_and_one_seat_decode(lease) as (p, d, s):
        busy, queued, _ = await queue_behind_a_busy_request(s, p, d)
        await asyncio.sleep(lease + 0.5)
        assert p.engine.pins  # renewed past its lease while d held the request
        if gone == "crashed":
            await d.crash()
        else:
            d.faults.hang = True
        t0 = time.monotonic()
        await until(lambda: not p.engine.pins, "the lease ran out", timeout=3.0)
        assert time.monotonic() - t0 < disagg.lease_extension(lease) + 0.2
        for t in (busy, queued):
            t.cancel()
        await asyncio.gather(busy, queued, return_exceptions=True)


async def test_the_heartbeat_route_renews_the_leases_it_names() -> None:
    lease = 1.5  # a heartbeat extends a lease to 1.5 * 2 // 3 = 1.0 s from then
    async with SimServer(sim_config(role="prefill", kv_lease_duration=lease)) as p, aiohttp.ClientSession() as s:
        pre, _ = await complete(
            p.url, {"prompt": PROMPT[:200], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        done = time.monotonic()  # just after the prefill finished and its lease began
        rid, engine = pre["kv_transfer_params"]["remote_request_id"], p.engine.engine_id
        await asyncio.sleep(0.9)
        for body, expected in [
            ({"remote_engine_id": engine, "remote_request_ids": [rid, "unknown"]}, (200, {"renewed": 1})),
            ({"remote_engine_id": "another", "remote_request_ids": [rid]}, (404, {"renewed": 0})),
            ({"remote_engine_id": engine, "remote_request_ids": rid}, (400, {"renewed": 0})),
        ]:
            async with s.post(p.url + disagg.HEARTBEAT_PATH, json=body) as r:
                assert (r.status, await r.json()) == expected, body
        await asyncio.sleep(done + 1.7 - time.monotonic())
        assert list(p.engine.pins) == [rid]  # past the first lease's end: renewed until >= 1.9 s
        await until(lambda: not p.engine.pins, "the renewed lease ran out")


async def test_on_a_1s_lease_heartbeats_extend_nothing_as_in_vllm() -> None:
    """vLLM 0.32 extends a lease by `kv_lease_duration * 2 // 3` (nixl base_worker.py), 0 on a 1 s
    lease: the prefill KV goes a second after the prefill however the decode engine heartbeats, and
    the pull fails (kv_load_failure_policy fail)."""
    lease = 1
    async with prefill_and_one_seat_decode(lease) as (p, d, s):
        busy, queued, _ = await queue_behind_a_busy_request(s, p, d)
        await until(lambda: not p.engine.pins, "the unextended lease ran out", timeout=lease + 0.5)
        assert len(d.engine.waiting) == 1  # while d still held the request and heartbeat for it
        busy.cancel()
        status, _ = await queued
        assert status == 500 and d.engine.stats.failed_transfers == 1
        await asyncio.gather(busy, return_exceptions=True)


async def test_a_prefill_peer_that_never_answers_delays_no_other_peers_heartbeats() -> None:
    """One heartbeat in flight per prefill engine, none waiting on another's (vLLM skips a peer whose
    handshake is pending): a prefill sim that takes connections but never answers (stopped,
    partitioned) must not let the leases on a healthy one run out. stop() ends the beat in flight."""
    lease = 2  # each heartbeat extends a lease by 1 s; one to the silent peer takes 5 s to time out
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # never accept()s
    bad = {**STALE, "remote_engine_id": "silent", "remote_port": silent.getsockname()[1]}
    try:
        async with prefill_and_one_seat_decode(lease) as (p, d, s):
            busy, queued, params = await queue_behind_a_busy_request(s, p, d)
            other = asyncio.create_task(
                post(s, d.url, {"prompt": PROMPT[:100], "max_tokens": 2, "kv_transfer_params": bad})
            )
            await until(lambda: len(d.engine.waiting) == 2, "a request for the silent peer waiting on d too")
            await asyncio.sleep(lease + 0.5)
            assert list(p.engine.pins) == [params["remote_request_id"]]  # renewed past its lease
            assert any(t.get_name().startswith("kv-beat-silent") for t in asyncio.all_tasks())
            busy.cancel()
            status, body = await queued
            assert (status, body["usage"]["completion_tokens"]) == (200, 2), body
            assert d.engine.stats.failed_transfers == 0
            other.cancel()
            await asyncio.gather(busy, other, return_exceptions=True)
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-")]
    finally:
        silent.close()


async def test_the_kv_routes_answer_400_to_a_body_that_is_not_a_json_object() -> None:
    """A bad body, not a message for another engine (404)."""
    async with SimServer(sim_config(role="prefill")) as p, aiohttp.ClientSession() as s:
        for path in (disagg.PULL_PATH, disagg.HEARTBEAT_PATH):
            for body in (b"[]", b'"x"', b"1", b"null", b"not json"):
                async with s.post(p.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == 400, (path, body)
            async with s.post(p.url + path, json={"remote_engine_id": "another", "remote_request_ids": []}) as r:
                assert r.status == 404, path
        async with s.post(p.url + disagg.PULL_PATH, json={"remote_request_id": ["x"]}) as r:
            assert r.status == 400  # an id that is no string (a list would not even hash: a 500 with a pin held)


STALE = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "x",
         "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}  # fmt: skip


async def test_stale_params_fall_back_to_local_prefill_when_recomputing() -> None:
    async with SimServer(sim_config(kv_load_failure_policy="recompute")) as d:
        body, _ = await complete(d.url, {"prompt": PROMPT[:300], "max_tokens": 2, "kv_transfer_params": STALE})
        assert body["usage"]["completion_tokens"] == 2
        assert d.engine.prefill_tokens_computed == 300


async def test_a_failed_pull_fails_the_request_as_vllm_does_by_default() -> None:
    """vLLM 0.32's kv_load_failure_policy "fail": the request ends with finish reason "error",
    which its API server answers as a 500 GenerationError, or on a stream as an error event."""
    internal = {
        "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
    }
    async with SimServer(sim_config(role="decode")) as d, aiohttp.ClientSession() as s:
        body = {"prompt": PROMPT[:300], "max_tokens": 2, "kv_transfer_params": STALE}
        async with s.post(d.url + "/v1/completions", json=body) as r:
            assert (r.status, await r.json()) == (500, internal)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(d.url + "/v1/completions", json=stream) as r:
            assert r.status == 200
            events = [line for line in (await r.read()).split(b"\n\n") if line]
        assert [json.loads(e[6:]) for e in events[:-1]] == [internal] and events[-1] == b"data: [DONE]"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "kv_transfer_params": STALE}
        async with s.post(d.url + "/v1/chat/completions", json=chat) as r:
            assert (r.status, await r.json()) == (500, internal)
        async with s.get(d.url + "/metrics") as r:
            text = await r.text()
        assert 'vllm:nixl_num_failed_transfers_total{engine="0",model_name="sim-llama"} 3.0' in text
        assert 'vllm:request_success_total{engine="0",finished_reason="error",model_name="sim-llama"} 3.0' in text
        assert d.engine.prefill_tokens_computed == 0 and d.engine.num_blocks_in_use == 0


def _hashes(messages: list[list[bytes]], kind: str) -> list[int]:
    return [h for e in events_of(messages) if e["type"] == kind for h in e["block_hashes"]]


async def test_blocks_a_pull_evicts_as_it_starts_are_published_at_once() -> None:
    """The step that only starts a pull computes nothing, yet allocating the prompt's blocks can
    evict cached ones: their BlockRemoved go out with that step, as vLLM's empty steps publish
    their events, not when the pull ends (never, on an engine idle after a failed pull)."""
    async with SimServer(sim_config(role="decode", num_gpu_blocks=9, kv_transfer_gbps=1e-6)) as d:
        sub = await connected_subscriber(d)
        try:
            assert await d.runner.submit(SimRequest("warm", list(range(100)), max_tokens=1)).result()
            stored = _hashes(await sub.wait_for(1), "BlockStored")
            assert len(stored) == 6
            # 100 new tokens need 7 of the 8 blocks: all but one of warm's cached ones go; the
            # pull then runs for minutes (a 1 kB/s link).
            pulling = d.runner.submit(SimRequest("d", list(range(500, 600)), max_tokens=2, remote_prefill=STALE))
            await sub.wait_for(2)
            removed = _hashes(sub.messages[1:], "BlockRemoved")
            assert not pulling.finished and d.engine.requests["d"].num_external_tokens == 100
            assert len(removed) == 6 - len(d.engine.cached_block_prefixes()) == 5
            assert set(removed) < set(stored)
            d.runner.abort("d")
        finally:
            sub.close()


def _task(name: str) -> asyncio.Task[Any] | None:
    return next((t for t in asyncio.all_tasks() if t.get_name() == name), None)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_a_pull_failing_for_a_request_aborted_during_it_logs_nothing(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The request is gone: neither "prefilling locally" nor "the request fails" is true of it."""
    async with SimServer(sim_config(role="decode", kv_load_failure_policy=policy, kv_transfer_gbps=0.001)) as d:
        stream = d.runner.submit(SimRequest("d", list(range(100)), max_tokens=2, remote_prefill=STALE))
        await until(lambda: _task("kv-pull-d") is not None, "d's pull started")
        pull = _task("kv-pull-d")
        assert pull is not None
        d.runner.abort("d")
        assert stream.finish_reason == "abort"
        await pull
        assert not [r for r in caplog.records if "remote KV for d" in r.getMessage()]
        assert d.engine.stats.failed_transfers == 0 and d.engine.num_blocks_in_use == 0
