"""Where the sim's HTTP answers once differed from vLLM 0.32's: usage chunks and details, the stream's
system fingerprint, /detokenize's bounds, `n`, HEAD, unknown routes and wrong methods, and the
headers vLLM's middleware adds. The expected answers are real vLLM 0.32's (the captures, or the
simfid audit's raw answers of 2026-12-03 where the captures do not reach), and its source."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from engine_sim import SimServer
from engine_sim.cli import config_from_args
from protocol.tokenizer import BuiltinTokenizer
from tests.engine_sim.conftest import sim_config
from tests.engine_sim.test_cli import parse
from tests.engine_sim.test_http_api import post, sse_events
from tests.protocol.vllm_captures import fixture_path

TOK = BuiltinTokenizer()
CHAT = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
COMPLETION = {"prompt": list(range(900, 1000)), "max_tokens": 2}  # 100 tokens: 6 blocks of 16 hit


def events(text: str) -> list[dict[str, Any]]:
    return [e for e in sse_events(text) if e != "[DONE]"]


async def request(sim: SimServer, method: str, path: str, **headers: str) -> tuple[int, bytes, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, sim.url + path, headers=headers, allow_redirects=False) as r,
    ):
        return r.status, await r.read(), r.headers


# --- stream_options without include_usage --------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"continuous_usage_stats": True}])
@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_stream_options_without_include_usage_add_no_usage_chunk(
    sim: SimServer, options: dict[str, Any], path: str, body: dict[str, Any]
) -> None:
    """vLLM's StreamOptions.include_usage defaults to False, and continuous stats need it too
    (raw/vllm/cmpl_stream_cont_only: the last chunk ends the choice, no usage anywhere)."""
    status, text, _ = await post(sim, path, {**body, "stream": True, "stream_options": options})
    chunks = events(text)
    assert status == 200 and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


async def test_continuous_usage_stats_put_a_running_usage_on_every_completion_chunk(sim: SimServer) -> None:
    """vLLM's completion/serving.py with include_usage and continuous_usage_stats: each chunk
    carries its prompt's tokens and its choice's tokens so far (this one's included), then the
    usage chunk totals them (the engine_sim audit of 2026-12-04: the sim sent only the last)."""
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 3, "n": 2, "temperature": 1, "stream": True}
    status, text, _ = await post(sim, "/v1/completions", {**body, "stream_options": CONTINUOUS})
    chunks = events(text)
    assert status == 200 and len(chunks) == 7
    for index in (0, 1):
        running = [c["usage"] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert running == [{"prompt_tokens": 4, "total_tokens": 4 + k, "completion_tokens": k} for k in (1, 2, 3)]
    assert list(chunks[0]) == ["id", "object", "created", "model", "choices", "usage"]  # vLLM's dump order
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "total_tokens": 10, "completion_tokens": 6}


async def test_continuous_usage_stats_on_chat_start_at_the_role_chunk(sim: SimServer) -> None:
    """chat_completion/serving.py: the role chunk (and an echo chunk) counts no output yet; each
    UsageInfo names completion_tokens_details, null, which exclude_unset keeps."""
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "ok"}]
    body = {"messages": messages, "max_tokens": 3, "add_generation_prompt": False, "echo": True, "stream": True}
    status, text, _ = await post(sim, "/v1/chat/completions", {**body, "stream_options": CONTINUOUS})
    chunks = events(text)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    counts = [0, 0, 1, 2, 3]  # role, echo, then one per token
    assert status == 200 and [c["usage"] for c in chunks[:-1]] == [
        {"prompt_tokens": prompt, "total_tokens": prompt + k, "completion_tokens": k, "completion_tokens_details": None}
        for k in counts
    ]
    assert list(chunks[0]) == ["id", "object", "created", "model", "choices", "usage", "prompt_token_ids",
                               "prompt_text"]  # fmt: skip
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt + 3, "completion_tokens": 3}


# --- usage.prompt_tokens_details ---------------------------------------------------------------------


def details(cached: int, created: int | None) -> dict[str, Any]:
    """vLLM's PromptTokenUsageInfo, as a non-streamed answer carries it."""
    return {"cached_tokens": cached, "created_cache_tokens": created, "multimodal_tokens": None}


async def test_prompt_tokens_details_as_vllm_fills_them() -> None:
    """With --enable-prompt-tokens-details vLLM reports the details on a miss too (0 cached); chat
    names the tokens the prompt wrote to the cache (completions leave them null); the streamed
    usage chunk drops nulls and keeps zeros (the simfid audit's ptd_out.txt, vLLM's
    completion/serving.py and chat_completion/serving.py)."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    async with SimServer(sim_config(enable_prompt_tokens_details=True)) as sim:
        _, miss, _ = await post(sim, "/v1/completions", COMPLETION)
        _, hit, _ = await post(sim, "/v1/completions", COMPLETION)
        assert miss["usage"]["prompt_tokens_details"] == details(0, None)
        assert hit["usage"]["prompt_tokens_details"] == details(96, None)
        _, text, _ = await post(sim, "/v1/completions", {**COMPLETION, **stream})
        assert events(text)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
        _, text, _ = await post(sim, "/v1/completions", {**COMPLETION, "prompt": list(range(1, 40)), **stream})
        assert events(text)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # a zero stays

        _, chat_miss, _ = await post(sim, "/v1/chat/completions", CHAT)
        prompt = chat_miss["usage"]["prompt_tokens"]
        full, hit_tokens = prompt // 16 * 16, (prompt - 1) // 16 * 16  # the prompt's full blocks; a hit's
        assert chat_miss["usage"]["prompt_tokens_details"] == details(0, full)
        _, chat_hit, _ = await post(sim, "/v1/chat/completions", CHAT)
        assert chat_hit["usage"]["prompt_tokens_details"] == details(hit_tokens, full - hit_tokens)
        _, text, _ = await post(sim, "/v1/chat/completions", {**CHAT, **stream})
        streamed = {"cached_tokens": hit_tokens, "created_cache_tokens": full - hit_tokens}
        assert events(text)[-1]["usage"]["prompt_tokens_details"] == streamed
        # prompt logprobs skip the cache (nothing hit) but still write it, as in the audit
        _, logprobs, _ = await post(sim, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1})
        assert logprobs["usage"]["prompt_tokens_details"] == details(0, full)
    async with SimServer(sim_config(enable_prompt_tokens_details=True, enable_prefix_caching=False)) as sim:
        for _ in range(2):
            _, out, _ = await post(sim, "/v1/chat/completions", CHAT)
            assert out["usage"]["prompt_tokens_details"] == details(0, 0)


# --- system_fingerprint in streams --------------------------------------------------------------------


def fingerprinted(chunks: list[dict[str, Any]]) -> list[int]:
    return [i for i, c in enumerate(chunks) if "system_fingerprint" in c]


def test_the_captures_name_the_fingerprint_once_on_the_last_chunk() -> None:
    """The captures: chat without include_usage names it on the chunk that ends the choice,
    completions with include_usage only on the usage chunk."""
    chat = events(fixture_path("chat_completion_stream.sse").read_text())
    assert fingerprinted(chat) == [len(chat) - 1] and chat[-1]["choices"][0]["finish_reason"] == "length"
    completion = events(fixture_path("completion_stream.sse").read_text())
    assert fingerprinted(completion) == [len(completion) - 1] and completion[-1]["choices"] == []


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_a_stream_names_its_fingerprint_where_vllm_does(
    sim: SimServer, include_usage: bool, path: str, body: dict[str, Any]
) -> None:
    """On the chunk that ends each choice when no usage chunk follows, else on the usage chunk
    alone (completion/serving.py and chat_completion/serving.py, "Stamp on terminal chunk only")."""
    req = {**body, "stream": True, "n": 2}
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    _, text, _ = await post(sim, path, req)
    chunks = events(text)
    if include_usage:
        assert fingerprinted(chunks) == [len(chunks) - 1] and "usage" in chunks[-1]
    else:
        ends = [i for i, c in enumerate(chunks) if c["choices"][0]["finish_reason"] is not None]
        assert len(ends) == 2 and fingerprinted(chunks) == ends
    _, whole, _ = await post(sim, path, body)
    assert {chunks[i]["system_fingerprint"] for i in fingerprinted(chunks)} == {whole["system_fingerprint"]}


# --- /detokenize ----------------------------------------------------------------------------------------

# vLLM 0.32's answers: `{"tokens": [-1]}` (raw/vllm/detok_neg), and `{"tokens": [5, -1, 2**63, "-3",
# -2 x 9]}` through DetokenizeRequest and vLLM's validation handler (.venv-vllm, 2026-12-03): each
# error a dict's repr, the first ten, then a count.
NEGATIVE = {"error": {"message": "1 validation error:\n  {'type': 'greater_than_equal', 'loc': 'body.tokens.0', "
            "'msg': 'Input should be greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}",
            "type": "Bad Request", "param": "body.tokens.0", "code": 400}}  # fmt: skip


def _below(i: int, shown: str) -> dict[str, Any]:
    return {"type": "greater_than_equal", "loc": f"body.tokens.{i}", "msg": "Input should be greater than or "
            "equal to 0", "input": shown, "ctx": {"ge": 0}}  # fmt: skip


_ABOVE = {"type": "less_than_equal", "loc": "body.tokens.2", "msg": "Input should be less than or equal to "
          "9223372036854775807", "input": "9223372036854775808", "ctx": {"le": 9223372036854775807}}  # fmt: skip
_ERRORS = [_below(1, "-1"), _ABOVE, _below(3, "-3"), *(_below(i, "-2") for i in range(4, 11))]
MANY = "\n  ".join(["12 validation errors:", *map(str, _ERRORS), "...and 2 more errors"])


async def test_detokenize_skips_ids_past_the_vocabulary(sim: SimServer) -> None:
    """vLLM's tokenizer decodes an unknown id to nothing: 200 `{"prompt": ""}` (raw/vllm/detok_oov),
    and among known ids decodes those alone (its `tokenizers` decode skips what it cannot map)."""
    ids = TOK.encode("the quick brown fox")
    assert (await post(sim, "/detokenize", {"tokens": [999999]}))[:2] == (200, {"prompt": ""})
    mixed = [ids[0], TOK.vocab_size, *ids[1:], 10**12]
    assert (await post(sim, "/detokenize", {"tokens": mixed}))[:2] == (200, {"prompt": "the quick brown fox"})


async def test_detokenize_refuses_ids_out_of_bounds_in_pydantics_words(sim: SimServer) -> None:
    assert (await post(sim, "/detokenize", {"tokens": [-1]}))[:2] == (400, NEGATIVE)
    # the body is judged before the model is looked up, as FastAPI validates before the handler
    assert (await post(sim, "/detokenize", {"model": "nope", "tokens": [-1]}))[:2] == (400, NEGATIVE)
    status, err, _ = await post(sim, "/detokenize", {"tokens": [5, -1, 2**63, "-3", *[-2] * 9]})
    assert (status, err) == (400, {"error": {"message": MANY, "type": "Bad Request", "param": "body.tokens.1",
                                             "code": 400}})  # fmt: skip


# --- n ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_n_out_of_range_is_vllms_400_naming_no_parameter(sim: SimServer, path: str, body: dict[str, Any]) -> None:
    """SamplingParams._verify_num_sequences (raw/vllm/cmpl_n0, chat_n0; VLLM_MAX_N_SEQUENCES 16384)."""
    status, err, _ = await post(sim, path, {**body, "n": 0})
    assert (status, err) == (400, {"error": {"message": "n must be at least 1, got 0.", "type": "BadRequestError",
                                             "param": None, "code": 400}})  # fmt: skip
    status, err, _ = await post(sim, path, {**body, "n": 16385})
    assert (status, err["error"]["param"]) == (400, None)
    assert err["error"]["message"] == (
        "n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
    )


# --- routes: HEAD, unknown paths, wrong methods ---------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/version", "/kv_event_sources"])
async def test_head_on_a_get_route_is_405_as_fastapi_answers(sim: SimServer, path: str) -> None:
    """raw/vllm/head_health, head_models, head_version: 405, `allow: GET`, a JSON body's length."""
    status, body, headers = await request(sim, "HEAD", path)
    assert (status, body, headers["Allow"], headers["Content-Type"]) == (405, b"", "GET", "application/json")
    assert headers["Content-Length"] == "31"  # {"detail":"Method Not Allowed"}, not sent


async def test_head_on_metrics_is_served(sim: SimServer) -> None:
    """raw/vllm/get_metrics_head: vLLM's mounted Prometheus app answers HEAD."""
    status, body, _ = await request(sim, "HEAD", "/metrics")
    assert (status, body) == (200, b"")


@pytest.mark.parametrize(
    ("method", "path", "status", "detail", "allow"),
    [
        ("GET", "/nope", 404, "Not Found", None),  # raw/vllm/get_404
        ("POST", "/v1/nope", 404, "Not Found", None),  # post_404
        ("GET", "/", 404, "Not Found", None),  # get_root
        ("POST", "/health", 405, "Method Not Allowed", "GET"),  # post_health
        ("POST", "/v1/models", 405, "Method Not Allowed", "GET"),  # post_models
        ("DELETE", "/v1/models", 405, "Method Not Allowed", "GET"),  # delete_models
        ("GET", "/v1/chat/completions", 405, "Method Not Allowed", "POST"),  # chat_get
    ],
)
async def test_unknown_routes_and_wrong_methods_answer_fastapis_json(
    sim: SimServer, method: str, path: str, status: int, detail: str, allow: str | None
) -> None:
    got, body, headers = await request(sim, method, path)
    assert (got, json.loads(body), headers["Content-Type"]) == (status, {"detail": detail}, "application/json")
    assert headers.get("Allow") == allow


async def test_a_trailing_slash_redirects_to_the_route(sim: SimServer) -> None:
    """raw/vllm/get_v1_models_slash: Starlette's 307 to the path without the slash, an absolute URL."""
    status, body, headers = await request(sim, "GET", "/v1/models/?x=1")
    assert (status, body, headers["Location"]) == (307, b"", sim.url + "/v1/models?x=1")
    assert (await request(sim, "GET", "/nope/"))[0] == 404


# --- headers vLLM's middleware adds ----------------------------------------------------------------


async def test_no_request_id_header_by_default_and_vary_origin_always(sim: SimServer) -> None:
    """vLLM echoes X-Request-Id only with --enable-request-id-headers (off by default); its CORS
    middleware adds `vary: Origin` to every answer (the audit's raw answers, all routes)."""
    _, body, headers = await post(sim, "/v1/completions", COMPLETION, **{"X-Request-Id": "abc"})
    assert body["id"] == "cmpl-abc" and "X-Request-Id" not in headers and headers["Vary"] == "Origin"
    _, _, headers = await post(sim, "/v1/chat/completions", {**CHAT, "stream": True}, **{"X-Request-Id": "abc"})
    assert "X-Request-Id" not in headers and headers["Vary"] == "Origin"
    for method, path in (("GET", "/health"), ("GET", "/nope"), ("HEAD", "/health")):
        headers = (await request(sim, method, path, **{"X-Request-Id": "abc"}))[2]
        assert "X-Request-Id" not in headers and headers["Vary"] == "Origin"


async def test_request_id_headers_when_enabled_on_every_answer() -> None:
    """vLLM's XRequestIdMiddleware: the request's own id, else a fresh uuid4 hex, on any answer."""
    async with SimServer(sim_config(enable_request_id_headers=True)) as sim:
        _, body, headers = await post(sim, "/v1/completions", COMPLETION, **{"X-Request-Id": "abc"})
        assert body["id"] == "cmpl-abc" and headers["X-Request-Id"] == "abc"
        _, _, headers = await post(sim, "/v1/chat/completions", {**CHAT, "stream": True}, **{"X-Request-Id": "s"})
        assert headers["X-Request-Id"] == "s"
        _, body, headers = await post(sim, "/v1/completions", COMPLETION)
        fresh = headers["X-Request-Id"]
        assert len(fresh) == 32 and int(fresh, 16) >= 0 and fresh not in body["id"]
        assert (await request(sim, "GET", "/nope", **{"X-Request-Id": "x"}))[2]["X-Request-Id"] == "x"
        assert len((await request(sim, "GET", "/health"))[2]["X-Request-Id"]) == 32


async def test_an_empty_request_id_header_names_the_request(sim: SimServer) -> None:
    """vLLM's _base_request_id takes the header whenever it is sent (`is not None`), empty too, over
    the body's request_id."""
    _, body, _ = await post(sim, "/v1/completions", {**COMPLETION, "request_id": "from-body"}, **{"X-Request-Id": ""})
    assert body["id"] == "cmpl-"
    _, body, _ = await post(sim, "/v1/completions", {**COMPLETION, "request_id": "from-body"})
    assert body["id"] == "cmpl-from-body"


def test_the_request_id_flag_is_vllms_and_off_by_default() -> None:
    assert not config_from_args(parse()).enable_request_id_headers
    assert config_from_args(parse("--enable-request-id-headers")).enable_request_id_headers


# --- null where vLLM's models take none ----------------------------------------------------------

# Recorded 2026-12-03 from vLLM 0.32's CompletionRequest and ChatCompletionRequest: each field the
# sim reads, given as null. False: pydantic refuses it (n, request_id, bad_words were the sim's
# misses); True, a sample of those it takes as unset.
VLLM_TAKES_NULL = [
    ("/v1/completions", "n", False),
    ("/v1/completions", "request_id", False),
    ("/v1/completions", "ignore_eos", False),
    ("/v1/completions", "min_tokens", False),
    ("/v1/chat/completions", "request_id", False),
    ("/v1/chat/completions", "bad_words", False),
    ("/v1/chat/completions", "n", True),
    ("/v1/completions", "seed", True),
    ("/v1/completions", "temperature", True),
    ("/v1/completions", "logprobs", True),
    ("/v1/completions", "echo", True),
    ("/v1/completions", "top_k", True),
]


@pytest.mark.parametrize(("path", "field", "takes_null"), VLLM_TAKES_NULL)
async def test_a_null_is_refused_where_vllm_refuses_it(sim: SimServer, path: str, field: str, takes_null: bool) -> None:
    body = COMPLETION if path == "/v1/completions" else CHAT
    status, out, _ = await post(sim, path, {**body, field: None})
    if takes_null:
        assert status == 200, out
    else:
        assert status == 400 and field in out["error"]["message"] + str(out["error"]["param"]), out


async def test_chat_streams_a_chunk_per_token_while_a_stop_string_holds_text_back(sim: SimServer) -> None:
    """vLLM 0.32's chat stream without a reasoning or tool parser sends `content: ""` for a token
    whose text a stop string might be starting, with its running usage (review of 2026-12-04: the
    sim left such chunks out, so continuous usage skipped counts)."""
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "ignore_eos": True, "seed": 1}
    _, out, _ = await post(sim, "/v1/chat/completions", {**body, "logprobs": True})
    first = out["choices"][0]["logprobs"]["content"][0]["token"]
    assert first
    stop = "\uffff" * (len(first) + 1)  # never completes; vLLM holds back len(stop) - 1 characters
    req = {**body, "stop": [stop], "stream": True, "stream_options": CONTINUOUS}
    status, text, _ = await post(sim, "/v1/chat/completions", req)
    tokens = [c for c in events(text) if c["choices"] and "role" not in c["choices"][0]["delta"]]
    assert status == 200 and [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3, 4]
    assert tokens[0]["choices"][0]["delta"] == {"content": ""}


async def test_an_empty_request_id_in_the_body_names_the_request(sim: SimServer) -> None:
    """vLLM takes the body's request_id whatever it is when no X-Request-Id header is sent."""
    _, out, _ = await post(sim, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "request_id": ""})
    assert out["id"] == "cmpl-"


@pytest.mark.parametrize(
    ("path", "body", "prefix"), [("/v1/completions", COMPLETION, "cmpl-"), ("/v1/chat/completions", CHAT, "chatcmpl-")]
)
async def test_no_request_id_anywhere_draws_a_fresh_one_per_request(
    sim: SimServer, path: str, body: dict[str, Any], prefix: str
) -> None:
    """vLLM's request_id field has a default_factory (random_uuid): a request naming none in its
    header or body gets its own id (bs32/completion_nonstream_tokenids.json: cmpl-b7ca7168691cde71),
    not the empty one an explicit "" gives."""
    ids = {(await post(sim, path, body))[1]["id"] for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith(prefix) and len(i) > len(prefix) for i in ids)
