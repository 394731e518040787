"""The build each process reports names the wire it speaks (protocol.version)."""

from __future__ import annotations

import msgspec
import pytest
from packaging.version import Version

from protocol import messages
from protocol.version import BUILD, WIRE_DIGEST, __version__, wire_digest


def test_the_build_is_the_release_with_the_wire_as_a_pep440_local_version() -> None:
    assert f"{__version__}+wire.{WIRE_DIGEST}" == BUILD
    parsed = Version(BUILD)
    assert parsed.public == __version__ and parsed.local == f"wire.{WIRE_DIGEST}"
    assert len(WIRE_DIGEST) == 12 and int(WIRE_DIGEST, 16) >= 0
    assert wire_digest() == WIRE_DIGEST  # the same in every process of one build


def test_a_change_to_a_message_changes_the_wire_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    # One field more in WorkerInfo: a wire two processes might read differently, so another build.
    class WorkerInfo(messages.WorkerInfo, kw_only=True):
        added: int = 0

    WorkerInfo.__module__ = messages.__name__
    monkeypatch.setattr(messages, "WorkerInfo", WorkerInfo)
    assert wire_digest() != WIRE_DIGEST


def test_a_default_changed_changes_the_wire_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    class CancelRequest(messages._Msg, kw_only=True):
        request_id: str
        reason: str = "other"

    CancelRequest.__module__ = messages.__name__
    monkeypatch.setattr(messages, "CancelRequest", CancelRequest)
    assert wire_digest() != WIRE_DIGEST


def test_words_about_a_message_are_not_the_wire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages.RouterInfo, "__doc__", "Another docstring, the same fields.")
    assert msgspec.json.schema(messages.RouterInfo)["$defs"]["RouterInfo"]["description"].startswith("Another")
    assert wire_digest() == WIRE_DIGEST
