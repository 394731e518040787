"""What every adapter turns its engine's KV events into, before normalisation.

Engine hashes are opaque keys (vLLM's uint64 or bytes, SGLang's signed int64, TensorRT-LLM's
size_t): only equality matters. `EngineBatch.reset` says the adapter lost track of the engine (it
restarted, or a gap could not be filled): everything known so far is void, and `complete` says
whether the events that follow rebuild the engine's whole state (a replay from its first batch) or
only what happens from now on. `live` is false for batches the adapter fetched again (a replay):
they say nothing about whether the live stream works. `ts` is when the engine made the batch, by
its own clock (vLLM's batch timestamp; None where the engine sends none): the endpoint probe
(worker_shim.endpoint_probe) compares it with the engine's `created` of a request it served.
An adapter whose event stream shows a new engine run ends `run_events` with `EngineRestarted`
instead of resetting: a restarted engine may run with other limits, so the shim ends the session.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from protocol.errors import ProtocolError

__all__ = [
    "FULL",
    "WINDOW",
    "EngineBatch",
    "EngineCleared",
    "EngineEvent",
    "EngineRemoved",
    "EngineRestarted",
    "EngineStored",
    "EventDecodeError",
    "EventSink",
    "UnknownEngineEvent",
]


class EventDecodeError(ProtocolError):
    """An engine event payload that does not have the engine's documented shape."""

    def __init__(self, engine: str, detail: str, kind: str | None = None) -> None:
        self.engine = engine
        super().__init__(f"{engine} KV event", detail, kind)


class UnknownEngineEvent(EventDecodeError):
    """An event of a type the shim does not know: left out, counted by type, not as malformed."""

    def __init__(self, engine: str, event_type: str, detail: str) -> None:
        self.event_type = event_type
        super().__init__(engine, detail, "unknown event type")


class EngineRestarted(Exception):
    """The event stream shows a new run of the engine, or cannot show it is the same run (`why`):
    nothing of the new run is delivered. The session ends and the next one registers a new worker
    id, its limits, served names and tokenizer read again, as after a restart the health checks saw
    (a restarted engine may have another block size, KV capacity or context length)."""

    def __init__(self, engine: str, why: str) -> None:
        super().__init__(f"the {engine} engine restarted: {why}")
        self.engine = engine
        self.why = why


FULL = "full"
WINDOW = "window"


@dataclass(slots=True, frozen=True)
class EngineStored:
    """Blocks cached in chain order; `parent` is the engine hash before hashes[0] (None: root).

    `token_ids` holds every block's tokens back to back; `salt` separates chains that share tokens
    but not KV (a LoRA adapter name) from their root; `media` separates these blocks from their
    parent on (the keys of images or other media whose placeholder tokens they hold: routers hash
    prompts by token ids alone, so such blocks are credited to no request, and their children link
    as usual). A hybrid model's engine caches each block once per KV cache
    `group`: `kind` FULL (full attention: what the prefix index holds), WINDOW (sliding window of
    `window` tokens: its events list only the blocks inside the window, `token_ids` still covering
    the whole range), or the engine's own name of a kind kvswitch does not model.
    """

    hashes: Sequence[int]
    parent: int | None
    token_ids: Sequence[int]
    block_size: int
    salt: str = ""
    medium: str | None = None
    group: int = 0
    kind: str = FULL
    window: int = 0
    media: str = ""


@dataclass(slots=True, frozen=True)
class EngineRemoved:
    """Blocks the engine dropped from its KV cache `group`; `kind` that group's kind where the
    event names it (SGLang's component), else None: the group's Stored says it."""

    hashes: Sequence[int]
    medium: str | None = None
    group: int = 0
    kind: str | None = None


@dataclass(slots=True, frozen=True)
class EngineCleared:
    """The engine dropped every cached block (vLLM's AllBlocksCleared)."""


EngineEvent = EngineStored | EngineRemoved | EngineCleared


@dataclass(slots=True)
class EngineBatch:
    events: list[EngineEvent] = field(default_factory=list)
    reset: bool = False
    complete: bool = True
    live: bool = True
    ts: float | None = None


EventSink = Callable[[EngineBatch], Awaitable[None]]
"""What an adapter hands its batches to, in order, awaiting each: the shim folds a long prompt's
stored chain in parts, its loop running between them."""
