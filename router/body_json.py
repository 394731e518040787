"""A JSON route's body as vLLM reads it (Starlette's json.loads of its bytes), decoded by msgspec: in
UTF-8, or in any other encoding the stdlib detects (a UTF-8 BOM, UTF-16 or UTF-32, with or without
one) through a UTF-8 copy (until 2026-12-07 those were the router's own 400).

What msgspec refuses is vLLM's 400 where the stdlib refuses it too (api_errors.not_json), else the
router's own, whose words name a place in the client's bytes: a byte offset msgspec gives in the copy
is moved to the body's own, and a lone surrogate, which the stdlib reads (its `surrogatepass`) and
no UTF-8 copy or message to a worker can hold, is named as such in every encoding. Until 2026-12-07
a UTF-16 body's NaN near its byte 118 was "invalid character (byte 58)", and a UTF-16 body holding a
lone surrogate was read as UTF-8 ("object keys must be strings (byte 1)").
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from router.api_errors import not_json

__all__ = ["decode_json"]

_DECODE = msgspec.json.Decoder()
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")  # where msgspec's words end with the offset
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str decoded with surrogatepass: only lone ones


def decode_json(raw: bytes) -> Any:
    """The body's JSON, or the 400 for it. Only a body msgspec refused pays for a look at its encoding."""
    try:
        return _DECODE.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        refused = exc
    encoding = json.detect_encoding(raw)
    try:
        text = raw.decode(encoding, "surrogatepass")  # as the stdlib's json.loads decodes it
    except UnicodeError:  # not that encoding after all: the stdlib refuses it too
        raise not_json(raw, refused) from refused
    if (lone := _LONE_SURROGATE.search(text)) is not None:
        at = len(text[: lone.start()].encode(encoding, "surrogatepass"))
        raise not_json(raw, f"a lone surrogate, U+{ord(lone.group()):04X} (byte {at})") from refused
    if encoding == "utf-8":
        raise not_json(raw, refused) from refused
    utf8 = text.encode()
    try:
        return _DECODE.decode(utf8)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise not_json(raw, _in_the_body(str(exc), utf8, text, encoding)) from exc


def _in_the_body(why: str, utf8: bytes, text: str, encoding: str) -> str:
    """msgspec's words about the UTF-8 copy, its byte offset (where it gives one) moved to the body's."""
    at = _AT_BYTE.search(why)
    if at is None:
        return why
    chars = len(utf8[: int(at.group(1))].decode(errors="ignore"))
    return f"{why[: at.start()]}(byte {len(text[:chars].encode(encoding))})"
