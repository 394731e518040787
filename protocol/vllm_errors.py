"""vLLM 0.32's 400 for a body its pydantic model refuses, as its validation handler writes it
(vllm/entrypoints/serve/exception_handling/handlers/validation.py): `type` "Bad Request", `param`
the first error's location ("body.n"), the message "N validation error(s):" and pydantic's error
dicts, one a line. engine_sim answers every body so; the router answers so for the fields it reads.

The error dicts are pydantic's (lax mode) for a value of a msgspec-described type: `type_errors`.
The media types a JSON route takes are vLLM's too: `json_media_type`.
"""

from __future__ import annotations

import email.message
import enum
import math
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.messages import lax_bool, lax_int

__all__ = [
    "UNSUPPORTED_MEDIA_TYPE",
    "VALIDATION_ERROR",
    "Detail",
    "JsonMediaType",
    "error_input",
    "field_error",
    "json_invalid_error",
    "json_media_type",
    "missing_error",
    "model_type_error",
    "struct_errors",
    "type_errors",
    "validation_message",
    "validation_param",
]

VALIDATION_ERROR = "Bad Request"
"""The error `type` of vLLM's 400 for a body its pydantic model refuses (before its endpoint runs)."""

UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"
"""validate_json_request's error, text only, for a body on a JSON route sent as another media type."""

_MAX_REPORTED_ERRORS = 10  # vLLM's validation handler reports this many, then counts the rest
_MAX_ERROR_INPUT_CHARS = 200
_SKIPPED_TYPES = (msgspec.inspect.NoneType, msgspec.inspect.AnyType)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_I64_BOUND = float(2**63)

Detail = dict[str, Any] | str  # a pydantic error dict, or an error that is only text


def validation_message(details: Sequence[Detail]) -> str:
    """The handler's message: the first ten errors, a count of the rest."""
    count = len(details)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {d}\n" for d in details[:_MAX_REPORTED_ERRORS])
    if count > _MAX_REPORTED_ERRORS:
        message += f"  ...and {count - _MAX_REPORTED_ERRORS} more {label}\n"
    return message.rstrip()


def validation_param(details: Sequence[Detail]) -> str | None:
    """The handler's `param`: the first error's location, none for an error that is only text."""
    first = details[0]
    return first["loc"] if isinstance(first, dict) else None


def error_input(value: Any) -> str:
    """A refused value as that handler shows it: containers by their size, anything else as text
    cut at 200 characters."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_ERROR_INPUT_CHARS else text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"


def field_error(kind: str, loc: str, msg: str, value: Any, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    detail = {"type": kind, "loc": loc, "msg": msg, "input": error_input(value)}
    return detail if ctx is None else {**detail, "ctx": ctx}


def missing_error(loc: str, parent: dict[str, Any]) -> dict[str, Any]:
    return {"type": "missing", "loc": loc, "msg": "Field required", "input": error_input(parent)}


def model_type_error(loc: str, value: Any, model: str) -> dict[str, Any]:
    return {"type": "model_type", "loc": loc, "msg": f"Input should be a valid dictionary or instance of {model}",
            "input": error_input(value), "ctx": {"class_name": model}}  # fmt: skip


def json_invalid_error(pos: int, why: str) -> dict[str, Any]:
    """FastAPI's error for a body that is not JSON: the character offset and the stdlib's words
    (json.JSONDecodeError's `pos` and `msg`)."""
    return {"type": "json_invalid", "loc": f"body.{pos}", "msg": "JSON decode error", "input": "<dict of 0 items>",
            "ctx": {"error": why}}  # fmt: skip


class JsonMediaType(enum.Enum):
    """What vLLM makes of a body on a JSON route (completions, chat, /tokenize, /detokenize) by its
    Content-Type: `json_media_type`."""

    JSON = "json"  # taken
    DECODED = "decoded"  # refused (UNSUPPORTED_MEDIA_TYPE), but a body is decoded as JSON first
    REFUSED = "refused"  # refused, the body unread


def json_media_type(content_type: str) -> JsonMediaType:
    """vLLM's validate_json_request takes `application/json` alone (any case, parameters after `;`),
    no header included. FastAPI decodes a body sent as `application/json` or `application/*+json`
    by the stdlib's email parser (`application/vnd.api+json`, `application/json ;...`) before that
    check runs, so a malformed one gets its `json_invalid` error, a well-formed one the refusal."""
    if content_type.lower().split(";", 1)[0] == "application/json":
        return JsonMediaType.JSON
    header = email.message.Message()
    header["content-type"] = content_type
    subtype = header.get_content_subtype()
    if header.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json")):
        return JsonMediaType.DECODED
    return JsonMediaType.REFUSED


def type_errors(loc: str, value: Any, t: msgspec.inspect.Type) -> list[dict[str, Any]]:
    """pydantic's errors for `value` as a field of type `t` (lax mode): a union's members each
    report theirs when all refuse it; None is refused only where the type has no None."""
    members = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
    if value is None and any(isinstance(m, msgspec.inspect.NoneType) for m in members):
        return []
    details: list[dict[str, Any]] = []
    for m in members:
        if isinstance(m, _SKIPPED_TYPES):
            continue
        if not (errors := _member_errors(loc, value, m)):
            return []
        details += errors
    return details


def struct_errors(loc: str, obj: dict[str, Any], fields: Sequence[msgspec.inspect.Field]) -> list[dict[str, Any]]:
    """pydantic's errors for the fields of a model, in the order given."""
    details: list[dict[str, Any]] = []
    for f in fields:
        if f.encode_name in obj:
            details += type_errors(f"{loc}.{f.encode_name}", obj[f.encode_name], f.type)
        elif f.required:
            details.append(missing_error(f"{loc}.{f.encode_name}", obj))
    return details


def _member_errors(loc: str, value: Any, t: msgspec.inspect.Type) -> list[dict[str, Any]]:
    if isinstance(t, msgspec.inspect.IntType):
        return _int_errors(loc, value, t)
    if isinstance(t, msgspec.inspect.FloatType):
        if isinstance(value, int | float) or (isinstance(value, str) and _is_float(value)):
            return []
        if isinstance(value, str):
            return [field_error("float_parsing", loc, "Input should be a valid number, unable to parse string as a "
                                "number", value)]  # fmt: skip
        return [field_error("float_type", loc, "Input should be a valid number", value)]
    if isinstance(t, msgspec.inspect.BoolType):
        if lax_bool(value) is not None:
            return []
        if isinstance(value, str) or _whole_i64(value):
            return [field_error("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input",
                                value)]  # fmt: skip
        return [field_error("bool_type", loc, "Input should be a valid boolean", value)]
    if isinstance(t, msgspec.inspect.StrType):
        return [] if isinstance(value, str) else [field_error("string_type", loc, "Input should be a valid string",
                                                              value)]  # fmt: skip
    if isinstance(t, msgspec.inspect.ListType):
        if not isinstance(value, list):
            return [field_error("list_type", loc, "Input should be a valid list", value)]
        return [e for i, item in enumerate(value) for e in type_errors(f"{loc}.{i}", item, t.item_type)]
    if isinstance(t, msgspec.inspect.DictType):
        if not isinstance(value, dict):
            return [field_error("dict_type", loc, "Input should be a valid dictionary", value)]
        return [e for k, v in value.items() for e in type_errors(f"{loc}.{k}", v, t.value_type)]
    if isinstance(t, msgspec.inspect.LiteralType):
        if value in t.values:
            return []
        quoted = [repr(v) for v in t.values]
        expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        return [field_error("literal_error", loc, f"Input should be {expected}", value, {"expected": expected})]
    if isinstance(t, msgspec.inspect.StructType):
        if not isinstance(value, dict):
            return [model_type_error(loc, value, t.cls.__name__)]
        return struct_errors(loc, value, t.fields)
    return []


def _int_errors(loc: str, value: Any, t: msgspec.inspect.IntType) -> list[dict[str, Any]]:
    number = lax_int(value)
    if number is not None:
        if t.ge is not None and number < t.ge:
            return [field_error("greater_than_equal", loc, f"Input should be greater than or equal to {t.ge}", value,
                                {"ge": t.ge})]  # fmt: skip
        if t.le is not None and number > t.le:
            return [field_error("less_than_equal", loc, f"Input should be less than or equal to {t.le}", value,
                                {"le": t.le})]  # fmt: skip
        return []
    if isinstance(value, str):
        return [field_error("int_parsing", loc, "Input should be a valid integer, unable to parse string as an "
                            "integer", value)]  # fmt: skip
    if isinstance(value, float) and not math.isfinite(value):
        return [field_error("finite_number", loc, "Input should be a finite number", value)]
    if isinstance(value, float) and value.is_integer():
        return [field_error("int_parsing_size", loc, "Unable to parse input string as an integer, exceeded maximum "
                            "size", value)]  # fmt: skip
    if isinstance(value, float):
        return [field_error("int_from_float", loc, "Input should be a valid integer, got a number with a fractional "
                            "part", value)]  # fmt: skip
    return [field_error("int_type", loc, "Input should be a valid integer", value)]


def _whole_i64(value: Any) -> bool:
    """pydantic reads a number as a boolean only through an i64: 2 or 2.0 it reads and refuses
    (bool_parsing); 0.5, 2**63 or 1e19 it cannot read (bool_type). A float must lie strictly inside
    (-2^63, 2^63), where an int may be -2^63 itself."""
    if isinstance(value, int):
        return _I64_MIN <= value <= _I64_MAX
    return isinstance(value, float) and value.is_integer() and -_I64_BOUND < value < _I64_BOUND


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
