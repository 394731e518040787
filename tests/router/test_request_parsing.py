"""parse_request's prompt forms, as vLLM takes them: token ids are validated in C (msgspec), and a
bad id is still named in the 400."""

from __future__ import annotations

from typing import Any

import pytest

from router.http_api import ApiError, parse_request


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([0, 5, 2**32 - 1], [[0, 5, 2**32 - 1]]),
        ("text", ["text"]),
        (["a", [1, 2], "b"], ["a", [1, 2], "b"]),
        ([[3], [4, 5]], [[3], [4, 5]]),
    ],
)
def test_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    assert parse_request({"prompt": prompt}, chat=False).prompts == expected


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, -1], "token ids must be integers in [0, 2^32), got -1"),
        ([1, 2**32], "token ids must be integers in [0, 2^32), got 4294967296"),
        ([[1, 2], [3, 2**40]], "token ids must be integers in [0, 2^32), got 1099511627776"),
        (["a", [7, -4]], "token ids must be integers in [0, 2^32), got -4"),
        # a bool or a float is not an id, so the list is neither ids nor a list of prompts
        ([1, True], "'prompt' must be a string, a non-empty list of token ids, or a list of strings or token-id lists"),
        ([1, 2.0], "'prompt' must be a string, a non-empty list of token ids, or a list of strings or token-id lists"),
        ([], "'prompt' must be a string, a non-empty list of token ids, or a list of strings or token-id lists"),
        ([[1], []], "'prompt' must be a string, a non-empty list of token ids, or a list of strings or token-id lists"),
    ],
)
def test_bad_prompts_are_400_naming_the_prompt(prompt: Any, message: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_request({"prompt": prompt}, chat=False)
    assert (err.value.code, err.value.param, err.value.message) == (400, "prompt", message)


def test_a_long_id_prompt_is_returned_as_sent() -> None:
    ids = list(range(10_000, 14_136))
    assert parse_request({"prompt": ids, "max_tokens": 4}, chat=False).prompts == [ids]
