"""The conversation and tools a chat template sees, prepared from a request as vLLM 0.32 prepares
them (`renderers/chat_utils.py`: `_parse_chat_message_content`, `_postprocess_messages`;
`renderers/hf.py`: developer messages; the tools' `model_dump()`). Rendering the client's raw
messages instead gives other ids from the first tool turn on (arguments a JSON string where
templates expect an object, `None` printed for an empty content, a `developer` role the template
refuses), so such requests lost prefix routing or were refused.

Content reaches the template as text (text parts joined by newlines) or, for a template that loops
over it (router.content_format), as a list of `{"type": "text", "text": ...}` parts, as vLLM hands
it over. Claude Code's per-request billing line is taken out of system messages, as vLLM does.
Not reproduced: multimodal parts (refused here).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from router.content_format import ContentFormat

__all__ = ["ConversationError", "conversation", "tool_definitions"]


class ConversationError(ValueError):
    """A message the router cannot prepare; `where` names it (`messages[2].content`)."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        self.why = why
        super().__init__(f"{where}: {why}")


def conversation(
    messages: Sequence[Mapping[str, Any]], template: str, content_format: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """Each message as vLLM hands it to `template`: only the keys vLLM keeps, content in
    `content_format`, tool-call arguments as objects, and `developer` messages as one leading
    `system` message when the template does not name the developer role."""
    out = [_message(i, m, content_format) for i, m in enumerate(messages)]
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


def _message(i: int, message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message.get("role")
    out: dict[str, Any] = {"role": role, "content": _content(i, role, message.get("content"), content_format)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [_tool_call(i, c) for c in calls]
        reasoning = message.get("reasoning")
        if reasoning is None:  # the older name, which vLLM renames (ChatCompletionRequest, before validation)
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        out["content"] = _tool_content(out["content"])
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        tools = message.get("tools")
        out["tools"] = [_developer_tool(t) for t in tools] if isinstance(tools, list) else tools
    return out


def _schema_order(d: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """`d` as pydantic rebuilds a TypedDict vLLM validates it against: the schema's keys in the
    schema's order, then the others in the client's; a template's `tojson` prints that order."""
    return {**{k: d[k] for k in keys if k in d}, **{k: v for k, v in d.items() if k not in keys}}


def _developer_tool(tool: Any) -> Any:
    """A developer message's tool as vLLM's ChatCompletionFunctionToolParam holds it."""
    if not isinstance(tool, Mapping):
        return tool
    function = tool.get("function")
    if isinstance(function, Mapping):
        tool = {**tool, "function": _schema_order(function, ("name", "description", "parameters", "strict"))}
    return _schema_order(tool, ("function", "type"))


def _tool_content(content: Any) -> Any:
    """vLLM 0.32 hands an "openai" template a tool result's text parts as one string, joined by
    newlines (most templates write tool content as a string; agents send it as parts); a list with
    any other part stays a list (renderers/chat_utils.py, _parse_chat_message_content)."""
    if not isinstance(content, list) or any(isinstance(p, dict) and p.get("type") != "text" for p in content):
        return content
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


# vLLM's text part types, and the key each keeps its text under.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Keys vLLM's part models know; a text part's other keys reach an "openai" template with it.
_KNOWN_PART_KEYS = frozenset({
    "audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url", "input_audio",
    "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid", "video_embeds", "video_url",
})  # fmt: skip
_MEDIA_KEYS = ("image_url", "image_pil", "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds",
               "audio_url", "input_audio", "video_url", "tool_reference")  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"
_NOT_TEXT = "the router tokenizes only text parts"


def _content(i: int, role: Any, content: Any, content_format: ContentFormat) -> Any:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        return content  # not a message vLLM accepts: the engine refuses it
    if role == "system":
        parts = _without_billing_header(parts)
    out = [p for p in (_part(i, part, content_format) for part in parts) if p is not None]
    return out if content_format == "openai" else "\n".join(out)


def _part(i: int, part: Any, content_format: ContentFormat) -> Any:
    """One content part as text, or as a text part for an "openai" template; None for a part
    vLLM skips (a text or refusal part without its text)."""
    extra: dict[str, Any] = {}
    if isinstance(part, str):
        text: Any = part
    elif isinstance(part, Mapping):
        kind = part.get("type")
        where = f"messages[{i}].content"
        if kind is None or part.get("uuid") is not None:
            raise ConversationError(where, _NOT_TEXT if any(k in part for k in _MEDIA_KEYS) else
                                    "Missing 'type' field in multimodal part.")  # fmt: skip
        if not isinstance(kind, str):
            raise ConversationError(where, "Invalid 'type' field in multimodal part.")
        if kind not in _TEXT_PARTS:
            raise ConversationError(where, _NOT_TEXT)
        text = part.get(_TEXT_PARTS[kind])
        if text is None and kind in ("text", "refusal"):
            return None
        if not isinstance(text, str):
            raise ConversationError(where, f"a {kind} part's text must be a string")
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_KEYS}
    else:
        raise ConversationError(f"messages[{i}].content", _NOT_TEXT)
    return {"type": "text", "text": text, **extra} if content_format == "openai" else text


def _without_billing_header(parts: list[Any]) -> list[Any]:
    """System parts without Claude Code's billing line: it changes on every request, so a prompt
    keeping it misses every cache from there on (vLLM 0.32 drops it the same way)."""
    out: list[Any] = []
    for part in parts:
        is_dict = isinstance(part, Mapping) and part.get("type") == "text"
        text = part.get("text") if is_dict else part
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append({**part, "text": rest} if is_dict else rest)
    return out


def _tool_call(i: int, call: Any) -> Any:
    """One assistant tool call with its arguments as an object: a JSON string parsed, anything
    that is not an object (bad JSON, a list, empty) as `{}`, as vLLM coerces them; its keys in
    the order of vLLM's ChatCompletionMessageFunctionToolCallParam (id, function, type; the
    function's arguments, name), not the client's (OpenAI's own order is id, type, function)."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or call.get("type", "function") != "function":
        raise ConversationError(
            f"messages[{i}].tool_calls", "chat completions only support tool calls of type 'function'"
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # nested too deep to parse is no object either
            arguments = {}
    function = _schema_order(
        {**function, "arguments": arguments if isinstance(arguments, dict) else {}}, ("arguments", "name")
    )
    return _schema_order({**call, "function": function}, ("id", "function", "type"))


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's consolidation after the developer-to-system change: every system message's text
    merged, blank lines between, into one message at the start, when one is not first already
    or there are several."""
    systems = [m for m in messages if m["role"] == "system"]
    if not systems or (len(systems) == 1 and messages[0]["role"] == "system"):
        return messages
    texts = [t for m in systems if (t := _joined(m.get("content")))]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m["role"] != "system")]


def _joined(content: Any) -> Any:
    """A system message's text for consolidation: an "openai" list's texts joined by newlines."""
    if not isinstance(content, list):
        return content or ""
    return "\n".join(p["text"] if isinstance(p, Mapping) else p for p in content
                     if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p))  # fmt: skip
