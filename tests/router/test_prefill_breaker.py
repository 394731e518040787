"""A prefill worker whose prefill legs fail through its own fault (no transfer handle, its time
limit, a server error) is left out of prefill legs for a cooldown (`prefill_failing`), then one
request probes it; healthy prefill workers take its requests, and with none left the decode worker
prefills them. Unit tests on Eligibility, then end to end against real NATS and etcd."""

from __future__ import annotations

import asyncio
import logging
import time
import types

import aiohttp
import pytest

from protocol.messages import BAD_TRANSFER_HANDLE, WorkerInfo
from router.dispatch import _prefill_fault
from router.eligibility import (
    ENGINE_COOLDOWN_S,
    ENGINE_FAILING_AFTER,
    PREFILL_COOLDOWN_S,
    Eligibility,
    Exclusion,
)
from router.leg import LegError
from router.load_view import Liveness
from router.policies import Outcome, Path
from router.service import RouterService
from tests.router.conftest import MODEL, Cluster, Worker, complete
from tests.router.polling import until
from tests.router.test_planner import _spill_fleet
from worker_shim.adapters.base import EngineError

SYSTEM = list(range(1, 257))  # a shared prefix: the prefill worker that prefilled it first holds it
NO_CONNECTOR = "--kv-transfer-config"


def without_connector(worker: Worker) -> None:
    """The prefill sim answers as vLLM 0.32 started without --kv-transfer-config does (core.py:
    "Got kv_transfer_params, but no KVConnector found"): it prefills, pins nothing, and returns
    kv_transfer_params null."""
    engine = worker.sim.engine
    finish = engine._finish

    def no_connector(req, reason, out):  # type: ignore[no-untyped-def]
        req.remote_decode = False
        return finish(req, reason, out)

    engine._finish = no_connector  # type: ignore[method-assign]


def handle_rewritten(worker: Worker) -> None:
    """Between the prefill sim and its shim, a proxy rewrites the prefill answer's
    kv_transfer_params to `{}`: the engine pinned its KV, and a decode engine given the handle
    pulls nothing."""
    engine = worker.sim.engine
    finish = engine._finish

    def rewritten(req, reason, out):  # type: ignore[no-untyped-def]
        finish(req, reason, out)
        if out.kv_transfer_params is not None:
            out.kv_transfer_params = {}

    engine._finish = rewritten  # type: ignore[method-assign]


POISON = 4242  # a prompt's first token standing for "this request's grammar does not compile"
ROLE_CHUNK = (
    b'{"id":"chatcmpl-x","object":"chat.completion.chunk","created":1,"model":"sim-llama","choices":'
    b'[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
)


def fails_poisoned_requests(worker: Worker, every: bool = False) -> None:
    """The engine fails a request with a 500 as vLLM 0.32 does one whose structured-output grammar
    passes validation but fails to compile (v1/structured_output: "so it can fail only this
    request"): any engine given it fails it alike. `every`: it fails every request so."""
    adapter = worker.shim.adapter
    generate = adapter.generate

    async def patched(leg, on_output):  # type: ignore[no-untyped-def]
        chat = leg.params.get("messages") if leg.params else None
        if every or (leg.token_ids and leg.token_ids[0] == POISON) or (chat and "POISON" in str(chat)):
            if chat and leg.stream and not leg.prefill_only:
                await on_output(0, [ROLE_CHUNK], [])  # vLLM's chat stream sends its role chunk first
            raise EngineError(500, "engine_error", "Internal server error (grammar compile failed)")
        return await generate(leg, on_output)

    adapter.generate = patched  # type: ignore[method-assign]


# --- Eligibility -------------------------------------------------------------------------------


class World:
    def __init__(self) -> None:
        self.now = 1000.0
        self.elig = Eligibility(
            clock=lambda: self.now,
            sync_state=lambda worker: None,
            liveness=lambda worker: Liveness(0.0, 0.5, True, True),
            tokenizer=None,
        )
        self.info = WorkerInfo(worker="p1", model=MODEL, role="prefill", engine="vllm", block_size=16)
        self.elig.added("p1")

    def exclusion(self) -> Exclusion | None:
        return self.elig.statuses([self.info])[0].exclusion


def test_a_prefill_worker_failing_its_legs_is_left_out_then_probed_once_per_cooldown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = World()
    with caplog.at_level(logging.INFO, logger="router.eligibility"):
        w.elig.prefill_leg("p1", "its prefill legs return no transfer handle (... --kv-transfer-config)")
        assert w.exclusion() is Exclusion.PREFILL_FAILING
        w.now += PREFILL_COOLDOWN_S - 0.1
        w.elig.prefill_leg("p1", None)  # a leg planned before the failure: says nothing
        assert w.exclusion() is Exclusion.PREFILL_FAILING
        w.now += 0.1
        assert w.exclusion() is None  # the next request planned there is the probe
        w.elig.prefill_probe("p1", 5.0)
        assert w.exclusion() is Exclusion.PREFILL_FAILING  # one probe, the others keep away
        w.now += 5.0
        assert w.exclusion() is None  # the probe never reported (its client left): another may probe
        w.elig.prefill_probe("p1", 5.0)
        w.elig.prefill_leg("p1", "no prefill answer within prefill_timeout_s")  # it failed: a new cooldown
        w.now += PREFILL_COOLDOWN_S - 0.1
        assert w.exclusion() is Exclusion.PREFILL_FAILING
        w.now += 0.1
        w.elig.prefill_probe("p1", 5.0)
        w.elig.prefill_leg("p1", None)  # the probe worked: the episode ends
        assert w.exclusion() is None
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO]  # one episode, however long
    assert "prefill worker p1" in said[0][1] and NO_CONNECTOR in said[0][1]


def test_a_prefill_failure_reported_late_is_not_the_probes() -> None:
    """Review of 5536a0b: a prefill leg's 5xx is reported only once its fallback gave output, and came
    with no age: one of a leg sent before the probe, reported during it, dropped the probe and began
    the wait again, and the probe's success then readmitted nothing. Now it leaves the probe's
    verdict standing, as engine_failing's late failure does."""
    w = World()
    w.elig.prefill_leg("p1", "its engine failed a prefill leg (engine_error 500)")
    w.now += PREFILL_COOLDOWN_S + 1.0
    w.elig.prefill_probe("p1", 30.0)
    w.now += 0.5
    w.elig.prefill_leg("p1", "its engine failed a prefill leg (engine_error 500)", ago_s=2.0)  # sent before the probe
    assert w.exclusion() is Exclusion.PREFILL_FAILING  # the probe still holds it
    w.elig.prefill_leg("p1", None)  # the probe worked: readmitted
    assert w.exclusion() is None


def test_a_worker_that_leaves_takes_its_prefill_episode_with_it() -> None:
    w = World()
    w.elig.prefill_leg("p1", "a server error")
    w.elig.removed("p1")
    w.elig.added("p1")
    assert w.exclusion() is None


@pytest.mark.parametrize(
    ("kind", "message", "advice"),
    [
        ("no_transfer", "final chunk without a transfer", NO_CONNECTOR),
        ("engine_protocol", "the prefill leg returned no kv_transfer_params", NO_CONNECTOR),
        (BAD_TRANSFER_HANDLE, "the prefill leg returned kv_transfer_params with no do_remote_prefill", "NixlConnector"),
        # a shim of 36ea325 (before the kind, still answering a router upgraded first): its wording
        (
            "engine_protocol",
            "the prefill leg returned kv_transfer_params with no do_remote_prefill, not true (received {}): "
            "a decode engine given them would prefill the whole prompt again",
            "NixlConnector",
        ),
    ],
)
def test_a_prefill_leg_without_a_usable_handle_is_advised_by_what_it_returned(
    kind: str, message: str, advice: str
) -> None:
    """No handle is an engine without a KV connector; a handle no decode engine would pull with
    (the shim's own kind) is not, and its advice sends no one to --kv-transfer-config. Either way
    its engine still serves whole requests."""
    fault = _prefill_fault(LegError("p1", 502, kind, message, retryable=False), 30.0, 60.0)
    assert fault is not None
    why, serves_whole = fault
    assert advice in why and message in why and serves_whole
    if advice == "NixlConnector":
        assert NO_CONNECTOR not in why and "rewrites kv_transfer_params" in why


# --- end to end ----------------------------------------------------------------------------------


async def test_a_prefill_engine_without_a_kv_connector_is_left_out_and_a_healthy_one_takes_its_requests(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    bad = await cluster.add_worker("prefill")
    without_connector(bad)
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    with caplog.at_level(logging.WARNING):
        status, body, _ = await complete(http, router, [*SYSTEM, *range(2000, 2040)], max_tokens=2)
        assert (status, body["kvswitch"]["outcome"]) == (200, "fallback_prefill_failed")
        good = await cluster.add_worker("prefill")
        await cluster.ready(router)
        await until(
            lambda: (
                good.id in {c["worker"] for c in router.path.explain(MODEL, SYSTEM, text=False)["prefill_candidates"]}
            ),
            what="the healthy prefill worker routable",
        )
        outcomes = []
        for k in range(8):
            status, body, _ = await complete(
                http, router, [*SYSTEM, *range(3000 + 40 * k, 3040 + 40 * k)], max_tokens=2
            )
            outcomes.append((status, body["kvswitch"]["outcome"], body["kvswitch"].get("prefill_worker")))
    assert outcomes == [(200, "remote_prefill", good.id)] * 8
    assert bad.requests_served == 1 and good.requests_served == 8
    failed = [r.getMessage() for r in caplog.records if "remote prefill failed" in r.getMessage()]
    episode = [r.getMessage() for r in caplog.records if r.name == "router.eligibility"]
    assert len(failed) == 1 and len(episode) == 1
    assert bad.id in episode[0] and NO_CONNECTOR in episode[0]
    # Shown where operators look: /debug/route's excluded, /ready's worker_status (the workers left
    # out only) and /debug/workers (every one).
    excluded = {e["worker"]: e for e in router.path.explain(MODEL, SYSTEM, text=False)["excluded"]}
    assert excluded[bad.id]["excluded"] == "prefill_failing" and NO_CONNECTOR in excluded[bad.id]["why"]
    _, ready = router.readiness()
    assert {st["worker"]: st["excluded"] for st in ready["worker_status"]} == {bad.id: "prefill_failing"}
    listed = {st["worker"]: st["excluded"] for st in router.worker_listing()["worker_status"]}
    assert listed[bad.id] == "prefill_failing" and listed[good.id] is None


async def test_a_prefill_handle_a_decode_engine_would_not_pull_with_falls_back_and_leaves_its_worker_out(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """2026-12-07: a handle rewritten to `{}` passed as a remote prefill (outcome remote_prefill, no
    fallback counted) while the decode engine prefilled the whole prompt again. Now the shim fails
    the leg: the router falls back, counts it, and leaves the prefill worker out."""
    bad = await cluster.add_worker("prefill")
    handle_rewritten(bad)
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    prompt = [*SYSTEM, *range(2000, 2040)]
    status, body, _ = await complete(http, router, prompt, max_tokens=2)
    assert (status, body["kvswitch"]["outcome"]) == (200, "fallback_prefill_failed")
    assert router.dispatcher.fallbacks == 1 and d.sim.engine.stats.external_kv_tokens == 0
    assert d.sim.engine.prefill_tokens_computed == len(prompt) + d.shim.probe.prompt_tokens
    excluded = {e["worker"]: e for e in router.path.explain(MODEL, SYSTEM, text=False)["excluded"]}
    why = excluded[bad.id]["why"]
    assert excluded[bad.id]["excluded"] == "prefill_failing" and "do_remote_prefill" in why
    # Its engine has its KV connector: the advice names the handle's rewriting, not a flag it has
    assert "rewrites kv_transfer_params" in why and "NixlConnector" in why and NO_CONNECTOR not in why
    assert router.eligibility.serves_whole(bad.id)  # its engine answers: it still takes whole requests


async def a_hung_prefill_worker_then_a_healthy_one(
    cluster: Cluster, http: aiohttp.ClientSession
) -> tuple[Worker, Worker, RouterService]:
    """A prefill worker whose engine hangs after one served leg (so it holds SYSTEM's blocks), a
    decode worker, a router with a 1 s prefill_timeout_s, then a healthy prefill worker: (bad,
    good, router)."""
    bad = await cluster.add_worker("prefill", hang_after=1)  # its shim stays up, its engine stops
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always", prefill_timeout_s=1.0)
    status, body, _ = await complete(http, router, [*SYSTEM, *range(2000, 2040)], max_tokens=2)
    assert (status, body["kvswitch"]["outcome"]) == (200, "remote_prefill")
    good = await cluster.add_worker("prefill")
    await cluster.ready(router)
    return bad, good, router


async def test_a_hung_prefill_engine_costs_one_prefill_timeout_not_one_per_request(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    bad, good, router = await a_hung_prefill_worker_then_a_healthy_one(cluster, http)
    rows = []
    for k in range(6):
        status, body, _ = await complete(http, router, [*SYSTEM, *range(3000 + 40 * k, 3040 + 40 * k)], max_tokens=2)
        rows.append((status, body["kvswitch"]["outcome"]))
    assert rows[0] == (200, "fallback_prefill_failed")  # it still held the prefix: one timeout
    assert rows[1:] == [(200, "remote_prefill")] * 5  # none waited prefill_timeout_s
    assert bad.requests_served == 2 and good.requests_served == 5


async def assert_served_on_the_decode_worker_alone(
    d: Worker, http: aiohttp.ClientSession, router: RouterService, n: int
) -> None:
    """`n` requests all served on `d`: the first by the fallback after its prefill leg failed, the
    rest bypassing the failing prefill worker."""
    outcomes = []
    for k in range(n):
        status, body, headers = await complete(http, router, list(range(1000 * k, 1000 * k + 200)), max_tokens=2)
        outcomes.append((status, headers["x-kvswitch-decode-worker"], body["kvswitch"]["outcome"]))
    assert outcomes == [(200, d.id, "fallback_prefill_failed")] + [(200, d.id, "bypass_transfer_failing")] * (n - 1)


async def test_with_no_healthy_prefill_worker_requests_prefill_on_their_decode_worker_without_a_failed_leg(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    bad = await cluster.add_worker("prefill")
    without_connector(bad)
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    await assert_served_on_the_decode_worker_alone(d, http, router, n=4)
    assert bad.requests_served == 1 and router.dispatcher.fallbacks == 1
    reason = router.path.explain(MODEL, list(range(200)), text=False)["reason"]
    assert bad.id in reason and "failing its prefill legs" in reason


async def test_after_the_cooldown_one_request_probes_the_failing_prefill_worker_while_the_others_keep_away(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("router.eligibility.PREFILL_COOLDOWN_S", 0.5)  # 30 s in service
    bad = await cluster.add_worker("prefill")
    without_connector(bad)
    await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    status, body, _ = await complete(http, router, [*SYSTEM, *range(2000, 2040)], max_tokens=2)
    assert (status, body["kvswitch"]["outcome"]) == (200, "fallback_prefill_failed")
    good = await cluster.add_worker("prefill")
    await cluster.ready(router)
    await until(
        lambda: good.id in {c["worker"] for c in router.path.explain(MODEL, SYSTEM, text=False)["prefill_candidates"]},
        what="the healthy prefill worker routable",
    )
    await asyncio.sleep(0.6)  # past the cooldown: bad, holding SYSTEM, ranks first again
    answers = await asyncio.gather(
        *(complete(http, router, [*SYSTEM, *range(3000 + 40 * k, 3040 + 40 * k)], max_tokens=2) for k in range(6))
    )
    outcomes = sorted(body["kvswitch"]["outcome"] for _, body, _ in answers)
    assert outcomes == ["fallback_prefill_failed"] + ["remote_prefill"] * 5  # the probe, and the rest
    assert bad.requests_served == 2 and good.requests_served == 5
    excluded = {e["worker"]: e["excluded"] for e in router.path.explain(MODEL, SYSTEM, text=False)["excluded"]}
    assert excluded[bad.id] == "prefill_failing"  # the probe failed: another cooldown


# --- review13 (R1-R3) ------------------------------------------------------------------------------


async def test_a_hung_prefill_engine_whose_shim_fires_the_legs_deadline_first_is_left_out_too(
    cluster: Cluster, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leg's deadline is prefill_timeout_s from its dispatch; the shim enforces it on its own
    clock and answers a 504 `deadline` when that clock runs ahead of the router's (a skew under the
    router's 1 s tolerance) or its loop is just first. That is the prefill time limit too."""
    from worker_shim import request_service

    ahead = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    ahead.time = lambda: time.time() + 0.05
    monkeypatch.setattr(request_service, "time", ahead)  # the shims' clock only
    bad, good, router = await a_hung_prefill_worker_then_a_healthy_one(cluster, http)
    rows = []
    for k in range(4):
        status, body, _ = await complete(http, router, [*SYSTEM, *range(3000 + 40 * k, 3040 + 40 * k)], max_tokens=2)
        rows.append((status, body["kvswitch"]["outcome"]))
    assert rows == [(200, "fallback_prefill_failed")] + [(200, "remote_prefill")] * 3
    excluded = {e["worker"]: e for e in router.path.explain(MODEL, SYSTEM, text=False)["excluded"]}
    assert excluded[bad.id]["excluded"] == "prefill_failing" and "prefill_timeout_s" in excluded[bad.id]["why"]
    assert bad.requests_served == 2 and good.requests_served == 3


async def poisoned_pair(cluster: Cluster) -> tuple[Worker, RouterService]:
    """A prefill and a decode worker whose engines both fail a poisoned request, behind a
    disagg="always" router: (the prefill worker, the router)."""
    p = await cluster.add_worker("prefill")
    d = await cluster.add_worker("decode")
    for w in (p, d):
        fails_poisoned_requests(w)
    return p, await cluster.add_ready_router(disagg="always")


async def assert_prefill_legs_still_go_to(
    p: Worker, http: aiohttp.ClientSession, router: RouterService, n: int
) -> None:
    """`n` clean requests after all take a remote prefill leg: `p` is not left out."""
    rows = []
    for k in range(n):
        status, answer, _ = await complete(
            http, router, list(range(1000 * (k + 1), 1000 * (k + 1) + 100)), max_tokens=2
        )
        rows.append((status, answer["kvswitch"]["outcome"]))
    assert rows == [(200, "remote_prefill")] * n
    excluded = {e["worker"] for e in router.path.explain(MODEL, list(range(50)), text=False)["excluded"]}
    assert p.id not in excluded


async def test_a_500_the_request_itself_causes_leaves_the_prefill_worker_in(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The local prefill fails the same request alike: the client gets its error, and the prefill
    worker, which did nothing wrong, keeps serving everyone else's prefill legs."""
    p, router = await poisoned_pair(cluster)
    status, _, _ = await complete(http, router, [POISON, *range(1, 100)], max_tokens=2)
    assert status == 502
    await assert_prefill_legs_still_go_to(p, http, router, n=4)


async def test_a_streamed_chat_500_after_its_role_chunk_leaves_the_prefill_worker_in(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """Before: the fallback's role chunk (no token) read as output, so the prefill worker was
    blamed before the error came, and everyone's requests after were bypassed."""
    p, router = await poisoned_pair(cluster)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "POISON " + " ".join(f"w{i}" for i in range(300))}],
        "max_tokens": 3,
        "stream": True,
    }
    async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and b'"error"' in await resp.read()  # the error event, mid-stream
    await assert_prefill_legs_still_go_to(p, http, router, n=3)


async def test_a_prefill_engine_failing_every_leg_with_a_500_is_left_out_once_the_fallback_serves(
    cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    """The fallback on the decode worker serves the request: the 500 was the prefill engine's."""
    p = await cluster.add_worker("prefill")
    fails_poisoned_requests(p, every=True)
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    await assert_served_on_the_decode_worker_alone(d, http, router, n=3)
    excluded = {e["worker"]: e for e in router.path.explain(MODEL, list(range(50)), text=False)["excluded"]}
    assert excluded[p.id]["excluded"] == "prefill_failing" and "engine_error 500" in excluded[p.id]["why"]


def test_a_prefill_worker_left_out_for_giving_no_transfer_handle_still_takes_spills_and_a_hung_one_does_not() -> None:
    """Spill runs a whole request on the prefill worker, which needs no transfer handle: an engine
    without a KV connector serves it, where one that hangs or fails would not."""
    f = _spill_fleet()
    f.report("d1", running=100)  # no decode room
    plan = f.planner.take(f.ctx(list(range(64)), "r0"))
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("p1", Outcome.SPILLED_TO_PREFILL)
    f.planner.eligibility.prefill_leg("p1", "its prefill legs return no transfer handle", True)
    f.report("d1", running=100)
    f.report("p1")
    plan = f.planner.take(f.ctx(list(range(64, 128)), "r1"))
    assert plan is not None and (plan.decode.worker, plan.path) == ("p1", Path.AGG)
    assert plan.outcome is Outcome.SPILLED_TO_PREFILL
    shown = f.planner.explain(f.ctx(list(range(128, 192)), "r2"))
    assert (shown["decode_worker"], shown["outcome"]) == ("p1", "spilled_to_prefill")
    assert {e["worker"]: e["excluded"] for e in shown["excluded"]}["p1"] == "prefill_failing"
    f.report("p1", draining=True)  # what prefill_failing hides from /ready still counts
    assert f.planner.take(f.ctx(list(range(256, 320)), "r4")) is None
    f.report("p1")
    f.planner.eligibility.prefill_leg("p1", "no prefill answer within prefill_timeout_s (30s)")  # now it hangs
    f.report("p1")
    assert f.planner.take(f.ctx(list(range(192, 256)), "r3")) is None  # waits for decode room


def test_a_prefill_worker_whose_spills_fail_with_its_engines_server_errors_takes_no_more_spills() -> None:
    """A spill is an agg leg: its engine's 5xx start an `engine_failing` episode, which
    `prefill_failing` hides from its status. Until 2026-12-07 spills went on to it, each a failed
    leg and a retry, until its next prefill probe (PREFILL_COOLDOWN_S)."""
    f = _spill_fleet()
    f.planner.eligibility.prefill_leg("p1", "its prefill legs return no transfer handle", True)
    f.report("d1", running=100)  # no decode room
    f.report("p1")
    plan = f.planner.take(f.ctx(list(range(64)), "r0"))
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("p1", Outcome.SPILLED_TO_PREFILL)
    for _ in range(ENGINE_FAILING_AFTER):
        f.clock.now += 0.1
        f.planner.eligibility.engine_leg("p1", "engine_error 500: internal server error")
    f.report("d1", running=100)
    f.report("p1")
    assert not f.planner.eligibility.serves_whole("p1")
    assert f.planner.take(f.ctx(list(range(64, 128)), "r1")) is None  # waits for decode room
    f.clock.now += ENGINE_COOLDOWN_S + 0.1  # the engine's cooldown over: spills try it again
    f.report("d1", running=100)
    f.report("p1")
    plan = f.planner.take(f.ctx(list(range(128, 192)), "r2"))
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("p1", Outcome.SPILLED_TO_PREFILL)
    f.report("d1", running=100)
    f.report("p1")
    assert f.planner.take(f.ctx(list(range(192, 256)), "r3")) is None  # one spill is the trial


@pytest.mark.parametrize("prefill_episode", [True, False], ids=["past_its_prefill_cooldown", "no_prefill_episode"])
def test_a_lone_prefill_worker_whose_spills_fail_with_its_engines_server_errors_takes_none_in_their_cooldown(
    prefill_episode: bool,
) -> None:
    """Past its prefill cooldown (or with no prefill episode) the worker reads as `engine_failing`,
    soft: the lone prefill worker is back in the prefill pool, as with no other a prefill leg still
    goes to it. A spill may wait for decode room instead: until 2026-12-07 spills went on to it
    through its engine's cooldown and its trial, each a failed leg and a retry."""
    f = _spill_fleet()
    el = f.planner.eligibility
    if prefill_episode:
        el.prefill_leg("p1", "its prefill legs return no transfer handle", True)
        f.clock.now += PREFILL_COOLDOWN_S + 0.1
    for _ in range(ENGINE_FAILING_AFTER):  # its spills fail with its engine's 5xx
        f.clock.now += 0.1
        el.engine_leg("p1", "engine_error 500: internal server error")
    f.report("d1", running=100)  # no decode room
    f.report("p1")
    assert el.statuses([f.infos[1]])[0].exclusion is Exclusion.ENGINE_FAILING
    assert f.planner.take(f.ctx(list(range(64)), "r0")) is None  # waits for decode room
    f.clock.now += ENGINE_COOLDOWN_S + 0.1  # the engine's cooldown over: one spill is its trial
    f.report("d1", running=100)
    f.report("p1")
    plan = f.planner.take(f.ctx(list(range(64, 128)), "r1"))
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("p1", Outcome.SPILLED_TO_PREFILL)
    f.report("d1", running=100)
    f.report("p1")
    assert f.planner.take(f.ctx(list(range(128, 192)), "r2")) is None  # its trial under way
