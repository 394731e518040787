"""The sim's request parsing: bodies decode as vLLM's FastAPI decodes them (the stdlib's JSON
rules, msgspec only as the fast path), and token-id prompts keep their forms."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engine_sim.errors import SimRequestError
from engine_sim.openai_request import CompletionRequest, _prompts, parse_body


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


@pytest.mark.parametrize("prompt", [[1, True], [1, 2.0], [], [[1], 2]])
def test_what_is_not_a_prompt_is_refused(prompt: Any) -> None:
    with pytest.raises(SimRequestError):
        _prompts(prompt)
