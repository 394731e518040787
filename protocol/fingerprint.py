"""Tokenizer fingerprints: how a router knows its tokenizer is the one a worker's engine uses.

Both sides tokenize the same fixed probes (`PROBES`) and hash the ids: the shim through its engine
(each probe's `body()` is a request vLLM's `/tokenize` takes), the router through its own tokenizer.
Equal fingerprints mean equal ids for every probe:
- the probe text (ASCII, digits, whitespace runs, accents, CJK, emoji) with the special tokens added;
- common special-token spellings in plain text (`SPECIAL_SPELLINGS`): a fine-tune's added tokens;
- a system and user turn with the generation prompt;
- a multi-turn chat ending on an assistant turn, without the generation prompt: how an assistant
  turn is closed (an `eos_token` there, say);
- `tools` with a user turn, and an assistant tool call with the tool's reply: the tool layout.
A probe the engine refuses (no chat template, a template that raises) counts as refused, on both
sides alike. engine_sim's built-in vocabulary advertises `BUILTIN` instead. Changing a probe changes
every fingerprint: a router and a shim of different probe sets disagree on every tokenizer.

The probe set changed on `PROBES_SINCE` (2026-12-04). Before, a shim probed the probe text and the
system + user chat alone (`PROBES[0]`, `PROBES[2]`, the chat left out when refused):
`legacy_fingerprint` computes that from the same results, so a router can tell a shim that predates
the change (its tokenizer matching under the old probes) from a tokenizer that differs. It never
accepts such a worker for text: the old probes cannot tell apart tokenizers the new ones do
(docs/deployment.md, "Upgrades").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import cache
from typing import Any

import msgspec
import xxhash

from protocol.tokenizer import BuiltinTokenizer, apply_chat_template

__all__ = [
    "BUILTIN",
    "PROBES",
    "PROBES_SINCE",
    "PROBE_MESSAGES",
    "PROBE_TEXT",
    "SPECIAL_SPELLINGS",
    "ChatProbe",
    "Probe",
    "TextProbe",
    "builtin_fingerprint",
    "fingerprint",
    "legacy_fingerprint",
]

BUILTIN = "builtin"
PROBE_TEXT = (
    "kvswitch tokenizer probe: The quick brown fox jumps over the lazy dog 0123456789.\n"
    "  Indented\ttabs, URLs https://example.com/a?b=c&d=e, café naïve Ünïcödé, 東京の天気, "
    "emoji 🚀🔥, code `def f(x): return x**2` and <tags></tags>."
)
# Control tokens model families use (and fine-tunes add): one that is a token to only one side
# tokenizes differently here.
SPECIAL_SPELLINGS = (
    "<s> </s> <unk> <pad> <mask> <bos> <eos> <|endoftext|> <|im_start|> <|im_end|> <|im_sep|> "
    "<|begin_of_text|> <|end_of_text|> <|start_header_id|> <|end_header_id|> <|eot_id|> <|eom_id|> "
    "<|python_tag|> <|finetune_right_pad_id|> <|reserved_special_token_0|> [INST] [/INST] <<SYS>> "
    "[SYSTEM_PROMPT] [AVAILABLE_TOOLS] [/AVAILABLE_TOOLS] [TOOL_CALLS] [TOOL_RESULTS] [/TOOL_RESULTS] "
    "<|system|> <|user|> <|assistant|> <|end|> <|tool|> <|tool_call|> <|/tool_call|> <|tool_response|> "
    "<tool_call> </tool_call> <tool_response> </tool_response> <tools> </tools> <think> </think> "
    "<start_of_turn> <end_of_turn> <|start|> <|message|> <|channel|> <|return|> <|call|> "
    "<|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
    "<|image|> <image> <|image_pad|> <|vision_start|> <|vision_end|> <|video_pad|> <|audio|> "
    # DeepSeek's, with full-width bars and U+2581 spaces
    "<\uff5cbegin\u2581of\u2581sentence\uff5c> <\uff5cend\u2581of\u2581sentence\uff5c> <\uff5cUser\uff5c> "
    "<\uff5cAssistant\uff5c> <\uff5ctool\u2581calls\u2581begin\uff5c>"
)
PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Say hello, 世界!"},
)
_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_SEED = 0x6B76737769746368
_REFUSED = 0xFFFFFFFF  # a probe's length field when the engine refused it (no probe is that long)


class TextProbe(msgspec.Struct, frozen=True, kw_only=True):
    """`/tokenize` of a prompt."""

    prompt: str
    add_special_tokens: bool

    def body(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens}


class ChatProbe(msgspec.Struct, frozen=True, kw_only=True):
    """`/tokenize` of messages through the chat template (vLLM's `add_special_tokens` default, false)."""

    messages: tuple[dict[str, Any], ...]
    add_generation_prompt: bool
    tools: tuple[dict[str, Any], ...] | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"messages": list(self.messages), "add_generation_prompt": self.add_generation_prompt}
        if self.tools is not None:
            body["tools"] = list(self.tools)
        return body


Probe = TextProbe | ChatProbe

PROBES: tuple[Probe, ...] = (
    TextProbe(prompt=PROBE_TEXT, add_special_tokens=True),
    TextProbe(prompt=SPECIAL_SPELLINGS, add_special_tokens=False),
    ChatProbe(messages=PROBE_MESSAGES, add_generation_prompt=True),
    ChatProbe(
        messages=(
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
            {"role": "assistant", "content": "Green, 绿色."},
        ),
        add_generation_prompt=False,
    ),
    ChatProbe(messages=({"role": "user", "content": "Weather in Paris?"},), add_generation_prompt=True, tools=(_TOOL,)),
    ChatProbe(
        messages=(
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call00001",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call00001", "content": "Sunny, 21 °C"},
        ),
        add_generation_prompt=True,
        tools=(_TOOL,),
    ),
)


PROBES_SINCE = "2026-12-04"
"""When `PROBES` took their present form: shims of before advertise `legacy_fingerprint`s."""
_LEGACY_TEXT, _LEGACY_CHAT = 0, 2  # the probes of before, in today's set


def legacy_fingerprint(results: Sequence[Sequence[int] | None]) -> str:
    """The fingerprint a shim older than `PROBES_SINCE` advertises for the tokenizer whose probe
    results (in `PROBES` order) are `results`: xxh3 over the probe text's ids and, unless refused
    (no chat template), the system + user chat's with the generation prompt."""
    if len(results) != len(PROBES):
        raise ValueError(f"{len(results)} probe results for {len(PROBES)} probes")
    text, chat = results[_LEGACY_TEXT], results[_LEGACY_CHAT]
    if text is None:
        raise ValueError("the probe text has no ids: a text probe is never refused")
    h = xxhash.xxh3_64(seed=_SEED)
    h.update(struct.pack(f"<I{len(text)}I", len(text), *text))
    if chat is not None:
        h.update(struct.pack(f"<I{len(chat)}I", len(chat), *chat))
    return f"tok-{h.hexdigest()}"


def fingerprint(results: Sequence[Sequence[int] | None]) -> str:
    """`tok-` and 16 hex digits over each probe's ids, in `PROBES` order (None: the probe was
    refused, e.g. the tokenizer has no chat template)."""
    if len(results) != len(PROBES):
        raise ValueError(f"{len(results)} probe results for {len(PROBES)} probes")
    h = xxhash.xxh3_64(seed=_SEED)
    for ids in results:
        if ids is None:
            h.update(struct.pack("<I", _REFUSED))
        else:
            h.update(struct.pack(f"<I{len(ids)}I", len(ids), *ids))
    return f"tok-{h.hexdigest()}"


@cache
def builtin_fingerprint() -> str:
    """The fingerprint of protocol.tokenizer's built-in vocabulary as engine_sim's `/tokenize`
    answers the probes: no special tokens to add, ChatML for messages (`tools` unused), a message
    ChatML cannot write (no text content) refused. A worker whose engine yields this advertises
    `BUILTIN` instead."""
    tok = BuiltinTokenizer()
    results: list[list[int] | None] = []
    for probe in PROBES:
        if isinstance(probe, TextProbe):
            results.append(tok.encode(probe.prompt))
            continue
        try:
            results.append(
                tok.encode(apply_chat_template(probe.messages, add_generation_prompt=probe.add_generation_prompt))
            )
        except ValueError:
            results.append(None)
    return fingerprint(results)
