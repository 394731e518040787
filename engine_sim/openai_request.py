"""Request bodies of vLLM 0.32's OpenAI API (/v1/completions, /v1/chat/completions, /tokenize,
/detokenize) and their validation, in vLLM's order and words: the body's own rules first (pydantic
validators), then the prompt (too long: 400), then each prompt's sampling parameters
(SamplingParams._verify_args and the engine's input checks). A valid body becomes a GenerateCall.

Field names and defaults are vLLM's. Unknown fields are ignored and logged, as vLLM does (each
name once per process here, to keep benchmark logs readable). What the sim accepts without being
able to honour it (it has no model): frequency/presence/repetition penalties, temperature, top_p,
top_k, min_p, logit_bias, allowed_token_ids, bad_words, response_format / structured_outputs,
tools (a tool_choice but "none" only with --enable-auto-tool-choice, as vLLM; no tool call is
formed), use_beam_search, cache_salt, add_special_tokens (the built-in tokenizer adds no special
tokens); each is validated as vLLM validates it. logprob_token_ids, which the sim cannot report, is
validated, then refused.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from engine_sim.errors import PromptTooLongError, SimRequestError, VllmValidationError
from engine_sim.logprobs import MAX_LOGPROBS
from engine_sim.lora import LoraRequest
from protocol.messages import lax_bool, lax_int
from protocol.tokenizer import VOCAB_SIZE, BuiltinTokenizer, apply_chat_template
from protocol.vllm_errors import (
    UNSUPPORTED_MEDIA_TYPE,
    VALIDATION_ERROR,
    JsonMediaType,
    error_input,
    field_error,
    json_invalid_error,
    json_media_type,
    missing_error,
    model_type_error,
    struct_errors,
    type_errors,
    validation_message,
    validation_param,
)
from protocol.vllm_validators import (
    CONTINUE_AND_GENERATE,
    ValidatorError,
    check_chat_body,
    check_completion_body,
    default_tool_choice,
)

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "GenerateCall",
    "Prompt",
    "TokenizeRequest",
    "chat_call",
    "check_generation_prompt",
    "check_json_media_type",
    "check_mm_kwargs",
    "check_request_template",
    "check_token_bounds",
    "completion_call",
    "encode_text",
    "parse_body",
    "render_chat",
]

log = logging.getLogger("engine_sim.http")
T = TypeVar("T")
_tokenizer = BuiltinTokenizer()


def encode_text(text: str) -> list[int]:
    """`text`'s ids; a text holding half a UTF-16 pair (JSON's `"\\ud800"`, which JSON decoders
    take) is a 400, as vLLM's: its tokenizer refuses a str no UTF-8 holds with a TypeError, which
    its handler answers 400 BadRequestError."""
    try:
        return _tokenizer.encode(text)
    except UnicodeEncodeError as exc:
        # exc.start is within the tokenizer's regex piece, not the text: find the surrogate in the text
        at = next(i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff")
        where = f"{text[at]!r} at {at}"
        raise SimRequestError(f"the text holds a lone UTF-16 surrogate ({where}), which is no UTF-8") from exc


_LONG = 2**63
_DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens's default, which a null becomes too
_MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
_MAX_TOKEN_ID = 2**63 - 1  # DetokenizeRequest.tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]
_MAX_STOP_STRINGS = 4  # vLLM's VLLM_MAX_STOP_STRINGS default: the body's `stop` list may hold this many
_warned: set[str] = set()
# transformers' apply_chat_template, for continue_final_message with add_generation_prompt by default
_CONTINUE_AND_GENERATE_TEMPLATE = (
    "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you "
    "want the model to continue the final message, and add_generation_prompt when you want to add a header that "
    "will prompt it to start a new assistant message instead."
)
# Content parts vLLM hands its multimodal processor (renderers/chat_utils.py), which a text-only
# model has not; the embeddings' parsers ask for a multimodal config first.
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image_pil", "audio_url", "input_audio", "video_url"})
_EMBEDS_PARTS = frozenset({"image_embeds", "audio_embeds", "video_embeds"})


class StreamOptions(msgspec.Struct, kw_only=True):
    # vLLM's defaults: `stream_options: {}` asks for no usage chunk (and continuous stats only
    # count with include_usage, vllm.entrypoints.serve.utils.api_utils.should_include_usage).
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(msgspec.Struct, kw_only=True):
    """What completions and chat share (vLLM's sampling and extra params)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    presence_penalty: float | None = 0.0
    seed: Annotated[int, msgspec.Meta(ge=-_LONG, le=_LONG - 1)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=_LONG - 1)] | None = None
    truncation_side: Any = None  # "left" | "right" | None, refused in vLLM's words (_check_body)
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int = 0
    # Names the answer when the client sends no X-Request-Id, "" too; absent, vLLM's default_factory
    # draws a fresh one (UNSET here), and it refuses a null.
    request_id: str | msgspec.UnsetType = msgspec.UNSET
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    n: int = 1  # chat's may be null, a completion's not (vLLM's models)
    prompt: Any = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True


class ChatRequest(_Sampling, kw_only=True):
    messages: list[Any]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    # UNSET when not in the body: vLLM's validator makes it "auto" when tools are given, else "none"
    tool_choice: Any = msgspec.UNSET
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    bad_words: list[str] = msgspec.field(default_factory=list)
    echo: bool = False
    # UNSET when not in the body: rendered as True, but vLLM's validator refuses it beside
    # continue_final_message only when given
    add_generation_prompt: bool | msgspec.UnsetType = msgspec.UNSET
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest | TokenizeChatRequest, told apart by `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | msgspec.UnsetType = msgspec.UNSET  # as ChatRequest's
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


def validation_error(details: list[dict[str, Any]] | list[str]) -> SimRequestError:
    """vLLM's 400 for a body its pydantic model refuses (protocol.vllm_errors)."""
    return SimRequestError(validation_message(details), kind=VALIDATION_ERROR, param=validation_param(details))


def check_json_media_type(content_type: str, raw: bytes) -> None:
    """vLLM's validate_json_request, a dependency of its JSON POST routes (completions, chat,
    /tokenize, /detokenize, the LoRA routes), after FastAPI's decoding of the body
    (protocol.vllm_errors.json_media_type)."""
    media = json_media_type(content_type)
    if media is JsonMediaType.JSON:
        return
    if raw and media is JsonMediaType.DECODED:
        _decode(raw)
    raise validation_error([UNSUPPORTED_MEDIA_TYPE])


def malformed_json_error(exc: json.JSONDecodeError) -> SimRequestError:
    """vLLM (FastAPI + pydantic) reports the decode error with its character offset."""
    return validation_error([json_invalid_error(exc.pos, exc.msg)])


def check_token_bounds(tokens: list[int]) -> None:
    """/detokenize's ids as DetokenizeRequest bounds them (ge=0, le=2**63-1), one error per id out
    of bounds. An id past the vocabulary is no error: vLLM's tokenizer decodes it to nothing."""
    details = []
    for i, t in enumerate(tokens):
        if t < 0:
            details.append({"type": "greater_than_equal", "loc": f"body.tokens.{i}",
                            "msg": "Input should be greater than or equal to 0", "input": error_input(t),
                            "ctx": {"ge": 0}})  # fmt: skip
        elif t > _MAX_TOKEN_ID:
            details.append({"type": "less_than_equal", "loc": f"body.tokens.{i}",
                            "msg": f"Input should be less than or equal to {_MAX_TOKEN_ID}",
                            "input": error_input(t), "ctx": {"le": _MAX_TOKEN_ID}})  # fmt: skip
    if details:
        raise validation_error(details)


def _loads(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)  # 2.7x the stdlib's speed on a 4 k-token prompt
    except msgspec.DecodeError:
        # what msgspec refuses the stdlib decides (NaN, 1e400, lone surrogates are accepted),
        # and its error carries the offset vLLM reports
        return json.loads(raw)


def _decode(raw: bytes) -> Any:
    try:
        return _loads(raw)
    except json.JSONDecodeError as exc:
        raise malformed_json_error(exc) from exc
    except UnicodeDecodeError as exc:
        raise SimRequestError(f"request body is not UTF-8: {exc}") from exc


def parse_body(raw: bytes, kind: type[T]) -> T:
    """The body as `kind`, checked as vLLM's model checks it: its `mode="before"` validators on the
    raw JSON first (completions and chat), then the fields, whose errors are pydantic's."""
    obj = _decode(raw or b"null")
    if not isinstance(obj, dict):
        raise SimRequestError("request body must be a JSON object")
    unknown = sorted(set(obj) - set(getattr(kind, "__struct_fields__", ())) - _warned)
    if unknown:
        _warned.update(unknown)
        log.warning("The following fields were present in the request but ignored: %s", set(unknown))
    if (before := _BEFORE_VALIDATORS.get(kind)) is not None:
        try:
            before(obj)
        except ValidatorError as exc:
            raise SimRequestError(exc.message, param=exc.param) from exc
    try:
        return msgspec.convert(_lax_fields(obj, kind), kind, strict=False)
    except (msgspec.ValidationError, _Unreadable) as exc:
        if details := _field_errors(obj, kind):
            raise validation_error(details) from exc
        raise SimRequestError(str(exc), param=str(exc).rsplit("`$.", 1)[-1].rstrip("`") or None) from exc


# The fields of vLLM's models in their order, which is the order pydantic reports their errors in.
_VLLM_FIELD_ORDER: dict[type, tuple[str, ...]] = {
    CompletionRequest: tuple(
        "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream "
        "stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty length_penalty "
        "stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
        "spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs "
        "logprob_token_ids prompt_embeds add_special_tokens response_format structured_outputs priority request_id "
        "return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params vllm_xargs".split()
    ),
    ChatRequest: tuple(
        "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
        "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
        "reasoning_effort include_reasoning parallel_tool_calls user use_beam_search top_k min_p repetition_penalty "
        "length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens "
        "spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs logprob_token_ids "
        "allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens documents "
        "chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority "
        "request_id return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params vllm_xargs".split()
    ),
}


def _field_errors(obj: dict[str, Any], kind: type) -> list[dict[str, Any]]:
    """pydantic's errors for the fields of `obj` that `kind` refuses, in vLLM's field order."""
    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    order = _VLLM_FIELD_ORDER.get(kind, ())
    fields = sorted(info.fields, key=lambda f: order.index(f.encode_name) if f.encode_name in order else len(order))
    # pydantic's own checks of the fields msgspec's types do not spell; the rest by their types
    details: list[dict[str, Any]] = []
    for f in fields:
        if (check := _FIELD_CHECKS.get(f.encode_name)) is not None and obj.get(f.encode_name) is not None:
            details += check(obj[f.encode_name])
        else:
            details += struct_errors("body", obj, [f])
    return details


def _lax_fields(obj: dict[str, Any], kind: type) -> dict[str, Any]:
    """`obj` with its boolean, integer and float fields read as vLLM's pydantic models read them.
    msgspec's lax mode takes only "true", "false", "1", "0", 0 and 1 as booleans, so `"stream":
    "yes"`, which vLLM streams, was a 400 here; and it takes no bool as an integer (vLLM reads
    `"max_tokens": true` as 1) or a float (`"temperature": true` is 1.0) but does take "1e3"
    (which vLLM refuses)."""
    fields = _typed_fields(kind)
    out = obj
    for name in obj.keys() & fields.bools:
        if (value := lax_bool(obj[name])) is not None and value is not obj[name]:
            out = out if out is not obj else dict(obj)
            out[name] = value
    for name in obj.keys() & fields.ints:
        if (value := _lax_int_field(obj[name])) is not obj[name]:
            out = out if out is not obj else dict(obj)
            out[name] = value
    for name in obj.keys() & fields.floats:
        if isinstance(value := obj[name], bool):  # pydantic reads true as 1.0, msgspec refuses it
            out = out if out is not obj else dict(obj)
            out[name] = float(value)
    for name in obj.keys() & fields.int_lists:
        if isinstance(raw := obj[name], list) and _strict_ids(raw) is None:
            out = out if out is not obj else dict(obj)
            out[name] = [_lax_int_field(t) for t in raw]
    for name, inner in fields.nested.items():
        if isinstance(sub := obj.get(name), dict) and (fixed := _lax_fields(sub, inner)) is not sub:
            out = out if out is not obj else dict(obj)
            out[name] = fixed
    return out


class _Unreadable(ValueError):
    """Text or a float an integer field may not take (msgspec's lax mode would take "1e3")."""


def _lax_int_field(value: Any) -> Any:
    """An integer field's value as vLLM reads it; a null is the Struct's to judge (a field may
    allow one). Text or a float vLLM refuses is _Unreadable; anything else it refuses msgspec
    refuses too. parse_body words either refusal as pydantic does."""
    if value is None or (type(value) is int):
        return value
    if (number := lax_int(value)) is not None:
        return number
    if isinstance(value, str | float):
        raise _Unreadable
    return value


@dataclass(frozen=True, slots=True)
class _Fields:
    bools: frozenset[str]
    ints: frozenset[str]
    floats: frozenset[str]
    int_lists: frozenset[str]  # list[int]: stop_token_ids, allowed_token_ids, /detokenize's tokens
    nested: dict[str, type]  # fields that are Structs of their own (`stream_options`)


@cache
def _typed_fields(kind: type) -> _Fields:
    """`kind`'s fields that pydantic would read laxly where msgspec does not, by type."""
    bools: set[str] = set()
    ints: set[str] = set()
    floats: set[str] = set()
    int_lists: set[str] = set()
    nested: dict[str, type] = {}
    for f in msgspec.structs.fields(kind):
        info = msgspec.inspect.type_info(f.type)
        types = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
        for t in types:
            if isinstance(t, msgspec.inspect.BoolType):
                bools.add(f.encode_name)
            elif isinstance(t, msgspec.inspect.IntType):
                ints.add(f.encode_name)
            elif isinstance(t, msgspec.inspect.FloatType):
                floats.add(f.encode_name)
            elif isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type, msgspec.inspect.IntType):
                int_lists.add(f.encode_name)
            elif isinstance(t, msgspec.inspect.StructType):
                nested[f.encode_name] = t.cls
    return _Fields(frozenset(bools), frozenset(ints), frozenset(floats), frozenset(int_lists), nested)


class Prompt(msgspec.Struct):
    token_ids: list[int]
    text: str | None  # the text it was encoded from, None for token ids


@dataclass(slots=True)
class GenerateCall:
    """A validated generate request: its prompts and, per prompt, what to run and return."""

    prompts: list[Prompt]
    max_tokens: list[int]  # per prompt, as the engine runs it
    n: int
    stops: list[str]
    stop_token_ids: frozenset[int]
    include_stop: bool
    min_tokens: int
    seed: int | None
    logprobs: int | None  # sample logprobs per token (completions: logprobs; chat: top_logprobs)
    prompt_logprobs: int | None
    echo: bool  # completions: prompt text (and logprobs) before the output
    echo_only: bool  # echo with max_tokens 0: the prompt alone, one token generated and not shown
    want_ids: bool
    as_ids: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every chunk too (stream_options.continuous_usage_stats)
    kv_transfer_params: dict[str, Any] | None
    request_id: str | None = None  # the body's
    cache_salt: str | None = None
    chat: bool = False  # a chat completion (its usage details name created_cache_tokens too)
    chat_echo: str = ""  # chat `echo`: the last message's content, when it has the reply's role
    lora: LoraRequest | None = None  # the adapter `model` names (the handler resolves it)


def _strict_ids(x: list[Any]) -> list[int] | None:
    """`x` as a fresh list of ints when every one is an int (no bool), else None. In C: a Python
    loop cost the engine 0.5 ms of a 4 k-token request."""
    try:
        return msgspec.convert(x, list[int])
    except msgspec.ValidationError:
        return None


def _ids(x: Any) -> list[int] | None:
    """`x` as a fresh list of token ids, read as vLLM's pydantic model reads them (2.0, "2" and
    true are ids too), or None. One by one in Python only when the strict reading fails."""
    if not isinstance(x, list):
        return None
    if (ids := _strict_ids(x)) is not None:
        return ids
    lax = []
    for t in x:
        if (tid := lax_int(t)) is None:
            return None
        lax.append(tid)
    return lax


def _prompts(raw: Any) -> list[Prompt]:
    """vLLM's union of prompt forms, picked as pydantic picks: all strings are texts (["1", "2"]
    too), all lists are id lists, lists among other things are refused, anything else is one
    prompt of ids ([1, "2"] is [1, 2]). `[]` is a batch of none, which vLLM's renderer refuses
    once its tokenization parameters are checked."""
    if isinstance(raw, str):
        return [Prompt(encode_text(raw), raw)]
    if raw == []:
        return []
    if isinstance(raw, list):
        if (ids := _strict_ids(raw)) is not None:
            return [Prompt(ids, None)]
        if all(isinstance(item, str) for item in raw):
            return [Prompt(encode_text(item), item) for item in raw]
        if all(isinstance(item, list) for item in raw):
            batch = [_ids(item) for item in raw]
            if all(ids is not None for ids in batch):
                return [Prompt(ids, None) for ids in batch if ids is not None]
        elif any(isinstance(item, list) for item in raw):  # ["text", [6, 7, 8]]: vLLM 0.32 refuses it
            raise SimRequestError("a batch of prompts must be all strings or all token-id lists", param="prompt")
        elif (ids := _ids(raw)) is not None:
            return [Prompt(ids, None)]
    raise SimRequestError(
        "prompt must be a string, a list of token ids, or a list of strings or token-id lists", param="prompt"
    )


def render_chat(messages: Any, *, add_generation_prompt: bool, continue_final_message: bool, model: str) -> str:
    """The built-in ChatML template; `continue_final_message` leaves the last message open. The
    sim serves a text-only model (`model`, the first served name): a media part is vLLM's 400 for
    one. Then transformers' apply_chat_template's own refusals, in its words."""
    if not isinstance(messages, list):
        raise SimRequestError("messages must be a non-empty list", param="messages")
    try:
        text = apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except (ValueError, AttributeError) as exc:
        raise SimRequestError(str(exc), param="messages") from exc
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise SimRequestError(f"{model} is not a multimodal model")
            if kind in _EMBEDS_PARTS:
                raise SimRequestError("The model is not multimodal.")
    if not messages:
        raise SimRequestError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise SimRequestError(_CONTINUE_AND_GENERATE_TEMPLATE)
    if continue_final_message:
        text = text.removesuffix("<|im_end|>\n")
    return text


def check_generation_prompt(add_generation_prompt: bool | msgspec.UnsetType, continue_final_message: bool) -> bool:
    """vLLM's check_generation_prompt validator (chat, /tokenize): both given true is a 400. The
    generation prompt as rendered: given, else added (where the template then refuses it beside
    continue_final_message)."""
    if continue_final_message and add_generation_prompt is True:
        raise VllmValidationError(CONTINUE_AND_GENERATE)
    return add_generation_prompt is not False


def check_mm_kwargs(mm_processor_kwargs: dict[str, Any] | None, media_io_kwargs: dict[str, Any] | None) -> None:
    """vLLM's validate_request_mm_kwargs, without --trust-request-mm-kwargs (its default; the sim
    has no such flag) before it renders chat messages."""
    if mm_processor_kwargs:
        raise VllmValidationError(
            "Per-request mm_processor_kwargs are disabled by default because they can change multimodal "
            "preprocessing resource usage. Start the server with --trust-request-mm-kwargs only when clients "
            "are trusted.",
            parameter="mm_processor_kwargs",
        )
    if media_io_kwargs:
        raise VllmValidationError(
            "Per-request media_io_kwargs are disabled by default because they can change multimodal media "
            "loading resource usage. Start the server with --trust-request-mm-kwargs only when clients are "
            "trusted.",
            parameter="media_io_kwargs",
        )


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)


def check_request_template(chat_template: str | None, chat_template_kwargs: dict[str, Any] | None) -> None:
    """vLLM refuses a client's own chat template unless started with --trust-request-chat-template
    (off by default). The sim has no such flag: its tokenizer renders ChatML only, so rendering a
    request's template with it would answer for a prompt the client did not send."""
    if chat_template is not None or (chat_template_kwargs and chat_template_kwargs.get("chat_template") is not None):
        raise SimRequestError(UNTRUSTED_TEMPLATE)


def _check_tok_params(body: _Sampling, max_model_len: int, max_output: int, output_param: str) -> None:
    """TokenizeParams.__post_init__, which vLLM runs before it renders the prompt."""
    if max_output > max_model_len:
        raise VllmValidationError(
            f"{output_param}={max_output} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            parameter=output_param,
            value=max_output,
        )
    truncate = body.truncate_prompt_tokens
    if truncate is not None and truncate > max_model_len:
        raise VllmValidationError(
            f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = {max_model_len}. "
            "Please request a smaller truncation size.",
            parameter="truncate_prompt_tokens",
            value=truncate,
        )


def _kept(truncate: int | None, max_model_len: int, max_output: int) -> int | None:
    """How many prompt tokens truncation keeps, None for all (TokenizeParams): -1 is the context
    less the one token held for output, the whole context when no output is asked for."""
    if truncate is None or truncate >= 0:
        return truncate
    return max_model_len if max_output == 0 else max(0, max_model_len - 1)


def _truncated(p: Prompt, max_model_len: int, keep: int | None, side: str | None) -> Prompt:
    """The prompt as vLLM's renderer leaves it: truncated, and refused when too long."""
    if keep is not None and keep < len(p.token_ids):
        # vLLM's _truncation_slice: "right" keeps the first `keep` tokens; "left", also the
        # tokenizer's own side for generation, the last
        ids = p.token_ids[:keep] if side == "right" else p.token_ids[len(p.token_ids) - keep :]
        p = Prompt(ids, None)
    n = len(p.token_ids)
    if n > max_model_len:
        # vLLM encodes text truncated to limit + 1 tokens, and says "at least" for any count of
        # limit + 1, ids too. A prompt of exactly the limit passes here, to leave no room for output.
        shown = max_model_len + 1 if p.text is not None else n
        raise PromptTooLongError(max_model_len, shown, at_least=shown == max_model_len + 1)
    return p


def _check_engine_prompt(ids: list[int]) -> None:
    """The engine's input checks (InputProcessor._validate_model_input), after the sampling
    parameters': an empty prompt, then the highest id if past the vocabulary (one below 0 was
    refused with the body). Neither names a parameter."""
    if not ids:
        raise VllmValidationError("The decoder prompt cannot be empty")
    if (high := max(ids)) >= VOCAB_SIZE:
        raise VllmValidationError(f"Token id {high} is out of vocabulary")


def _tokenize_validators(data: dict[str, Any]) -> None:
    """vLLM's /tokenize body is TokenizeCompletionRequest | TokenizeChatRequest: one with neither
    a text `prompt` nor `messages` fails both, each naming its own required field."""
    if data.get("messages") is not None or isinstance(data.get("prompt"), str):
        return
    prompt = missing_error("body.prompt", data) if "prompt" not in data else field_error(
        "string_type", "body.prompt", "Input should be a valid string", data["prompt"])  # fmt: skip
    messages = missing_error("body.messages", data) if "messages" not in data else field_error(
        "list_type", "body.messages", "Input should be a valid list", data["messages"])  # fmt: skip
    raise validation_error([prompt, messages])


_BEFORE_VALIDATORS: dict[type, Callable[[dict[str, Any]], None]] = {
    CompletionRequest: check_completion_body,
    ChatRequest: check_chat_body,
    TokenizeRequest: _tokenize_validators,
}


@cache
def _checked_fields(kind: type[_Sampling]) -> tuple[str, ...]:
    """The fields of `kind` that _FIELD_CHECKS checks, in vLLM's field order."""
    order = _VLLM_FIELD_ORDER[kind]
    return tuple(sorted(_FIELD_CHECKS.keys() & set(kind.__struct_fields__), key=order.index))


def _check_body(body: _Sampling) -> None:
    """pydantic's checks of the fields msgspec's types do not make."""
    names = _checked_fields(type(body))
    details = [e for name in names if (value := getattr(body, name)) is not None for e in _FIELD_CHECKS[name](value)]
    if details:
        raise validation_error(details)


# vLLM's `response_format`: ResponseFormat | StructuralTagResponseFormat |
# LegacyStructuralTagResponseFormat, each model's `type` literal and required fields
_RESPONSE_FORMATS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("ResponseFormat", ("text", "json_object", "json_schema"), ()),
    ("StructuralTagResponseFormat", ("structural_tag",), ("format",)),
    ("LegacyStructuralTagResponseFormat", ("structural_tag",), ("structures", "triggers")),
)


def _response_format_errors(value: Any) -> list[dict[str, Any]]:
    """pydantic's errors for a `response_format` no member of vLLM's union takes, or none."""
    loc = "body.response_format"
    details: list[dict[str, Any]] = []
    for model, types, required in _RESPONSE_FORMATS:
        if not isinstance(value, dict):
            details.append(model_type_error(loc, value, model))
            continue
        errors = [missing_error(f"{loc}.{name}", value) for name in ("type", *required) if name not in value]
        if "type" in value and value["type"] not in types:
            quoted = [f"'{t}'" for t in types]
            expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
            errors.insert(0, field_error("literal_error", f"{loc}.type", f"Input should be {expected}", value["type"],
                                    {"expected": expected}))  # fmt: skip
        if not errors:
            return []
        details += errors
    return details


def _side_errors(value: Any) -> list[dict[str, Any]]:
    """pydantic's literal_error for a `truncation_side` other than "left" or "right"."""
    return type_errors("body.truncation_side", value, _SIDE_TYPE)


_SIDE_TYPE = msgspec.inspect.type_info(Literal["left", "right"])


def _stop_errors(value: Any) -> list[dict[str, Any]]:
    """vLLM's `stop: str | Annotated[list[str], Field(max_length=VLLM_MAX_STOP_STRINGS)] | None`:
    a longer list fails both members of the union."""
    if not isinstance(value, list) or len(value) <= _MAX_STOP_STRINGS:
        return type_errors("body.stop", value, _STOP_TYPE)
    count = len(value)
    shown = f"<list of {count} items>"
    return [
        {"type": "string_type", "loc": "body.stop", "msg": "Input should be a valid string", "input": shown},
        {"type": "too_long", "loc": "body.stop",
         "msg": f"List should have at most {_MAX_STOP_STRINGS} items after validation, not {count}", "input": shown,
         "ctx": {"field_type": "List", "max_length": _MAX_STOP_STRINGS, "actual_length": count}},
    ]  # fmt: skip


_STOP_TYPE = msgspec.inspect.type_info(str | list[str] | None)


def _tools_errors(tools: Any) -> list[dict[str, Any]]:
    """Pydantic's checks of chat's `tools` (list[ChatCompletionToolsParam]: `type` "function",
    `function` a FunctionDefinition with a string `name`)."""
    if not isinstance(tools, list):
        return [field_error("list_type", "body.tools", "Input should be a valid list", tools)]
    details: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        at = f"body.tools.{i}"
        if not isinstance(tool, dict):
            details.append(model_type_error(at, tool, "ChatCompletionToolsParam"))
            continue
        if "type" in tool and tool["type"] != "function":
            details.append({"type": "literal_error", "loc": f"{at}.type", "msg": "Input should be 'function'",
                            "input": error_input(tool["type"]), "ctx": {"expected": "'function'"}})  # fmt: skip
        function = tool.get("function")
        if "function" not in tool:
            details.append(missing_error(f"{at}.function", tool))
        elif not isinstance(function, dict):
            details.append(model_type_error(f"{at}.function", function, "FunctionDefinition"))
        elif "name" not in function:
            details.append(missing_error(f"{at}.function.name", function))
        elif not isinstance(function["name"], str):
            name = error_input(function["name"])
            details.append({"type": "string_type", "loc": f"{at}.function.name",
                            "msg": "Input should be a valid string", "input": name})  # fmt: skip
    return details


# pydantic's checks of the fields whose vLLM types msgspec's do not spell: their errors for a value
# not null, in parse_body's errors too
_FIELD_CHECKS: dict[str, Callable[[Any], list[dict[str, Any]]]] = {
    "response_format": _response_format_errors,
    "truncation_side": _side_errors,
    "tools": _tools_errors,
    "stop": _stop_errors,
}


def _check_tool_parser(choice: Any, tool_parsing: bool) -> None:
    """vLLM's OnlineRenderer.render_chat: a tool_choice other than "none" needs a tool parser
    (--enable-auto-tool-choice with --tool-call-parser), or the request is refused."""
    if tool_parsing or choice in ("none", None):
        return
    if choice == "auto":
        raise SimRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    desc = f'function "{choice["function"]["name"]}"' if isinstance(choice, dict) else f'"{choice}"'
    raise SimRequestError(f"tool_choice={desc} requires --tool-call-parser to be set")


def _check_sampling(body: _Sampling, n: int, max_tokens: int, logprobs: int | None) -> None:
    """SamplingParams.from_optional's logit_bias keys, _verify_args, then verify() (the engine's
    input processor), in vLLM's order."""
    bias = body.logit_bias or {}
    unreadable = [key for key in bias if not _is_int(key)]
    if unreadable:
        raise VllmValidationError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {unreadable!r}",
            parameter="logit_bias",
            value=unreadable,
        )
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    top_k = 0 if body.top_k is None else body.top_k
    min_p = 0.0 if body.min_p is None else body.min_p
    presence = body.presence_penalty or 0.0
    frequency = body.frequency_penalty or 0.0
    repetition = 1.0 if body.repetition_penalty is None else body.repetition_penalty
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    # SamplingParams._verify_num_sequences: its VLLMValidationError names no parameter
    if n < 1:
        raise VllmValidationError(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise VllmValidationError(
            f"n must be at most {_MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
            "environment variable."
        )
    t = temperature
    checks: list[tuple[bool, str, str | None, object]] = [
        (-2.0 <= presence <= 2.0, f"presence_penalty must be in [-2, 2], got {presence}.", None, None),
        (-2.0 <= frequency <= 2.0, f"frequency_penalty must be in [-2, 2], got {frequency}.", None, None),
        (math.isfinite(repetition), f"repetition_penalty must be a finite number, got {repetition}.", None, None),
        (repetition > 0.0, f"repetition_penalty must be greater than zero, got {repetition}.", None, None),
        (math.isfinite(t), f"temperature must be a finite number, got {t}.", "temperature", t),
        (t >= 0.0, f"temperature must be non-negative, got {t}.", "temperature", t),
        (t <= 2.0, f"temperature must be in [0, 2], got {t}.", "temperature", t),
        (0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p),
        (top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {top_k}.", None, None),
        (0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}.", None, None),
        (max_tokens >= 1, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens),
        (body.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {body.min_tokens}.", None, None),
        (body.min_tokens <= max_tokens,
         f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}.", None, None),
        (logprobs is None or logprobs >= 0 or logprobs == -1,
         f"logprobs must be non-negative or -1, got {logprobs}.", "logprobs", logprobs),
        (all(stops), "stop cannot contain an empty string.", None, None),
        (t >= 1e-5 or n == 1, f"n must be 1 when using greedy sampling, got {n}.", None, None),
    ]  # fmt: skip
    for ok, message, parameter, value in checks:
        if not ok:
            raise VllmValidationError(message, parameter=parameter, value=value)
    for name, k in (("sample", logprobs), ("prompt", body.prompt_logprobs)):
        wanted = VOCAB_SIZE if k == -1 else k
        if wanted and wanted > MAX_LOGPROBS:
            raise VllmValidationError(
                f"Requested {name} logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                parameter="logprobs" if name == "sample" else "prompt_logprobs",
                value=wanted,
            )
    # token ids index the logits, VOCAB_SIZE wide (sampling_params.py _validate_logit_bias,
    # _validate_stop_token_ids, _validate_allowed_token_ids)
    for parameter, ids in (("logit_bias", list(dict.fromkeys(int(key) for key in bias))),
                           ("stop_token_ids", body.stop_token_ids or [])):  # fmt: skip
        outside = [tid for tid in ids if not 0 <= tid < VOCAB_SIZE]
        if outside:
            raise VllmValidationError(
                f"token_id(s) {outside} in {parameter} contain out-of-vocab token ids. Vocabulary size: {VOCAB_SIZE}",
                parameter=parameter,
                value=outside,
            )
    allowed = body.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise VllmValidationError(
                "allowed_token_ids is not None and empty!", parameter="allowed_token_ids", value=[]
            )
        outside = [tid for tid in allowed if not 0 <= tid < VOCAB_SIZE]
        if outside:
            raise VllmValidationError(
                "allowed_token_ids contains out-of-vocab token id!", parameter="allowed_token_ids", value=outside
            )


def _is_int(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


def _call(
    body: _Sampling,
    prompts: list[Prompt],
    max_model_len: int,
    asked: int | None,
    *,
    logprobs: int | None,
    echo: bool,
) -> GenerateCall:
    n = 1 if body.n is None else body.n
    keep = _kept(body.truncate_prompt_tokens, max_model_len, asked or 0)
    prompts = [_truncated(p, max_model_len, keep, body.truncation_side) for p in prompts]
    echo_only = echo and asked == 0
    max_tokens = []
    for p in prompts:
        room = max_model_len - len(p.token_ids)
        mt = room if asked is None else min(asked, room)
        _check_sampling(body, n, 1 if echo_only else mt, logprobs)
        _check_engine_prompt(p.token_ids)
        max_tokens.append(1 if echo_only else mt)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    opts = body.stream_options
    include_usage = bool(opts is not None and opts.include_usage)
    return GenerateCall(
        prompts=prompts,
        max_tokens=max_tokens,
        n=n,
        stops=stops,
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        include_stop=body.include_stop_str_in_output,
        min_tokens=body.min_tokens,
        seed=body.seed,
        logprobs=VOCAB_SIZE if logprobs == -1 else logprobs,
        prompt_logprobs=body.prompt_logprobs,
        echo=echo,
        echo_only=echo_only,
        want_ids=bool(body.return_token_ids),
        as_ids=bool(body.return_tokens_as_token_ids),
        stream=bool(body.stream),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(opts is not None and opts.continuous_usage_stats),
        kv_transfer_params=body.kv_transfer_params,
        request_id=None if body.request_id is msgspec.UNSET else body.request_id,
        cache_salt=body.cache_salt,
    )


def completion_call(body: CompletionRequest, max_model_len: int) -> GenerateCall:
    """`body` as parse_body leaves it (vLLM's validators of the raw body passed)."""
    _check_body(body)
    if body.suffix is not None:
        raise SimRequestError("suffix is not currently supported")
    if body.prompt_embeds is not None:
        raise SimRequestError("prompt_embeds is not supported by the simulated engine", param="prompt_embeds")
    _refuse_logprob_token_ids(body)
    prompts = _prompts(body.prompt)
    negative = next((t for p in prompts for t in p.token_ids if t < 0), None)
    if negative is not None:  # pydantic's refusal in vLLM (its ids are `ge=0`), before the engine's checks
        raise VllmValidationError(f"Token id {negative} is out of vocabulary", parameter="prompt")
    # vLLM's normalize_null_max_tokens: a null is the field's default, not "up to the context"
    asked = _DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    _check_tok_params(body, max_model_len, asked or 0, "max_tokens")
    if not prompts:
        raise SimRequestError("You must pass at least one prompt")  # the renderer's, for `prompt: []`
    call = _call(body, prompts, max_model_len, asked, logprobs=body.logprobs, echo=bool(body.echo))
    if call.prompt_logprobs is None and call.echo:
        call.prompt_logprobs = body.logprobs  # vLLM: an echoed prompt comes with its logprobs too
    return call


def chat_call(body: ChatRequest, max_model_len: int, *, model: str, tool_parsing: bool = False) -> GenerateCall:
    """`body` as parse_body leaves it (vLLM's validators of the raw body passed). `model`: the
    served model's (first) name, which names it in vLLM's refusal of media. `tool_parsing`: the
    server runs a tool parser (vLLM's --enable-auto-tool-choice)."""
    add_generation_prompt = check_generation_prompt(body.add_generation_prompt, body.continue_final_message)
    tool_choice = default_tool_choice(body.tools) if body.tool_choice is msgspec.UNSET else body.tool_choice
    top = body.top_logprobs
    _check_body(body)
    _refuse_logprob_token_ids(body)
    # the renderer's checks, after the model's (generate_api.py): tool parser, then template
    _check_tool_parser(tool_choice, tool_parsing)
    check_request_template(body.chat_template, body.chat_template_kwargs)
    check_mm_kwargs(body.mm_processor_kwargs, body.media_io_kwargs)
    # vLLM: max_completion_tokens when given (a 0 too), else the deprecated max_tokens; null: no limit
    given = body.max_completion_tokens is not None
    asked = body.max_completion_tokens if given else body.max_tokens
    _check_tok_params(body, max_model_len, asked or 0, "max_completion_tokens" if given else "max_tokens")
    text = render_chat(body.messages, add_generation_prompt=add_generation_prompt,
                       continue_final_message=body.continue_final_message, model=model)  # fmt: skip
    logprobs = top if body.logprobs else None
    call = _call(body, [Prompt(encode_text(text), text)], max_model_len, asked, logprobs=logprobs, echo=False)
    call.chat = True
    if call.prompt_logprobs is None and body.echo:
        call.prompt_logprobs = top  # vLLM: an echo asks for the prompt's logprobs too
    if body.echo:
        call.chat_echo = _echoed(body.messages, "assistant" if add_generation_prompt else None)
    return call


def _refuse_logprob_token_ids(body: _Sampling) -> None:
    """vLLM reports the logprobs of these ids at each position; the sim has no model to score them."""
    if body.logprob_token_ids:
        raise SimRequestError("logprob_token_ids is not supported by the simulated engine", param="logprob_token_ids")


def _echoed(messages: list[dict[str, Any]], role: str | None) -> str:
    """vLLM's chat echo: the last message's content when its role is the reply's (the last
    message's own role when no generation prompt is added)."""
    last = messages[-1]
    if last.get("role") != (role or last.get("role")):
        return ""
    content = last.get("content") or ""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)
