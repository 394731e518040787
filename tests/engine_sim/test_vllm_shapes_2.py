"""Where the sim's HTTP answers once differed from vLLM 0.32's, second round (the simfid2 audit of
2026-12-03): the JSON media type vLLM's POST routes require, which stop string wins, sampling
parameters vLLM refuses, /ping and /load, the prefix-cache query counter, CORS preflights, and
vLLM's words for refused prompts and chat options. The expected answers are real vLLM 0.32's (the
audit's raw answers), or recorded from its own code in `.venv-vllm` where they do not reach: its
check_stop_strings, its request models' validators, its validate_json_request and validation
handler, and Starlette's CORSMiddleware as vLLM configures it. vLLM's tiny-llama has a vocabulary
of 4,096 ids where the audit's messages say so; the sim's is VOCAB_SIZE."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from engine_sim import SimServer
from engine_sim.cli import config_from_args
from engine_sim.detokenizer import ChoiceText
from engine_sim.errors import SimConfigError
from engine_sim.lora import LoraModule
from protocol.tokenizer import VOCAB_SIZE, BuiltinTokenizer
from tests.engine_sim.conftest import sim_config
from tests.engine_sim.test_cli import parse
from tests.engine_sim.test_http_api import post

TOK = BuiltinTokenizer()
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hello there"}]
COMPLETION = {"prompt": list(range(300, 340)), "max_tokens": 5, "temperature": 0}
CHAT_BODY = {"messages": USER, "max_tokens": 5, "temperature": 0}
PLAIN = {"Content-Type": "text/plain"}


async def send(
    sim: SimServer, method: str, path: str, data: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes, Any]:
    """A request with exactly these headers: aiohttp adds no Content-Type of its own."""
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, sim.url + path, data=data, headers=headers or {}, skip_auto_headers=["Content-Type"]) as r,
    ):
        return r.status, await r.read(), r.headers


def error(message: str, param: str | None = None, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": 400}}


# --- 1. Only application/json ------------------------------------------------------------------------

# vLLM's validate_json_request through its validation handler (raw/vllm/cmpl_no_ct, cmpl_form_ct,
# chat_no_ct, tok_no_ct; the other media types recorded from the two in .venv-vllm).
MEDIA_TYPE = error(
    "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", kind="Bad Request"
)
MALFORMED = error("1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.10', 'msg': 'JSON decode error', "
                  "'input': '<dict of 0 items>', 'ctx': {'error': 'Expecting value'}}",
                  "body.10", "Bad Request")  # fmt: skip
VLLM_MEDIA_TYPES: list[tuple[str | None, bytes, dict[str, Any] | None]] = [
    (None, b'{"prompt": "hi"}', MEDIA_TYPE),
    ("text/plain", b'{"prompt": "hi"}', MEDIA_TYPE),
    (None, b'{"prompt":', MEDIA_TYPE),  # the media type is judged first...
    ("application/x-www-form-urlencoded", b"a=b", MEDIA_TYPE),
    (None, b"", MEDIA_TYPE),
    ("application/merge-patch+json", b'{"prompt": "hi"}', MEDIA_TYPE),
    ("application/merge-patch+json", b'{"prompt":', MALFORMED),  # ...but FastAPI decodes JSON types first
    ("application/json ; charset=utf-8", b'{"prompt": "hi"}', MEDIA_TYPE),  # vLLM splits at ";", no strip
    ("application/json ; charset=utf-8", b'{"prompt":', MALFORMED),
    ("application/json; charset=utf-8", b'{"prompt": "hi"}', None),
    ("Application/JSON", b'{"prompt": "hi"}', None),
]


@pytest.mark.parametrize(("ctype", "data", "refusal"), VLLM_MEDIA_TYPES)
async def test_a_body_not_sent_as_json_is_vllms_400(
    sim: SimServer, ctype: str | None, data: bytes, refusal: dict[str, Any] | None
) -> None:
    headers = {} if ctype is None else {"Content-Type": ctype}
    status, body, _ = await send(sim, "POST", C, data, headers)
    if refusal is None:
        assert status == 200, body
    else:
        assert (status, json.loads(body)) == (400, refusal)


@pytest.mark.parametrize(
    ("path", "body"),
    [(C, COMPLETION), (CHAT, CHAT_BODY), ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [300]})],
)
async def test_every_json_route_requires_the_media_type(sim: SimServer, path: str, body: dict[str, Any]) -> None:
    """completion/api_router.py, chat_completion/api_router.py, tokenize/api_router.py: each route
    depends on validate_json_request; nothing reaches the engine."""
    for headers in ({}, PLAIN):
        status, out, _ = await send(sim, "POST", path, json.dumps(body).encode(), headers)
        assert (status, json.loads(out)) == (400, MEDIA_TYPE)
    assert sim.engine.stats.prompt_tokens == 0
    assert (await post(sim, path, body))[0] == 200


async def test_the_lora_routes_require_it_too_and_the_others_do_not() -> None:
    """lora/api_router.py's load and unload routes depend on it; /ping, /health and the dev mode's
    /reset_prefix_cache (serve/dev/cache/api_router.py) do not."""
    cfg = sim_config(runtime_lora_updating=True, lora_modules=(LoraModule("a", "/a"),))
    async with SimServer(cfg) as sim:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/b"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "a"})):  # fmt: skip
            status, out, _ = await send(sim, "POST", path, json.dumps(body).encode(), PLAIN)
            assert (status, json.loads(out)) == (400, MEDIA_TYPE)
        assert [lora.name for lora in sim.loras] == ["a"]
        for path in ("/ping", "/reset_prefix_cache"):
            assert (await send(sim, "POST", path, b"x", PLAIN))[0] == 200


# --- 2. Which stop string wins -------------------------------------------------------------------------

# vLLM's check_stop_strings (v1/engine/detokenizer.py) on the text so far plus one token's text:
# the stop string completing earliest wins, list order breaks ties. (text before, the token's text,
# stop, include_stop_str_in_output) -> (stop string, the text left).
VLLM_STOPS: list[tuple[str, str, list[str], bool, str, str]] = [
    ("", "a zz", ["zz", "a"], False, "a", ""),
    ("", "a zz", ["zz", "a"], True, "a", "a"),
    ("x", "abc", ["bc", "abc"], False, "bc", "xa"),  # both end at the same place: the first listed
    ("x", "abc", ["abc", "bc"], False, "abc", "x"),
    ("x", "abcd", ["cd", "ab"], False, "ab", "x"),
    ("x", "abcd", ["cd", "ab"], True, "ab", "xab"),
    ("hel", "lo wor", ["wor", "lo w", "o"], False, "o", "hell"),
    ("ab", "cde", ["bcd", "de", "abcde"], False, "bcd", "a"),
    ("ab", "cde", ["de", "bcd"], True, "bcd", "abcd"),
]


@pytest.mark.parametrize(("before", "piece", "stops", "include", "stop", "text"), VLLM_STOPS)
def test_the_stop_string_completed_earliest_wins(
    before: str, piece: str, stops: list[str], include: bool, stop: str, text: str
) -> None:
    t = ChoiceText(stops, include_stop=include)
    t.add(before)
    assert t.stop_reason is None
    t.add(piece)
    assert t.stop_reason == stop and t.text == text


@pytest.mark.parametrize("stream", [False, True])
async def test_two_stop_strings_ending_in_one_token(sim: SimServer, stream: bool) -> None:
    """The audit's stoporder.py: a token whose first two characters and last two are each a stop
    string, the later-ending one listed first: vLLM stops at the earlier one."""
    body = {"prompt": list(range(300, 340)), "max_tokens": 12, "logprobs": 0, "ignore_eos": True}
    _, out, _ = await post(sim, C, body)
    tokens = out["choices"][0]["logprobs"]["tokens"]
    before = ""
    for token in tokens:
        if before and len(token) >= 4 and token[:2] not in before + token[2:] and token[-2:] not in before + token[:-2]:
            break
        before += token
    else:
        pytest.fail(f"no token fits in {tokens}")
    req = {**body, "logprobs": None, "stop": [token[-2:], token[:2]], "stream": stream}
    _, got, _ = await post(sim, C, req)
    if stream:
        events = [json.loads(line[6:]) for line in got.splitlines() if line.startswith("data: {")]
        text = "".join(c["text"] for e in events for c in e["choices"])
        reason = next(c["stop_reason"] for e in events for c in e["choices"] if c["finish_reason"])
    else:
        text, reason = got["choices"][0]["text"], got["choices"][0]["stop_reason"]
    assert (text, reason) == (before, token[:2])


# --- 3. Sampling parameters vLLM refuses -------------------------------------------------------------

STOP_6 = error("2 validation errors:\n  {'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a "
               "valid string', 'input': '<list of 6 items>'}\n  {'type': 'too_long', 'loc': 'body.stop', 'msg': "
               "'List should have at most 4 items after validation, not 6', 'input': '<list of 6 items>', 'ctx': "
               "{'field_type': 'List', 'max_length': 4, 'actual_length': 6}}", "body.stop", "Bad Request")  # fmt: skip
TOOLS_0 = error("1 validation error:\n  {'type': 'missing', 'loc': 'body.tools.0.function', 'msg': 'Field required', "
                "'input': '<dict of 1 items>'}", "body.tools.0.function", "Bad Request")  # fmt: skip
MM_KWARGS = (
    "Per-request mm_processor_kwargs are disabled by default because they can change multimodal preprocessing "
    "resource usage. Start the server with --trust-request-mm-kwargs only when clients are trusted. "
    "(parameter=mm_processor_kwargs)"
)
MEDIA_IO = (
    "Per-request media_io_kwargs are disabled by default because they can change multimodal media loading "
    "resource usage. Start the server with --trust-request-mm-kwargs only when clients are trusted. "
    "(parameter=media_io_kwargs)"
)


def oov(ids: str, param: str) -> dict[str, Any]:
    return error(
        f"token_id(s) {ids} in {param} contain out-of-vocab token ids. Vocabulary size: {VOCAB_SIZE} "
        f"(parameter={param}, value={ids})",
        param,
    )


def image(kind: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": kind, kind: {"url": "x"}}]}]


# raw/vllm answers from c2.py (stop_many, stop_tok_neg, stop_tok_huge, logit_bias_oov,
# allowed_tok_empty, allowed_tok_oov, chat_tools_bad, chat_mm_proc, chat_image_part), and from
# sampling_params.py, chat_utils.py and generate/base/protocol.py where they do not reach.
VLLM_REFUSES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (C, {"stop": ["a1", "b2", "c3", "d4", "e5", "f6"]}, STOP_6),
    (C, {"stop_token_ids": [-1]}, oov("[-1]", "stop_token_ids")),
    (C, {"stop_token_ids": [10**7]}, oov("[10000000]", "stop_token_ids")),
    (C, {"stop_token_ids": [5, VOCAB_SIZE, -2]}, oov(f"[{VOCAB_SIZE}, -2]", "stop_token_ids")),
    (C, {"logit_bias": {"999999": 1}}, oov("[999999]", "logit_bias")),
    (C, {"logit_bias": {"abc": 1, "5": 1, "x": 2}}, error(
        "logit_bias contains key(s) that cannot be converted to integer token IDs: ['abc', 'x'] "
        "(parameter=logit_bias, value=['abc', 'x'])", "logit_bias")),
    (C, {"allowed_token_ids": []},
     error("allowed_token_ids is not None and empty! (parameter=allowed_token_ids, value=[])", "allowed_token_ids")),
    (C, {"allowed_token_ids": [5, 999999]}, error(
        "allowed_token_ids contains out-of-vocab token id! (parameter=allowed_token_ids, value=[999999])",
        "allowed_token_ids")),
    (CHAT, {"stop": ["a", "b", "c", "d", "e", "f"]}, STOP_6),
    (CHAT, {"tools": [{"type": "function"}]}, TOOLS_0),
    (CHAT, {"mm_processor_kwargs": {"a": 1}}, error(MM_KWARGS, "mm_processor_kwargs")),
    (CHAT, {"media_io_kwargs": {"image": {"a": 1}}}, error(MEDIA_IO, "media_io_kwargs")),
    (CHAT, {"messages": image("image_url")}, error("sim-llama is not a multimodal model")),
    (CHAT, {"messages": image("input_audio")}, error("sim-llama is not a multimodal model")),
    (CHAT, {"messages": image("image_embeds")}, error("The model is not multimodal.")),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "refusal"), VLLM_REFUSES)
async def test_parameters_vllm_refuses(sim: SimServer, path: str, body: dict[str, Any], refusal: Any) -> None:
    base = COMPLETION if path == C else CHAT_BODY
    status, out, _ = await post(sim, path, {**base, **body})
    assert (status, out) == (400, refusal)


async def test_what_vllm_still_takes(sim: SimServer) -> None:
    """Four stop strings, ids inside the vocabulary, empty kwargs, a tool without a type (with
    tool_choice "none": no tool parser needed), text parts: served."""
    bodies: list[tuple[str, dict[str, Any]]] = [
        (C, {"stop": ["a1", "b2", "c3", "d4"], "stop_token_ids": [0, VOCAB_SIZE - 1], "logit_bias": {"5": 200},
             "allowed_token_ids": [0, VOCAB_SIZE - 1]}),
        (CHAT, {"mm_processor_kwargs": {}, "media_io_kwargs": {}, "tools": [{"function": {"name": "f"}}],
                "tool_choice": "none", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ]  # fmt: skip
    for path, body in bodies:
        status, out, _ = await post(sim, path, {**(COMPLETION if path == C else CHAT_BODY), **body})
        assert status == 200, out


# ChatCompletionRequest.model_validate on each `tools`, through vLLM's validation handler.
VLLM_TOOLS: list[tuple[list[Any], list[str]]] = [
    ([{"type": "x", "function": {"name": "f"}}],
     ["{'type': 'literal_error', 'loc': 'body.tools.0.type', 'msg': \"Input should be 'function'\", 'input': 'x', "
      "'ctx': {'expected': \"'function'\"}}"]),
    ([{"function": "f"}],
     ["{'type': 'model_type', 'loc': 'body.tools.0.function', 'msg': 'Input should be a valid dictionary or instance "
      "of FunctionDefinition', 'input': 'f', 'ctx': {'class_name': 'FunctionDefinition'}}"]),
    ([{"function": {"description": "d"}}],
     ["{'type': 'missing', 'loc': 'body.tools.0.function.name', 'msg': 'Field required', 'input': '<dict of 1 "
      "items>'}"]),
    ([{"function": {"name": 5}}],
     ["{'type': 'string_type', 'loc': 'body.tools.0.function.name', 'msg': 'Input should be a valid string', "
      "'input': '5'}"]),
    (["f"],
     ["{'type': 'model_type', 'loc': 'body.tools.0', 'msg': 'Input should be a valid dictionary or instance of "
      "ChatCompletionToolsParam', 'input': 'f', 'ctx': {'class_name': 'ChatCompletionToolsParam'}}"]),
    ([{"type": "function"}, {"function": {}}],
     ["{'type': 'missing', 'loc': 'body.tools.0.function', 'msg': 'Field required', 'input': '<dict of 1 items>'}",
      "{'type': 'missing', 'loc': 'body.tools.1.function.name', 'msg': 'Field required', 'input': '<dict of 0 "
      "items>'}"]),
]  # fmt: skip


@pytest.mark.parametrize(("tools", "errors"), VLLM_TOOLS)
async def test_tools_are_checked_as_pydantic_checks_them(sim: SimServer, tools: list[Any], errors: list[str]) -> None:
    status, out, _ = await post(sim, CHAT, {**CHAT_BODY, "tools": tools})
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n  " + "\n  ".join(errors)
    param = errors[0].split("'loc': '", 1)[1].split("'", 1)[0]
    assert (status, out) == (400, error(message, param, "Bad Request"))


# --- 4. /ping and /load ----------------------------------------------------------------------------------


async def test_ping_answers_as_health(sim: SimServer) -> None:
    """serve/sagemaker/api_router.py: GET and POST /ping call /health's handler (raw/vllm/ping_get,
    ping_post: 200, no body, no content type). Its GET route is registered first, so Starlette's
    405 names GET alone (recorded with FastAPI in .venv-vllm)."""
    health = (await send(sim, "GET", "/health"))[2].get("Content-Type")
    for method in ("GET", "POST"):
        status, body, headers = await send(sim, method, "/ping")
        assert (status, body, headers.get("Content-Type")) == (200, b"", health)
    for method in ("HEAD", "PUT"):
        status, _, headers = await send(sim, method, "/ping")
        assert (status, headers["Allow"]) == (405, "GET")
    sim.faults.health_delay_s = 0.2
    started = time.monotonic()
    assert (await send(sim, "GET", "/ping"))[0] == 200 and time.monotonic() - started >= 0.2


async def _load(sim: SimServer) -> Any:
    status, body, headers = await send(sim, "GET", "/load")
    assert status == 200 and headers["Content-Type"] == "application/json"
    return json.loads(body)


@pytest.mark.parametrize("tracking", [False, True])
async def test_load_counts_requests_in_flight_only_when_tracking(tracking: bool) -> None:
    """serve/instrumentator/basic.py: `{"server_load": N}`, N counted by load_aware_call only with
    --enable-server-load-tracking (off by default: raw/vllm/load answers 0); a request counts until
    it is answered, a client that goes away uncounts it."""
    async with SimServer(sim_config(enable_server_load_tracking=tracking)) as sim:
        assert await _load(sim) == {"server_load": 0}
        sim.faults.hang = True
        calls = [asyncio.create_task(post(sim, path, body)) for path, body in ((C, COMPLETION), (CHAT, CHAT_BODY))]
        for _ in range(200):
            if len(sim.engine.waiting) == 2:
                break
            await asyncio.sleep(0.01)
        assert await _load(sim) == {"server_load": 2 if tracking else 0}
        calls[0].cancel()
        for _ in range(200):
            if (await _load(sim))["server_load"] == int(tracking):
                break
            await asyncio.sleep(0.01)
        assert await _load(sim) == {"server_load": 1 if tracking else 0}
        sim.faults.hang = False
        await calls[1]
        assert await _load(sim) == {"server_load": 0}


def test_the_load_tracking_flag_is_vllms_and_off_by_default() -> None:
    assert not config_from_args(parse()).enable_server_load_tracking
    assert config_from_args(parse("--enable-server-load-tracking")).enable_server_load_tracking


# --- 5. vllm:prefix_cache_queries counts only requests that read the cache ---------------------------


async def _queries_and_hits(cfg_changes: dict[str, Any]) -> tuple[int, int]:
    """The audit's ev.py on a sim shaped as its vLLM (block size 32): two 100-token prompts, one
    longer, one shorter, then the first with prompt_logprobs, each answered in turn."""
    prompt = list(range(300, 400))
    bodies = [(prompt, {}), (prompt, {}), ([*prompt, 7, 8], {}), (prompt[:64], {}), (prompt, {"prompt_logprobs": 1})]
    async with SimServer(sim_config(block_size=32, max_model_len=2048, **cfg_changes)) as sim:
        for ids, extra in bodies:
            status, _, _ = await post(sim, C, {"prompt": ids, "max_tokens": 5, "temperature": 0, **extra})
            assert status == 200
        return sim.engine.stats.prefix_cache_queries, sim.engine.stats.prefix_cache_hits


async def test_prefix_cache_queries_skip_requests_that_skip_the_cache() -> None:
    """v1/core/kv_cache_manager.py record_prefix_cache_stats: a request with prompt logprobs reads
    no cache and is no query (ev.out: vLLM counted 366 tokens, the sim 466); hits were the same."""
    assert await _queries_and_hits({}) == (100 + 100 + 102 + 64, 96 + 96 + 32)
    assert await _queries_and_hits({"enable_prefix_caching": False}) == (0, 0)


# --- 7. CORS preflight ---------------------------------------------------------------------------------

PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, Access-Control-Request-Private-Network"
)
ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT, QUERY"
# raw/vllm/options_preflight, and Starlette 1.10's CORSMiddleware as vLLM adds it (allowed origins
# none, methods and headers "*") on the other requests: (request headers, body, mirrored headers).
VLLM_PREFLIGHTS: list[tuple[dict[str, str], str, str | None]] = [
    ({"Access-Control-Request-Method": "POST"}, "Disallowed CORS origin", None),
    ({"Access-Control-Request-Method": "post"}, "Disallowed CORS origin, method", None),
    ({"Access-Control-Request-Method": ""}, "Disallowed CORS origin, method", None),
    ({"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "X-Foo, content-type"},
     "Disallowed CORS origin", "X-Foo, content-type"),
    ({"Access-Control-Request-Method": "GET", "Access-Control-Request-Private-Network": "true"},
     "Disallowed CORS origin, private-network", None),
]  # fmt: skip


@pytest.mark.parametrize(("asked", "text", "mirrored"), VLLM_PREFLIGHTS)
@pytest.mark.parametrize("path", [C, "/nope", "/health"])
async def test_a_preflight_is_refused_as_vllms_cors_middleware_refuses_it(
    sim: SimServer, path: str, asked: dict[str, str], text: str, mirrored: str | None
) -> None:
    status, body, headers = await send(sim, "OPTIONS", path, headers={"Origin": "http://x.example", **asked})
    assert (status, body.decode(), headers["Content-Type"]) == (400, text, "text/plain; charset=utf-8")
    assert (headers["Vary"], headers["Access-Control-Allow-Methods"]) == (PREFLIGHT_VARY, ALL_METHODS)
    assert headers["Access-Control-Max-Age"] == "600" and headers.get("Access-Control-Allow-Headers") == mirrored
    assert "Access-Control-Allow-Origin" not in headers


async def test_an_options_that_is_no_preflight_is_routed(sim: SimServer) -> None:
    """raw/vllm/options_plain: no Origin (or no requested method), FastAPI's 405."""
    for headers in ({}, {"Origin": "http://x.example"}, {"Access-Control-Request-Method": "POST"}):
        status, body, got = await send(sim, "OPTIONS", C, headers=headers)
        assert (status, json.loads(body), got["Allow"], got["Vary"]) == (
            405,
            {"detail": "Method Not Allowed"},
            "POST",
            "Origin",
        )


async def test_a_preflight_carries_the_request_id_header_when_enabled() -> None:
    """vLLM adds XRequestIdMiddleware after (outside) the CORS middleware."""
    async with SimServer(sim_config(enable_request_id_headers=True)) as sim:
        headers = {"Origin": "o", "Access-Control-Request-Method": "POST", "X-Request-Id": "pre"}
        assert (await send(sim, "OPTIONS", C, headers=headers))[2]["X-Request-Id"] == "pre"


# --- 8. vLLM's words -------------------------------------------------------------------------------------

HF_CONTINUE = (
    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you "
    "want the model to continue the final message, and add_generation_prompt when you want to add a header that "
    "will prompt it to start a new assistant message instead."
)
TOOLS_NEEDED = error("When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice")
USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
TOOL = [{"type": "function", "function": {"name": "f"}}]
JSON_SCHEMA_NEEDED = error("When response_format type is 'json_schema', the 'json_schema' field must be provided. "
                           "(parameter=response_format)", "response_format")  # fmt: skip
ONE_KIND = "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."
TOO_MANY_PROMPTS = error("prompt list length 1025 exceeds the maximum allowed count of 1024. To increase this "
                         "limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable. (parameter=prompt)",
                         "prompt")  # fmt: skip
CONSTRAINTS_OR_TOOLS = error("You can only either use constraints for structured outputs or tools, not both.")
# raw/vllm answers from c2.py (logprobs_neg1, logprobs_neg2, chat_tool_choice_req, _auto_notools,
# chat_assistant_last_contfm, prompt_empty_list, prompt_list_of_empty, truncate_0, prompt_empty_str,
# prompt_oov_tok, chat_empty_messages), and the validators of vLLM's request models.
VLLM_WORDS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (C, {"logprobs": -1}, error(f"Requested sample logprobs of {VOCAB_SIZE}, which is greater than max allowed: 20 "
                                f"(parameter=logprobs, value={VOCAB_SIZE})", "logprobs")),
    (C, {"logprobs": -2},
     error("`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)", "logprobs")),
    (C, {"prompt": []}, error("You must pass at least one prompt")),
    (C, {"prompt": [[]]}, error("The decoder prompt cannot be empty")),
    (C, {"prompt": [[5], []]}, error("The decoder prompt cannot be empty")),
    (C, {"prompt": [""]}, error("The decoder prompt cannot be empty")),  # the sim's tokenizer adds no BOS
    (C, {"truncate_prompt_tokens": 0}, error("The decoder prompt cannot be empty")),
    (C, {"prompt": ""}, error("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                              "prompt")),
    (C, {"prompt": None}, error("Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                                "prompt")),
    (C, {"prompt": [10**6]}, error("Token id 1000000 is out of vocabulary")),
    (C, {"prompt": [5, VOCAB_SIZE + 1, VOCAB_SIZE]}, error(f"Token id {VOCAB_SIZE + 1} is out of vocabulary")),
    (CHAT, {"tool_choice": "required"}, TOOLS_NEEDED),
    (CHAT, {"tool_choice": "auto"}, TOOLS_NEEDED),
    (CHAT, {"tool_choice": "auto", "tools": None}, TOOLS_NEEDED),
    (CHAT, {"tools": []}, error("`tools` must not be an empty array. Either provide at least one tool or omit the "
                                "field entirely. (parameter=tools)", "tools")),
    (CHAT, {"tool_choice": "any", "tools": TOOL}, error('Invalid value for `tool_choice`: any! Only named tools, '
                                                        '"none", "auto" or "required" are supported. '
                                                        "(parameter=tool_choice)", "tool_choice")),
    (CHAT, {"tool_choice": {"function": "f"}, "tools": TOOL},
     error(f"Invalid value for `function`: `f` in `tool_choice`! {USAGE} (parameter=tool_choice.function)",
           "tool_choice.function")),
    (CHAT, {"tool_choice": {"function": {}}, "tools": TOOL},
     error(f"Expected field `name` in `function` in `tool_choice`! {USAGE} (parameter=tool_choice.function.name)",
           "tool_choice.function.name")),
    (CHAT, {"tool_choice": {"function": {"name": ""}}, "tools": TOOL},
     error(f"Invalid `name` in `function`: `` in `tool_choice`! {USAGE} (parameter=tool_choice.function.name)",
           "tool_choice.function.name")),
    (CHAT, {"tool_choice": {"function": {"name": "g"}}, "tools": TOOL},
     error("The tool specified in `tool_choice` does not match any of the specified `tools` "
           "(parameter=tool_choice)", "tool_choice")),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": "ok"}], "continue_final_message": True},
     error(HF_CONTINUE)),
    (CHAT, {"continue_final_message": True, "add_generation_prompt": True},
     error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")),
    (CHAT, {"messages": []},
     error("Cannot apply chat template to an empty conversation. Provide at least one message.")),
    # the engine_sim audit of 2026-12-04 (repro.out, C2-C5), from vLLM's models in .venv-vllm: its
    # `mode="before"` validators the sim lacked, and logprobs fields sent as text
    (C, {"response_format": {"type": "json_schema"}}, JSON_SCHEMA_NEEDED),
    (CHAT, {"response_format": {"type": "json_schema"}}, JSON_SCHEMA_NEEDED),
    (C, {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     error(f"{ONE_KIND} (parameter=structured_outputs)", "structured_outputs")),
    (CHAT, {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, error(ONE_KIND)),
    (CHAT, {"structured_outputs": {"regex": "a+"}, "tools": TOOL,
            "tool_choice": {"type": "function", "function": {"name": "f"}}}, CONSTRAINTS_OR_TOOLS),
    (CHAT, {"structured_outputs": {"regex": "a+"}, "tools": TOOL, "tool_choice": None}, CONSTRAINTS_OR_TOOLS),
    (C, {"logprob_token_ids": [5, 6]}, error("when using `logprob_token_ids`, `logprobs` must be set. "
                                              "(parameter=logprob_token_ids)", "logprob_token_ids")),
    (CHAT, {"logprob_token_ids": [5, 6]}, error("when using `logprob_token_ids`, `logprobs` must be set to true. "
                                                 "(parameter=logprob_token_ids)", "logprob_token_ids")),
    (C, {"logprob_token_ids": [5], "logprobs": 1, "use_beam_search": True},
     error("`logprob_token_ids` is not supported with beam search. (parameter=logprob_token_ids)",
           "logprob_token_ids")),
    (C, {"use_beam_search": True, "echo": True, "logprobs": 1},
     error("`echo` with `logprobs` is not supported with beam search because beam search does not compute prompt "
           "logprobs. (parameter=echo)", "echo")),
    (C, {"logprob_token_ids": [5], "echo": True, "max_tokens": 0, "logprobs": 1},
     error("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no output tokens are "
           "generated. (parameter=logprob_token_ids)", "logprob_token_ids")),
    (C, {"prompt": ["a"] * 1025}, TOO_MANY_PROMPTS),
    (C, {"prompt": [[5]] * 1025}, TOO_MANY_PROMPTS),
    (C, {"logprobs": "2"}, error("`logprobs` must be an integer. (parameter=logprobs, value=2)", "logprobs")),
    (C, {"prompt_logprobs": "1"},
     error("`prompt_logprobs` must be an integer. (parameter=prompt_logprobs, value=1)", "prompt_logprobs")),
    (CHAT, {"logprobs": True, "top_logprobs": "2"},
     error("`top_logprobs` must be an integer. (parameter=top_logprobs, value=2)", "top_logprobs")),
    (C, {"cache_salt": ""}, error("Parameter 'cache_salt' must be a non-empty string if provided. "
                                  "(parameter=cache_salt)", "cache_salt")),
    (CHAT, {"cache_salt": "a/b"}, error("Parameter 'cache_salt' must be at most 128 characters and must not "
                                        "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)", "cache_salt")),
    # what vLLM would report for them the sim cannot: refused, not dropped
    (C, {"logprob_token_ids": [5, 6], "logprobs": 1},
     error("logprob_token_ids is not supported by the simulated engine", "logprob_token_ids")),
    (CHAT, {"logprob_token_ids": [5, 6], "logprobs": True},
     error("logprob_token_ids is not supported by the simulated engine", "logprob_token_ids")),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "refusal"), VLLM_WORDS)
async def test_refusals_in_vllms_words(sim: SimServer, path: str, body: dict[str, Any], refusal: Any) -> None:
    base = COMPLETION if path == C else CHAT_BODY
    status, out, _ = await post(sim, path, {**base, **body})
    assert (status, out) == (400, refusal)


# OnlineRenderer.render_chat (renderers/online_renderer.py) with no tool parser, vLLM's default:
# any tool_choice but "none" (`tools` alone make it "auto") is refused, a plain 400.
AUTO_NEEDS_PARSER = error('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
TOOL_CHOICES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"tools": TOOL}, AUTO_NEEDS_PARSER),
    ({"tools": TOOL, "tool_choice": "auto"}, AUTO_NEEDS_PARSER),
    ({"tools": TOOL, "tool_choice": "required"}, error('tool_choice="required" requires --tool-call-parser to be set')),
    ({"tools": TOOL, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     error('tool_choice=function "f" requires --tool-call-parser to be set')),
]  # fmt: skip


@pytest.mark.parametrize(("body", "refusal"), TOOL_CHOICES)
async def test_a_tool_choice_needs_vllms_tool_parser(body: dict[str, Any], refusal: dict[str, Any]) -> None:
    """Refused without --enable-auto-tool-choice (a --tool-call-parser alone is not used, as in vLLM),
    served with it: the sim's tokens form no tool call, so the answer is plain text."""
    parsing = sim_config(enable_auto_tool_choice=True, tool_call_parser="hermes")
    parser_only = sim_config(tool_call_parser="hermes")
    async with SimServer(sim_config()) as plain, SimServer(parser_only) as half, SimServer(parsing) as tools:
        for sim in (plain, half):
            assert (await post(sim, CHAT, {**CHAT_BODY, **body}))[:2] == (400, refusal)
        status, out, _ = await post(tools, CHAT, {**CHAT_BODY, **body})
        assert status == 200 and out["choices"][0]["finish_reason"] == "length"


async def test_tools_with_no_tool_choice_need_no_parser(sim: SimServer) -> None:
    """tool_choice "none" or null (given, so check_tool_usage does not make it "auto"): served."""
    for choice in ("none", None):
        status, out, _ = await post(sim, CHAT, {**CHAT_BODY, "tools": TOOL, "tool_choice": choice})
        assert status == 200, out


async def test_the_tool_parser_refusal_comes_where_vllms_does(sim: SimServer) -> None:
    """After the request model's validators and the model's lookup, before the untrusted chat
    template's refusal (render_chat checks the tool choice first)."""
    body = {**CHAT_BODY, "tools": TOOL}
    status, out, _ = await post(sim, CHAT, {**body, "top_logprobs": -5})
    assert (status, out["error"]["message"]) == (400, "`top_logprobs` must be a positive value or -1. "
                                                      "(parameter=top_logprobs, value=-5)")  # fmt: skip
    assert (await post(sim, CHAT, {**body, "model": "nope"}))[0] == 404
    assert (await post(sim, CHAT, {**body, "chat_template": "{{ 1 }}"}))[:2] == (400, AUTO_NEEDS_PARSER)


def test_the_tool_flags_are_vllms() -> None:
    """vLLM refuses to start with --enable-auto-tool-choice but no --tool-call-parser (cli_args.py)
    or one it has not registered (launcher.py); a parser alone is never looked up."""
    assert not config_from_args(parse()).enable_auto_tool_choice
    cfg = config_from_args(parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    assert (cfg.enable_auto_tool_choice, cfg.tool_call_parser) == (True, "hermes")
    assert config_from_args(parse("--tool-call-parser", "nope")).tool_call_parser == "nope"
    with pytest.raises(SimConfigError) as no_parser:
        config_from_args(parse("--enable-auto-tool-choice"))
    assert (
        str(no_parser.value) == "invalid --enable-auto-tool-choice = True: requires --tool-call-parser, as vLLM's does"
    )
    with pytest.raises(SimConfigError) as unknown:
        config_from_args(parse("--enable-auto-tool-choice", "--tool-call-parser", "nope"))
    assert str(unknown.value).startswith("invalid --tool-call-parser = 'nope': allowed values: apertus, ")


async def test_tokenize_renders_chat_as_chat_completions_do(sim: SimServer) -> None:
    """TokenizeChatRequest has the same validator, and its messages go through the same renderer."""
    answers = [
        ({"messages": USER, "continue_final_message": True}, error(HF_CONTINUE)),
        ({"messages": USER, "continue_final_message": True, "add_generation_prompt": True},
         error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")),
        ({"messages": image("video_url")}, error("sim-llama is not a multimodal model")),
        ({"messages": USER, "mm_processor_kwargs": {"a": 1}}, error(MM_KWARGS, "mm_processor_kwargs")),
    ]  # fmt: skip
    for body, refusal in answers:
        assert (await post(sim, "/tokenize", body))[:2] == (400, refusal)
    _, out, _ = await post(sim, "/tokenize", {"messages": USER, "add_generation_prompt": False,
                                              "continue_final_message": True})  # fmt: skip
    assert TOK.decode(out["tokens"]).endswith("hello there")


# ChatCompletionRequest / CompletionRequest.model_validate with two refusals at once: the
# `mode="before"` validators run last-defined first (.venv-vllm, 2026-12-03).
VLLM_FIRST_REFUSAL: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"tool_choice": "auto", "continue_final_message": True, "add_generation_prompt": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    (CHAT, {"tool_choice": "auto", "top_logprobs": -5}, TOOLS_NEEDED["error"]["message"]),
    (CHAT, {"stream_options": {"include_usage": True}, "top_logprobs": -5},
     "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-5)"),
    (CHAT, {"stream_options": {"include_usage": True}, "tool_choice": "auto"}, TOOLS_NEEDED["error"]["message"]),
    (C, {"prompt": "", "logprobs": -2},
     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
    (C, {"prompt": "", "stream_options": {"include_usage": True}},
     "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"),
    (C, {"stream_options": {"include_usage": True}, "logprobs": -2},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    # the engine_sim audit of 2026-12-04: the raw body's validators before the fields' types
    (C, {"prompt": ["a"] * 1025, "stream_options": {"a": 1}}, TOO_MANY_PROMPTS["error"]["message"]),
    (C, {"stream_options": {"a": 1}, "logprobs": "x"},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    (C, {"logprobs": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "`logprobs` must be an integer. (parameter=logprobs, value=x)"),
    (C, {"response_format": {"type": "json_schema"}, "cache_salt": "", "seed": "abc"},
     JSON_SCHEMA_NEEDED["error"]["message"]),
    (CHAT, {"continue_final_message": "false", "add_generation_prompt": "false"},  # the raw values' truth
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
    (CHAT, {"tool_choice": "auto", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     TOOLS_NEEDED["error"]["message"]),
    (CHAT, {"top_logprobs": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, ONE_KIND),
    (CHAT, {"top_logprobs": "x", "stream_options": {"a": 1}},
     "`top_logprobs` must be an integer. (parameter=top_logprobs, value=x)"),
    (CHAT, {"response_format": {"type": "json_schema"}, "stream_options": {"a": 1}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "message"), VLLM_FIRST_REFUSAL)
async def test_the_first_refusal_is_vllms(sim: SimServer, path: str, body: dict[str, Any], message: str) -> None:
    base = COMPLETION if path == C else CHAT_BODY
    status, out, _ = await post(sim, path, {**base, **body})
    assert (status, out["error"]["message"]) == (400, message)


async def test_models_are_described_afresh_on_every_call(sim: SimServer) -> None:
    """vLLM's ModelCard and ModelPermission build `created` and the permission's id with default
    factories (serve/engine/protocol.py), so every GET /v1/models has new ones."""
    before = int(time.time())
    _, first, _ = await send(sim, "GET", "/v1/models")
    await asyncio.sleep(1.1)
    _, second, _ = await send(sim, "GET", "/v1/models")
    a, b = json.loads(first)["data"][0], json.loads(second)["data"][0]
    assert before <= a["created"] < b["created"] <= int(time.time())
    assert a["permission"][0]["created"] == a["created"] and b["permission"][0]["created"] == b["created"]
    assert a["permission"][0]["id"] != b["permission"][0]["id"]
    assert len(b["permission"][0]["id"]) == len("modelperm-") + 16


# --- 9. The engine_sim audit of 2026-12-04 --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (C, {"stream_options": {}}),
        (CHAT, {"stream_options": {}}),
        (C, {"stream": "false", "stream_options": {"include_usage": True}}),
        (C, {"temperature": True}),  # pydantic reads it as 1.0
    ],
)
async def test_bodies_vllms_validators_let_through_are_served(sim: SimServer, path: str, body: dict[str, Any]) -> None:
    """validate_stream_options tests the raw JSON's truth: `{}` is no stream options, and the text
    "false" is true there (pydantic reads it as False later), so vLLM answers these, unstreamed."""
    status, out, _ = await post(sim, path, {**(COMPLETION if path == C else CHAT_BODY), **body})
    assert status == 200 and out["object"] == ("text_completion" if path == C else "chat.completion"), out


def pydantic(*errors: str) -> dict[str, Any]:
    """vLLM's validation handler's 400 for these pydantic errors (its `param` the first's loc)."""
    label = "error" if len(errors) == 1 else "errors"
    param = errors[0].split("'loc': '", 1)[1].split("'", 1)[0]
    return error(f"{len(errors)} validation {label}:\n  " + "\n  ".join(errors), param, "Bad Request")


SEED_TEXT = ("{'type': 'int_parsing', 'loc': 'body.seed', 'msg': 'Input should be a valid integer, unable to parse "
             "string as an integer', 'input': 'abc'}")  # fmt: skip
RF = "body.response_format"
RF_BOGUS = [
    f"{{'type': 'literal_error', 'loc': '{RF}.type', 'msg': \"Input should be 'text', 'json_object' or "
    "'json_schema'\", 'input': 'bogus', 'ctx': {'expected': \"'text', 'json_object' or 'json_schema'\"}}",
    f"{{'type': 'literal_error', 'loc': '{RF}.type', 'msg': \"Input should be 'structural_tag'\", 'input': 'bogus', "
    "'ctx': {'expected': \"'structural_tag'\"}}",
    f"{{'type': 'missing', 'loc': '{RF}.format', 'msg': 'Field required', 'input': '<dict of 1 items>'}}",
    f"{{'type': 'literal_error', 'loc': '{RF}.type', 'msg': \"Input should be 'structural_tag'\", 'input': 'bogus', "
    "'ctx': {'expected': \"'structural_tag'\"}}",
    f"{{'type': 'missing', 'loc': '{RF}.structures', 'msg': 'Field required', 'input': '<dict of 1 items>'}}",
    f"{{'type': 'missing', 'loc': '{RF}.triggers', 'msg': 'Field required', 'input': '<dict of 1 items>'}}",
]
# The engine_sim audit's repro.out (C6) and vLLM 0.32's CompletionRequest / ChatCompletionRequest
# through its validation handler (.venv-vllm): pydantic's errors, every one, in vLLM's field order.
VLLM_PYDANTIC: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (C, {"seed": "abc"}, pydantic(SEED_TEXT)),
    (C, {"seed": 2**64}, pydantic(
        "{'type': 'less_than_equal', 'loc': 'body.seed', 'msg': 'Input should be less than or equal to "
        "9223372036854775807', 'input': '18446744073709551616', 'ctx': {'le': 9223372036854775807}}")),
    (C, {"seed": -(2**63) - 1}, pydantic(
        "{'type': 'greater_than_equal', 'loc': 'body.seed', 'msg': 'Input should be greater than or equal to "
        "-9223372036854775808', 'input': '-9223372036854775809', 'ctx': {'ge': -9223372036854775808}}")),
    (C, {"seed": 2.5}, pydantic(
        "{'type': 'int_from_float', 'loc': 'body.seed', 'msg': 'Input should be a valid integer, got a number with a "
        "fractional part', 'input': '2.5'}")),
    (C, {"seed": 1e20}, pydantic(
        "{'type': 'int_parsing_size', 'loc': 'body.seed', 'msg': 'Unable to parse input string as an integer, "
        "exceeded maximum size', 'input': '1e+20'}")),
    (C, {"n": None}, pydantic(
        "{'type': 'int_type', 'loc': 'body.n', 'msg': 'Input should be a valid integer', 'input': 'None'}")),
    (C, {"temperature": "hot"}, pydantic(
        "{'type': 'float_parsing', 'loc': 'body.temperature', 'msg': 'Input should be a valid number, unable to "
        "parse string as a number', 'input': 'hot'}")),
    (C, {"temperature": [1]}, pydantic(
        "{'type': 'float_type', 'loc': 'body.temperature', 'msg': 'Input should be a valid number', 'input': '<list "
        "of 1 items>'}")),
    (C, {"stop": 5}, pydantic(
        "{'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '5'}",
        "{'type': 'list_type', 'loc': 'body.stop', 'msg': 'Input should be a valid list', 'input': '5'}")),
    (C, {"stop": ["a", 1]}, pydantic(
        "{'type': 'string_type', 'loc': 'body.stop', 'msg': 'Input should be a valid string', 'input': '<list of 2 "
        "items>'}",
        "{'type': 'string_type', 'loc': 'body.stop.1', 'msg': 'Input should be a valid string', 'input': '1'}")),
    (C, {"echo": "maybe"}, pydantic(
        "{'type': 'bool_parsing', 'loc': 'body.echo', 'msg': 'Input should be a valid boolean, unable to interpret "
        "input', 'input': 'maybe'}")),
    (C, {"ignore_eos": None}, pydantic(
        "{'type': 'bool_type', 'loc': 'body.ignore_eos', 'msg': 'Input should be a valid boolean', 'input': 'None'}")),
    (C, {"request_id": None}, pydantic(
        "{'type': 'string_type', 'loc': 'body.request_id', 'msg': 'Input should be a valid string', 'input': "
        "'None'}")),
    (C, {"stream": True, "stream_options": "x"}, pydantic(
        "{'type': 'model_type', 'loc': 'body.stream_options', 'msg': 'Input should be a valid dictionary or instance "
        "of StreamOptions', 'input': 'x', 'ctx': {'class_name': 'StreamOptions'}}")),
    (C, {"stream": True, "stream_options": {"include_usage": "maybe"}}, pydantic(
        "{'type': 'bool_parsing', 'loc': 'body.stream_options.include_usage', 'msg': 'Input should be a valid "
        "boolean, unable to interpret input', 'input': 'maybe'}")),
    (C, {"logit_bias": {"5": "x"}}, pydantic(
        "{'type': 'float_parsing', 'loc': 'body.logit_bias.5', 'msg': 'Input should be a valid number, unable to "
        "parse string as a number', 'input': 'x'}")),
    (C, {"stop_token_ids": "x"}, pydantic(
        "{'type': 'list_type', 'loc': 'body.stop_token_ids', 'msg': 'Input should be a valid list', 'input': 'x'}")),
    (C, {"logprobs": 1.5}, pydantic(
        "{'type': 'int_from_float', 'loc': 'body.logprobs', 'msg': 'Input should be a valid integer, got a number "
        "with a fractional part', 'input': '1.5'}")),
    (C, {"response_format": {"type": "bogus"}}, pydantic(*RF_BOGUS)),
    (CHAT, {"response_format": {"type": "bogus"}}, pydantic(*RF_BOGUS)),
    (C, {"response_format": "x"}, pydantic(*(
        f"{{'type': 'model_type', 'loc': '{RF}', 'msg': 'Input should be a valid dictionary or instance of {m}', "
        f"'input': 'x', 'ctx': {{'class_name': '{m}'}}}}"
        for m in ("ResponseFormat", "StructuralTagResponseFormat", "LegacyStructuralTagResponseFormat")))),
    (C, {"seed": "abc", "n": "x", "echo": "maybe"}, pydantic(  # several: vLLM's field order, not the body's
        "{'type': 'bool_parsing', 'loc': 'body.echo', 'msg': 'Input should be a valid boolean, unable to interpret "
        "input', 'input': 'maybe'}",
        "{'type': 'int_parsing', 'loc': 'body.n', 'msg': 'Input should be a valid integer, unable to parse string as "
        "an integer', 'input': 'x'}",
        SEED_TEXT)),
    (C, {"stop": ["a", "b", "c", "d", "e", "f"], "seed": "abc"}, pydantic(SEED_TEXT, *STOP_6["error"]["message"]
                                                                           .split("\n  ")[1:])),
    (C, {"truncation_side": "mid", "seed": "abc"}, pydantic(
        SEED_TEXT, "{'type': 'literal_error', 'loc': 'body.truncation_side', 'msg': \"Input should be 'left' or "
        "'right'\", 'input': 'mid', 'ctx': {'expected': \"'left' or 'right'\"}}")),
    (CHAT, {"messages": "x"}, pydantic(
        "{'type': 'list_type', 'loc': 'body.messages', 'msg': 'Input should be a valid list', 'input': 'x'}")),
    (CHAT, {"tools": "x"}, pydantic(
        "{'type': 'list_type', 'loc': 'body.tools', 'msg': 'Input should be a valid list', 'input': 'x'}")),
    (CHAT, {"seed": "abc", "tools": [{"type": "x", "function": {"name": "f"}}]}, pydantic(
        SEED_TEXT, "{'type': 'literal_error', 'loc': 'body.tools.0.type', 'msg': \"Input should be 'function'\", "
        "'input': 'x', 'ctx': {'expected': \"'function'\"}}")),
    *((path, {"truncate_prompt_tokens": -5}, pydantic(
        "{'type': 'greater_than_equal', 'loc': 'body.truncate_prompt_tokens', 'msg': 'Input should be greater than "
        "or equal to -1', 'input': '-5', 'ctx': {'ge': -1}}")) for path in (C, CHAT)),
    (C, {"truncate_prompt_tokens": 2**63}, pydantic(
        "{'type': 'less_than_equal', 'loc': 'body.truncate_prompt_tokens', 'msg': 'Input should be less than or "
        "equal to 9223372036854775807', 'input': '9223372036854775808', 'ctx': {'le': 9223372036854775807}}")),
    (CHAT, {"max_completion_tokens": "x"}, pydantic(
        "{'type': 'int_parsing', 'loc': 'body.max_completion_tokens', 'msg': 'Input should be a valid integer, "
        "unable to parse string as an integer', 'input': 'x'}")),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "refusal"), VLLM_PYDANTIC)
async def test_refused_fields_are_pydantics_errors(
    sim: SimServer, path: str, body: dict[str, Any], refusal: Any
) -> None:
    """Until 2026-12-04 these were msgspec's words ("Expected `int`, got `str` - at `$.seed`"),
    type BadRequestError, `param` the bare field."""
    status, out, _ = await post(sim, path, {**(COMPLETION if path == C else CHAT_BODY), **body})
    assert (status, out) == (400, refusal)


async def test_a_chat_without_messages_and_a_tokenize_with_neither_are_pydantics_errors(sim: SimServer) -> None:
    """ChatCompletionRequest requires `messages`; /tokenize's union of models fails both members."""
    status, out, _ = await post(sim, CHAT, {"max_tokens": 2, "temperature": 0})
    assert (status, out) == (
        400,
        pydantic("{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 2 items>'}"),
    )
    missing = "{'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of %d items>'}"
    answers = [
        ({}, pydantic("{'type': 'missing', 'loc': 'body.prompt', 'msg': 'Field required', 'input': '<dict of 0 "
                      "items>'}", missing % 0)),
        ({"prompt": None, "model": "sim-llama"}, pydantic(
            "{'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid string', 'input': "
            "'None'}", missing % 2)),
        ({"prompt": 5}, pydantic("{'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid "
                                 "string', 'input': '5'}", missing % 1)),
    ]  # fmt: skip
    for body, refusal in answers:
        assert (await post(sim, "/tokenize", body))[:2] == (400, refusal)
