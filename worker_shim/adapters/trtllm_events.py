"""TensorRT-LLM's KV cache events as `trtllm-serve` returns them from `POST /kv_cache_events`.

The JSON shape is `KVCacheEventSerializer` in tensorrt_llm/_utils.py: a list of
`{"event_id", "data": {...}, "window_size", ["attention_dp_rank"]}` with data one of
`{"type": "created", "num_blocks_per_cache_level"}`, `{"type": "stored", "parent_hash", "blocks":
[{"type": "stored_block", "block_hash", "tokens": [{"type": "unique_token", "token_id",
"token_extra_id"}], "cache_level", "priority"}]}`, `{"type": "removed", "block_hashes"}`,
`{"type": "updated", "block_hash", "cache_level", "priority"}`.

`event_id` counts up by one per event: a jump means events were lost (the engine's event buffer
overflowed, or another reader drained them), a step back or a `created` event means the engine
started afresh. There is no replay, so both reset the state (`complete` only for a fresh start).
`updated` (a block moving between cache levels or priorities) does not change what is cached and
is ignored. Each read drains the engine's queue: the shim must be the only reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker_shim.engine_events import EngineBatch, EngineRemoved, EngineStored, EventDecodeError

__all__ = ["TrtllmEventTracker"]


def _stored(data: dict[str, Any]) -> EngineStored:
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        raise EventDecodeError("trtllm", "stored event without blocks")
    hashes: list[int] = []
    tokens: list[int] = []
    sizes = set()
    for b in blocks:
        toks = b.get("tokens") if isinstance(b, dict) else None
        if not isinstance(toks, list) or not isinstance(b.get("block_hash"), int):
            raise EventDecodeError("trtllm", "stored_block needs block_hash and tokens")
        hashes.append(b["block_hash"])
        sizes.add(len(toks))
        tokens.extend(t["token_id"] if isinstance(t, dict) else t for t in toks)
    parent = data.get("parent_hash")
    return EngineStored(
        hashes=hashes,
        parent=parent if isinstance(parent, int) else None,
        token_ids=tokens,
        block_size=sizes.pop() if len(sizes) == 1 else -1,  # uneven blocks: the normaliser rejects them
    )


@dataclass(slots=True)
class TrtllmEventTracker:
    """Turns each polled list into one EngineBatch, watching event ids for gaps and restarts."""

    last_id: int | None = None
    gaps: int = 0
    restarts: int = 0
    ignored: int = 0
    kv_total_blocks: int | None = None

    def fold(self, events: Any) -> EngineBatch:
        if not isinstance(events, list):
            raise EventDecodeError("trtllm", "/kv_cache_events must return a JSON list")
        batch = EngineBatch()
        for ev in events:
            if (
                not isinstance(ev, dict)
                or not isinstance(ev.get("event_id"), int)
                or not isinstance(ev.get("data"), dict)
            ):
                raise EventDecodeError("trtllm", f"event without event_id/data: {str(ev)[:100]}")
            eid, data = ev["event_id"], ev["data"]
            kind = data.get("type")
            if kind == "created" or (self.last_id is not None and eid <= self.last_id):
                if self.last_id is not None:
                    self.restarts += 1
                batch.events.clear()
                batch.reset, batch.complete = True, eid == 0
                levels = data.get("num_blocks_per_cache_level")
                if isinstance(levels, list) and levels:
                    self.kv_total_blocks = int(levels[0])
            elif self.last_id is not None and eid != self.last_id + 1:
                self.gaps += 1
                batch.events.clear()
                batch.reset, batch.complete = True, False
            self.last_id = eid
            if kind == "stored":
                batch.events.append(_stored(data))
            elif kind == "removed":
                hashes = data.get("block_hashes")
                if not isinstance(hashes, list):
                    raise EventDecodeError("trtllm", "removed event without block_hashes")
                batch.events.append(EngineRemoved(hashes=hashes))
            elif kind != "created":
                self.ignored += 1
        return batch
