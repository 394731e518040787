"""RequestPath's utility calls (/tokenize, /detokenize): which workers they go to, in what order,
when a failed call moves on to the next worker, and none while NATS is down; and the models and
LoRA adapters a request may name."""

from __future__ import annotations

import asyncio
import logging
import time
import types
from typing import Any, cast

import msgspec
import pytest

from protocol import GenerateRequest, WorkerInfo
from protocol.messages import ENDPOINT_TOKENIZE
from router.leg import LegError
from router.leg_failures import LegFailures
from router.planner import PlanError
from router.request_path import NO_WORKER_RETRY_S, RECENT_S, RequestPath, Unknown
from router.worker_registry import Departed
from tests.router.builders import worker


class Planner:
    def __init__(self, infos: list[WorkerInfo]) -> None:
        self.infos = infos

    def utility_workers(self, model: str, endpoint: str) -> list[WorkerInfo]:
        return [i for i in self.infos if i.model == model]


class Dispatcher:
    """Answers from every worker but those in `fails`, which raise the LegError given; those in
    `slow` only once the call's deadline has passed. As router.dispatch's, an answer ends its
    worker's episodes in the utility calls' leg failures it handed out."""

    def __init__(
        self, fails: dict[str, LegError] | None = None, *, up: bool = True, slow: frozenset[str] = frozenset()
    ) -> None:
        self.fails = fails or {}
        self.up = up
        self.slow = slow
        self.calls: list[tuple[str, str, GenerateRequest]] = []
        self.failure_logs: list[LegFailures] = []

    async def connected(self) -> bool:
        return self.up

    def leg_failures(self, logger: logging.Logger, *, utility: bool = False) -> LegFailures:
        failures = LegFailures(logger)
        if utility:  # its calls are utility calls: the others' episodes end on a token
            self.failure_logs.append(failures)
        return failures

    async def call(self, worker: str, role: str, req: GenerateRequest, deadline: float) -> bytes:
        self.calls.append((worker, role, req))
        if worker in self.slow:
            await asyncio.sleep(deadline - time.monotonic() + 0.01)
        if worker in self.fails:
            raise self.fails[worker]
        for failures in self.failure_logs:
            failures.served(worker)
        return b'{"from": "' + worker.encode() + b'"}'


def path(infos: list[WorkerInfo], dispatcher: Dispatcher, **kw: Any) -> RequestPath:
    stub = cast(Any, None)
    fields: dict[str, Any] = {"models": lambda: ["m"], **kw}
    return RequestPath(
        planner=cast(Any, Planner(infos)),
        admission=stub,
        dispatcher=cast(Any, dispatcher),
        metrics=stub,
        tracer=stub,
        **fields,
    )


async def test_calls_take_the_workers_in_turn_on_their_own_subjects() -> None:
    d = Dispatcher()
    p = path([worker("a", "agg"), worker("b", "decode"), worker("c", "prefill")], d)
    answers = [await p.call("m", ENDPOINT_TOKENIZE, {"prompt": "x"}) for _ in range(4)]
    assert answers == [b'{"from": "a"}', b'{"from": "b"}', b'{"from": "c"}', b'{"from": "a"}']
    assert [(w, role) for w, role, _ in d.calls] == [("a", "agg"), ("b", "decode"), ("c", "prefill"), ("a", "agg")]
    req = d.calls[0][2]
    assert req.endpoint == ENDPOINT_TOKENIZE and req.params == {"prompt": "x"} and req.token_ids == []
    assert len({r.request_id for _, _, r in d.calls}) == 4, "each call its own id"


async def test_a_worker_that_failed_before_answering_hands_the_call_on_once() -> None:
    silent = LegError("a", 503, "worker_silent", "no chunk", retryable=True)
    d = Dispatcher({"a": silent})
    p = path([worker("a", "agg"), worker("b", "agg"), worker("c", "agg")], d)
    assert await p.call("m", ENDPOINT_TOKENIZE, {}) == b'{"from": "b"}'
    assert [w for w, _, _ in d.calls] == ["a", "b"]

    both = Dispatcher({"a": silent, "b": LegError("b", 502, "internal", "boom", retryable=True)})
    p = path([worker("a", "agg"), worker("b", "agg"), worker("c", "agg")], both)
    with pytest.raises(LegError) as err:
        await p.call("m", ENDPOINT_TOKENIZE, {})
    assert err.value.worker == "b" and [w for w, _, _ in both.calls] == ["a", "b"], "two tries, not the fleet"


async def test_a_worker_failing_every_call_is_said_once_per_episode_until_a_call_on_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A dead engine behind a worker still registered: every call that starts on it is handed on.
    Until 2026-12-07 each was a WARNING ("trying b"), a line per call a client polled with."""
    caplog.set_level(logging.DEBUG, logger="router.request_path")
    dead = LegError("a", 503, "engine_unavailable", "connection refused 127.0.0.1:9", retryable=True)
    d = Dispatcher({"a": dead})
    p = path([worker("a", "agg"), worker("b", "agg")], d)
    for _ in range(10):  # the calls take a and b in turn: five start on a
        assert await p.call("m", ENDPOINT_TOKENIZE, {}) == b'{"from": "b"}'
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "router.request_path"]
    warnings = [line for level, line in said if level == logging.WARNING]
    assert len(warnings) == 1, said
    assert warnings[0].startswith("tokenize call ") and warnings[0].endswith(
        "; trying b; further engine_unavailable failures on worker a are counted (said every 30s at most) "
        "until it serves again"
    ), warnings[0]
    assert [level for level, line in said[1:]] == [logging.DEBUG] * 4, said
    assert all(line.endswith("; trying b") for _, line in said[1:]), said

    caplog.clear()
    del d.fails["a"]  # its engine is back
    assert [await p.call("m", ENDPOINT_TOKENIZE, {}) for _ in range(2)] == [b'{"from": "a"}', b'{"from": "b"}']
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "router.request_path"]
    assert len(said) == 1 and said[0][0] == logging.INFO, said
    assert said[0][1].startswith("worker a serves again: 5 of its legs failed with engine_unavailable "), said

    caplog.clear()
    d.fails["a"] = dead  # it dies again: a new episode, said
    for _ in range(2):
        await p.call("m", ENDPOINT_TOKENIZE, {})
    assert [r.levelno for r in caplog.records if r.name == "router.request_path"] == [logging.WARNING]


async def test_a_call_whose_first_try_ran_past_the_deadline_tries_no_other_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past the deadline the next try would not be sent (Dispatcher._open): the call ends with
    the first try's error. Until 2026-12-07 it logged "trying b", then failed as b's deadline_passed."""
    silent = LegError("a", 503, "worker_silent", "no chunk", retryable=True)
    d = Dispatcher({"a": silent}, slow=frozenset({"a"}))
    with pytest.raises(LegError) as err:
        await path([worker("a", "agg"), worker("b", "agg")], d, request_timeout_s=0.05).call("m", ENDPOINT_TOKENIZE, {})
    assert err.value is silent and [w for w, _, _ in d.calls] == ["a"]
    assert not [r for r in caplog.records if "trying" in r.getMessage()]


async def test_an_engines_refusal_is_the_answer_not_a_reason_to_try_elsewhere() -> None:
    refusal = LegError("a", 400, "engine_rejected", "bad tokens", retryable=False, body=b'{"error": {}}')
    d = Dispatcher({"a": refusal})
    with pytest.raises(LegError) as err:
        await path([worker("a", "agg"), worker("b", "agg")], d).call("m", ENDPOINT_TOKENIZE, {})
    assert err.value is refusal and len(d.calls) == 1


async def test_no_worker_of_the_model_is_a_503() -> None:
    with pytest.raises(PlanError) as err:
        await path([worker("a", "agg", model="other")], Dispatcher()).call("m", ENDPOINT_TOKENIZE, {})
    assert err.value.code == 503 and "model m" in err.value.message


async def test_without_nats_a_call_is_a_503_naming_it_and_nothing_is_sent() -> None:
    d = Dispatcher(up=False)
    with pytest.raises(PlanError) as err:
        await path([worker("a", "agg")], d).call("m", ENDPOINT_TOKENIZE, {})
    assert err.value.code == 503 and "NATS" in err.value.message and not d.calls


def resolver(default: str | None = None) -> RequestPath:
    adapters = {"sql": "m", "chat": "n"}
    return path([], Dispatcher(), models=lambda: ["m", "n"], adapters=lambda: adapters, default_model=default)


@pytest.mark.parametrize(
    ("default", "name", "resolved"),
    [(None, "m", "m"), (None, "sql", "sql"), (None, "chat", "chat"), ("m", None, "m"), ("m", "sql", "sql")],
)
def test_a_request_may_name_a_model_or_one_of_its_lora_adapters(
    default: str | None, name: str | None, resolved: str
) -> None:
    assert resolver(default).resolve_model(name) == resolved


@pytest.mark.parametrize(
    ("default", "name", "message"),
    [
        (None, "nope", "The model `nope` does not exist. Registered: m, n, sql, chat"),
        ("m", "chat", "The model `chat` does not exist. This router serves `m` and its LoRA adapters sql"),
        ("n", "m", "The model `m` does not exist. This router serves `n` and its LoRA adapters chat"),
    ],
)
def test_an_unknown_name_is_a_404_naming_what_is_served(default: str | None, name: str | None, message: str) -> None:
    with pytest.raises(Unknown) as err:
        resolver(default).resolve_model(name)
    assert err.value.code == 404 and str(err.value) == message


NO_WORKER = "right now (workers left, or have not registered yet): send the request again later. Registered: "


@pytest.mark.parametrize("name", [None, "z"])
def test_the_routers_own_model_with_no_worker_is_a_503_not_a_404(name: str | None) -> None:
    """--model z that no worker serves (yet, or any more) is no unknown model: a 503 with Retry-After
    (audit router_stream D2: a 404 "does not exist" before, which clients do not retry)."""
    with pytest.raises(Unknown) as err:
        resolver("z").resolve_model(name)
    assert err.value.code == 503 and err.value.retry_after_s == NO_WORKER_RETRY_S
    assert str(err.value) == f"no worker serves the model `z` {NO_WORKER}m, n, sql, chat"


def test_a_name_served_lately_whose_workers_left_is_a_503_then_a_404_once_forgotten() -> None:
    served, now = ["m"], [1000.0]
    adapters = {"sql": "m"}
    p = path([], Dispatcher(), models=lambda: served, adapters=lambda: adapters if served else {}, ns="prod")
    p.clock = lambda: now[0]
    with pytest.raises(Unknown) as err:
        p.resolve_model("q")  # never served here
    assert err.value.code == 404
    assert p.resolve_model("m") == "m" and p.resolve_model("sql") == "sql"
    adapters = {}  # the adapter unloaded, its model still served: gone for good, as vLLM says
    with pytest.raises(Unknown) as err:
        p.resolve_model("sql")
    assert err.value.code == 404
    adapters = {"sql": "m"}
    served.clear()  # every worker left
    now[0] += RECENT_S - 1
    for name in ("m", "sql"):
        with pytest.raises(Unknown) as err:
            p.resolve_model(name)
        said = str(err.value)
        assert err.value.code == 503 and err.value.retry_after_s == NO_WORKER_RETRY_S, said
        assert said.startswith(f"no worker serves the model `{name}` {NO_WORKER}none ("), said
        assert "--namespace" not in said, said  # this router saw workers: no namespace mismatch
    with pytest.raises(Unknown) as err:
        p.resolve_model(None)  # the one model it served is gone: no 400 asking for a model
    assert err.value.code == 503 and "any model (served lately: m, sql)" in str(err.value), str(err.value)
    with pytest.raises(Unknown) as err:
        p.resolve_model("q")
    assert err.value.code == 404 and "--namespace" not in str(err.value), str(err.value)
    now[0] += 2
    with pytest.raises(Unknown) as err:
        p.resolve_model("m")
    assert err.value.code == 404 and "--namespace" not in str(err.value), str(err.value)


def test_a_name_its_workers_left_is_a_503_on_a_replica_that_never_served_it_until_forgotten() -> None:
    """The registry's departures, not this replica's own requests: another replica served them
    (models audit F1: a 404 here). One of another model than the --model stays its 404."""
    now = [1000.0]
    left = {"sql": Departed(now[0], "m"), "m": Departed(now[0], "m"), "x": Departed(now[0], "n")}
    p = path([], Dispatcher(), models=list, departed=lambda: left, ns="prod")
    p.clock = lambda: now[0]
    now[0] += RECENT_S - 1
    with pytest.raises(Unknown) as err:
        p.resolve_model("sql")
    assert err.value.code == 503 and err.value.retry_after_s == NO_WORKER_RETRY_S, str(err.value)
    assert str(err.value) == f"no worker serves the model `sql` {NO_WORKER}none (every worker left)"
    with pytest.raises(Unknown) as err:
        p.resolve_model(None)
    assert err.value.code == 503 and "any model (served lately: sql, m, x)" in str(err.value), str(err.value)
    assert not p.vllm_only("sql") and not p.vllm_only(None)  # the 503 stands, whatever engines come back
    with pytest.raises(Unknown) as err:
        p.resolve_model("q")
    assert err.value.code == 404 and "--namespace" not in str(err.value), str(err.value)
    p.default_model = "m"
    with pytest.raises(Unknown) as err:
        p.resolve_model("x")
    assert err.value.code == 404 and str(err.value) == "The model `x` does not exist. This router serves `m`"
    with pytest.raises(Unknown) as err:
        p.resolve_model("sql")
    assert err.value.code == 503, str(err.value)
    p.default_model = None
    now[0] += 2
    for name in ("sql", "m"):
        with pytest.raises(Unknown) as err:
            p.resolve_model(name)
        assert err.value.code == 404, str(err.value)


def test_a_router_that_never_saw_a_worker_keeps_the_namespace_hint_on_its_503() -> None:
    p = path([], Dispatcher(), models=list, ns="prod", default_model="m")
    with pytest.raises(Unknown) as err:
        p.resolve_model(None)
    assert err.value.code == 503 and "--namespace is prod" in str(err.value), str(err.value)


def _sglang(info: WorkerInfo) -> WorkerInfo:
    return msgspec.structs.replace(info, engine="sglang")


_FLEET = [
    worker("v1", "agg", model="m"),
    msgspec.structs.replace(worker("v2", "agg", model="m"), aliases=["m-alias"], adapters=["sql"]),
    _sglang(worker("s1", "agg", model="s")),
    _sglang(msgspec.structs.replace(worker("s2", "agg", model="s"), adapters=["s-lora"])),
    worker("x1", "agg", model="mixed"),
    _sglang(worker("x2", "agg", model="mixed")),
]


@pytest.mark.parametrize(
    ("fleet", "default", "name", "vllm_only"),
    [
        (_FLEET, None, "m", True),
        (_FLEET, None, "m-alias", True),
        (_FLEET, None, "sql", True),
        (_FLEET, None, "s", False),
        (_FLEET, None, "s-lora", False),
        (_FLEET, None, "mixed", False),  # one of its workers is SGLang
        (_FLEET, "s", None, False),  # no name: the --model's
        (_FLEET, "m", "", True),
        (_FLEET, None, "nope", False),  # a name none serves: the whole fleet's, which is mixed
        (_FLEET, None, 5, False),  # no name at all, as sent
        (_FLEET[:2], None, "nope", True),
        (_FLEET[:2], None, None, True),
        ([], None, "m", True),  # no worker: answered as vLLM
    ],
)
def test_vllms_own_refusals_apply_only_where_vllm_engines_alone_serve_the_name(
    fleet: list[WorkerInfo], default: str | None, name: Any, vllm_only: bool
) -> None:
    p = path(fleet, Dispatcher(), default_model=default, workers=lambda: fleet)
    assert p.vllm_only(name) is vllm_only


def test_a_name_whose_workers_left_is_left_to_its_503_not_refused_as_vllm_would() -> None:
    """Its workers gone (a restart of an SGLang-only model), the fleet left is vLLM: judged by it,
    a body SGLang takes got vLLM's 400, which ends a client's retries, where resolve_model answers
    503 with Retry-After (review of 08c9760)."""
    fleet = [worker("v1", "agg", model="m"), _sglang(worker("s1", "agg", model="s"))]
    models = ["m", "s"]
    p = path(fleet, Dispatcher(), models=lambda: models, workers=lambda: fleet)
    assert p.resolve_model("s") == "s" and p.vllm_only("s") is False
    del fleet[1], models[1]  # its workers left
    with pytest.raises(Unknown) as err:
        p.resolve_model("s")
    assert err.value.code == 503
    assert p.vllm_only("s") is False
    assert p.vllm_only("q") is True  # never served here: judged by the fleet, as vLLM checks first
    default = path([], Dispatcher(), models=list, default_model="s")  # --model s, none registered yet
    assert default.vllm_only(None) is False and default.vllm_only("s") is False


def test_the_registrys_engines_of_a_name_follow_its_workers() -> None:
    from router.worker_registry import WorkerRegistry

    discovery = cast(Any, types.SimpleNamespace(ns="ns"))
    registry = WorkerRegistry(discovery, lambda info: None, lambda worker: None)  # fed here
    registry._put("v1", worker("v1", "agg", model="m"), 1)
    assert registry.engines("m") == {"vllm"} and registry.engines(None) == {"vllm"}
    registry._put("s1", _sglang(worker("s1", "agg", model="m")), 2)
    assert registry.engines("m") == {"vllm", "sglang"} and registry.engines("nope") == frozenset()
    assert "nope" not in registry._engines  # a client's names are not kept
