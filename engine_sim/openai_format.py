"""vLLM 0.32's OpenAI response and error bodies, field for field as captured in
tests/fixtures/vllm-0.32 (key order included): plain functions from values to JSON-ready dicts.
Request bodies and their validation: engine_sim/openai_request.py."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from engine_sim.lora import LoraRequest

__all__ = [
    "SSE_DONE",
    "VLLM_VERSION",
    "Head",
    "Output",
    "chat_choice",
    "chat_chunk",
    "chat_echo_chunk",
    "chat_first_chunk",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_response",
    "error_body",
    "models_response",
    "running_usage",
    "sse",
    "tokenize_response",
    "usage",
    "usage_chunk",
]

VLLM_VERSION = "0.32.0"

_json = msgspec.json.Encoder()


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt: int, completion: int, cached: int | None = None, created: int | None = None) -> dict[str, Any]:
    """vLLM's UsageInfo. prompt_tokens_details (its PromptTokenUsageInfo) whenever the caller
    passes `cached` (with --enable-prompt-tokens-details: a miss is a 0, not null); `created`,
    the prompt tokens written to the cache, only chat fills."""
    details = None
    if cached is not None:
        details = {"cached_tokens": cached, "created_cache_tokens": created, "multimodal_tokens": None}
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
        "completion_tokens_details": None,
    }


def _without_none(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in obj.items() if v is not None}


class Head(msgspec.Struct, frozen=True, gc=False):
    """What every response object of one call names: its id, creation time, model and fingerprint."""

    rid: str
    created: int
    model: str
    fingerprint: str

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}


class Output(msgspec.Struct, gc=False):
    """What one choice (or one chunk of it) carries. `token_ids` only when the client asked;
    `logprobs` already in the endpoint's shape (engine_sim/logprobs.py) or None."""

    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    token_ids: list[int] | None
    logprobs: dict[str, Any] | None = None


def completion_response(
    head: Head, choices: list[dict[str, Any]], usage_: dict[str, Any], kv_transfer_params: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        **head.envelope("text_completion"),
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": head.fingerprint,
        "usage": usage_,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def _text_choice(index: int, out: Output) -> dict[str, Any]:
    return {
        "index": index,
        "text": out.text,
        "logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }


def completion_choice(
    index: int, out: Output, prompt_token_ids: list[int] | None, prompt_logprobs: list[Any] | None = None
) -> dict[str, Any]:
    return {
        **_text_choice(index, out),
        "token_ids": out.token_ids,
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def running_usage(prompt: int, completion: int, *, chat: bool) -> dict[str, Any]:
    """A chunk's usage with stream_options.continuous_usage_stats: the choice's prompt and its
    tokens so far. vLLM serialises only the fields it set, chat's completion_tokens_details too."""
    counts = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    return {**counts, "completion_tokens_details": None} if chat else counts


def completion_chunk(
    head: Head,
    index: int,
    out: Output,
    prompt_token_ids: list[int] | None,
    fingerprint: bool,
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`fingerprint`: no usage chunk follows, so the chunk that ends the choice names it (vLLM).
    `usage_`: running_usage's, with continuous usage stats."""
    choice = {**_text_choice(index, out), "prompt_token_ids": prompt_token_ids, "token_ids": out.token_ids}
    chunk = {**head.envelope("text_completion"), "choices": [choice]}
    if usage_ is not None:
        chunk["usage"] = usage_
    if fingerprint and out.finish_reason is not None:
        chunk["system_fingerprint"] = head.fingerprint
    return chunk


def usage_chunk(head: Head, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The final stream chunk; vLLM serialises it without its null fields (zeros stay)."""
    return {**head.envelope(obj), "choices": [], "usage": _without_none(usage_), "system_fingerprint": head.fingerprint}


def chat_choice(index: int, out: Output) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": out.text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": index,
        "message": message,
        "logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": out.token_ids,
        "routed_experts": None,
    }


def chat_response(
    head: Head,
    choices: list[dict[str, Any]],
    prompt_token_ids: list[int] | None,
    usage_: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    return {
        **head.envelope("chat.completion"),
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": head.fingerprint,
        "usage": usage_,
        "prompt_logprobs": prompt_logprobs,
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_first_chunk(
    head: Head, index: int, prompt_token_ids: list[int] | None, usage_: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    chunk: dict[str, Any] = {**head.envelope("chat.completion.chunk"), "choices": [choice]}
    if usage_ is not None:
        chunk["usage"] = usage_
    return {**chunk, "prompt_token_ids": prompt_token_ids, "prompt_text": None}


def chat_echo_chunk(head: Head, index: int, content: str, usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    chunk = {**head.envelope("chat.completion.chunk"), "choices": [choice]}
    return chunk if usage_ is None else {**chunk, "usage": usage_}


def chat_chunk(
    head: Head, index: int, out: Output, fingerprint: bool, usage_: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`fingerprint` and `usage_` as completion_chunk's."""
    choice: dict[str, Any] = {"index": index, "delta": {"content": out.text}, "logprobs": out.logprobs,
                              "finish_reason": out.finish_reason}  # fmt: skip
    # vLLM adds stop_reason only to the chunk that ends the choice, and the fingerprint only there
    # when no usage chunk follows (that one names it).
    if out.finish_reason is not None:
        choice["stop_reason"] = out.stop_reason
    choice["token_ids"] = out.token_ids
    chunk = {**head.envelope("chat.completion.chunk"), "choices": [choice]}
    if usage_ is not None:
        chunk["usage"] = usage_
    if fingerprint and out.finish_reason is not None:
        chunk["system_fingerprint"] = head.fingerprint
    return chunk


def tokenize_response(tokens: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


def _model_card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    """vLLM's ModelCard with one ModelPermission, built afresh for every answer: their `created`
    and the permission's `id` are default factories (now, `modelperm-` and 16 random hex digits)."""
    created = int(time.time())
    permission = {
        "id": f"modelperm-{secrets.token_hex(8)}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [permission],
    }


def models_response(
    model: str,
    max_model_len: int,
    loras: Sequence[LoraRequest] = (),
    aliases: Sequence[str] = (),
    root: str = "",
) -> dict[str, Any]:
    """A card per served name (`model`, then `aliases`, each with the model's `root`: its path,
    "" for `model`), then one per LoRA adapter in load order, as vLLM's show_available_models
    builds them: an adapter's root is its path, its parent the first served name, and its
    max_model_len null (ModelCard's default, which vLLM sets on base cards only). vLLM makes a new
    permission (and id) per card (bs32/v1_models_aliases.json), and new cards for every call."""
    root = root or model
    cards = [_model_card(model, root, None, max_model_len)]
    cards += [_model_card(a, root, None, max_model_len) for a in aliases]
    cards += [_model_card(a.name, a.path, model, None) for a in loras]
    return {"object": "list", "data": cards}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
