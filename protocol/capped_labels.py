"""Metric label values taken from a sender's strings (an engine's event types, a newer peer's
kinds), capped so a sender cannot grow a metric without bound: the first MAX_LABELS values seen,
each at most MAX_LABEL_CHARS long, are labels of their own; any other counts under OTHER, as
does a value that is OTHER itself (it would read as the overflow)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MAX_LABELS", "MAX_LABEL_CHARS", "OTHER", "capped_label"]

MAX_LABELS = 8
MAX_LABEL_CHARS = 64
OTHER = "other"


def capped_label(counts: Mapping[str, int], value: str) -> str:
    """The label `value` counts under, given the labels already in `counts`."""
    own = len(value) <= MAX_LABEL_CHARS and (value in counts or len(counts) < MAX_LABELS)
    return value if own and value != OTHER else OTHER
