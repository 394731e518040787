"""router.conversation: messages as vLLM hands them to a chat template."""

from __future__ import annotations

import json
from typing import Any

from router.conversation import conversation


def test_tool_call_arguments_nested_too_deep_to_parse_count_as_no_object() -> None:
    """json.loads raises RecursionError, not JSONDecodeError, past Python's recursion limit: it
    escaped as a 500 where any other unparsable arguments string reads as {} (audit protocol)."""
    deep = "[" * 5000 + "]" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    shallow = {**call, "function": {"name": "f", "arguments": json.dumps({"a": 1})}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call, shallow]},
    ]
    out = conversation(messages, template="")
    calls = out[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {} and calls[1]["function"]["arguments"] == {"a": 1}
