"""vLLM 0.32's OpenAI response and error bodies, field for field as captured in
tests/fixtures/vllm-0.32 (key order included): plain functions from values to JSON-ready dicts,
plus the request bodies as msgspec Structs (unknown fields ignored, as vLLM ignores them)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

from engine_sim.errors import SimRequestError

__all__ = [
    "VLLM_VERSION",
    "ChatBody",
    "CompletionBody",
    "Head",
    "Output",
    "StopText",
    "chat_chunk",
    "chat_first_chunk",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_response",
    "error_body",
    "malformed_json_error",
    "models_response",
    "parse_body",
    "usage",
    "usage_chunk",
]

VLLM_VERSION = "0.32.0"

_json = msgspec.json.Encoder()
T = TypeVar("T")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerateBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionBody(_GenerateBody, kw_only=True):
    prompt: Any = None


class ChatBody(_GenerateBody, kw_only=True):
    messages: Any = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True


def error_body(message: str, kind: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def malformed_json_error(exc: json.JSONDecodeError) -> SimRequestError:
    """vLLM (FastAPI + pydantic) reports the decode error with its character offset."""
    loc = f"body.{exc.pos}"
    detail = {"type": "json_invalid", "loc": loc, "msg": "JSON decode error", "input": "<dict of 0 items>",
              "ctx": {"error": exc.msg}}  # fmt: skip
    return SimRequestError(f"1 validation error:\n  {detail}", kind="Bad Request", param=loc)


def parse_body(raw: bytes, kind: type[T]) -> T:
    try:
        obj = json.loads(raw or b"null")
    except json.JSONDecodeError as exc:
        raise malformed_json_error(exc) from exc
    except UnicodeDecodeError as exc:
        raise SimRequestError(f"request body is not UTF-8: {exc}") from exc
    if not isinstance(obj, dict):
        raise SimRequestError("request body must be a JSON object")
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as exc:
        raise SimRequestError(str(exc), param=str(exc).rsplit("`$.", 1)[-1].rstrip("`") or None) from exc


def usage(prompt: int, completion: int, *, details: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        out["prompt_tokens_details"] = None
        out["completion_tokens_details"] = None
    return out


class Head(msgspec.Struct, frozen=True, gc=False):
    """What every response object of one call names: its id, creation time, model and fingerprint."""

    rid: str
    created: int
    model: str
    fingerprint: str

    def envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}


class Output(msgspec.Struct, gc=False):
    """What one choice (or one chunk of it) carries; `token_ids` only when the client asked."""

    text: str
    finish_reason: str | None
    stop_reason: str | None
    token_ids: list[int] | None


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
        "logprobs": None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }


def completion_choice(index: int, out: Output, prompt_token_ids: list[int] | None) -> dict[str, Any]:
    return {
        **_text_choice(index, out),
        "token_ids": out.token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "routed_experts": None,
    }


def completion_chunk(head: Head, index: int, out: Output, prompt_token_ids: list[int] | None) -> dict[str, Any]:
    choice = {**_text_choice(index, out), "prompt_token_ids": prompt_token_ids, "token_ids": out.token_ids}
    return {**head.envelope("text_completion"), "choices": [choice]}


def usage_chunk(head: Head, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    return {**head.envelope(obj), "choices": [], "usage": usage_, "system_fingerprint": head.fingerprint}


def chat_response(
    head: Head,
    out: Output,
    prompt_token_ids: list[int] | None,
    usage_: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": out.text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "token_ids": out.token_ids,
        "routed_experts": None,
    }
    return {
        **head.envelope("chat.completion"),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": head.fingerprint,
        "usage": usage_,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_first_chunk(head: Head, prompt_token_ids: list[int] | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return {**head.envelope("chat.completion.chunk"), "choices": [choice], "prompt_token_ids": prompt_token_ids,
            "prompt_text": None}  # fmt: skip


def chat_chunk(head: Head, out: Output) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": out.text}, "logprobs": None,
                              "finish_reason": out.finish_reason}  # fmt: skip
    # vLLM adds stop_reason and the fingerprint only to the chunk that ends the choice.
    if out.finish_reason is not None:
        choice["stop_reason"] = out.stop_reason
    choice["token_ids"] = out.token_ids
    chunk = {**head.envelope("chat.completion.chunk"), "choices": [choice]}
    if out.finish_reason is not None:
        chunk["system_fingerprint"] = head.fingerprint
    return chunk


def models_response(model: str, created: int, max_model_len: int, perm_id: str) -> dict[str, Any]:
    permission = {
        "id": perm_id,
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
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class StopText:
    """Incremental detokenisation with stop strings, as vLLM's output processor does it: text that
    could still turn out to begin a stop string is held back; on a match the text ends before it."""

    __slots__ = ("_hold", "_sent", "stop_reason", "stops", "text")

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stop_reason: str | None = None

    def add(self, piece: str) -> str:
        """Append decoded text; return what may be emitted now (possibly "")."""
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0:
                self.stop_reason = s
                self.text = self.text[:i]
                return self._flush(len(self.text))
        return self._flush(len(self.text) - self._hold)

    def finish(self) -> str:
        return self._flush(len(self.text))

    def _flush(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self.text[self._sent : upto]
        self._sent = upto
        return out
