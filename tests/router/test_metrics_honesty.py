"""What operators watch says what happened: a stream that fails mid-way is not a 200, retries and
fallbacks are counted, refused requests are counted under fixed labels, routing time is routing
and not the wait for room, and the docs and the dashboard say so (2026-12-03 audit). End to end
against the session's real NATS and etcd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import RouterMetrics, StateFigures
from router.service import RouterService
from tests.deploy.test_compose import _router_metric_names, _shim_metric_names
from tests.router.conftest import MODEL, Cluster, busy_decode_fleet, complete
from tests.router.polling import until
from worker_shim.adapters.base import EngineError

ROOT = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def _scrape(http: aiohttp.ClientSession, router: RouterService) -> Samples:
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _requests(samples: Samples) -> dict[tuple[str, str], float]:
    """kvswitch_router_requests_total by (endpoint, code)."""
    out = {}
    for (name, labels), value in samples.items():
        if name == "kvswitch_router_requests_total":
            by = dict(labels)
            out[by["endpoint"], by["code"]] = value
    return out


async def test_a_stream_that_fails_after_its_first_token_counts_with_its_error_code_and_is_logged_once(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    caplog.set_level(logging.WARNING, logger="router")
    body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 30000, "stream": True, "ignore_eos": True}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        request_id = resp.headers["x-request-id"].removeprefix("cmpl-")  # the router's id: no X-Request-Id sent
        await resp.content.readline()  # tokens are flowing
        await worker.sim.crash()
        tail = (await resp.read()).decode()
    (event,) = [line for line in tail.splitlines() if '"error"' in line]
    code = json.loads(event.removeprefix("data: "))["error"]["code"]
    assert code >= 500 and tail.rstrip().endswith("data: [DONE]")
    counted = _requests(await _scrape(http, router))
    assert counted == {("completions", str(code)): 1.0}, counted
    said = [r for r in caplog.records if r.name.startswith("router") and request_id in r.getMessage()]
    assert [(r.name, r.levelno) for r in said] == [("router.http_api", logging.WARNING)], said
    assert "after its first chunk" in said[0].getMessage() and f"a {code} error event" in said[0].getMessage()
    assert said[0].__dict__["request_id"] == request_id


class _Refuse(Exception):
    pass


async def _fails_after_its_first_token(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, error: EngineError
) -> tuple[RouterService, int, list[logging.LogRecord]]:
    """A streamed request whose engine sends its first output and then `error`: the router, the
    error event's code and the router's log records naming the request."""
    worker = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    generate = worker.shim.adapter.generate

    async def failing(leg: Any, on_output: Any) -> Any:
        async def first_only(*output: Any) -> None:
            await on_output(*output)
            raise _Refuse

        with contextlib.suppress(_Refuse):
            await generate(leg, first_only)
        raise error

    worker.shim.adapter.generate = failing  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="router")
    caplog.clear()
    body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 30, "stream": True, "ignore_eos": True}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        request_id = resp.headers["x-request-id"].removeprefix("cmpl-")
        tail = (await resp.read()).decode()
    (event,) = [line for line in tail.splitlines() if '"error"' in line]
    assert '"text"' in tail.split(event)[0], "no token went out before the error"
    said = [r for r in caplog.records if r.name.startswith("router") and request_id in r.getMessage()]
    return router, json.loads(event.removeprefix("data: "))["error"]["code"], said


async def test_an_engines_refusal_after_its_first_token_is_said_at_info_as_the_clients(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang 0.5.23 can refuse a request after tokens (a 400 abort: a sampling mask past
    --sampling-mask-max-tokens, batch_result_processor.py). Until 2026-12-07 the router said it at
    WARNING as a worker's failure; now at INFO, as a refusal before the first output is."""
    why = "Sampling support exceeds --sampling-mask-max-tokens=64, commonly because of cutoff ties."
    router, code, said = await _fails_after_its_first_token(
        cluster, http, caplog, EngineError(400, "engine_rejected", why)
    )
    assert code == 400
    assert _requests(await _scrape(http, router)) == {("completions", "400"): 1.0}
    assert [(r.name, r.levelno) for r in said] == [("router.http_api", logging.INFO)], said
    line = said[0].getMessage()
    assert "after its first chunk" in line and why in line and line.endswith("a 400 error event"), line
    assert all(s.routable for s in router.eligibility.statuses(router.registry.workers())), "a worker was blamed"


async def test_an_engines_429_after_its_first_token_stays_a_warning(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A 429 (or 408) after tokens is no refusal of the request: the engine cut the answer off for
    its load, which the client did not cause. Said at WARNING, as a worker's failure after the
    first chunk is (533a703 had said it at INFO with the refusals)."""
    why = "The server is overloaded: too many running requests."
    _, code, said = await _fails_after_its_first_token(cluster, http, caplog, EngineError(429, "engine_rejected", why))
    assert [(r.name, r.levelno) for r in said] == [("router.http_api", logging.WARNING)], said
    line = said[0].getMessage()
    assert "after its first chunk" in line and why in line and line.endswith(f"a {code} error event"), line


@pytest.mark.parametrize("stream", [True, False])
async def test_a_request_that_fails_before_its_first_output_is_logged_once(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    worker = await cluster.add_worker("agg", hang_after=0)  # its engine takes the request and never answers
    router = await cluster.add_router(config={"request_timeout_s": 1.5}, disagg="never")
    await cluster.ready(router)
    caplog.set_level(logging.INFO, logger="router")
    caplog.clear()
    body = {"model": MODEL, "prompt": list(range(50)), "max_tokens": 4, "stream": stream}
    async with http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 504, await resp.text()
    said = [r for r in caplog.records if r.name.startswith("router")]  # an error's x-request-id is a fresh one
    assert [(r.name, r.levelno) for r in said] == [("router.http_api", logging.WARNING)], said
    line, request_id = said[0].getMessage(), said[0].__dict__["request_id"]
    assert line.startswith(f"request {request_id}: failed before its first output"), line
    said_leg = re.search(rf"agg leg on worker {worker.id}: timeout: no answer by its deadline, ([0-9.]+)s after", line)
    counted = (
        f"; further timeout failures on worker {worker.id} are counted (said every 30s at most) until it serves again"
    )
    assert said_leg is not None and 1.2 < float(said_leg[1]) < 3.0 and line.endswith("a 504" + counted), (
        line
    )  # not a slice


@pytest.mark.parametrize(("endpoint", "body"), [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})])
async def test_a_utility_call_that_fails_on_its_last_try_is_logged_once_by_its_id(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, endpoint: str, body: dict[str, Any]
) -> None:
    """Until 2026-12-07 a /tokenize or /detokenize whose last try failed was said nowhere (its retry
    was): now as a completion that fails before its first output, under the id its retry named."""
    workers = [await cluster.add_worker("agg") for _ in range(2)]
    router = await cluster.add_ready_router(disagg="never")

    async def failing(endpoint: str, body: dict[str, Any]) -> bytes:
        raise EngineError(500, "engine_error", "Internal server error (the tokenizer crashed)")

    for w in workers:
        w.shim.adapter.call = failing  # type: ignore[method-assign]
    caplog.set_level(logging.INFO, logger="router")
    caplog.clear()
    async with http.post(router.url + endpoint, json={"model": MODEL, **body}) as resp:
        status = resp.status
    assert status >= 500
    said = [r for r in caplog.records if r.name.startswith("router")]
    assert [(r.name, r.levelno) for r in said] == [
        ("router.request_path", logging.WARNING),  # its retry on the other worker
        ("router.http_api", logging.WARNING),
    ], said
    request_id = said[1].__dict__["request_id"]
    assert said[0].getMessage().startswith(f"{endpoint[1:]} call {request_id}: "), said[0].getMessage()
    line = said[1].getMessage()
    assert line.startswith(f"request {request_id}: failed before its first output (agg leg on worker "), line
    worker = line.split("agg leg on worker ")[1].split(":")[0]
    counted = (
        f"; further engine_error failures on worker {worker} are counted (said every 30s at most) until it serves again"
    )
    assert "engine_error: Internal server error (the tokenizer crashed)" in line, line
    assert line.endswith(f"a {status}{counted}"), line


async def test_a_worker_whose_utility_calls_fail_is_said_once_per_episode_until_one_answers(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A client polling /tokenize while one worker's engine fails every call: until 2026-12-07 each
    call handed on was a WARNING, and an answer from that worker ended no episode (only a generated
    token did), so its count went on until 30 s without a failure."""
    dead, alive = [await cluster.add_worker("agg") for _ in range(2)]
    router = await cluster.add_ready_router(disagg="never")
    serve = dead.shim.adapter.call

    async def failing(endpoint: str, body: dict[str, Any]) -> bytes:
        raise EngineError(500, "engine_error", "Internal server error (the tokenizer crashed)")

    dead.shim.adapter.call = failing  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    for _ in range(8):  # the calls take the two workers in turn: four start on the dead one
        async with http.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status == 200, await resp.text()
    handed_on = [r for r in caplog.records if r.name == "router.request_path"]
    assert [r.levelno for r in handed_on] == [logging.WARNING] + [logging.DEBUG] * 3, handed_on
    assert f"; trying {alive.id}; further engine_error failures on worker {dead.id} are counted" in (
        handed_on[0].getMessage()
    )
    warned = [r for r in caplog.records if r.name.startswith("router") and r.levelno >= logging.WARNING]
    assert warned == handed_on[:1], warned

    dead.shim.adapter.call = serve  # type: ignore[method-assign]
    caplog.clear()
    for _ in range(2):
        async with http.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status == 200, await resp.text()
    ends = [r.getMessage() for r in caplog.records if r.name == "router.request_path" and r.levelno == logging.INFO]
    assert ends and ends[0].startswith(f"worker {dead.id} serves again: 4 of its legs failed with engine_error "), ends


async def _mixed_rounds(http: aiohttp.ClientSession, router: RouterService, n: int) -> None:
    """A client that counts its prompt's tokens before each completion, `n` times: the completions
    share a prefix, so they go to the worker that served it first."""
    for i in range(n):
        async with http.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status == 200, await resp.text()
        body = {"model": MODEL, "prompt": [*_MIXED_PROMPT, i], "max_tokens": 2}
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()


_MIXED_PROMPT = list(range(1000, 1400))


async def test_a_worker_whose_generation_fails_while_its_utility_calls_answer_is_said_once_per_episode(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 an answered /tokenize ended the worker's episode of failing generation legs:
    a WARNING ("retrying on") and an INFO ("serves again") per round of a client mixing the two."""
    workers = [await cluster.add_worker("agg") for _ in range(2)]
    router = await cluster.add_ready_router(disagg="never")
    await _mixed_rounds(http, router, 1)
    dead = max(workers, key=lambda w: w.requests_served)  # the prefix's worker
    failed: list[str] = []

    async def failing(*args: Any, **kwargs: Any) -> Any:
        failed.append(dead.id)
        raise EngineError(500, "engine_error", "Internal server error (engine core died)")

    dead.shim.adapter.generate = failing  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    await _mixed_rounds(http, router, 8)
    assert len(failed) >= 2, "the completions kept going to the failing worker"
    retried = [r for r in caplog.records if r.name == "router.dispatch" and "retrying on" in r.getMessage()]
    assert [r.levelno for r in retried] == [logging.WARNING] + [logging.DEBUG] * (len(failed) - 1), retried
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("router")]
    assert not [line for level, line in said if level == "INFO" and "serves again" in line], said


async def test_a_worker_whose_utility_calls_fail_while_it_generates_is_said_once_per_episode(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """Until 2026-12-07 a generated token ended the worker's episode of utility calls handed on
    from it (an engine with no /tokenize route, a tokenizer that crashed): a WARNING ("trying W") and
    an INFO ("serves again") per round of a client mixing the two."""
    workers = [await cluster.add_worker("agg") for _ in range(2)]
    router = await cluster.add_ready_router(disagg="never")
    await _mixed_rounds(http, router, 1)
    dead = max(workers, key=lambda w: w.requests_served)  # the prefix's worker: it generates on
    before = dead.requests_served

    async def failing(endpoint: str, body: dict[str, Any]) -> bytes:
        raise EngineError(500, "engine_error", "Internal server error (the tokenizer crashed)")

    dead.shim.adapter.call = failing  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    await _mixed_rounds(http, router, 8)
    assert dead.requests_served - before >= 2, "the completions left the worker"
    handed_on = [r for r in caplog.records if r.name == "router.request_path"]
    assert [r.levelno for r in handed_on] == [logging.WARNING] + [logging.DEBUG] * 3, handed_on
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("router")]
    assert not [line for level, line in said if level == "INFO" and "serves again" in line], said


async def test_a_lone_worker_whose_utility_calls_fail_while_it_generates_is_said_once_per_episode(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """No worker to hand a call on to: each call's last try fails, said by the API once per
    episode, which the worker's tokens do not end (until 2026-12-07 they did: a WARNING and an
    INFO per round)."""
    alone = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")

    async def failing(endpoint: str, body: dict[str, Any]) -> bytes:
        raise EngineError(500, "engine_error", "Internal server error (the tokenizer crashed)")

    alone.shim.adapter.call = failing  # type: ignore[method-assign]
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    for i in range(4):
        async with http.post(router.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}) as resp:
            assert resp.status >= 500, await resp.text()
        body = {"model": MODEL, "prompt": [*_MIXED_PROMPT, i], "max_tokens": 2}
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
    failed = [r for r in caplog.records if r.name == "router.http_api" and "before its first output" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.WARNING] + [logging.DEBUG] * 3, failed
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith("router")]
    assert not [line for level, line in said if level == "INFO" and "serves again" in line], said


async def test_a_retry_before_the_first_token_is_counted(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    doomed = await cluster.add_worker("agg", crash_after=1)  # serves one request, then its engine dies
    alive = await cluster.add_worker("agg")
    router = await cluster.add_ready_router(disagg="never")
    prompt = list(range(800))
    # Warm the doomed worker's cache directly, so the router prefers it for this prompt.
    async with http.post(doomed.sim.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}):
        pass
    await until(lambda: len(router.index.worker_hashes(doomed.id)) >= 50, what="the prefix indexed")
    before = await _scrape(http, router)
    assert before[("kvswitch_router_retries_total", frozenset())] == 0.0
    status, out, headers = await complete(http, router, prompt, max_tokens=3)
    assert (status, headers["x-kvswitch-decode-worker"], out["kvswitch"]["attempts"]) == (200, alive.id, 2), out
    after = await _scrape(http, router)
    assert after[("kvswitch_router_retries_total", frozenset())] == 1.0 == router.dispatcher.retries


@pytest.mark.parametrize(
    ("cause", "prefill", "settings"),
    [
        ("prefill_failed", {"hang_after": 0}, {"prefill_timeout_s": 0.3}),  # the prefill leg never answers
        ("transfer_failed", {"kv_lease_duration": 1e-6}, {}),  # its KV is freed before the pull
    ],
)
async def test_a_fallback_to_a_local_prefill_is_counted_by_its_cause(
    cluster: Cluster, http: aiohttp.ClientSession, cause: str, prefill: dict[str, Any], settings: dict[str, Any]
) -> None:
    await cluster.add_worker("prefill", **prefill)
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always", **settings)
    # a router is ready with its decode worker alone; a prefill worker still syncing is no pool (a
    # clean-clone CI run got `no_prefill_pool` once)
    await until(
        lambda: all(st["routable"] for st in router.worker_listing()["worker_status"]), what="both workers routable"
    )
    status, out, _ = await complete(http, router, list(range(400)), max_tokens=2)
    assert (status, out["kvswitch"]["outcome"]) == (200, f"fallback_{cause}"), out
    samples = await _scrape(http, router)
    fallbacks = {
        dict(labels)["cause"]: value
        for (name, labels), value in samples.items()
        if name == "kvswitch_router_fallbacks_total"
    }
    zero = {"prefill_failed": 0.0, "prefill_refused": 0.0, "transfer_failed": 0.0, "handle_too_large": 0.0}
    assert fallbacks == {**zero, cause: 1.0}, fallbacks
    assert samples[("kvswitch_router_retries_total", frozenset())] == 0.0


async def test_401_404_and_405_are_counted_under_fixed_labels_never_the_path(
    cluster: Cluster, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text("sk-right\n")
    router = await cluster.add_router(api_keys_file=str(tmp_path / "keys"))
    key = {"Authorization": "Bearer sk-right"}
    body = {"model": MODEL, "prompt": "x"}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        async with http.post(router.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 401
    async with http.get(router.url + "/v1/no-such-thing") as r:  # no key either: the 401 comes first
        assert r.status == 401
    for i in range(3):
        async with http.post(router.url + f"/v1/nope{i}", json={}, headers=key) as r:
            assert r.status == 404
    async with http.get(router.url + "/v1/completions", headers=key) as r:
        assert r.status == 405
    counted = _requests(await _scrape(http, router))
    assert counted == {("auth", "401"): 3.0, ("unrouted", "404"): 3.0, ("unrouted", "405"): 1.0}, counted


async def test_a_stall_of_the_routers_own_loop_is_counted(cluster: Cluster, http: aiohttp.ClientSession) -> None:
    """A stall excuses its workers' silence for a window (runtime.loop_watch): it is no silent thing."""
    router = await cluster.add_router()
    stall: tuple[str, frozenset[tuple[str, str]]] = ("kvswitch_router_loop_stalls_total", frozenset())
    before = (await _scrape(http, router))[stall]
    time.sleep(0.3)  # the loop blocked: a GC pause, a long synchronous step
    await asyncio.sleep(0.2)
    assert (await _scrape(http, router))[stall] >= before + 1


async def test_route_seconds_times_the_planner_and_the_wait_for_room_is_queue_wait(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    # The only decode worker has no room for a second request while the first runs, so the second
    # waits at admission until the first ends.
    router, _, first = await busy_decode_fleet(cluster, http)
    second = asyncio.create_task(complete(http, router, list(range(1000, 1064))))
    await until(lambda: router.path.admission.depth == 1, what="the second request waiting at admission")
    await asyncio.sleep(0.3)
    assert not second.done()
    assert [(await first)[0], (await second)[0]] == [200, 200]
    samples = await _scrape(http, router)

    def figure(name: str) -> float:
        return samples[(name, frozenset())]

    # Planning two requests (and the offers while one waited) is CPU work of milliseconds; before
    # 2026-12-03 route_seconds held the wait too.
    assert figure("kvswitch_router_route_seconds_count") == 2
    assert figure("kvswitch_router_route_seconds_sum") < 0.25, figure("kvswitch_router_route_seconds_sum")
    assert figure("kvswitch_router_queue_wait_seconds_count") == 2
    waited = figure("kvswitch_router_queue_wait_seconds_sum")
    assert waited >= 0.3, waited
    help_text = router.metrics.route._documentation
    assert "tokenis" not in help_text and "kvswitch_router_queue_wait_seconds" in help_text


def test_the_shims_metrics_table_has_a_row_for_every_metric_it_exports() -> None:
    doc = (ROOT / "docs" / "worker_shim.md").read_text()
    rows = {
        m for line in doc.splitlines() if line.startswith("| `kvswitch_shim_") for m in re.findall(r"`([^`{]+)", line)
    }
    assert _shim_metric_names() - rows == set()


def test_the_router_docs_name_every_metric_the_router_exports() -> None:
    doc = (ROOT / "docs" / "router.md").read_text()
    section = doc[doc.index("\n## Metrics\n") : doc.index("\n## Figures\n")]
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in _router_metric_names()}
    assert {n for n in names if f"`{n}" not in section} == set()
    assert "kvswitch_router_queue_wait_seconds" in names and "kvswitch_router_fallbacks_total" in names


def test_the_dashboards_bypass_rate_leaves_fallbacks_out_of_its_denominator() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvswitch.json").read_text())
    (bypass,) = [p for p in dashboard["panels"] if p["title"] == "Bypass rate"]
    _, denominator = bypass["targets"][0]["expr"].split(" / ")
    assert 'outcome!~"fallback_.*"' in denominator, denominator
    charted = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("kvswitch_router_retries_total", "kvswitch_router_fallbacks_total", "queue_wait_seconds"):
        assert metric in charted, metric


def test_cancels_sent_again_are_on_metrics() -> None:
    """Each is a cancel lost on the way while an engine generated for nobody: it was counted in a
    Python attribute only (the final read of 2026-12-06)."""
    text = RouterMetrics(lambda: StateFigures(cancels_again=3)).render().decode()
    assert "kvswitch_router_cancels_again_total 3.0" in text
