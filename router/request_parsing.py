"""What the router reads of an OpenAI completions or chat body: the fields it routes by, checked
as vLLM 0.32's pydantic models read them (ApiError 400 naming the parameter), the fields only the
router may set, refused, and the prompt's token ids as the engine computes them (`prompt_ids`).

Where only vLLM engines serve the request's model, the router runs vLLM's model validators of the
raw body first, as vLLM does (protocol.vllm_validators), and types vLLM's dicts of router-only
fields; where another engine may serve it (SGLang takes bodies those refuse), they are the
engine's. It validates only the fields it reads, refuses the ones only it may set
(`kv_transfer_params`, `disaggregated_params`, the bootstrap triple, `ec_transfer_params`, and the
transfer handles in `vllm_xargs`; a null, which the engines read as unset, is no handle: taken)
last, and passes everything else on. So stop strings, `n`, `echo`, logprobs, penalties, tools,
`response_format`, usage details and the engine's other 400s are the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, cast

import msgspec

from protocol import asks_prompt_logprobs, lax_bool
from protocol.messages import lax_int
from protocol.vllm_errors import struct_errors, type_errors
from protocol.vllm_validators import ValidatorError, check_chat_body, check_completion_body
from router.api_errors import ApiError, validation_failed
from router.request_context import RequestShape
from router.tokenization import ChatOptions, Tokenization, TokenizerError, UntrustedTemplate

__all__ = ["NOT_AN_OBJECT", "ParsedRequest", "StreamOptions", "check_hashable", "header_priority", "is_text",
           "keep_specials_truncated", "parse_request", "prompt_ids", "typed_field"]  # fmt: skip

# Set by the router for the engine, never by a client: transfer handles name hosts the engine
# would pull KV from. A null is none: vLLM 0.32 (like TensorRT-LLM and SGLang) reads it as unset
# (CompletionRequest.to_sampling_params passes on only a truthy one), so it is taken, and dropped;
# so is an empty vLLM handle.
# ec_transfer_params: the encoder-cache handle, which the router never sets.
_ROUTER_ONLY = (
    "kv_transfer_params", "disaggregated_params", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "ec_transfer_params",
)  # fmt: skip
# vLLM 0.32 takes transfer handles from `vllm_xargs` too (v1/request.py reads them from extra_args).
_HANDLES = ("kv_transfer_params", "ec_transfer_params")
# vLLM 0.32 reads it from `vllm_xargs` (v1/request.py); "full" re-announces a prefix-cache hit's
# blocks as new BlockStored events, with no BlockRemoved to match, so the shim's counts keep them
# after eviction. Only its default, "incremental", is safe.
_REPORT_MODE = "kv_cache_report_mode"


def _names_nothing(name: str, value: Any) -> bool:
    """Whether a router-only field names nothing: a null, or for vLLM's handles an empty object,
    which vLLM 0.32 passes on only when truthy (CompletionRequest.to_sampling_params)."""
    return value is None or (name in _HANDLES and value == {})


NOT_AN_OBJECT = "request body must be a JSON object"  # engine_sim's words
_TOKEN_ID_LIMIT = 2**32  # canonical block hashes pack ids as u32
_TokenIds = list[Annotated[int, msgspec.Meta(ge=0, lt=_TOKEN_ID_LIMIT)]]
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1  # what a msgpack integer holds


@dataclass(slots=True)
class ParsedRequest:
    """A validated request: what routing reads, and `params`, the body for the engine."""

    chat: bool
    model: str | None
    prompts: list[str | list[int]]  # completions: one per prompt of a batch; chat: none
    messages: list[dict[str, Any]] | None
    chat_options: ChatOptions | None
    add_special_tokens: bool
    # (tokens to keep, side) when the router can apply it; side None: the tokenizer's (left for
    # generation, as vLLM loads it), and a text prompt keeps its special tokens
    truncate: tuple[int, str | None] | None
    stream: bool
    max_tokens: int | None  # None: a chat request with no limit (vLLM then generates to the context's end)
    annotations: list[str]
    params: dict[str, Any] = field(default_factory=dict)
    shape: RequestShape = field(default_factory=RequestShape)
    engine_tokenizes: bool = False  # the engine gets the text: its answer depends on the text itself
    # truncate_prompt_tokens -1, vLLM's "the context": (tokens held back for output, side), resolved
    # into `truncate` from the model's max_model_len (prompt_ids); the context less one token, the
    # whole context when no output is asked for (its TokenizeParams.max_truncation_tokens)
    truncate_to_context: tuple[int, str | None] | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    """vLLM's, named as its errors name it."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_SEED = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
_TRUNCATE = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]


class _CompletionFields(msgspec.Struct, kw_only=True):
    """vLLM 0.32's CompletionRequest's types of the fields the router reads, in its order, which is
    the order pydantic reports their errors in (engine_sim's model has them all). `annotations`
    is kvswitch's own, last."""

    model: str | None = None
    max_tokens: int | None = 16
    n: int = 1
    seed: _SEED | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: _TRUNCATE | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    annotations: list[str] | None = None


class _ChatFields(msgspec.Struct, kw_only=True):
    """As _CompletionFields, of vLLM 0.32's ChatCompletionRequest."""

    messages: list[Any]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    seed: _SEED | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None
    truncate_prompt_tokens: _TRUNCATE | None = None
    truncation_side: Literal["left", "right"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    annotations: list[str] | None = None


_VLLM_DICTS = ("kv_transfer_params", "vllm_xargs")  # typed as vLLM's model types them: vLLM's alone
_FIELDS = {(chat, vllm): tuple(f for f in cast(msgspec.inspect.StructType, msgspec.inspect.type_info(t)).fields
                               if vllm or f.name not in _VLLM_DICTS)
           for chat, t in ((False, _CompletionFields), (True, _ChatFields)) for vllm in (False, True)}  # fmt: skip
_TYPES: dict[type, msgspec.inspect.Type] = {
    kind: msgspec.inspect.type_info(kind) for kind in (bool, int, str, list, dict)
}


def _check_fields(body: dict[str, Any], chat: bool, vllm_only: bool) -> None:
    """Every field the router reads that vLLM's model would refuse, in one 400 as vLLM's (vLLM's
    names the fields the router does not read too: the engine's)."""
    if details := struct_errors("body", body, _FIELDS[chat, vllm_only]):
        raise validation_failed(details)


def typed_field(body: Mapping[str, Any], name: str, kind: type, default: Any = None, *, at: str = "body") -> Any:
    """`body[name]` as `kind`. Integers and booleans are read as vLLM's pydantic models read them
    (so as engine_sim does): 512.0, "512" and " 512 " are 512, true is 1 ("1e3" and 3.5 are not);
    "true", "yes" and 1 are True. Refused in vLLM's words, `at` the body's path to `body`."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    if kind is bool and (flag := lax_bool(value)) is not None:  # "yes", "on", "t", 1, ... as pydantic reads them
        return flag
    if kind is int and (number := lax_int(value)) is not None:
        if not _INT_MIN <= number <= _UINT_MAX:  # text holds any size; _check_ints sees ints only
            raise ApiError(400, f"'{name}' is out of the 64-bit integer range", name)
        return number
    raise validation_failed(type_errors(f"{at}.{name}", value, _TYPES[kind]))


def _valid_ids(raw: list[Any]) -> list[int] | None:
    """`raw` as token ids when every one is an integer in [0, 2^32), else None. In C: a Python
    loop over a 4 k-token prompt cost the router 0.9 ms of every request."""
    try:
        return msgspec.convert(raw, _TokenIds)
    except msgspec.ValidationError:
        return None


def _token_ids(raw: list[Any]) -> list[int]:
    """`raw` as token ids, read as vLLM's pydantic model reads them: 2.0, "2" and true are ids too
    (lax_int), one by one in Python only when the strict reading in C fails. Any size: _not_negative
    and check_hashable judge them."""
    ids = _valid_ids(raw)
    if ids is not None:
        return ids
    ids = []
    for t in raw:
        if (tid := lax_int(t)) is None:
            raise ApiError(400, _NOT_A_PROMPT, "prompt")
        ids.append(tid)
    return ids


def _not_negative(batch: list[list[int]]) -> list[list[int]]:
    """`batch`, refused as vLLM's model refuses an id below 0 (`ge=0`, its first, named). One past
    the vocabulary is its engine's, after truncation: check_hashable."""
    negative = next((t for ids in batch for t in ids if t < 0), None)
    if negative is not None:
        raise ApiError(400, f"Token id {negative} is out of vocabulary (parameter=prompt)", "prompt")
    return batch


def check_hashable(prompts: list[list[int]]) -> None:
    """Refuses prompts (as truncated) the router cannot hash (ids are u32 there) as vLLM's engine
    refuses an id past the vocabulary, 2^32 and beyond being past any: the first such prompt's
    highest id, naming no parameter. vLLM says it after its length check and its checks of the
    sampling parameters; the caller makes the length check first."""
    for ids in prompts:
        if (high := max(ids, default=0)) >= _TOKEN_ID_LIMIT:
            raise ApiError(400, f"Token id {high} is out of vocabulary")


# vLLM's words (its InputProcessor's, naming no parameter; its renderer's; its validator's) and
# engine_sim's for a prompt of no form vLLM takes
_EMPTY_PROMPT = "The decoder prompt cannot be empty"
_NO_PROMPTS = "You must pass at least one prompt"
_NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"
_NOT_A_PROMPT = "prompt must be a string, a list of token ids, or a list of strings or token-id lists"


def _prompts(raw: Any) -> list[str | list[int]]:
    """vLLM's prompt forms: a string, token ids, or a non-empty list of strings or of token-id
    lists, picked as its pydantic union picks: all strings are texts (["1", "2"] too), all lists
    are id lists, lists among other things are refused (vLLM 0.32 too), and anything else is one
    prompt of ids ([1, "2"] is [1, 2]). A missing or empty one is refused in vLLM's validator's
    words, where that did not run: a BOS alone would be served."""
    if raw is None or raw == "":
        raise ApiError(400, _NO_PROMPT, "prompt")
    if isinstance(raw, str):
        return [raw]
    if raw == []:
        raise ApiError(400, _NO_PROMPTS)
    if isinstance(raw, list):
        ids = _valid_ids(raw)
        if ids is not None:
            return [ids]
        if all(isinstance(item, str) for item in raw):
            return list(raw)
        if all(isinstance(item, list) for item in raw):
            batch = [_token_ids(item) for item in raw]
            if not all(batch):
                raise ApiError(400, _EMPTY_PROMPT)
            return list(_not_negative(batch))
        if any(isinstance(item, list) for item in raw):  # ["text", [6, 7, 8]]
            raise ApiError(400, "a batch of prompts must be all strings or all token-id lists", "prompt")
        return list(_not_negative([_token_ids(raw)]))
    raise ApiError(400, _NOT_A_PROMPT, "prompt")


def _check_ints(params: Mapping[str, Any]) -> None:
    """Top-level integers must fit a 64-bit field (deeper ones are caught when the leg is sent)."""
    for name, value in params.items():
        if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _UINT_MAX:
            raise ApiError(400, f"'{name}' is out of the 64-bit integer range", name)


def _chat_options(body: Mapping[str, Any]) -> ChatOptions:
    given = typed_field(body, "chat_template_kwargs", dict, {})
    if not all(isinstance(k, str) for k in given):
        raise ApiError(400, "'chat_template_kwargs' keys must be strings", "chat_template_kwargs")
    # vLLM 0.32's merge (build_chat_params, then ChatParams.with_defaults): the client's kwargs
    # without their null or "auto" values; the top-level values that are set override them,
    # except `tools`, where the kwargs' win; the kwargs' special tokens override the tokenizer's.
    kwargs = {k: v for k, v in given.items() if k not in _RENDER_ARGS and v not in _UNSET}
    if "messages" in kwargs:  # vLLM's 400: its template gets `messages` twice
        raise ApiError(
            400,
            "jinja2.environment.Template.render() got multiple values for keyword argument 'messages'",
            "chat_template_kwargs",
        )
    raw_tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    documents = typed_field(body, "documents", list, documents)
    effort = body.get("reasoning_effort")
    if effort not in _UNSET:
        kwargs["reasoning_effort"] = effort
    if effort is not None and "enable_thinking" not in given:
        kwargs["enable_thinking"] = effort != "none"
    return ChatOptions(
        add_generation_prompt=typed_field(body, "add_generation_prompt", bool, True),
        continue_final_message=typed_field(body, "continue_final_message", bool, False),
        tools=typed_field(body, "tools", list, None),
        tool_choice=body.get("tool_choice"),
        raw_tools=raw_tools,
        documents=documents,
        chat_template=_request_template(body, given),
        chat_template_kwargs=kwargs,
        add_special_tokens=typed_field(body, "add_special_tokens", bool, False),
    )


def _request_template(body: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Any:
    """The client's own chat template: vLLM takes one in chat_template_kwargs as the request's too,
    and refuses it alike, whatever its type (the kwargs' values are untyped: `Any`). Both given
    would leave one unused: refused rather than one dropped."""
    own: str | None = typed_field(body, "chat_template", str, None)
    in_kwargs = kwargs.get("chat_template")
    if own is not None and in_kwargs is not None:
        raise ApiError(400, "give the chat template once: 'chat_template' or 'chat_template_kwargs'", "chat_template")
    return own if own is not None else in_kwargs


# Kwargs the router passes by its own fields: the request's flags always override them (vLLM's
# too), and a template in the kwargs is the request's template.
_RENDER_ARGS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template"})
_UNSET = (None, "auto")  # vLLM's merge_kwargs skips these values


def _refuse_router_only(body: Mapping[str, Any]) -> None:
    """The fields only the router may set. Checked after everything vLLM checks of the body here,
    as the engine accepts them: a body it would refuse anyway gets its refusal."""
    for name in _ROUTER_ONLY:
        if not _names_nothing(name, body.get(name)):
            raise ApiError(400, f"'{name}' is set by the router, not by clients", name)
    xargs = body.get("vllm_xargs")
    for name in _HANDLES:
        if isinstance(xargs, dict) and not _names_nothing(name, xargs.get(name)):
            raise ApiError(
                400, f"'vllm_xargs.{name}' is a transfer handle, set by the router, not by clients", "vllm_xargs"
            )
    if isinstance(xargs, dict) and xargs.get(_REPORT_MODE, "incremental") != "incremental":
        raise ApiError(
            400,
            f'\'vllm_xargs.{_REPORT_MODE}\' must be "incremental", got {xargs[_REPORT_MODE]!r}: under "full" vLLM '
            "announces a cache hit's blocks again but removes them once, so kvswitch's index would keep them after "
            "eviction",
            "vllm_xargs",
        )


def parse_request(body: Any, *, chat: bool, vllm_only: bool = True) -> ParsedRequest:
    """Validate what the router reads of an OpenAI request body; ApiError(400) naming the
    parameter for anything wrong. Everything else goes to the engine unread. `vllm_only`: every
    worker that may serve it is vLLM (RequestPath.vllm_only), so vLLM's own refusals of the body
    are the router's too; else an engine that takes the body gets it."""
    if not isinstance(body, dict):
        raise ApiError(400, NOT_AN_OBJECT)
    if vllm_only:
        try:  # vLLM's model validators read the raw body before any field is typed
            (check_chat_body if chat else check_completion_body)(body)
        except ValidatorError as exc:
            raise ApiError(400, exc.message, exc.param) from exc
    _check_fields(body, chat, vllm_only)
    _check_ints(body)
    messages = options = None
    prompts: list[str | list[int]] = []
    if chat:
        messages = body.get("messages")
        if not messages:  # vLLM's words (its renderer's), naming no parameter
            raise ApiError(400, "Cannot apply chat template to an empty conversation. Provide at least one message.")
        if not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "'messages' must be a list of message objects", "messages")
        options = _chat_options(body)
    else:
        # vLLM prefills the embeddings as prompts of their own, ahead of `prompt`: a batch whose
        # first prompt the router cannot see (an empty list is no embeddings to vLLM).
        if body.get("prompt_embeds") not in (None, []):
            raise ApiError(
                400,
                "kvswitch routes text or token-id prompts, not 'prompt_embeds': send embeddings to an engine directly",
                "prompt_embeds",
            )
        prompts = _prompts(body.get("prompt"))
    _refuse_router_only(body)
    max_tokens = typed_field(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else typed_field(body, "max_tokens", int, None)
    n = typed_field(body, "n", int, 1)
    truncate = typed_field(body, "truncate_prompt_tokens", int, None)
    side = typed_field(body, "truncation_side", str, None)
    annotations = typed_field(body, "annotations", list, [])
    # The router's own fields the client sent as null (none other passed the refusal above) are
    # none: not passed on, as the adapters set them per leg. A null in vllm_xargs goes on as sent:
    # vLLM 0.32 refuses it there itself (its values are strings, numbers or lists).
    params = {k: v for k, v in body.items() if k != "annotations" and k not in _ROUTER_ONLY}
    return ParsedRequest(
        chat=chat,
        model=typed_field(body, "model", str, None),
        prompts=prompts,
        messages=messages,
        chat_options=options,
        add_special_tokens=typed_field(body, "add_special_tokens", bool, not chat),
        truncate=(truncate, side) if truncate is not None and truncate > 0 else None,
        stream=typed_field(body, "stream", bool, False),
        # vLLM's defaults: completions 16 tokens (a null too: its normalize_null_max_tokens), chat
        # no limit. Booking 16 for chat would tell routing that every such request is short.
        max_tokens=max_tokens if max_tokens is not None and max_tokens > 0 else (None if chat else 16),
        # vLLM echoes a text prompt as written and a FIM `suffix` needs the text; a truncation with
        # no side keeps the prompt's special tokens (its tokenizer truncates): ids would lose them.
        engine_tokenizes=not chat
        and (
            lax_bool(body.get("echo")) is True
            or body.get("suffix") is not None
            or (truncate is not None and side is None)
        ),
        annotations=annotations,
        params=params,
        truncate_to_context=None if truncate is None or truncate >= 0 else (_held_for_output(max_tokens, chat), side),
        # Read without validating: the engine judges these fields, and a wrong value the engine
        # refuses costs nothing on the local path.
        shape=RequestShape(
            sequences=max(len(prompts), 1) * max(n, 1),
            prompt_logprobs=asks_prompt_logprobs(body, chat=chat),
            cache_salt=salt if isinstance(salt := body.get("cache_salt"), str) else "",
            beam_search=lax_bool(body.get("use_beam_search")) is True,
            priority=(lax_int(given) or 0) if (given := body.get("priority")) is not None else 0,
        ),
    )


def header_priority(headers: Mapping[str, str]) -> int | None:
    """X-Vllm-Priority, which vLLM takes over the body's `priority`; None when absent or no
    integer, where vLLM 0.32 takes the body's with no error (_get_priority), as the caller does."""
    value = headers.get("X-Vllm-Priority")
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def _held_for_output(max_tokens: int | None, chat: bool) -> int:
    """The tokens vLLM holds back from a truncation to the context: one when the request asks for
    output (its max_output_tokens: a completion's max_tokens, 16 when null; a chat request's
    max_completion_tokens else max_tokens, 0 when neither), none when it does not."""
    asked = max_tokens if max_tokens is not None else (0 if chat else 16)
    return 1 if asked else 0


async def prompt_ids(
    tok: Tokenization, parsed: ParsedRequest, max_model_len: int | None = None
) -> tuple[list[int], list[list[int]]]:
    """The routed prompt's ids (the first prompt of a batch) and every prompt's ids: those the
    engine computes (tests/router/test_vllm_render.py holds them to vLLM 0.32's own renderer).
    `max_model_len`, the model's, resolves a truncate_prompt_tokens of -1 as vLLM does; without it
    such a prompt is routed whole."""
    truncate = parsed.truncate
    if truncate is None and parsed.truncate_to_context is not None and max_model_len is not None:
        held, side = parsed.truncate_to_context
        truncate = (max(0, max_model_len - held), side)
    try:
        if parsed.chat:
            assert parsed.messages is not None and parsed.chat_options is not None
            ids = await tok.encode_chat(parsed.messages, parsed.chat_options)
            options = parsed.chat_options
            if truncate is not None and truncate[1] is None and options.add_special_tokens:
                # vLLM's tokenizer truncates the rendered text, keeping the specials it adds to it
                bare = await tok.encode_chat(parsed.messages, replace(options, add_special_tokens=False))
                ids = _keep_specials(ids, bare, truncate[0])
            elif truncate is not None:  # the template wrote the special tokens: plain ids
                ids = _truncated(ids, *truncate)
            if not ids:  # a template that renders nothing: vLLM's input processor refuses it, naming no parameter
                raise ApiError(400, _EMPTY_PROMPT)
            return ids, [ids]
        prompts = []
        offload = sum(len(p) for p in parsed.prompts if isinstance(p, str)) > tok.offload_chars
        for p in parsed.prompts:
            if isinstance(p, list):
                ids = p if truncate is None else _truncated(p, *truncate)
            elif truncate is not None and truncate[1] is None and parsed.add_special_tokens:
                ids = await keep_specials_truncated(tok, p, truncate[0], offload=offload)
            else:
                ids = await tok.encode(p, parsed.add_special_tokens, offload=offload)
                if truncate is not None:
                    ids = _truncated(ids, *truncate)
            prompts.append(ids)
    except UntrustedTemplate as exc:  # vLLM's refusal names no parameter
        raise ApiError(400, exc.why) from exc
    except TokenizerError as exc:
        raise ApiError(400, str(exc), _param_of(exc, parsed)) from exc
    if not prompts[0]:
        raise ApiError(400, _EMPTY_PROMPT)
    return prompts[0], prompts


def _param_of(exc: TokenizerError, parsed: ParsedRequest) -> str:
    """The field the client sent what a rendering error is about: transformers' checks of `tools`
    and `documents` from chat_template_kwargs (only those reach the template unchecked: the
    top-level ones are checked as vLLM's model checks them) and a template there that is no
    string, else the messages (or the prompt) the template renders."""
    if not parsed.chat:
        return "prompt"
    if exc.what in ("tools", "documents", "chat_template_kwargs"):
        return "chat_template_kwargs"
    return "messages"


async def keep_specials_truncated(tok: Tokenization, text: str, keep: int, *, offload: bool = False) -> list[int]:
    """vLLM's truncation with no side: its tokenizer keeps the last `keep` tokens *with* the
    special tokens it adds (a BOS stays first), where slicing the encoded ids would drop them."""
    marked = await tok.encode(text, True, offload=offload)
    return _keep_specials(marked, await tok.encode(text, False, offload=offload), keep)


def _keep_specials(marked: list[int], bare: list[int], keep: int) -> list[int]:
    """The last `keep` of `marked` (a text's ids with the tokenizer's specials) with those
    specials kept, `bare` being the same text's ids without them."""
    added = len(marked) - len(bare)
    start = next((i for i in range(added + 1) if marked[i : i + len(bare)] == bare), None)
    # Not specials + text + specials, or nothing to cut: a plain slice, which can only cost a
    # routing guess (the engine gets the text and truncates it itself).
    if start is None or len(marked) <= keep:
        return _truncated(marked, keep, "left")
    body = bare[len(bare) - (keep - added) :] if keep > added else []
    return marked[:start] + body + marked[start + len(bare) :]


def _truncated(ids: list[int], keep: int, side: str | None) -> list[int]:
    """vLLM's slice: the first `keep` ids for side "right" (cut at the end), else the last `keep`
    (no side: the tokenizer's, "left" for generation)."""
    return ids[:keep] if side == "right" else ids[max(len(ids) - keep, 0) :]


def is_text(parsed: ParsedRequest) -> bool:
    """The prompt needs the router's tokenizer (chat always; completions unless token ids)."""
    return parsed.chat or any(isinstance(p, str) for p in parsed.prompts)
