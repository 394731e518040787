"""engine_sim reads requests as vLLM 0.32 does where the audit of 2026-12-03 found it did not:
integers and token ids as pydantic's lax mode reads them, a batch mixing texts and id lists
refused, a completion's `max_tokens: null` as 16, `truncation_side` honoured, and the
TokenizeParams checks (`max_tokens` or `truncate_prompt_tokens` over the context: a 400)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine_sim import SimServer
from engine_sim.errors import SimRequestError
from engine_sim.openai_request import (
    ChatRequest,
    CompletionRequest,
    GenerateCall,
    chat_call,
    completion_call,
    parse_body,
)
from tests.engine_sim.test_http_api import post
from tests.router.test_request_fidelity import VLLM_INTEGERS, VLLM_PROMPTS

MAX_MODEL_LEN = 32768
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]}


def complete(body: dict[str, Any], max_model_len: int = MAX_MODEL_LEN) -> GenerateCall:
    return completion_call(parse_body(json.dumps(body).encode(), CompletionRequest), max_model_len)


def chat(body: dict[str, Any], max_model_len: int = MAX_MODEL_LEN) -> GenerateCall:
    return chat_call(parse_body(json.dumps({**CHAT, **body}).encode(), ChatRequest), max_model_len, model="sim-llama")


def refused(call: Any, body: dict[str, Any], max_model_len: int = MAX_MODEL_LEN) -> SimRequestError:
    with pytest.raises(SimRequestError) as err:
        call(body, max_model_len)
    return err.value


@pytest.mark.parametrize(("value", "vllm"), VLLM_INTEGERS)
def test_integer_fields_are_read_as_vllm_reads_them(value: Any, vllm: Any) -> None:
    def read(kind: type, body: dict[str, Any], name: str) -> Any:
        try:
            return getattr(parse_body(json.dumps(body).encode(), kind), name)
        except SimRequestError as exc:
            return (exc.kind, exc.param)

    got = [
        read(CompletionRequest, {"prompt": "x", "max_tokens": value}, "max_tokens"),
        read(CompletionRequest, {"prompt": "x", "n": value}, "n"),
        read(CompletionRequest, {"prompt": "x", "stop_token_ids": [7, value]}, "stop_token_ids"),
        read(ChatRequest, {**CHAT, "max_completion_tokens": value}, "max_completion_tokens"),
    ]
    if vllm == "ERR":  # pydantic's 400 naming the field, as vLLM's validation handler writes it
        assert got == [
            ("Bad Request", "body.max_tokens"),
            ("Bad Request", "body.n"),
            ("Bad Request", "body.stop_token_ids.1"),
            ("Bad Request", "body.max_completion_tokens"),
        ]
    else:
        assert got == [vllm, vllm, [7, vllm], vllm]


@pytest.mark.parametrize(("prompt", "vllm"), VLLM_PROMPTS)
def test_prompts_are_read_as_vllm_reads_them(prompt: Any, vllm: Any) -> None:
    if vllm == "ERR":
        assert refused(complete, {"prompt": prompt, "max_tokens": 1}).param == "prompt"
        return
    call = complete({"prompt": prompt, "max_tokens": 1})
    one_prompt = all(isinstance(t, int) for t in vllm)
    assert [p.token_ids if p.text is None else p.text for p in call.prompts] == ([vllm] if one_prompt else vllm)


def test_a_batch_mixing_texts_and_id_lists_is_refused_saying_so() -> None:
    err = refused(complete, {"prompt": ["Hello", [6, 7, 8]]})
    assert (err.status, err.param, err.message) == (
        400,
        "prompt",
        "a batch of prompts must be all strings or all token-id lists",
    )


def test_a_null_max_tokens_is_16_for_completions_and_no_limit_for_chat() -> None:
    assert complete({"prompt": [5] * 10, "max_tokens": None}, 1000).max_tokens == [16]  # normalize_null_max_tokens
    room = 1000 - len(chat({}).prompts[0].token_ids)
    assert chat({"max_tokens": None}, 1000).max_tokens == [room]
    assert chat({"max_completion_tokens": None, "max_tokens": 7}, 1000).max_tokens == [7]


IDS = list(range(1000, 1010))


@pytest.mark.parametrize(
    ("side", "kept"), [(None, IDS[-4:]), ("left", IDS[-4:]), ("right", IDS[:4])], ids=["default", "left", "right"]
)
def test_truncation_keeps_the_side_asked_for(side: str | None, kept: list[int]) -> None:
    body = {"prompt": IDS, "max_tokens": 1, "truncate_prompt_tokens": 4, "truncation_side": side}
    assert complete(body).prompts[0].token_ids == kept
    rendered = chat({}).prompts[0].token_ids
    truncated = chat({"truncate_prompt_tokens": 3, "truncation_side": side}).prompts[0].token_ids
    assert truncated == (rendered[:3] if side == "right" else rendered[-3:])


def test_truncating_to_minus_one_holds_a_token_back_for_the_output() -> None:
    # TokenizeParams.max_truncation_tokens: the context less one when output is asked for.
    call = complete({"prompt": list(range(1000, 1200)), "max_tokens": 16, "truncate_prompt_tokens": -1}, 128)
    assert call.prompts[0].token_ids == list(range(1073, 1200)) and call.max_tokens == [1]


# vLLM 0.32's answers, recorded with `.venv-vllm/bin/python`: its validation_exception_handler and
# CompletionRequest / ChatCompletionRequest in a FastAPI app (TestClient) for the literal error;
# TokenizeParams(max_total_tokens=32768, ..., max_total_tokens_param="max_model_len") for the rest.
SIDE_MIDDLE = {
    "error": {
        "message": "1 validation error:\n  {'type': 'literal_error', 'loc': 'body.truncation_side', 'msg': \"Input "
        "should be 'left' or 'right'\", 'input': 'middle', 'ctx': {'expected': \"'left' or 'right'\"}}",
        "type": "Bad Request",
        "param": "body.truncation_side",
        "code": 400,
    }
}
MAX_TOKENS_OVER = (
    "max_tokens=1000000 cannot be greater than max_model_len=32768. Please request fewer output tokens. "
    "(parameter=max_tokens, value=1000000)"
)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_unknown_truncation_side_is_vllms_400(sim: SimServer, path: str) -> None:
    body = {"prompt": "a b c"} if path == "/v1/completions" else CHAT
    status, out, _ = await post(sim, path, {**body, "truncate_prompt_tokens": 2, "truncation_side": "middle"})
    assert (status, out) == (400, SIDE_MIDDLE)
    _, numeric, _ = await post(sim, path, {**body, "truncation_side": 1})
    assert "'input': '1'" in numeric["error"]["message"]  # vLLM's handler shows a value as its str()


async def test_max_tokens_over_the_context_is_vllms_400(sim: SimServer) -> None:
    status, out, _ = await post(sim, "/v1/completions", {"prompt": "a b c", "max_tokens": 1_000_000})
    assert (status, out) == (
        400,
        {"error": {"message": MAX_TOKENS_OVER, "type": "BadRequestError", "param": "max_tokens", "code": 400}},
    )


@pytest.mark.parametrize(
    ("call", "body", "param", "message"),
    [
        (complete, {"prompt": [5], "max_tokens": 1_000_000}, "max_tokens", MAX_TOKENS_OVER),
        (chat, {"max_completion_tokens": 40_000, "max_tokens": 5},
         "max_completion_tokens", "max_completion_tokens=40000 cannot be greater than max_model_len=32768. Please "
         "request fewer output tokens. (parameter=max_completion_tokens, value=40000)"),
        (chat, {"max_tokens": 40_000},
         "max_tokens", "max_tokens=40000 cannot be greater than max_model_len=32768. Please request fewer output "
         "tokens. (parameter=max_tokens, value=40000)"),
        (complete, {"prompt": [5], "truncate_prompt_tokens": 40_000},
         "truncate_prompt_tokens", "truncate_prompt_tokens=40000 cannot be greater than max_model_len = 32768. "
         "Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value=40000)"),
        (chat, {"truncate_prompt_tokens": 40_000},
         "truncate_prompt_tokens", "truncate_prompt_tokens=40000 cannot be greater than max_model_len = 32768. "
         "Please request a smaller truncation size. (parameter=truncate_prompt_tokens, value=40000)"),
    ],
    ids=["max_tokens", "max_completion_tokens", "chat-max_tokens", "truncate", "chat-truncate"],
)  # fmt: skip
def test_what_cannot_fit_the_context_is_vllms_400(call: Any, body: dict[str, Any], param: str, message: str) -> None:
    err = refused(call, body)
    assert (err.status, err.kind, err.param, err.message) == (400, "BadRequestError", param, message)


def test_a_prompt_of_the_whole_context_leaves_no_room_for_output() -> None:
    """vLLM's renderer refuses only more than max_model_len tokens (renderers/params.py
    _token_len_check); a prompt of exactly that many gets 0 from get_max_tokens, which
    SamplingParams refuses. "at least" whenever the count shown is the limit + 1, ids too."""
    chat_tokens = len(chat({}).prompts[0].token_ids)
    for call, body, limit in ((complete, {"prompt": [7] * 2048, "max_tokens": 4}, 2048), (chat, {}, chat_tokens)):
        err = refused(call, body, limit)
        assert (err.param, err.message) == ("max_tokens", "max_tokens must be at least 1, got 0. "
                                                          "(parameter=max_tokens, value=0)")  # fmt: skip
    assert complete({"prompt": [7] * 2048, "max_tokens": 0, "echo": True}, 2048).max_tokens == [1]  # echo only
    err = refused(complete, {"prompt": [7] * 2049, "max_tokens": 4}, 2048)
    assert (err.param, err.message) == ("input_tokens", "This model's maximum context length is 2048 tokens. However, "
                                        "your prompt contains at least 2049 input tokens, which exceeds this limit "
                                        "even without any output tokens. Please reduce the length of the input prompt. "
                                        "(parameter=input_tokens, value=2049)")  # fmt: skip
    assert "contains 2050 input tokens" in refused(complete, {"prompt": [7] * 2050, "max_tokens": 4}, 2048).message


def test_the_whole_context_may_be_asked_for() -> None:
    assert complete({"prompt": [5], "max_tokens": MAX_MODEL_LEN}).max_tokens == [MAX_MODEL_LEN - 1]
    assert complete({"prompt": [5], "truncate_prompt_tokens": MAX_MODEL_LEN}).prompts[0].token_ids == [5]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"model": "sim-llama", "prompt": "a \\ud800 b"}'),
        ("/v1/chat/completions", '{"model": "sim-llama", "messages": [{"role": "user", "content": "\\udfff"}]}'),
        ("/tokenize", '{"model": "sim-llama", "prompt": "\\ud800"}'),
    ],
)
async def test_a_lone_surrogate_in_the_text_is_vllms_400(sim: SimServer, path: str, body: str) -> None:
    """JSON may escape half a UTF-16 pair (`"\\ud800"`); vLLM's stdlib JSON takes it, and its
    tokenizer refuses a text no UTF-8 can hold, a TypeError its handler answers 400. The sim's
    answer was a bare 500."""
    status, out, _ = await post(sim, path, body)
    assert status == 400, out
    assert out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
    assert "lone UTF-16 surrogate" in out["error"]["message"]


async def test_a_lone_surrogates_position_is_its_index_in_the_text(sim: SimServer) -> None:
    """The tokenizer encodes the text a regex piece at a time, its UnicodeEncodeError's offset within
    the piece: until 2026-12-07 "a \\ud800 b" was said to hold ('a' at 0)."""
    status, out, _ = await post(sim, "/v1/completions", '{"model": "sim-llama", "prompt": "a \\ud800 b"}')
    assert status == 400, out
    assert "('\\ud800' at 2)" in out["error"]["message"], out
