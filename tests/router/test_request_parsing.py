"""parse_request's prompt forms, as vLLM takes them: token ids are validated in C (msgspec), and a
bad id is still named in the 400; the integers and booleans the router reads, as vLLM's lax
parsing reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from protocol import asks_prompt_logprobs
from router.api_errors import ApiError
from router.request_context import RequestShape
from router.request_parsing import check_hashable, keep_specials_truncated, parse_request, prompt_ids
from router.tokenization import HfPromptTokenizer, Tokenization, load_tokenizer
from tests.vllm.make_model import build_tokenizer


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([0, 5, 2**32 - 1], [[0, 5, 2**32 - 1]]),
        ("text", ["text"]),
        ([[3], [4, 5]], [[3], [4, 5]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert parse_request({"prompt": prompt}, chat=False).prompts == expected


_MIXED = "a batch of prompts must be all strings or all token-id lists"
_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"


@pytest.mark.parametrize(
    ("prompt", "message", "param"),
    [
        # vLLM's (engine_sim's) words: an id below 0 its model's, named
        ([1, -1], "Token id -1 is out of vocabulary (parameter=prompt)", "prompt"),
        ([[1, 2**33], [3, -2]], "Token id -2 is out of vocabulary (parameter=prompt)", "prompt"),
        ([1, 2.5], "prompt must be a string, a list of token ids, or a list of strings or token-id lists", "prompt"),
        # vLLM 0.32 refuses a batch mixing texts and id lists (tests/router/test_request_fidelity.py)
        (["a", [7, -4]], _MIXED, "prompt"),
        (["a", [1, 2], "b"], _MIXED, "prompt"),
        ("", _NO_PROMPT, "prompt"),  # vLLM's validator
        (None, _NO_PROMPT, "prompt"),
        ([], "You must pass at least one prompt", None),  # vLLM 0.32's renderer's words (and engine_sim's)
        ([[1], []], "The decoder prompt cannot be empty", None),  # its engine's
    ],
)
@pytest.mark.parametrize("vllm_only", [True, False])
def test_bad_prompts_are_400_in_vllms_words(prompt: Any, message: str, param: str | None, vllm_only: bool) -> None:
    """The same 400 whether vLLM's validators ran or not: where another engine serves the model,
    a missing or empty prompt is still refused (a BOS alone would be served)."""
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": prompt}, chat=False, vllm_only=vllm_only)
    assert (err.value.code, err.value.param, err.value.message) == (400, param, message)


_M = [{"role": "user", "content": "hi"}]
_VLLM_ALONE_REFUSES: list[tuple[dict[str, Any], str]] = [
    # vLLM's model validators (protocol.vllm_validators); SGLang's models have none of them
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "Stream options can only be defined"),
    ({"prompt": "hi", "cache_salt": "tenant/1"}, "Parameter 'cache_salt' must be at most 128 characters"),
    ({"prompt": "hi", "cache_salt": "x" * 200}, "Parameter 'cache_salt' must be at most 128 characters"),
    ({"prompt": ["a", "b"], "cache_salt": ["x", "y"]}, "Parameter 'cache_salt' must be a non-empty string"),
    ({"prompt": "hi", "prompt_logprobs": "2"}, "`prompt_logprobs` must be an integer."),
    ({"messages": _M, "tools": []}, "`tools` must not be an empty array."),
    ({"messages": _M, "continue_final_message": True, "add_generation_prompt": True}, "Cannot set both"),
    ({"messages": _M, "tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set."),
    ({"messages": _M, "top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."),
    ({"messages": _M, "response_format": {"type": "json_schema", "schema": {}}}, "the 'json_schema' field must be"),
    # vLLM's model types vllm_xargs as a dict
    ({"prompt": "hi", "vllm_xargs": "x"}, "Input should be a valid dictionary"),
    ({"messages": _M, "vllm_xargs": ["x"]}, "Input should be a valid dictionary"),
]


@pytest.mark.parametrize(("body", "message"), _VLLM_ALONE_REFUSES)
def test_what_vllm_alone_refuses_is_the_routers_400_only_where_vllm_alone_serves(
    body: dict[str, Any], message: str
) -> None:
    """Where another engine may serve the model (SGLang takes these bodies), the body goes on as
    sent, as before 2026-12-07; where vLLM alone serves it, vLLM's 400."""
    chat = "messages" in body
    parsed = parse_request(body, chat=chat, vllm_only=False)
    assert parsed.params == body
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=chat, vllm_only=True)
    assert err.value.code == 400 and message in err.value.message, err.value.message


@pytest.mark.parametrize(
    ("body", "message"),
    [
        # its engine's words for an id past the vocabulary: the prompt's highest, naming no parameter
        ({"prompt": [1, 2**32, 2**33, 5]}, "Token id 8589934592 is out of vocabulary"),
        ({"prompt": [[1, 2], [3, 2**40]]}, "Token id 1099511627776 is out of vocabulary"),
        ({"prompt": [2**32, 5, 6], "truncate_prompt_tokens": 3}, "Token id 4294967296 is out of vocabulary"),
        # cut by the truncation, as vLLM truncates before its engine looks: served
        ({"prompt": [2**32, 5, 6], "truncate_prompt_tokens": 2}, None),
        ({"prompt": [[2**32, 5, 6], [7, 8]], "truncate_prompt_tokens": 2}, None),
        ({"prompt": [5, 6, 2**40], "truncate_prompt_tokens": 2, "truncation_side": "right"}, None),
    ],
)
async def test_an_id_the_router_cannot_hash_is_judged_as_truncated(body: dict[str, Any], message: str | None) -> None:
    """An id of 2^32 or more was refused as the body was read, so a truncation that cut it was
    never served (vLLM serves it)."""
    parsed = parse_request(body, chat=False)
    tok = Tokenization(load_tokenizer(None))
    try:
        _, prompts = await prompt_ids(tok, parsed)
    finally:
        tok.close()
    if message is None:
        check_hashable(prompts)
        return
    with pytest.raises(ApiError) as err:
        check_hashable(prompts)
    assert (err.value.code, err.value.param, err.value.message) == (400, None, message)


def test_a_long_id_prompt_is_returned_as_sent() -> None:
    ids = list(range(10_000, 14_136))
    assert parse_request({"prompt": ids, "max_tokens": 4}, chat=False).prompts == [ids]


@pytest.mark.parametrize(
    ("body", "chat", "max_tokens"),
    [
        ({"prompt": "hi"}, False, 16),  # vLLM's completions default
        ({"prompt": "hi", "max_tokens": 0}, False, 16),
        ({"prompt": "hi", "max_tokens": None}, False, 16),  # vLLM 0.32's normalize_null_max_tokens
        ({"messages": [{"role": "user", "content": "hi"}]}, True, None),  # chat: up to the context
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None}, True, None),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}, True, 300),
    ],
)
def test_an_unset_max_tokens_is_the_engines_default(body: dict[str, Any], chat: bool, max_tokens: int | None) -> None:
    assert parse_request(body, chat=chat).max_tokens == max_tokens


@pytest.mark.parametrize(
    ("body", "read"),
    [
        ({"max_tokens": 512.0}, ("max_tokens", 512)),  # a Python client's arithmetic
        ({"max_tokens": "512"}, ("max_tokens", 512)),
        ({"max_completion_tokens": "7", "max_tokens": 3}, ("max_tokens", 7)),
        ({"stream": "true"}, ("stream", True)),
        ({"stream": 0}, ("stream", False)),
        ({"stream": "yes"}, ("stream", True)),  # pydantic's lax bool, checked against vLLM 0.32's model
        ({"stream": "off"}, ("stream", False)),
        ({"truncate_prompt_tokens": 4.0}, ("truncate", (4, None))),  # no side: the tokenizer's
        ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, ("truncate", (4, "right"))),
    ],
)
def test_integers_and_booleans_are_read_as_vllm_reads_them(body: dict[str, Any], read: tuple[str, Any]) -> None:
    chat = "max_completion_tokens" in body
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    parsed = parse_request({**prompt, **body}, chat=chat)
    assert getattr(parsed, read[0]) == read[1]
    assert {k: parsed.params[k] for k in body} == body, "the engine gets the values as sent"


_INT = "Input should be a valid integer"


@pytest.mark.parametrize(
    ("name", "value", "kind", "msg"),
    [
        ("max_tokens", 3.5, "int_from_float", f"{_INT}, got a number with a fractional part"),
        ("max_tokens", "many", "int_parsing", f"{_INT}, unable to parse string as an integer"),
        ("n", [2], "int_type", _INT),
        ("stream", "maybe", "bool_parsing", "Input should be a valid boolean, unable to interpret input"),
        ("stream", 2, "bool_parsing", "Input should be a valid boolean, unable to interpret input"),
        ("stream", 2.0, "bool_parsing", "Input should be a valid boolean, unable to interpret input"),
        # no number pydantic reads as a boolean (an i64): not even one to refuse
        ("stream", 0.5, "bool_type", "Input should be a valid boolean"),
        ("stream", 2**63, "bool_type", "Input should be a valid boolean"),
        ("add_special_tokens", 1e19, "bool_type", "Input should be a valid boolean"),
    ],
)
def test_what_vllm_would_not_read_is_400_naming_it(name: str, value: Any, kind: str, msg: str) -> None:
    """In vLLM's validation handler's words: pydantic's error, `param` its location."""
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": "hi", name: value}, chat=False)
    shown = "<list of 1 items>" if isinstance(value, list) else str(value)
    detail = {"type": kind, "loc": f"body.{name}", "msg": msg, "input": shown}
    assert err.value.body() == {
        "error": {"message": f"1 validation error:\n  {detail}", "type": "Bad Request", "param": f"body.{name}",
                  "code": 400}
    }  # fmt: skip


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("value", "kind", "msg", "ctx"),
    [
        (-5, "greater_than_equal", "Input should be greater than or equal to -1", {"ge": -1}),
        (2**63, "less_than_equal", f"Input should be less than or equal to {2**63 - 1}", {"le": 2**63 - 1}),
    ],
)
def test_a_truncation_vllms_model_bounds_is_its_400(chat: bool, value: int, kind: str, msg: str, ctx: Any) -> None:
    """vLLM 0.32 types truncate_prompt_tokens ge=-1, le=2**63-1: -5 is no "truncate to the context"."""
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    with pytest.raises(ApiError) as err:
        parse_request({**prompt, "truncate_prompt_tokens": value}, chat=chat)
    detail = {"type": kind, "loc": "body.truncate_prompt_tokens", "msg": msg, "input": str(value), "ctx": ctx}
    assert err.value.body()["error"]["message"] == f"1 validation error:\n  {detail}"
    assert err.value.param == "body.truncate_prompt_tokens"
    assert parse_request({**prompt, "truncate_prompt_tokens": -1}, chat=chat).truncate_to_context is not None


@pytest.mark.parametrize(
    ("chat", "extra", "shape"),
    [
        (False, {}, RequestShape()),
        (False, {"prompt": ["a", "b", "c"], "n": 2}, RequestShape(sequences=6)),
        (True, {"n": "3"}, RequestShape(sequences=3)),
        (False, {"prompt_logprobs": 0}, RequestShape(prompt_logprobs=True)),
        (True, {"prompt_logprobs": 2}, RequestShape(prompt_logprobs=True)),
        (False, {"echo": True, "logprobs": 0}, RequestShape(prompt_logprobs=True)),
        (False, {"echo": True}, RequestShape()),  # the prompt's text, not its logits
        (False, {"logprobs": 2}, RequestShape()),  # the output's
        (True, {"logprobs": True, "top_logprobs": 2}, RequestShape()),  # chat logprobs are the output's
        # vLLM 0.32's chat echo asks for prompt_logprobs = top_logprobs (0 when unset or null)
        (True, {"echo": True, "logprobs": True}, RequestShape(prompt_logprobs=True)),
        (True, {"echo": True}, RequestShape(prompt_logprobs=True)),
        (True, {"echo": "true", "top_logprobs": None}, RequestShape(prompt_logprobs=True)),
        (True, {"echo": "false"}, RequestShape()),
        (False, {"use_beam_search": True}, RequestShape(beam_search=True)),
        (True, {"use_beam_search": "yes"}, RequestShape(beam_search=True)),  # vLLM's lax boolean
        (False, {"use_beam_search": False}, RequestShape()),
    ],
)
def test_the_shape_says_what_a_transfer_handle_could_not_serve(
    chat: bool, extra: dict[str, Any], shape: RequestShape
) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    assert parse_request({**body, **extra}, chat=chat).shape == shape
    assert shape.local_prefill_only is (shape != RequestShape())
    assert asks_prompt_logprobs({**body, **extra}, chat=chat) is shape.prompt_logprobs, "the shim's reuse credit"


@pytest.mark.parametrize("embeds", ["AAAA", ["AAAA"], ["AAAA", "BBBB"]])
@pytest.mark.parametrize("prompt", [{"prompt": "hi"}, {}])
def test_prompt_embeds_are_refused_naming_them(embeds: Any, prompt: dict[str, Any]) -> None:
    """vLLM prefills embeddings as prompts of their own ahead of `prompt`: a batch the router
    cannot tokenize, route or split into transfer handles."""
    with pytest.raises(ApiError) as err:
        parse_request({**prompt, "prompt_embeds": embeds}, chat=False)
    assert (err.value.code, err.value.param) == (400, "prompt_embeds")
    assert "prompt_embeds" in err.value.message


@pytest.mark.parametrize("embeds", [None, []])
def test_no_prompt_embeds_is_a_plain_prompt(embeds: Any) -> None:
    assert parse_request({"prompt": "hi", "prompt_embeds": embeds}, chat=False).shape == RequestShape()


@pytest.mark.parametrize(
    ("extra", "engine_tokenizes"),
    [
        ({}, False),
        ({"echo": True}, True),
        ({"echo": 1}, True),  # vLLM's lax boolean: an echo all the same
        ({"echo": "true"}, True),
        ({"echo": "false", "logprobs": 1}, False),
        ({"suffix": ")"}, True),  # FIM renders the text
        ({"truncate_prompt_tokens": 5}, True),  # its tokenizer truncates and keeps the BOS
        ({"truncate_prompt_tokens": -1}, True),
        ({"truncate_prompt_tokens": 5, "truncation_side": "left"}, False),  # vLLM slices the ids
    ],
)
def test_requests_whose_answer_depends_on_the_text_keep_it(extra: dict[str, Any], engine_tokenizes: bool) -> None:
    parsed = parse_request({"prompt": "hi there", **extra}, chat=False)
    assert parsed.engine_tokenizes is engine_tokenizes
    assert parse_request({"prompt": "hi there", **extra, "echo": "false"}, chat=False).shape == RequestShape()


@pytest.mark.parametrize("keep", [1, 2, 3, 5, 7, 40])
async def test_a_truncation_with_no_side_keeps_the_special_tokens_as_the_engines_tokenizer_does(
    tmp_path: Path, keep: int
) -> None:
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate("a b c d e f g h".split())}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>"])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.save(str(tmp_path / "tokenizer.json"))
    text = "a b c d e f g h"
    # What vLLM's tokenizer gives (truncation=True, max_length=keep, its side "left" for generation).
    engine = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    engine.enable_truncation(keep, direction="left")
    expected = engine.encode(text, add_special_tokens=True).ids
    tok = Tokenization(load_tokenizer(tmp_path))
    try:
        got = await keep_specials_truncated(tok, text, keep)
    finally:
        tok.close()
    assert got == expected
    if keep < 9:
        assert got[0] == 1, "the BOS stays first"


@pytest.mark.parametrize("keep", [1, 2, 6, 12])
async def test_a_chat_truncation_with_no_side_keeps_the_special_tokens_the_tokenizer_adds(
    tmp_path: Path, keep: int
) -> None:
    """A chat with add_special_tokens: vLLM's tokenizer truncates the rendered text and keeps the
    BOS it adds, where slicing the ids dropped it. No vLLM capture holds this case: the engine's
    tokenizer's own truncation stands for it, as for completions above."""
    build_tokenizer(tmp_path)
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog again and again"}]
    body = {"model": "m", "messages": messages, "truncate_prompt_tokens": keep, "add_special_tokens": True}
    parsed = parse_request(body, chat=True)
    assert parsed.chat_options is not None
    hf = load_tokenizer(tmp_path)
    assert isinstance(hf, HfPromptTokenizer)
    tok = Tokenization(hf)
    try:
        routed, _ = await prompt_ids(tok, parsed)
        text = hf.render_chat(messages, parsed.chat_options)
    finally:
        tok.close()
    engine = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    engine.enable_truncation(keep, direction="left")
    assert routed == engine.encode(text, add_special_tokens=True).ids
    assert routed[0] == engine.token_to_id("<s>"), "the BOS stays first"
    # without the specials, or with a side given, vLLM slices the rendered ids as before
    for extra in ({"add_special_tokens": False}, {"truncation_side": "left"}):
        plain = parse_request({**body, **extra}, chat=True)
        assert plain.chat_options is not None
        tok = Tokenization(load_tokenizer(tmp_path))
        try:
            whole = await tok.encode_chat(plain.messages or [], plain.chat_options)
            assert (await prompt_ids(tok, plain))[0] == whole[-keep:]
        finally:
            tok.close()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # transformers' checks of what reaches the template unvalidated name the field the client
        # sent it in (until 2026-12-07 every rendering error named `messages`)
        ({"chat_template_kwargs": {"tools": [1]}}, "chat_template_kwargs"),
        # a top-level document not an object is vLLM's model's 400 (list[dict[str, str]]), before rendering
        ({"documents": ["a"]}, "body.documents.0"),
        ({"chat_template_kwargs": {"documents": ["a"]}}, "chat_template_kwargs"),
        ({"documents": [1], "chat_template_kwargs": {"documents": [{"title": "t", "text": "x"}]}}, "body.documents.0"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
async def test_a_rendering_error_names_the_field_the_client_sent(
    tmp_path: Path, extra: dict[str, Any], param: str
) -> None:
    build_tokenizer(tmp_path)
    tok = Tokenization(load_tokenizer(tmp_path))
    try:
        with pytest.raises(ApiError) as err:
            await prompt_ids(tok, parse_request({"messages": [{"role": "user", "content": "x"}], **extra}, chat=True))
    finally:
        tok.close()
    assert (err.value.code, err.value.param) == (400, param)
