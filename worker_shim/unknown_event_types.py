"""KV events of a type the shim does not know: dropped, counted by type and said once per type.

Not malformed: an engine newer than the shim may add a type (vLLM 0.32 sends BlockStored,
BlockRemoved and AllBlocksCleared). Dropping one is still no small thing: a BlockStored renamed
so (say "BlockStoredV2") leaves every chain under it with an unknown parent, so it must show. The
types are the engine's strings, so the label values are capped (protocol.capped_labels).
"""

from __future__ import annotations

import logging

from protocol.capped_labels import MAX_LABEL_CHARS as MAX_TYPE_CHARS
from protocol.capped_labels import MAX_LABELS as MAX_TYPES
from protocol.capped_labels import OTHER, capped_label

__all__ = ["MAX_TYPES", "MAX_TYPE_CHARS", "OTHER", "UnknownEventTypes"]

log = logging.getLogger(__name__)


class UnknownEventTypes:
    """Counts by label (`counts`, for kvswitch_shim_kv_events_unknown_type_total{type}); one per
    adapter, so it outlives each run of the event source, as the transport's stats do."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, engine: str, event_type: str) -> None:
        label = capped_label(self.counts, event_type)
        first = label not in self.counts
        self.counts[label] = self.counts.get(label, 0) + 1
        if not first:
            return
        if label == OTHER:
            log.warning(
                "%s KV events of more types the shim does not know (%.80r, ...), dropped: counted as "
                "kvswitch_shim_kv_events_unknown_type_total{type=%r} (logged once)",
                engine,
                event_type,
                OTHER,
            )
            return
        log.warning(
            "%s KV events of type %r, which the shim does not know, are dropped (an engine newer than this "
            "kvswitch?); a chain stored under it leaves its children with unknown parents: "
            "kvswitch_shim_kv_events_unknown_type_total{type=%r} counts them (logged once per type)",
            engine,
            event_type,
            label,
        )
