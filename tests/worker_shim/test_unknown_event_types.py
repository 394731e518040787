"""KV events of types the shim does not know: counted by type under a bounded set of labels."""

from __future__ import annotations

import logging

import pytest

from worker_shim.unknown_event_types import MAX_TYPE_CHARS, MAX_TYPES, OTHER, UnknownEventTypes


def test_each_type_is_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    types = UnknownEventTypes()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            types.add("vllm", "BlockStoredV2")
            types.add("vllm", "BlockPinned")
    assert types.counts == {"BlockStoredV2": 5, "BlockPinned": 5}
    said = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "BlockStoredV2" in said[0].getMessage() and "BlockPinned" in said[1].getMessage()


def test_types_past_the_first_few_and_long_ones_count_as_other(caplog: pytest.LogCaptureFixture) -> None:
    """The types are the engine's strings: an engine sending a new one per event would grow the
    label set, and the log, without bound."""
    types = UnknownEventTypes()
    with caplog.at_level(logging.WARNING):
        types.add("vllm", "x" * (MAX_TYPE_CHARS + 1))
        for i in range(1000):
            types.add("vllm", f"T{i}")
        types.add("vllm", "T0")
    own = {f"T{i}": 1 for i in range(MAX_TYPES - 1)} | {"T0": 2}
    assert types.counts == {**own, OTHER: 1 + 1000 - (MAX_TYPES - 1)}
    assert len(caplog.records) == MAX_TYPES
