"""What each engine's leg bodies keep of the client's parameters: a prefill leg's min_tokens
(clamped, since SGLang's and TensorRT-LLM's prefill samples the client's first token), a token-id
leg's cache_salt (the request service salts its chain by it), SGLang refusing a truncation it
cannot do, and TensorRT-LLM's chat prefill body as trtllm-serve validates it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from engine_sim import SimRequestError
from engine_sim.openai_request import ChatRequest, CompletionRequest, chat_call, completion_call, parse_body
from protocol import SamplingParams, lax_bool
from protocol.messages import ENDPOINT_CHAT, ENDPOINT_COMPLETIONS
from worker_shim import ShimConfig
from worker_shim.adapters.base import EngineError, LegRequest
from worker_shim.adapters.sglang import SglangAdapter, openai_body
from worker_shim.adapters.trtllm import disagg_body
from worker_shim.adapters.vllm import completion_body, engine_body

BOOT = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}
MESSAGES = [{"role": "user", "content": "hi"}]


def leg(endpoint: str, params: dict[str, Any], sampling: SamplingParams | None = None, **kw: Any) -> LegRequest:
    sampling = sampling or SamplingParams(max_tokens=64)
    return LegRequest("r", "m", [1, 2, 3], sampling, endpoint=endpoint, params=params, **kw)


BUILDERS = {
    "vllm": lambda lg: engine_body(lg)[1],
    "sglang": lambda lg: openai_body(lg, BOOT),
    "trtllm": disagg_body,
}


@pytest.mark.parametrize("engine", sorted(BUILDERS))
@pytest.mark.parametrize("endpoint", [ENDPOINT_COMPLETIONS, ENDPOINT_CHAT])
def test_a_prefill_leg_keeps_min_tokens_clamped_to_its_one_token(engine: str, endpoint: str) -> None:
    """SGLang's decode appends the prefill's first token, TensorRT-LLM's generation continues from
    it: without min_tokens that token could be an EOS, ending the answer at one token."""
    build = BUILDERS[engine]
    params = {"model": "m", "max_tokens": 64, "min_tokens": 8}
    if endpoint == ENDPOINT_CHAT:
        params["messages"] = MESSAGES
    pre = build(leg(endpoint, dict(params), prefill_only=True))
    assert pre["min_tokens"] == 1 and pre["max_tokens"] == 1
    assert build(leg(endpoint, dict(params), transfer={"ctx_request_id": 1}))["min_tokens"] == 8
    bare = build(leg(endpoint, {"model": "m", "messages": MESSAGES}, prefill_only=True))
    # vLLM's prefill leg asks for one whatever the client sent (test_a_vllm_prefill_leg_...)
    assert bare.get("min_tokens") == (1 if engine == "vllm" else None)


@pytest.mark.parametrize("endpoint", ["", ENDPOINT_COMPLETIONS, ENDPOINT_CHAT])
@pytest.mark.parametrize("client", [{}, {"min_tokens": 0}, {"min_tokens": 3}], ids=["none", "zero", "three"])
def test_a_vllm_prefill_leg_always_asks_for_min_tokens_1(endpoint: str, client: dict[str, Any]) -> None:
    """vLLM's connectors return kv_transfer_params only for a leg that ended on its length: one
    token that was an EOS or a client's stop id ended it "stop", with none, and the router took
    the prefill worker for one without a KV connector. min_tokens 1 masks those for that token."""
    params = {"model": "m", "max_tokens": 64, "stop_token_ids": [5], **client}
    if endpoint == ENDPOINT_CHAT:
        params["messages"] = MESSAGES
    sampling = SamplingParams(max_tokens=64, stop_token_ids=[5])  # a token-id leg's
    pre = engine_body(leg(endpoint, params, prefill_only=True, sampling=sampling))[1]
    assert pre["min_tokens"] == 1 and pre["max_tokens"] == 1 and pre["stop_token_ids"] == [5]
    for kw in ({}, {"transfer": {"remote_engine_id": "e"}}):  # no other leg gets one
        other = engine_body(leg(endpoint, params, sampling=sampling, **kw))[1]
        assert other.get("min_tokens") == (client.get("min_tokens") if endpoint else None)


VALID_REWRITTEN: list[tuple[str, dict[str, Any]]] = [
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "min_tokens": 5, "n": 1}),
    (ENDPOINT_COMPLETIONS, {"min_tokens": 16}),  # vLLM's 16 when no max_tokens is given
    (ENDPOINT_COMPLETIONS, {"max_tokens": None, "min_tokens": 16}),  # and when it is null
    (ENDPOINT_COMPLETIONS, {"max_tokens": 100, "stream": True, "stream_options": {"include_usage": True}}),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 100, "stream_options": {}}),  # falsy: vLLM's validator passes it
    (ENDPOINT_COMPLETIONS, {"max_tokens": 100}),  # its context, 100 tokens, is no bound on the client's
    (ENDPOINT_CHAT, {"min_tokens": 50}),  # a chat's limit is the context's room (79 here)
    (ENDPOINT_CHAT, {"max_completion_tokens": 8, "max_tokens": 2, "min_tokens": 8}),  # the first is read
    (ENDPOINT_CHAT, {"max_completion_tokens": None, "max_tokens": 8, "min_tokens": 8}),  # null: the second
    (ENDPOINT_CHAT, {"max_tokens": 8, "n": None}),  # a chat's n may be null (1)
    # integers as vLLM's pydantic models read them (protocol.messages.lax_int)
    (ENDPOINT_COMPLETIONS, {"max_tokens": "64"}),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 64.0, "min_tokens": 0.0}),
    (ENDPOINT_COMPLETIONS, {"max_tokens": " +8 ", "min_tokens": "8"}),
    (ENDPOINT_COMPLETIONS, {"max_tokens": True, "min_tokens": True, "n": True}),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "min_tokens": False, "n": "1"}),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "n": 1.0}),
    (ENDPOINT_CHAT, {"max_completion_tokens": "8", "min_tokens": 8.0}),
]
# each refused by vLLM 0.32 (engine_sim.openai_request holds its checks) as the client sent it
INVALID_KEPT: list[tuple[str, dict[str, Any], str]] = [
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "min_tokens": 10}, "min_tokens"),
    (ENDPOINT_COMPLETIONS, {"min_tokens": 17}, "min_tokens"),
    (ENDPOINT_COMPLETIONS, {"min_tokens": -1}, "min_tokens"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 101}, "max_tokens"),  # past max_model_len
    (ENDPOINT_CHAT, {"max_completion_tokens": 101, "max_tokens": 2}, "max_completion_tokens"),
    (ENDPOINT_CHAT, {"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens"),
    (ENDPOINT_CHAT, {"min_tokens": 500}, "min_tokens"),  # past the context, so past any room in it
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "n": 0}, "n"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "stream_options": {"include_usage": True}}, "stream_options"),
    (ENDPOINT_CHAT, {"stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    # a null where vLLM types the field `int`: a completion's n, min_tokens on both endpoints
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "n": None}, "n"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "min_tokens": None}, "min_tokens"),
    (ENDPOINT_CHAT, {"max_completion_tokens": 5, "min_tokens": None}, "min_tokens"),
    # lax values vLLM reads as ints that it refuses, and values it cannot read as ints
    (ENDPOINT_COMPLETIONS, {"max_tokens": "5", "min_tokens": "10"}, "min_tokens"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": False}, "max_tokens"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": "1e3"}, "max_tokens"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5.5}, "max_tokens"),
    (ENDPOINT_COMPLETIONS, {"max_tokens": 5, "n": "0"}, "n"),
    (ENDPOINT_CHAT, {"max_completion_tokens": 8, "max_tokens": "eight"}, "max_tokens"),  # read though unused
]


def _client(endpoint: str, fields: dict[str, Any]) -> dict[str, Any]:
    extra = {"messages": MESSAGES} if endpoint == ENDPOINT_CHAT else {}
    return {"model": "m", **extra, **fields}


@pytest.mark.parametrize("engine", sorted(BUILDERS))
@pytest.mark.parametrize(("endpoint", "fields"), VALID_REWRITTEN)
def test_a_prefill_leg_makes_a_valid_request_one_token(engine: str, endpoint: str, fields: dict[str, Any]) -> None:
    pre = BUILDERS[engine](leg(endpoint, _client(endpoint, fields), prefill_only=True, max_model_len=100))
    assert pre["stream"] is False and pre["n"] == 1 and "stream_options" not in pre
    assert max(pre.get("max_tokens", 1), pre.get("max_completion_tokens", 1)) == 1
    assert pre.get("min_tokens", 0) <= 1
    # the rewritten values go as ints, whatever form of them the client sent
    assert all(type(pre[k]) is int for k in ("n", "max_tokens", "max_completion_tokens", "min_tokens") if k in pre)


def _engine_refusal(endpoint: str, body: dict[str, Any]) -> str | None:
    """engine_sim's refusal of `body` (vLLM 0.32's request checks, max_model_len 100), None where
    it takes it."""
    raw = json.dumps(body).encode()
    try:
        if endpoint == ENDPOINT_CHAT:
            chat_call(parse_body(raw, ChatRequest), 100, model="m")
        else:
            completion_call(parse_body(raw, CompletionRequest), 100)
    except SimRequestError as exc:
        return exc.message
    return None


@pytest.mark.parametrize(
    ("endpoint", "fields"), VALID_REWRITTEN + [(endpoint, fields) for endpoint, fields, _ in INVALID_KEPT]
)
def test_the_engine_refuses_a_prefill_leg_exactly_when_it_refuses_the_clients_request(
    endpoint: str, fields: dict[str, Any]
) -> None:
    """The shim's copy of vLLM's rules judged by engine_sim's own validation: a request the engine
    takes becomes a prefill leg it takes, of one token; one it refuses stays one it refuses, in the
    same words, so that no remote prefill runs before the refusal."""
    client = (
        {"prompt": [1, 2, 3], **_client(endpoint, fields)}
        if endpoint == ENDPOINT_COMPLETIONS
        else _client(endpoint, fields)
    )
    pre = engine_body(leg(endpoint, dict(client), prefill_only=True, max_model_len=100))[1]
    refusal = _engine_refusal(endpoint, client)
    assert _engine_refusal(endpoint, pre) == refusal
    assert (refusal is None) == ((endpoint, fields) in VALID_REWRITTEN)  # the tables say which is which
    if refusal is None:
        assert pre["max_tokens"] == 1 and pre["n"] == 1 and pre["min_tokens"] == 1


@pytest.mark.parametrize("engine", sorted(BUILDERS))
@pytest.mark.parametrize(("endpoint", "fields", "refused"), INVALID_KEPT)
def test_a_prefill_leg_keeps_a_value_the_engine_refuses_as_the_client_sent_it(
    engine: str, endpoint: str, fields: dict[str, Any], refused: str
) -> None:
    """Made valid (max_tokens 1, n 1, min_tokens 1, stream_options dropped), such a request ran a
    whole remote prefill before the decode engine refused it: as the client sent it, the prefill
    engine refuses it at once, in the words the decode engine would use."""
    client = _client(endpoint, fields)
    pre = BUILDERS[engine](leg(endpoint, dict(client), prefill_only=True, max_model_len=100))
    assert pre[refused] == client[refused]
    if refused in ("min_tokens", "max_tokens", "max_completion_tokens"):
        # the limit and min_tokens checked together stay the client's, as it gave them
        assert {k: pre.get(k) for k in ("max_tokens", "min_tokens")} == {
            k: client.get(k) for k in ("max_tokens", "min_tokens")
        }


STREAM_OPTIONS = {"stream_options": {"include_usage": True}}
# the client's raw `stream` beside stream_options, and whether vLLM 0.32 takes the request: its
# validator reads the raw value's truthiness, its model then the value ("false" is truthy text, False)
STREAMS: list[tuple[Any, bool]] = [("false", True), ("0", True), (False, False), (None, False), (True, True)]


@pytest.mark.parametrize("endpoint", [ENDPOINT_COMPLETIONS, ENDPOINT_CHAT])
@pytest.mark.parametrize(("stream", "taken"), STREAMS)
@pytest.mark.parametrize("kind", ["aggregated", "decode", "prefill"])
def test_the_engine_refuses_a_legs_stream_options_exactly_when_it_refuses_the_clients(
    endpoint: str, stream: Any, taken: bool, kind: str
) -> None:
    """Until 2026-12-08 an unstreamed leg kept the client's stream_options beside the parsed
    `stream` false: vLLM took `"stream": "false"` with them from the client, the router too, but
    refused the decode leg, after the whole remote prefill had run (the prefill leg dropped them)."""
    fields = {"max_tokens": 5, **STREAM_OPTIONS, **({} if stream is None else {"stream": stream})}
    client = _client(endpoint, {**({"prompt": [1, 2, 3]} if endpoint == ENDPOINT_COMPLETIONS else {}), **fields})
    kw: dict[str, Any] = {"prefill_only": True} if kind == "prefill" else {}
    if kind == "decode":
        kw["transfer"] = {"remote_engine_id": "e"}
    body = engine_body(leg(endpoint, dict(client), stream=lax_bool(stream) is True, max_model_len=100, **kw))[1]
    refusal = _engine_refusal(endpoint, client)
    assert (refusal is None) == taken
    assert _engine_refusal(endpoint, body) == refusal
    if body["stream"]:  # the client's usage chunk
        assert body["stream_options"] == client["stream_options"]


def test_a_vllm_token_id_leg_carries_the_clients_cache_salt() -> None:
    salted = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=4), params={"cache_salt": "tenant-a"})
    assert completion_body(salted)["cache_salt"] == "tenant-a"
    assert engine_body(salted)[1]["cache_salt"] == "tenant-a"
    assert "cache_salt" not in completion_body(LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=4)))


def test_a_trtllm_token_id_leg_with_a_cache_salt_is_refused() -> None:
    """TensorRT-LLM's CompletionRequest has no cache_salt: the engine would cache the prompt
    unsalted while the shim counts it salted."""
    for kw in ({}, {"prefill_only": True}, {"transfer": {"ctx_request_id": 1}}):
        salted = LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=4), params={"cache_salt": "t"}, **kw)
        with pytest.raises(EngineError) as caught:
            disagg_body(salted)
        err = caught.value
        assert err.code == 400 and err.kind == "bad_request"
        assert "cache_salt" in err.message and "TensorRT-LLM" in err.message
    assert "cache_salt" not in disagg_body(LegRequest("r", "m", [1, 2, 3], SamplingParams(max_tokens=4)))


TEXT_LEGS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (ENDPOINT_CHAT, {"messages": MESSAGES}),
    "text": (ENDPOINT_COMPLETIONS, {"prompt": "a long text"}),
    "texts": (ENDPOINT_COMPLETIONS, {"prompt": ["one", "two"]}),
}
ID_LEGS: dict[str, tuple[str, dict[str, Any]]] = {
    "routed ids": (ENDPOINT_COMPLETIONS, {}),
    "ids": (ENDPOINT_COMPLETIONS, {"prompt": [5, 6, 7]}),
    "batch of ids": (ENDPOINT_COMPLETIONS, {"prompt": [[5, 6], [7]]}),
}


@pytest.mark.parametrize("name", sorted(TEXT_LEGS))
@pytest.mark.parametrize("prefill_only", [False, True])
def test_sglang_refuses_to_truncate_a_text_prompt(name: str, prefill_only: bool) -> None:
    """SGLang's OpenAI protocol has no truncate_prompt_tokens and ignores it: it would serve the
    whole prompt where the router routed and booked the truncated ids."""
    endpoint, params = TEXT_LEGS[name]
    with pytest.raises(EngineError) as caught:
        openai_body(
            leg(endpoint, {"model": "m", "truncate_prompt_tokens": 4, **params}, prefill_only=prefill_only), BOOT
        )
    err = caught.value
    assert err.code == 400 and err.kind == "bad_request"
    assert "truncate_prompt_tokens" in err.message and "SGLang" in err.message
    assert openai_body(leg(endpoint, {"model": "m", **params}), None)["model"] == "m"


@pytest.mark.parametrize("name", sorted(ID_LEGS))
def test_sglang_takes_truncate_prompt_tokens_on_a_leg_of_token_ids(name: str) -> None:
    endpoint, params = ID_LEGS[name]
    body = openai_body(
        leg(endpoint, {"model": "m", "truncate_prompt_tokens": 2, "truncation_side": "left", **params}), None
    )
    assert body["truncate_prompt_tokens"] == 2


async def test_an_sglang_prefill_leg_it_cannot_serve_fails_the_leg() -> None:
    """The prefill leg runs in the background: a refusal there was only logged, so it must come
    before, from generate itself."""
    config = ShimConfig(
        engine="sglang", model="m", engine_url="http://127.0.0.1:9", kv_events="tcp://127.0.0.1:9", role="prefill"
    )
    adapter = SglangAdapter(config.validate())

    async def ignore(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
        return None

    try:
        with pytest.raises(EngineError) as caught:
            await adapter.generate(
                leg(
                    ENDPOINT_CHAT, {"model": "m", "messages": MESSAGES, "truncate_prompt_tokens": 4}, prefill_only=True
                ),
                ignore,
            )
        assert caught.value.code == 400 and not adapter._background
    finally:
        await adapter.close()


class TrtllmChat(BaseModel):
    """What trtllm-serve's ChatCompletionRequest checks of these bodies (openai_protocol.py:
    OpenAIBaseModel forbids extra fields and populates by name; max_completion_tokens is also read
    as `max_tokens`, so a body with both names carries an extra field)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    model: str
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, validation_alias="max_tokens")
    min_tokens: int = 0
    n: int = 1
    stream: bool | None = False
    disaggregated_params: dict[str, Any] | None = None


@pytest.mark.parametrize(
    "asked",
    [{"max_tokens": 64}, {"max_completion_tokens": 64}, {}],
    ids=["max_tokens", "max_completion_tokens", "neither"],
)
def test_trtllm_takes_the_chat_prefill_body_under_the_clients_own_name(asked: dict[str, int]) -> None:
    """Both names on the prefill leg failed every TensorRT-LLM chat request on the remote-prefill
    path with trtllm-serve's 400 "Extra inputs are not permitted"."""
    client = {"model": "m", "messages": MESSAGES, "min_tokens": 8, **asked}
    TrtllmChat.model_validate(client)
    pre = disagg_body(leg(ENDPOINT_CHAT, dict(client), prefill_only=True))
    assert TrtllmChat.model_validate(pre).max_completion_tokens == 1
    assert [k for k in ("max_tokens", "max_completion_tokens") if k in pre] == (list(asked) or ["max_tokens"])
    decode = disagg_body(leg(ENDPOINT_CHAT, dict(client), transfer={"ctx_request_id": 1}))
    assert TrtllmChat.model_validate(decode).max_completion_tokens == next(iter(asked.values()), None)
