"""The conversation and tools a chat template sees, prepared from a request as vLLM 0.32 prepares
them (`renderers/chat_utils.py`: `_parse_chat_message_content`, `_postprocess_messages`;
`renderers/hf.py`: developer messages; the tools' `model_dump()`), for templates that take text
content. Rendering the client's raw messages instead gives other ids from the first tool turn on
(arguments a JSON string where templates expect an object, `None` printed for an empty content, a
`developer` role the template refuses), so such requests lost prefix routing or were refused.

Not reproduced: templates that take content as a list of parts (vLLM detects them from the
template's syntax tree), multimodal parts (refused here), and vLLM's Claude Code billing-header
stripping from system messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ConversationError", "conversation", "tool_definitions"]


class ConversationError(ValueError):
    """A message the router cannot prepare; `where` names it (`messages[2].content`)."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        self.why = why
        super().__init__(f"{where}: {why}")


def conversation(messages: Sequence[Mapping[str, Any]], template: str) -> list[dict[str, Any]]:
    """Each message as vLLM hands it to `template`: only the keys vLLM keeps, text parts joined by
    newlines, tool-call arguments as objects, and `developer` messages as one leading `system`
    message when the template does not name the developer role."""
    out = [_message(i, m) for i, m in enumerate(messages)]
    if any(m["role"] == "developer" for m in out) and '"developer"' not in template and "'developer'" not in template:
        out = _system_first([{**m, "role": "system"} if m["role"] == "developer" else m for m in out])
        for m in out:
            m.pop("tools", None)
    return out


def tool_definitions(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """`tools` as vLLM's models dump them: `type`, then `function` with `name`, `description` and
    `parameters` (None when absent), `strict` and `defer_loading` only when set; other keys
    dropped. A malformed tool is left as sent: the engine refuses it."""
    if tools is None:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            out.append(tool)
            continue
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        defer = function.get("defer_loading", tool.get("defer_loading"))
        for key, value in (("strict", function.get("strict")), ("defer_loading", defer)):
            if value is not None:
                dumped[key] = value
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def _message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    out: dict[str, Any] = {"role": role, "content": _text(i, message.get("content"))}
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [_tool_call(i, c) for c in calls]
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _text(i: int, content: Any) -> Any:
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        text = part.get("text") if isinstance(part, Mapping) and part.get("type", "text") == "text" else None
        if not isinstance(text, str):
            raise ConversationError(f"messages[{i}].content", "the router tokenizes only text parts")
        texts.append(text)
    return "\n".join(texts)


def _tool_call(i: int, call: Any) -> Any:
    """One assistant tool call with its arguments as an object: a JSON string parsed, anything
    that is not an object (bad JSON, a list, empty) as `{}`, as vLLM coerces them."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise ConversationError(
            f"messages[{i}].tool_calls", "chat completions only support tool calls of type 'function'"
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's consolidation after the developer-to-system change: every system message's text
    merged, blank lines between, into one message at the start, when one is not first already
    or there are several."""
    systems = [m for m in messages if m["role"] == "system"]
    if not systems or (len(systems) == 1 and messages[0]["role"] == "system"):
        return messages
    texts = [t for m in systems if (t := m.get("content") or "")]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m["role"] != "system")]
