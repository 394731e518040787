"""The kvswitch build every process reports (WorkerInfo.version, RouterInfo.version, /version,
--version).

`__version__` is the release, pyproject.toml's version. It alone named nothing: it stayed 0.1.0
across hundreds of wire changes, so two processes that spoke different wires reported the same
version and no mismatch could show. `BUILD` adds the wire they speak as a PEP 440 local version,
`0.1.0+wire.<WIRE_DIGEST>`: the digest is over the JSON schema of every message Struct in
protocol.messages (their fields, types, tags and defaults; docstrings left out), so any change to
what crosses a process boundary changes it, and processes that report equal `BUILD`s read each
other's messages alike. It lives in protocol because it travels on the wire. The schema is
msgspec's rendering, so one build installed with another msgspec (pyproject pins ~=0.23) could read
as another wire: a false warning, never a silent one.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import msgspec

from protocol import messages

__all__ = ["BUILD", "WIRE_DIGEST", "__version__", "wire_digest"]

__version__ = "0.1.0"


def _structs() -> list[type[msgspec.Struct]]:
    """Every msgspec Struct protocol.messages defines, by name."""
    return sorted(
        (
            obj
            for _, obj in inspect.getmembers(messages, inspect.isclass)
            if issubclass(obj, msgspec.Struct) and obj.__module__ == messages.__name__
        ),
        key=lambda cls: cls.__qualname__,
    )


def _without_descriptions(node: Any) -> Any:
    """`node` less its `description`s (docstrings): words about the wire are not the wire."""
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_without_descriptions(v) for v in node]
    return node


def wire_digest() -> str:
    """12 hex digits of a SHA-256 over the canonical (keys sorted) JSON schema of protocol.messages'
    Structs."""
    _, components = msgspec.json.schema_components(_structs())
    raw = msgspec.json.encode(_without_descriptions(components), order="sorted")
    return hashlib.sha256(raw).hexdigest()[:12]


WIRE_DIGEST = wire_digest()
BUILD = f"{__version__}+wire.{WIRE_DIGEST}"
