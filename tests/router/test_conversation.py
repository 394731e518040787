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


# What vLLM 0.32's ChatCompletionRequest validation hands the template for these messages, printed
# with json.dumps as a template's `tojson` prints it (a chat template that dumps `messages`, run
# through vLLM's own OnlineRenderer.render_chat; chat audit of 2026-12-06).
def test_tool_calls_and_developer_tools_come_in_vllm_s_key_order_not_the_client_s() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "dev", "tools": [{
            "function": {"parameters": {"type": "object"}, "strict": True, "description": "d", "name": "g", "zz": 1},
            "type": "function", "extra_tool": 2,
        }]},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "zz": 1, "type": "function", "function": {"q": 3, "name": "f", "arguments": '{"b": 1, "a": 2}'},
            "index": 0, "id": "c1",
        }]},
    ]  # fmt: skip
    out = conversation(messages, template="{# 'developer' #}")  # a template naming the role keeps it
    assert json.dumps(out[0]["tools"]) == (
        '[{"function": {"name": "g", "description": "d", "parameters": {"type": "object"}, "strict": true, "zz": 1}, '
        '"type": "function", "extra_tool": 2}]'
    )
    assert json.dumps(out[2]["tool_calls"]) == (
        '[{"id": "c1", "function": {"arguments": {"b": 1, "a": 2}, "name": "f", "q": 3}, "type": "function", '
        '"zz": 1, "index": 0}]'
    )


def test_reasoning_content_is_read_as_reasoning_unless_reasoning_is_given() -> None:
    def assistant(**reasoning: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "ok", **reasoning}]
        return conversation(messages, template="")[1]

    assert assistant(reasoning_content="R2") == {
        "role": "assistant", "content": "ok", "reasoning": "R2", "reasoning_content": "R2"
    }  # fmt: skip
    assert assistant(reasoning=None, reasoning_content="R2")["reasoning"] == "R2"
    assert assistant(reasoning="R1", reasoning_content="R2")["reasoning_content"] == "R1"
