"""Kinds of items a newer kvswitch puts in a message, which this router does not know: KV events
of a new `type`, sync entries of a new `kind` (protocol.messages.decode_extensible leaves them out
of their message, and the rest of it is applied: docs/decisions.md, "Kinds a newer kvswitch
adds"). Counted by kind for /metrics; the caller says them once per sender.

The kinds are the sender's strings, so the label values are capped (protocol.capped_labels), as
the shim caps an engine's event types.
"""

from __future__ import annotations

from collections.abc import Mapping

from protocol.capped_labels import MAX_LABEL_CHARS as MAX_KIND_CHARS
from protocol.capped_labels import MAX_LABELS as MAX_KINDS
from protocol.capped_labels import OTHER, capped_label

__all__ = ["MAX_KINDS", "MAX_KIND_CHARS", "OTHER", "NewerKinds", "shown"]


class NewerKinds:
    """Counts by label in `counts` (a stats object's, exported as is)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def add(self, kinds: Mapping[str, int]) -> None:
        """Count the items of each kind in `kinds` left out of one message."""
        for kind, n in kinds.items():
            label = capped_label(self.counts, kind)
            self.counts[label] = self.counts.get(label, 0) + n


def shown(kinds: Mapping[str, int]) -> str:
    """`kinds` for a log line: each repr'd and cut to MAX_KIND_CHARS, the first MAX_KINDS of them."""
    names = [repr(kind[:MAX_KIND_CHARS]) for kind in list(kinds)[:MAX_KINDS]]
    more = f" and {len(kinds) - MAX_KINDS} more" if len(kinds) > MAX_KINDS else ""
    return ", ".join(names) + more
