"""protocol.vllm_errors's errors against pydantic's own (python mode, as FastAPI validates a body
vLLM's models read)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from pydantic import TypeAdapter, ValidationError

from protocol.vllm_errors import type_errors

_BOOL = TypeAdapter(bool)


def _pydantic_kind(adapter: TypeAdapter[Any], value: Any) -> str | None:
    try:
        adapter.validate_python(value)
    except ValidationError as exc:
        return str(exc.errors()[0]["type"])
    return None


@pytest.mark.parametrize(
    "value",
    [
        # read as a number, then refused: bool_parsing
        2, -1, 2.0, -1.0, 9.2e18, -(2**63), 2**63 - 1, -9.223372036854775e18, "maybe", "2",
        # no boolean pydantic can read as a number: bool_type (was bool_parsing: every number was)
        0.5, 1.5, -0.5, 1e-300, 2**63, -(2**63) - 1, 2**64, 10**30, 1e19, 1e300, float(2**63), float(-(2**63)),
        float("inf"), float("-inf"), float("nan"), [], {},
        # taken
        True, 1, 0, 1.0, -0.0, "yes", "off",
    ],
)  # fmt: skip
def test_a_boolean_field_is_refused_as_pydantic_refuses_it(value: Any) -> None:
    errors = type_errors("body.stream", value, msgspec.inspect.type_info(bool))
    assert (errors[0]["type"] if errors else None) == _pydantic_kind(_BOOL, value), value
