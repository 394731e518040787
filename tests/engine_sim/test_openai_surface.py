"""The OpenAI surface beyond the captured responses, as vLLM 0.32 serves it: n, echo, logprobs, stop
strings and stop token ids, min_tokens, max_tokens, sampling parameters, usage details, unknown
fields. Shapes follow vLLM's protocol classes; the captured shapes are pinned in test_http_api.py."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from engine_sim import SimServer
from protocol.tokenizer import BuiltinTokenizer
from tests.engine_sim.conftest import sim_config
from tests.engine_sim.test_http_api import post, sse_events

TOK = BuiltinTokenizer()
PROMPT = list(range(700, 740))


def chunks(text: str) -> list[dict[str, Any]]:
    return [e for e in sse_events(text) if e != "[DONE]"]


# --- n -------------------------------------------------------------------------------------------


async def test_n_choices_are_indexed_prompt_major_and_differ(sim: SimServer) -> None:
    body = {"prompt": [TOK.encode("one two"), [500, 501, 502]], "n": 3, "max_tokens": 4, "return_token_ids": True}
    status, out, _ = await post(sim, "/v1/completions", body)
    assert status == 200
    assert [c["index"] for c in out["choices"]] == list(range(6))  # prompt i's choice j is i * n + j
    assert [c["prompt_token_ids"] for c in out["choices"][3:]] == [[500, 501, 502]] * 3
    texts = [c["text"] for c in out["choices"]]
    assert len(set(texts[:3])) == 3 and len(set(texts[3:])) == 3  # n samples, not n copies
    # usage: each prompt once, every choice's tokens
    assert out["usage"]["prompt_tokens"] == len(TOK.encode("one two")) + 3
    assert out["usage"]["completion_tokens"] == 6 * 4
    # choice 0 is what n = 1 gives
    _, single, _ = await post(sim, "/v1/completions", {"prompt": [500, 501, 502], "max_tokens": 4})
    assert single["choices"][0]["text"] == texts[3]
    assert sim.engine.num_blocks_in_use == 0


async def test_n_choices_stream_with_vllms_indices(sim: SimServer) -> None:
    body = {"prompt": ["one two", "three"], "n": 2, "max_tokens": 3, "stream": True}
    _, text, _ = await post(sim, "/v1/completions", body)
    by_index: dict[int, str] = {}
    for c in chunks(text):
        (choice,) = c["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    _, whole, _ = await post(sim, "/v1/completions", {**body, "stream": False})
    assert by_index == {c["index"]: c["text"] for c in whole["choices"]}


async def test_chat_n_choices_stream_a_role_chunk_each(sim: SimServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3}
    _, whole, _ = await post(sim, "/v1/chat/completions", body)
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"]["completion_tokens"] == 6
    _, text, _ = await post(sim, "/v1/chat/completions", {**body, "stream": True})
    events = chunks(text)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    contents = {0: "", 1: ""}
    for e in events[2:]:
        contents[e["choices"][0]["index"]] += e["choices"][0]["delta"]["content"]
    assert contents == {c["index"]: c["message"]["content"] for c in whole["choices"]}


async def test_n_above_one_with_greedy_sampling_is_vllms_error(sim: SimServer) -> None:
    status, out, _ = await post(sim, "/v1/completions", {"prompt": "x", "n": 2, "temperature": 0})
    assert status == 400
    assert out["error"]["message"] == "n must be 1 when using greedy sampling, got 2."


# --- echo ----------------------------------------------------------------------------------------


async def test_echo_puts_the_prompt_before_the_output(sim: SimServer) -> None:
    _, plain, _ = await post(sim, "/v1/completions", {"prompt": "hello world", "max_tokens": 3})
    _, echoed, _ = await post(sim, "/v1/completions", {"prompt": "hello world", "max_tokens": 3, "echo": True})
    assert echoed["choices"][0]["text"] == "hello world" + plain["choices"][0]["text"]
    _, ids, _ = await post(sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True})
    assert ids["choices"][0]["text"].startswith(TOK.decode(PROMPT))
    # max_tokens 0 with echo: the prompt alone (vLLM generates one token and does not show it)
    _, only, _ = await post(sim, "/v1/completions", {"prompt": "hello world", "max_tokens": 0, "echo": True})
    assert only["choices"][0]["text"] == "hello world"
    assert only["usage"]["completion_tokens"] == 1


async def test_echo_streams_the_prompt_in_the_first_chunk(sim: SimServer) -> None:
    body = {"prompt": "hello world", "max_tokens": 3, "echo": True, "stream": True}
    _, text, _ = await post(sim, "/v1/completions", body)
    events = chunks(text)
    first = events[0]["choices"][0]
    assert first["text"].startswith("hello world") and first["prompt_token_ids"] == TOK.encode("hello world")
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:])
    _, whole, _ = await post(sim, "/v1/completions", {**body, "stream": False})
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]


async def test_chat_echo_prepends_a_last_message_of_the_replys_role(sim: SimServer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    body = {"messages": messages, "max_tokens": 2, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    _, out, _ = await post(sim, "/v1/chat/completions", body)
    assert out["choices"][0]["message"]["content"].startswith("Well,")
    _, text, _ = await post(sim, "/v1/chat/completions", {**body, "stream": True})
    events = chunks(text)
    assert events[1]["choices"][0]["delta"] == {"content": "Well,"}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == out["choices"][0]["message"]["content"]


# --- logprobs ------------------------------------------------------------------------------------


def _valid_distribution(logprobs: list[float]) -> None:
    assert all(lp < 0 for lp in logprobs) and sum(math.exp(lp) for lp in logprobs) <= 1 + 1e-9
    assert logprobs == sorted(logprobs, reverse=True)


async def test_completion_logprobs_in_vllms_shape(sim: SimServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 3}
    _, out, _ = await post(sim, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for token, token_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        # The emitted token is the best one; top_logprobs holds it and the top 3 (vLLM's k + 1, deduplicated).
        assert len(top) == 3 and max(top.values()) == top[token] == token_lp
        _valid_distribution(list(top.values()))
    _, again, _ = await post(sim, "/v1/completions", body)
    assert again["choices"][0]["logprobs"] == lp  # deterministic
    _, text, _ = await post(sim, "/v1/completions", {**body, "stream": True})
    streamed = [e["choices"][0]["logprobs"] for e in chunks(text)]
    assert [s["tokens"][0] for s in streamed] == lp["tokens"]
    assert [s["text_offset"][0] for s in streamed] == lp["text_offset"]
    assert [s["top_logprobs"][0] for s in streamed] == lp["top_logprobs"]


async def test_echo_with_logprobs_reports_the_prompt_too(sim: SimServer) -> None:
    prompt = [800, 801, 802, 803]
    _, out, _ = await post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "logprobs": 1, "echo": True})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 6 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:4] == [TOK.decode([t]) for t in prompt]
    assert choice["prompt_logprobs"][0] is None
    for tid, pos in zip(prompt[1:], choice["prompt_logprobs"][1:], strict=True):
        assert list(pos[str(tid)]) == ["logprob", "rank", "decoded_token"]
        assert pos[str(tid)]["decoded_token"] == TOK.decode([tid])
        ranks = sorted(v["rank"] for v in pos.values())
        assert ranks[0] >= 1 and len(pos) <= 2


async def test_chat_logprobs_in_vllms_shape(sim: SimServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    _, out, _ = await post(sim, "/v1/chat/completions", body)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and "".join(c["token"] for c in content) == out["choices"][0]["message"]["content"]
    for c in content:
        assert list(c) == ["token", "logprob", "bytes", "top_logprobs"]
        assert c["bytes"] == list(c["token"].encode())
        assert [list(t) for t in c["top_logprobs"]] == [["token", "logprob", "bytes"]] * 2
        assert c["top_logprobs"][0]["token"] == c["token"] and c["top_logprobs"][0]["logprob"] == c["logprob"]
        _valid_distribution([t["logprob"] for t in c["top_logprobs"]])
    _, plain, _ = await post(sim, "/v1/chat/completions", {**body, "top_logprobs": 0})
    assert all(c["top_logprobs"] == [] for c in plain["choices"][0]["logprobs"]["content"])
    _, text, _ = await post(sim, "/v1/chat/completions", {**body, "stream": True})
    streamed = [e["choices"][0]["logprobs"] for e in chunks(text)[1:]]
    assert [c for s in streamed for c in s["content"]] == content


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "x"}]
INVALID = [
    (C, {"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max allowed: 20"
     " (parameter=logprobs, value=21)"),
    (C, {"logprobs": -2}, "`logprobs` must be a positive value or -1. (parameter=logprobs, value=-2)"),
    (CHAT, {"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"),
    (C, {"prompt_logprobs": 1, "stream": True},
     "`prompt_logprobs` are not available when `stream=True`. (parameter=prompt_logprobs)"),
    (C, {"stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    (C, {"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0."),
    (C, {"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
    (C, {"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0."),
    (C, {"temperature": 2.5}, "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"),
    (C, {"max_tokens": 0}, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
    (C, {"min_tokens": 20, "max_tokens": 5}, "min_tokens must be less than or equal to max_tokens=5, got 20."),
    (C, {"stop": ["a", ""]}, "stop cannot contain an empty string."),
    (C, {"suffix": "y"}, "suffix is not currently supported"),
    (CHAT, {"continue_final_message": True, "add_generation_prompt": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True."),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "message"), INVALID)
async def test_invalid_parameters_get_vllms_400(sim: SimServer, path: str, body: dict[str, Any], message: str) -> None:
    status, out, _ = await post(sim, path, {**body, **({"prompt": "x"} if path == C else {"messages": USER})})
    assert status == 400 and out["error"]["type"] == "BadRequestError"
    assert out["error"]["message"] == message


# --- stop, min_tokens, max_tokens ----------------------------------------------------------------


async def test_stop_token_id_ends_with_its_id_as_stop_reason_and_no_text(sim: SimServer) -> None:
    _, full, _ = await post(sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True})
    ids = full["choices"][0]["token_ids"]
    body = {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True, "stop_token_ids": [ids[3]]}
    _, out, _ = await post(sim, "/v1/completions", body)
    choice = out["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[3])
    assert choice["token_ids"] == ids[:4] and out["usage"]["completion_tokens"] == 4  # the stop token counts
    assert choice["text"] == TOK.decode(ids[:3])  # but adds no text
    _, kept, _ = await post(sim, "/v1/completions", {**body, "include_stop_str_in_output": True})
    assert kept["choices"][0]["text"] == TOK.decode(ids[:4])
    # min_tokens masks it: the next best token is emitted instead and generation goes on
    _, masked, _ = await post(sim, "/v1/completions", {**body, "min_tokens": 6})
    assert masked["choices"][0]["finish_reason"] == "length" and ids[3] not in masked["choices"][0]["token_ids"]


async def test_stop_strings_with_min_tokens_and_include(sim: SimServer) -> None:
    _, full, _ = await post(sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})
    words = full["choices"][0]["text"].split(" ")
    stop = " " + words[2]  # the 2nd generated word
    _, out, _ = await post(sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stop": stop})
    assert out["choices"][0]["text"] == " " + words[1] and out["choices"][0]["stop_reason"] == stop
    _, inc, _ = await post(
        sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stop": stop, "include_stop_str_in_output": True}
    )
    assert inc["choices"][0]["text"] == " " + words[1] + stop
    # not looked for until min_tokens tokens are out
    body = {"prompt": PROMPT, "max_tokens": 8, "stop": stop, "min_tokens": 3}
    _, late, _ = await post(sim, "/v1/completions", body)
    assert late["choices"][0]["text"] == full["choices"][0]["text"] and late["choices"][0]["finish_reason"] == "length"


async def test_max_tokens_defaults_and_bounds_like_vllm() -> None:
    async with SimServer(sim_config(max_model_len=128)) as sim:
        _, out, _ = await post(sim, "/v1/completions", {"prompt": PROMPT})
        assert out["usage"]["completion_tokens"] == 16  # completions default to 16
        _, chat, _ = await post(sim, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert chat["usage"]["total_tokens"] == 128  # chat: up to the context
        _, big, _ = await post(sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 128})
        assert big["usage"]["completion_tokens"] == 128 - len(PROMPT)  # bounded by the context, 200
        assert big["choices"][0]["finish_reason"] == "length"


async def test_sampling_parameters_are_accepted_and_seed_changes_the_text(sim: SimServer) -> None:
    base = {"prompt": PROMPT, "max_tokens": 5}
    _, plain, _ = await post(sim, "/v1/completions", base)
    extra = {
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "temperature": 0.7,
        "top_p": 0.9, "top_k": 40, "min_p": 0.05, "response_format": {"type": "json_object"}, "min_tokens": 2,
    }  # fmt: skip
    status, same, _ = await post(sim, "/v1/completions", {**base, **extra})
    assert status == 200 and same["choices"][0]["text"] == plain["choices"][0]["text"]  # no model to steer
    _, seeded, _ = await post(sim, "/v1/completions", {**base, "seed": 7})
    _, seeded2, _ = await post(sim, "/v1/completions", {**base, "seed": 7})
    assert seeded["choices"][0]["text"] == seeded2["choices"][0]["text"] != plain["choices"][0]["text"]
    status, _, _ = await post(sim, "/v1/completions", {**base, "response_format": {"type": "yaml"}})
    assert status == 400


async def test_unknown_fields_are_ignored_and_logged(sim: SimServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_sim.http"):
        status, out, _ = await post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 2, "frobnicate_ix": 1})
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    assert "frobnicate_ix" in caplog.text and "ignored" in caplog.text


# --- usage.prompt_tokens_details -------------------------------------------------------------------


async def test_cached_tokens_only_with_the_flag_and_a_hit() -> None:
    body = {"prompt": list(range(900, 1000)), "max_tokens": 2}
    async with SimServer(sim_config()) as sim:
        await post(sim, "/v1/completions", body)
        _, off, _ = await post(sim, "/v1/completions", body)
        assert off["usage"]["prompt_tokens_details"] is None  # vLLM's default: not reported
    async with SimServer(sim_config(enable_prompt_tokens_details=True)) as sim:
        _, miss, _ = await post(sim, "/v1/completions", body)
        no_hit = {"cached_tokens": 0, "created_cache_tokens": None, "multimodal_tokens": None}
        assert miss["usage"]["prompt_tokens_details"] == no_hit  # no hit: 0, as vLLM (simfid audit)
        _, hit, _ = await post(sim, "/v1/completions", body)
        assert hit["usage"]["prompt_tokens_details"] == {**no_hit, "cached_tokens": 96}
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        _, text, _ = await post(sim, "/v1/completions", stream)
        usage = chunks(text)[-1]["usage"]
        assert usage == {"prompt_tokens": 100, "total_tokens": 102, "completion_tokens": 2,
                         "prompt_tokens_details": {"cached_tokens": 96}}  # fmt: skip
        chat = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 2}
        await post(sim, "/v1/chat/completions", chat)
        _, again, _ = await post(sim, "/v1/chat/completions", chat)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
