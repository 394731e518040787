"""vLLM 0.32's `mode="before"` validators of a completions or chat body (CompletionRequest's and
ChatCompletionRequest's, last-defined first, as pydantic runs them): they read the raw JSON before
any field is typed, so a body they refuse gets their 400 whatever its fields hold. engine_sim runs
them as vLLM does; the router runs them before its own checks, so that its 400 is the one vLLM
would give, for a model only vLLM engines serve (router.request_parsing: other engines take such
bodies).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "CONTINUE_AND_GENERATE",
    "ValidatorError",
    "check_chat_body",
    "check_completion_body",
    "default_tool_choice",
]

_MAX_PROMPTS = 1024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS default
_MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
# vLLM's validator, for both set in the body
CONTINUE_AND_GENERATE = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


class ValidatorError(ValueError):
    """vLLM's VLLMValidationError as its API reports it: a 400 BadRequestError, the message followed
    by `(parameter=..., value=...)` for whichever is set, `param` the parameter."""

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
        self.message = f"{message} ({', '.join(extras)})" if extras else message
        self.param = parameter
        super().__init__(self.message)


def check_completion_body(data: dict[str, Any]) -> None:
    """CompletionRequest's `mode="before"` validators on the raw body, last-defined first."""
    prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > _MAX_PROMPTS:
        raise ValidatorError(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of {_MAX_PROMPTS}. To increase "
            "this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            parameter="prompt",
        )
    if isinstance(embeds, list) and len(embeds) > _MAX_PROMPTS:
        raise ValidatorError(
            f"prompt_embeds list length {len(embeds)} exceeds the maximum allowed count of {_MAX_PROMPTS}. To "
            "increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
            parameter="prompt_embeds",
        )
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        raise ValidatorError("Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt")
    _check_stream_options(data)
    _check_logprobs(data, "logprobs")
    _check_structured_outputs(data, parameter="structured_outputs")
    _check_response_format(data)
    _check_cache_salt(data.get("cache_salt"))


def default_tool_choice(tools: Any) -> str:
    """check_tool_usage's tool_choice when the body gives none: "auto" with tools, else "none"."""
    return "auto" if tools else "none"


def check_chat_body(data: dict[str, Any]) -> None:
    """ChatCompletionRequest's `mode="before"` validators on the raw body, last-defined first."""
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise ValidatorError(CONTINUE_AND_GENERATE)
    _check_tool_usage(data)
    _check_structured_outputs(data, parameter=None)
    choice = data.get("tool_choice", default_tool_choice(data.get("tools")))
    if _structured_count(data) and choice not in ("none", "auto", "required"):
        raise ValidatorError("You can only either use constraints for structured outputs or tools, not both.")
    _check_logprobs(data, "top_logprobs")
    _check_stream_options(data)
    _check_response_format(data)
    _check_cache_salt(data.get("cache_salt"))


def _check_stream_options(data: dict[str, Any]) -> None:
    # the raw values' truthiness: `{}`, or `"stream": "false"` (truthy text, read as False), pass
    if data.get("stream_options") and not data.get("stream"):
        raise ValidatorError("Stream options can only be defined when `stream=True`.", parameter="stream_options")


def _check_logprobs(data: dict[str, Any], top: str) -> None:
    """vLLM's check_logprobs validator; `top` is the field of sample logprobs (completions:
    `logprobs`, an integer; chat: `top_logprobs`, beside the boolean `logprobs`)."""
    chat = top == "top_logprobs"
    token_ids, beam = data.get("logprob_token_ids"), data.get("use_beam_search")
    if token_ids and beam:
        raise ValidatorError("`logprob_token_ids` is not supported with beam search.", parameter="logprob_token_ids")
    if not chat and beam and data.get("echo") and data.get("logprobs") is not None:
        raise ValidatorError(
            "`echo` with `logprobs` is not supported with beam search because beam search does not compute "
            "prompt logprobs.",
            parameter="echo",
        )
    if not chat and token_ids and data.get("echo") and data.get("max_tokens") == 0:
        raise ValidatorError(
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no output tokens "
            "are generated.",
            parameter="logprob_token_ids",
        )
    if token_ids and (not data.get("logprobs") if chat else data.get("logprobs") is None):
        must = "must be set to true." if chat else "must be set."
        raise ValidatorError(f"when using `logprob_token_ids`, `logprobs` {must}", parameter="logprob_token_ids")
    for name in ("prompt_logprobs", top):
        value = data.get(name)
        if value is not None and not isinstance(value, int | float):
            raise ValidatorError(f"`{name}` must be an integer.", parameter=name, value=value)
    pl = data.get("prompt_logprobs")
    if pl is not None:
        if data.get("stream") and (pl > 0 or pl == -1):
            raise ValidatorError("`prompt_logprobs` are not available when `stream=True`.", parameter="prompt_logprobs")
        if pl < 0 and pl != -1:
            raise ValidatorError(
                "`prompt_logprobs` must be a positive value or -1.", parameter="prompt_logprobs", value=pl
            )
    k = data.get(top)
    if k is not None:
        if k < 0 and k != -1:
            raise ValidatorError(f"`{top}` must be a positive value or -1.", parameter=top, value=k)
        if chat and (k == -1 or k > 0) and not data.get("logprobs"):
            raise ValidatorError("when using `top_logprobs`, `logprobs` must be set to true.", parameter="top_logprobs")


def _structured_count(data: dict[str, Any]) -> int:
    outputs = data.get("structured_outputs")
    if not isinstance(outputs, dict):
        return 0
    return sum(outputs.get(k) is not None for k in ("json", "regex", "choice"))


def _check_structured_outputs(data: dict[str, Any], *, parameter: str | None) -> None:
    """check_structured_outputs_count: one kind of constraint (chat's refusal names no parameter)."""
    if _structured_count(data) > 1:
        raise ValidatorError(
            "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
            parameter=parameter,
        )


def _check_response_format(data: dict[str, Any]) -> None:
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise ValidatorError(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            parameter="response_format",
        )


def _check_cache_salt(salt: Any) -> None:
    """vLLM's validate_cache_salt."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ValidatorError("Parameter 'cache_salt' must be a non-empty string if provided.", parameter="cache_salt")
    if len(salt) > _MAX_CACHE_SALT_CHARS or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise ValidatorError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL.",
            parameter="cache_salt",
        )


def _check_tool_usage(data: dict[str, Any]) -> None:
    """vLLM's check_tool_usage validator, on the raw body."""
    tools, choice = data.get("tools"), data.get("tool_choice", msgspec.UNSET)
    if tools == []:
        raise ValidatorError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            parameter="tools",
        )
    if choice is msgspec.UNSET or choice in ("none", None):
        return
    if tools is None:
        raise ValidatorError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if not isinstance(choice, dict):
        if choice not in ("auto", "required"):
            raise ValidatorError(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                "are supported.",
                parameter="tool_choice",
            )
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise ValidatorError(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}", parameter="tool_choice.function"
        )
    if "name" not in function:
        raise ValidatorError(
            f"Expected field `name` in `function` in `tool_choice`! {usage}", parameter="tool_choice.function.name"
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ValidatorError(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}", parameter="tool_choice.function.name"
        )
    named = (t.get("function") for t in tools if isinstance(t, dict)) if isinstance(tools, list) else ()
    if not any(isinstance(f, dict) and f.get("name") == name for f in named):
        raise ValidatorError(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", parameter="tool_choice"
        )
