"""TensorRT-LLM's KV cache events as `trtllm-serve` returns them from `POST /kv_cache_events`.

The JSON shape is `KVCacheEventSerializer` in tensorrt_llm/_utils.py: a list of
`{"event_id", "data": {...}, "window_size", ["attention_dp_rank"], ["hash_algo"],
["layer_group_id"]}` with data one of `{"type": "created", "num_blocks_per_cache_level"}`,
`{"type": "stored", "parent_hash", "blocks": [{"type": "stored_block", "block_hash", "tokens":
[{"type": "unique_token", "token_id", "token_extra_id"}], "mm_keys", "cache_salt", "cache_level",
"priority"}]}`, `{"type": "removed", "block_hashes"}`, `{"type": "updated", "block_hash",
"cache_level", "priority"}`; an entry may be `{}` (the serializer's answer for a missing event).

Block hashes are opaque keys: an integer (the C++ manager's size_t, or KV cache manager V2's
SHA-256 truncated to 64 bits) or a string (V2's default `v2_sha256`, a hex digest). A string is
keyed above every 64-bit value, so no string ever names the block an integer does.

`event_id` counts up by one per event: a jump means events were lost (the engine's event buffer
overflowed, or another reader drained them), a step back means the engine started afresh. There
is no replay, so a gap resets the state, incomplete. A step back ends the fold there: the events
from it on are the new run's, kept in `next_run` (the engine handed them over once), and the
adapter ends the session and folds them first in the next (TrtllmAdapter.run_events), where they
start from a complete reset at `created` event 0, and delivers that fold again first in each
session after until the engine answers one. Until 2026-12-08 they were folded into the
batch the ended session dropped: the next session's state stayed partial and blocks stored under
them had an unknown parent. A step back right after them (`after_held`: another engine took the
URL since) is a reset, complete from its `created` event 0, counted in `restarts` but not ending
the session as a restart does. The start is the
engine's `created` events, one per attention window size: a model with sliding-window layers
(VSWA) has one per window, numbered on, and caches each block once per window. Only the largest
window's blocks hold a prompt's whole prefix, so only its `stored` and `removed` events are
folded. `updated` (a block moving between cache levels or priorities) does not change what is
cached and is ignored. An event of any other type is dropped, counted by type and said once per
type (worker_shim.unknown_event_types: a `stored` renamed by a newer engine would leave every
chain under it with an unknown parent); one whose data has no string type is malformed. Each read
drains the engine's queue: the shim must be the only reader.

A stored block's `cache_salt` (the request's, TensorRT-LLM's per-tenant cache isolation) salts
its chain as the router salts such a prompt (protocol.hashing.chain_salt). Its `lora_id` (a LoRA
task's blocks, cached apart from the base model's) salts it as the adapter's id in text, as vLLM's
events without a name do: a router salts an adapter's prompt with the adapter's name, so such a
chain is credited to no request, where unsalted it was credited to base-model prompts of the same
tokens. Blocks with `mm_keys` (the hashes of the images or other media whose placeholder tokens
they hold) go apart from the first of them on (EngineStored.media): routers hash prompts by token
ids alone, so two requests with the same placeholders and different images were one canonical
chain, credited to both. KV cache manager V2 writes each media item's first token as the item's
content digest (a hex string, as its mm_key's hash): in a block with `mm_keys` it is read as one
fixed id, since the mm_keys key that chain; a string token in a block without them is malformed.
Until 2026-12-07 the digest was malformed too: a V2 engine's media block and every block after it
in its event were dropped, and the blocks later stored under them orphaned.

A released sequence's `stored` event ends with its partly filled last block
(kvCacheManager.cpp `storeBlocksForReuse` chops with allowPartial): that block is a leaf no
router hashes (a later prompt's block there is full, under another key), so it is dropped and
counted in `partial`, and the full blocks before it are folded. A short block anywhere else is
malformed.

With attention data parallelism every rank has a cache of its own and numbers its events from 0,
tagged `attention_dp_rank`, and trtllm-serve runs each request on a rank of its choosing: its
OpenAI requests take no rank (tensorrt_llm/serve/openai_protocol.py `CompletionRequest` and
`ChatCompletionRequest` have no `attention_dp_rank`, and refuse unknown fields). One worker
indexing them would be credited with every rank's cache while its requests land anywhere, so
events from a second rank are a ConfigError, not folded.

A malformed event is counted, logged once per kind and dropped on its own; its event id, when
readable, still counts for continuity. A poll answer that is no JSON list (a proxy's error page, a
cut body) is counted as malformed too, logged once per kind, and is a gap: the engine drained its
events for that answer, so the state resets, incomplete, at once (the next event's id, past the
lost ones, is then no second gap). Until 2026-12-07 an answer that was no JSON ended the session
(the worker re-registered under a new id, counted nowhere), and one of JSON that was no list
waited for the next event's id to show the gap, its removals credited until then.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ConfigError
from protocol.hashing import chain_salt
from worker_shim.engine_events import EngineBatch, EngineRemoved, EngineStored, EventDecodeError
from worker_shim.unknown_event_types import UnknownEventTypes

__all__ = ["TrtllmEventTracker", "attention_dp_error"]

log = logging.getLogger(__name__)

_STR_KEYS = 1 << 64  # string hashes are keyed from here on, above every int64 and uint64 value
_MIN_INT = -(1 << 63)
# KV cache manager V2 stores a media item's first token as the item's content digest (a hex
# string, the hash its mm_key carries). The chain of a block with media is keyed by its mm_keys
# (EngineStored.media), so the token stands in as one fixed id, as V1's placeholder id does.
_DIGEST_TOKEN = 0


def _key(value: object) -> int:
    """A block hash as the normaliser's key: an integer as it is, a string injectively above
    every 64-bit integer (so they never collide)."""
    if isinstance(value, int) and not isinstance(value, bool) and _MIN_INT <= value < _STR_KEYS:
        return value
    if isinstance(value, str):
        return _STR_KEYS + int.from_bytes(b"\x01" + value.encode("utf-8", "surrogatepass"), "big")
    raise EventDecodeError("trtllm", "a block hash is neither a 64-bit integer nor a string")


def attention_dp_error(ranks: set[int]) -> ConfigError:
    why = (
        f"the engine's KV events come from attention data-parallel ranks {', '.join(map(str, sorted(ranks)))}, "
        "each with a KV cache of its own, but trtllm-serve runs a request on a rank of its choosing (its OpenAI "
        "requests name none), so this worker would be credited with every rank's cache: serve the model without "
        "enable_attention_dp (--data-parallel-rank, one shim per rank, is vLLM's, whose requests name their rank)"
    )
    return ConfigError("data_parallel_rank", None, why)


def _stored(data: dict[str, Any], block_size: int | None) -> EngineStored | None:
    """The event less a partly filled last block (`block_size` tokens make a full one; None: as
    many as the first block's); None when that block was all it held."""
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks or not all(isinstance(b, dict) for b in blocks):
        raise EventDecodeError("trtllm", "stored event without blocks")
    hashes: list[int] = []
    per_block: list[list[int]] = []
    for b in blocks:
        toks = b.get("tokens")
        if not isinstance(toks, list) or "block_hash" not in b:
            raise EventDecodeError("trtllm", "stored_block needs block_hash and tokens")
        hashes.append(_key(b["block_hash"]))
        ids: list[int] = []
        media = bool(_media(b))
        for t in toks:
            tid = t.get("token_id") if isinstance(t, dict) else t
            if isinstance(tid, str) and media:
                tid = _DIGEST_TOKEN
            elif not isinstance(tid, int):
                raise EventDecodeError("trtllm", "a stored_block token without an integer token_id")
            ids.append(tid)
        per_block.append(ids)
    if len(per_block[-1]) < (block_size or len(per_block[0])):
        del hashes[-1], per_block[-1]
        if not hashes:
            return None
    sizes = {len(ids) for ids in per_block}
    parent = data.get("parent_hash")
    return EngineStored(
        hashes=hashes,
        parent=None if parent is None else _key(parent),
        token_ids=[t for ids in per_block for t in ids],
        block_size=sizes.pop() if len(sizes) == 1 else -1,  # uneven blocks: the normaliser rejects them
        salt=_salt(blocks[0]),
        media=",".join(str(k.get("hash") if isinstance(k, dict) else k) for b in blocks for k in _media(b)),
    )


def _salt(block: dict[str, Any]) -> str:
    """One request's blocks: its cache_salt and LoRA task are on each (None when it gave none)."""
    lora_id, cache_salt = block.get("lora_id"), block.get("cache_salt")
    lora = str(lora_id) if isinstance(lora_id, int) and not isinstance(lora_id, bool) else ""
    return chain_salt(lora, cache_salt if isinstance(cache_salt, str) else "")


def _media(block: dict[str, Any]) -> list[Any]:
    keys = block.get("mm_keys")
    return keys if isinstance(keys, list) else []


def _split_at_media(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored event as the part before its first block with media keys and the part from it on
    (whose parent is the last block before it): the first part's blocks hold text only."""
    blocks = data.get("blocks")
    if not isinstance(blocks, list):
        return [data]
    cut = next((i for i, b in enumerate(blocks) if isinstance(b, dict) and _media(b)), None)
    if not cut:  # none, or from the first block on
        return [data]
    last_text = blocks[cut - 1]
    if not isinstance(last_text, dict) or "block_hash" not in last_text:
        return [data]  # malformed: _stored says so
    return [{**data, "blocks": blocks[:cut]}, {**data, "parent_hash": last_text["block_hash"], "blocks": blocks[cut:]}]


def _removed(data: dict[str, Any]) -> EngineRemoved:
    hashes = data.get("block_hashes")
    if not isinstance(hashes, list):
        raise EventDecodeError("trtllm", "removed event without block_hashes")
    return EngineRemoved(hashes=[_key(h) for h in hashes])


@dataclass(slots=True)
class TrtllmEventTracker:
    """Turns each polled list into one EngineBatch, watching event ids for gaps and restarts."""

    last_id: int | None = None
    gaps: int = 0
    restarts: int = 0
    went_back: tuple[int, int] | None = None  # the last restart's ids: the last one before, the first after
    next_run: list[Any] = field(default_factory=list)  # the last fold's events from a restart on, not folded
    ignored: int = 0  # `updated` events, `{}` entries, and smaller windows' stored/removed events
    partial: int = 0  # partly filled last blocks of stored events, dropped
    malformed: int = 0
    unknown: UnknownEventTypes = field(default_factory=UnknownEventTypes)  # other types, by type
    block_size: int | None = None  # the worker's tokens per block (the adapter's limits)
    window: int | None = None  # the largest attention window seen since the engine started
    ranks: set[int] = field(default_factory=set)  # attention data-parallel ranks seen (untagged: 0)
    _logged: set[str] = field(default_factory=set)
    _after_lost: bool = False  # a poll's answer was lost since the last event: reset already

    def fold(self, events: Any, *, after_held: bool = False) -> EngineBatch:
        """One poll's events up to a restart (the rest in `next_run`); raises ConfigError once they
        come from a second attention-DP rank. `after_held`: the fold before was a restart's held-over
        events, and this poll is the first answer of the engine whose limits the session read: ids
        going back are that engine's start: a restart counted, folded as a reset, no `next_run`."""
        batch = EngineBatch()
        self.next_run = []
        if not isinstance(events, list):
            return self.lost("/kv_cache_events answered JSON that is no list", "no JSON list")
        for at, ev in enumerate(events):
            if isinstance(ev, dict) and not ev:
                self.ignored += 1
                continue
            eid = ev.get("event_id") if isinstance(ev, dict) else None
            rank = ev.get("attention_dp_rank") if isinstance(ev, dict) else None
            rank = 0 if rank is None else rank  # untagged: no attention DP
            if not isinstance(eid, int) or isinstance(eid, bool) or not isinstance(rank, int):
                self._malformed(EventDecodeError("trtllm", "an event without an integer event_id and rank"))
                continue
            self.ranks.add(rank)
            if len(self.ranks) > 1:
                raise attention_dp_error(self.ranks)
            data = ev.get("data")
            kind = data.get("type") if isinstance(data, dict) else None
            if self.last_id is not None and eid <= self.last_id:
                self.restarts += 1
                last, self.last_id, self.window = self.last_id, None, None  # a restarted engine may have other windows
                if not after_held:
                    # Another engine run: its events are for the next fold, its ids compared with its own.
                    self.went_back = (last, eid)
                    self.next_run = events[at:]
                    return batch
                # Until 2026-12-08 a second restart: the session ended again, having published the
                # held-over run's blocks as exact with this engine's block size. A restart all the
                # same, counted (until later that day, not), but the session goes on.
                log.info(
                    "KV event ids went back from %d to %d right after the events held over from the last restart: "
                    "another engine took the URL since; its events start the state afresh",
                    last,
                    eid,
                )
                self._reset(batch, complete=False)  # complete from its created event 0 (_step)
            self._step(eid, kind, batch)
            if not isinstance(data, dict):
                self._malformed(EventDecodeError("trtllm", "an event without data"))
                continue
            window = ev.get("window_size")
            if isinstance(window, int) and window > (self.window or 0):
                if self.window is not None and kind != "created":
                    self._reset(batch, complete=False)  # what was folded was a sliding window's
                self.window = window
            try:
                self._fold(kind, data, window, batch)
            except EventDecodeError as exc:
                self._malformed(exc)
        return batch

    def lost(self, detail: str, kind: str) -> EngineBatch:
        """A poll answer that is no JSON list: the events the engine drained for it are lost. A
        malformed answer (counted, logged once per `kind`) and a gap: the state resets, incomplete."""
        self.malformed += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(
                "%s (logged once per kind): the events the engine handed over for it are lost, so the KV state "
                "resets, incomplete (kvswitch_shim_kv_events_malformed_total counts each)",
                detail,
            )
        batch = EngineBatch()
        self._reset(batch, complete=False)
        self._after_lost = True
        return batch

    def _step(self, eid: int, kind: object, batch: EngineBatch) -> None:
        """Event-id continuity: ids count up by one from the engine's start (its created events)."""
        last = self.last_id
        if last is None and kind == "created":
            self._reset(batch, complete=eid == 0)
        elif last is not None and eid != last + 1 and not self._after_lost:
            self.gaps += 1
            self._reset(batch, complete=False)
        self.last_id, self._after_lost = eid, False

    def _fold(self, kind: object, data: dict[str, Any], window: object, batch: EngineBatch) -> None:
        if kind == "created":
            pass  # the engine's start (_step); its capacity is the limits' (/metrics maxNumBlocks)
        elif kind == "updated":
            self.ignored += 1
        elif not isinstance(kind, str):
            raise EventDecodeError("trtllm", "an event whose data has no string type")
        elif kind not in ("stored", "removed"):
            self.unknown.add("trtllm", kind)
        elif isinstance(window, int) and self.window is not None and window < self.window:
            self.ignored += 1  # a sliding window's copy of blocks the largest window holds too
        elif kind == "removed":
            batch.events.append(_removed(data))
        else:
            for part in _split_at_media(data):
                stored = _stored(part, self.block_size)
                if stored is None or len(stored.hashes) < len(part["blocks"]):
                    self.partial += 1
                if stored is not None:
                    batch.events.append(stored)

    @staticmethod
    def _reset(batch: EngineBatch, *, complete: bool) -> None:
        batch.events.clear()
        batch.reset, batch.complete = True, complete

    def _malformed(self, exc: EventDecodeError) -> None:
        self.malformed += 1
        if exc.kind not in self._logged:
            self._logged.add(exc.kind)
            log.warning("dropping a malformed TensorRT-LLM KV event (logged once per kind): %s", exc.detail)
