"""Typed errors of the simulated engine. Each carries the values involved."""

from __future__ import annotations

__all__ = ["PromptTooLongError", "SimConfigError", "SimRequestError", "VllmValidationError"]


class SimConfigError(ValueError):
    """A sim setting has a value it may not have. Names the flag and what is allowed."""

    def __init__(self, setting: str, value: object, allowed: str) -> None:
        self.setting = setting
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid --{setting.replace('_', '-')} = {value!r}: {allowed}")


class SimRequestError(ValueError):
    """A request the OpenAI API rejects: `status`, vLLM's error `kind` (the JSON `type`) and `param`."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "BadRequestError", param: str | None = None):
        self.message = message
        self.status = status
        self.kind = kind
        self.param = param
        super().__init__(message)


class VllmValidationError(SimRequestError):
    """vLLM's VLLMValidationError as its API reports it: 400 BadRequestError, the message followed by
    `(parameter=..., value=...)` for whichever is set, `param` the parameter."""

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        extras = [f"{k}={v}" for k, v in (("parameter", parameter), ("value", value)) if v is not None]
        super().__init__(f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


class PromptTooLongError(VllmValidationError):
    """vLLM's 400 for a prompt that does not fit the model's context even with no output."""

    def __init__(self, max_model_len: int, prompt_tokens: int, *, at_least: bool) -> None:
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{count} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt.",
            parameter="input_tokens",
            value=prompt_tokens,
        )
