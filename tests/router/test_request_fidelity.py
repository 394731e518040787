"""The router reads the request fields it routes by as vLLM 0.32 reads them: integers and token ids
as its pydantic models' lax mode does, a batch that mixes texts and id lists refused as vLLM
refuses it, and a completion's `max_tokens: null` as the 16 tokens vLLM runs (the audit of
2026-12-03 found all three different). tests/engine_sim/test_request_fidelity.py holds engine_sim
to the same tables."""

from __future__ import annotations

import math
from typing import Any

import pytest

import router.request_parsing
from router.api_errors import ApiError
from router.request_parsing import parse_request

# vLLM 0.32's CompletionRequest (pydantic, lax mode) on each value of `max_tokens`; ERR is its 400.
# Recorded with `.venv-vllm/bin/python`: CompletionRequest.model_validate({"model": "m", "prompt":
# "x", "max_tokens": value}).max_tokens; `n`, `stop_token_ids: [7, value]` and chat's
# `max_completion_tokens` read every value alike. Text is read as pydantic-core's str_as_int reads
# it, quirks included ("0-9" is -9); msgspec's lax mode, which the router used, took "1e3" and
# refused true.
VLLM_INTEGERS: list[tuple[Any, Any]] = [
    (True, 1), (False, 0), (2.0, 2), (-0.0, 0), (2.5, "ERR"), ("2", 2), ("2.0", 2), ("2.00", 2),
    (" 2 ", 2), ("\t2\n", 2), ("\xa02", 2), ("+3", 3), ("-1", -1), ("1_000", 1000), ("0002", 2),
    ("0-9", -9), ("2.", "ERR"), ("1e3", "ERR"), ("0x10", "ERR"), ("2.5", "ERR"), ("", "ERR"), ("x", "ERR"),
    ("true", "ERR"), ("\x1c2", "ERR"), ("\u0661\u0662", "ERR"), ("1__0", "ERR"), (1e20, "ERR"),
    (math.nan, "ERR"), ([2], "ERR"), ({}, "ERR"),
]  # fmt: skip

# The same model's `prompt` (a union of token ids, id lists, a text and texts): the value it
# validates to, ERR for its 400. All strings are texts; an id list is read laxly, id by id.
VLLM_PROMPTS: list[tuple[Any, Any]] = [
    ([1, 2.0], [1, 2]), ([1, True], [1, 1]), ([1, "2"], [1, 2]), ([1, " 2 "], [1, 2]), ([True], [1]),
    (["5", 6], [5, 6]), ([[1, 2], [3.0]], [[1, 2], [3]]), ([[1], ["2"]], [[1], [2]]),
    ([[1], [True, "3"]], [[1], [1, 3]]), (["1", "2"], ["1", "2"]),
    (["Hello", [6, 7, 8]], "ERR"), ([[6, 7], "Hello"], "ERR"), ([[1], 2], "ERR"), ([1, 2.5], "ERR"),
    ([1, "2."], "ERR"), ([1, "1e3"], "ERR"), ([1, None], "ERR"), ([1, -1], "ERR"), (["a", 1], "ERR"),
]  # fmt: skip

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(body: dict[str, Any], *, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_request(body, chat=chat)
    return err.value


@pytest.mark.parametrize(("value", "vllm"), VLLM_INTEGERS)
def test_integer_fields_are_read_as_vllm_reads_them(value: Any, vllm: Any) -> None:
    bodies = {
        "max_tokens": ({"prompt": "hi", "max_tokens": value}, False),
        "n": ({"prompt": "hi", "n": value}, False),
        "truncate_prompt_tokens": ({"prompt": "hi", "truncate_prompt_tokens": value}, False),
        "max_completion_tokens": ({**CHAT, "max_completion_tokens": value}, True),
    }
    if vllm == "ERR":
        for name, (body, chat) in bodies.items():
            err = _refused(body, chat=chat)
            assert (err.code, err.param) == (400, f"body.{name}")  # vLLM's validation handler's
        return
    if vllm < -1:  # vLLM 0.32 bounds truncate_prompt_tokens ge=-1
        body, chat = bodies.pop("truncate_prompt_tokens")
        assert _refused(body, chat=chat).param == "body.truncate_prompt_tokens"
    read = {name: parse_request(body, chat=chat) for name, (body, chat) in bodies.items()}
    # What the router books of each: vLLM's value, where a count below 1 is the default
    assert read["max_tokens"].max_tokens == (vllm if vllm > 0 else 16)
    assert read["n"].shape.sequences == max(vllm, 1)
    if "truncate_prompt_tokens" in read:
        assert read["truncate_prompt_tokens"].truncate == ((vllm, None) if vllm > 0 else None)
    assert read["max_completion_tokens"].max_tokens == (vllm if vllm > 0 else None)
    assert read["max_tokens"].params["max_tokens"] is value, "the engine gets the value as sent"


@pytest.mark.parametrize(("prompt", "vllm"), VLLM_PROMPTS)
def test_prompts_are_read_as_vllm_reads_them(prompt: Any, vllm: Any) -> None:
    if vllm == "ERR":
        err = _refused({"prompt": prompt})
        assert (err.code, err.param) == (400, "prompt")
        return
    one_prompt = all(isinstance(t, int) for t in vllm)
    assert parse_request({"prompt": prompt}, chat=False).prompts == ([vllm] if one_prompt else vllm)


@pytest.mark.parametrize("prompt", [["Hello", [6, 7, 8]], [[6, 7], "Hello", [8]], [[1], 2]])
def test_a_batch_mixing_texts_and_id_lists_is_refused_saying_so(prompt: Any) -> None:
    err = _refused({"prompt": prompt})
    assert (err.code, err.param, err.message) == (
        400,
        "prompt",
        "a batch of prompts must be all strings or all token-id lists",
    )


def test_an_id_vllm_would_not_read_is_a_prompt_of_no_form_it_takes() -> None:
    """As engine_sim words it (vLLM's union refuses every member); until 2026-12-07 the router's
    own words named the id."""
    err = _refused({"prompt": [1, "2", 2.5, "x"]})
    assert (err.param, err.message) == (
        "prompt",
        "prompt must be a string, a list of token ids, or a list of strings or token-id lists",
    )


def test_a_prompt_of_plain_ids_is_read_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    # The lax reading is a Python loop: a 4 k-token prompt of plain ids must not take it.
    def no_loop(value: object) -> int | None:
        raise AssertionError("lax_int on the common path")

    monkeypatch.setattr(router.request_parsing, "lax_int", no_loop)
    ids = list(range(4096))
    assert parse_request({"prompt": ids}, chat=False).prompts == [ids]
    assert parse_request({"prompt": [ids[:5], ids[5:9]]}, chat=False).prompts == [ids[:5], ids[5:9]]


@pytest.mark.parametrize(
    ("body", "chat", "booked"),
    [
        ({"prompt": "hi", "max_tokens": None}, False, 16),  # normalize_null_max_tokens: the default
        ({**CHAT, "max_tokens": None}, True, None),  # chat has no normalizer: no limit
        ({**CHAT, "max_completion_tokens": None}, True, None),
        ({**CHAT, "max_completion_tokens": None, "max_tokens": 5}, True, 5),
    ],
)
def test_a_null_max_tokens_is_booked_as_vllm_runs_it(body: dict[str, Any], chat: bool, booked: int | None) -> None:
    assert parse_request(body, chat=chat).max_tokens == booked


@pytest.mark.parametrize("text", [str(2**64), "1" + "0" * 30, "1" + "0" * 400, str(-(2**63) - 1)])
def test_an_integer_given_as_text_is_held_to_the_64_bit_range_too(text: str) -> None:
    """lax_int reads text of any size; out of range it was booked (10^30 sequences) or raised
    OverflowError in the SLO policy's float average, a 500, where an int of that size is a 400."""
    for name in ("max_tokens", "n"):
        with pytest.raises(ApiError) as err:
            parse_request({"prompt": "hi", name: text}, chat=False)
        assert err.value.code == 400 and err.value.param == name and "64-bit" in str(err.value)
