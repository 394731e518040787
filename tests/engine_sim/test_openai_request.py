"""The sim's request parsing: bodies decode as vLLM's FastAPI decodes them (the stdlib's JSON
rules, msgspec only as the fast path), and token-id prompts keep their forms."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from engine_sim.errors import SimRequestError
from engine_sim.openai_request import CompletionRequest, _prompts, completion_call, parse_body


def test_the_stdlibs_json_extensions_are_accepted_as_vllm_accepts_them() -> None:
    body = parse_body(b'{"prompt": "x", "temperature": NaN, "top_p": 1e400}', CompletionRequest)
    assert math.isnan(body.temperature or 0.0) and body.top_p == math.inf


def test_malformed_json_names_the_offset() -> None:
    with pytest.raises(SimRequestError) as err:
        parse_body(b'{"prompt": [1, 2,', CompletionRequest)
    assert err.value.param == "body.17" and "json_invalid" in str(err.value)


@pytest.mark.parametrize(
    ("prompt", "ids"),
    [([5, 6, 7], [[5, 6, 7]]), ([[5], [6, 7]], [[5], [6, 7]]), (list(range(4096)), [list(range(4096))])],
)
def test_token_id_prompts(prompt: Any, ids: list[list[int]]) -> None:
    assert [p.token_ids for p in _prompts(prompt)] == ids


@pytest.mark.parametrize("prompt", [[[1], 2], ["one", [5, 6]]])
def test_what_is_not_a_prompt_is_refused(prompt: Any) -> None:
    with pytest.raises(SimRequestError):
        _prompts(prompt)


def test_an_empty_prompt_list_is_a_batch_of_none_which_vllm_refuses() -> None:
    assert _prompts([]) == []  # refused later, in the renderer's words (test_vllm_shapes_2.py)
    with pytest.raises(SimRequestError, match=r"^You must pass at least one prompt$"):
        completion_call(parse_body(b'{"prompt": []}', CompletionRequest), 32768)


# vLLM 0.32's CompletionRequest (pydantic, lax mode) on each value, for `stream`, `echo`,
# `ignore_eos` (a bool with no None) and `stream_options.include_usage`; ERR is its 422/400.
# Recorded with `.venv-vllm/bin/python`: CompletionRequest.model_validate({..., field: value}).
VLLM_BOOLEANS: list[tuple[Any, list[Any]]] = [
    ("yes", [True] * 4), ("YES", [True] * 4), ("On", [True] * 4), ("t", [True] * 4), ("y", [True] * 4),
    ("1", [True] * 4), (1, [True] * 4), (1.0, [True] * 4), ("True", [True] * 4),
    ("off", [False] * 4), ("n", [False] * 4), ("F", [False] * 4), ("0", [False] * 4), (0.0, [False] * 4),
    ("maybe", ["ERR"] * 4), (2, ["ERR"] * 4), (1.5, ["ERR"] * 4), (None, [None, None, "ERR", None]),
]  # fmt: skip


@pytest.mark.parametrize(("value", "vllm"), VLLM_BOOLEANS)
def test_booleans_are_read_as_vllm_reads_them(value: Any, vllm: list[Any]) -> None:
    # msgspec's own lax mode refused "yes", "on", "t" and 1.0: a 400 where vLLM streams.
    def read(body: dict[str, Any], get: Any) -> Any:
        try:
            return get(parse_body(json.dumps({"prompt": "x", **body}).encode(), CompletionRequest))
        except SimRequestError:
            return "ERR"

    got = [read({f: value}, lambda b, f=f: getattr(b, f)) for f in ("stream", "echo", "ignore_eos")]
    got.append(
        read({"stream": True, "stream_options": {"include_usage": value}}, lambda b: b.stream_options.include_usage)
    )
    assert got == vllm
