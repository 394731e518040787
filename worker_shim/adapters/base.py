"""The one interface every engine adapter implements, and the values that cross it.

An adapter owns everything engine-specific: its event transport and wire format, its metrics, its
HTTP API and its P/D handle. The shim owns everything else (normalisation, NATS, etcd).

- `health()`: does the engine answer right now: UP, BUSY (it did not answer in time: alive but
  loaded, or hung) or DOWN (refused, reset, or an error status).
- `limits()`: block size, KV capacity and batch budget, as far as the engine tells them.
- `load()`: running/waiting requests and KV use; `stale` where the engine gave nothing new (the
  last figures read, repeated).
- `run_events(sink, live)`: deliver `EngineBatch`es to `sink`, awaiting each, until cancelled; set
  `live` once the event stream is known to work. `request_rebuild()` asks for the engine's whole
  state again (the normaliser met an unknown parent). Transport faults the adapter can see (no
  peer on the event socket, frames under another topic) go to `event_health`, which the shim also
  feeds; `event_stats()` names the transport's counters for /metrics, `events_lag_s()` how far a
  polled stream is behind.
- `EngineCold` from `limits()` or `run_events`: the engine reports nothing until it has served a
  request (TensorRT-LLM); the shim has it serve one one-token request and asks again.
- `tokenizer_fingerprint()`: protocol.fingerprint over the engine's own tokenization of the
  probes, None when the engine cannot tokenize for us.
- `generate(leg, on_output)`: run one leg, awaiting `on_output(tokens, events, token_ids)` with
  the output that arrives together (streaming legs only; one call per read of the engine's
  stream, so a shim that fell behind hands over several events at once and sends them as one
  chunk): `tokens` how many output tokens it holds; `events` the engine's own SSE payloads for a
  pass-through leg (`leg.endpoint` set: the client's OpenAI request), empty for a token-id leg,
  which gives its `token_ids`.
  Returns how it ended; a non-streaming pass-through leg returns the engine's whole answer in
  `body`. A leg with `prefill_only` is the remote-prefill leg and returns the engine's transfer
  parameters; a leg with `transfer` is a decode leg continuing from them. A request the engine
  refuses (4xx) raises EngineError with the engine's own error body. An engine that needs the decode
  leg running before its prefill can end (SGLang's waits for its decode peer) returns the transfer
  parameters at once with `engine_done`: a task that ends with the engine's own outcome of the
  prefill, or its EngineError. The caller awaits or cancels it (a cancel aborts the engine's
  request); `close()` cancels and awaits those left.
- Abort: cancel the task running `generate`. Adapters close the engine request on cancellation
  (vLLM and TensorRT-LLM abort on disconnect; SGLang gets an explicit abort as well).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol import ConfigError, SamplingParams, Usage
from worker_shim.adapters.silence import EngineSilence
from worker_shim.config import ShimConfig
from worker_shim.engine_events import EventSink
from worker_shim.event_health import EventHealth

__all__ = [
    "PROBE_OUTPUT_TOKENS",
    "EngineAdapter",
    "EngineCold",
    "EngineError",
    "EngineHealth",
    "EngineLimits",
    "EngineLoad",
    "EngineTiming",
    "EventSource",
    "LegOutcome",
    "LegRequest",
    "ModelCard",
    "OnOutput",
    "engine_limit",
]

PROBE_OUTPUT_TOKENS = 1  # serve_probe's max_tokens: one prefill step, no decoding


class EngineHealth(enum.Enum):
    UP = "up"
    BUSY = "busy"  # no answer within the probe's timeout
    DOWN = "down"  # refused, reset, or answered with an error


class EngineError(Exception):
    """An engine leg failed. `code` is HTTP-like, `kind` a short machine word for ErrorInfo;
    `body` the engine's own JSON error body when it refused the request; `retry_after_s` its
    Retry-After in seconds, where it gave one (a 429's)."""

    def __init__(
        self, code: int, kind: str, message: str, body: bytes = b"", *, retry_after_s: int | None = None
    ) -> None:
        self.code = code
        self.kind = kind
        self.message = message
        self.body = body
        self.retry_after_s = retry_after_s
        super().__init__(f"{kind} ({code}): {message}")


class EngineCold(EngineError):
    """The engine reports nothing yet: it has served no request since it started (TensorRT-LLM's
    /metrics answers [] and its /kv_cache_events 500 until its first request). The shim has it
    serve one one-token request (WorkerShim._warm_up) and asks again; a 503, so a caller that does
    not warm it fails the session, which is retried."""

    def __init__(self, message: str) -> None:
        super().__init__(503, "engine_unavailable", message)


@dataclass(slots=True, frozen=True)
class EngineLimits:
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    cache_dtype: str | None = None
    max_model_len: int | None = None
    prefix_caching: bool | None = None  # None: the engine does not say


def engine_limit(value: object, field: str) -> int | None:
    """A block size or capacity the engine reported as `field`: None (it does not say) or a positive
    integer; EngineError (502 `engine_protocol`) naming the field otherwise. Until 2026-12-07 such
    values passed unchecked: a string crashed the normaliser or was read as not reported, True
    registered a block size of 1, and 0 or a negative a limit no engine has."""
    if value is None:
        return None
    if type(value) is int and value > 0:
        return value
    raise EngineError(502, "engine_protocol", f"the engine's {field} is {value!r}, not a positive integer")


@dataclass(slots=True, frozen=True)
class ModelCard:
    """One entry of the engine's /v1/models: a LoRA adapter's `parent` is the model it runs on; vLLM
    gives each name a model is served under a card of its own, all with the model's `root`."""

    max_model_len: int | None = None
    parent: str | None = None
    root: str | None = None


@dataclass(slots=True, frozen=True)
class EventSource:
    """Where one data-parallel rank of the engine publishes its KV events, as the engine says."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(slots=True, frozen=True)
class EngineTiming:
    """The engine's cumulative step and latency counters, as LoadReport forwards them to the
    routers' timing calibration (protocol.messages.LoadReport has what each one is)."""

    iterations: int = 0
    iteration_tokens: int = 0
    prefill_requests: int = 0
    prefill_seconds: float = 0.0
    prefill_computed_tokens: int = 0
    prefix_hit_tokens: int = 0
    itl_count: int = 0
    itl_seconds: float = 0.0
    generation_tokens: int = 0


@dataclass(slots=True, frozen=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    kv_total_blocks: int | None = None
    num_preemptions: int = 0
    timing: EngineTiming = EngineTiming()  # all 0 for an engine that exports none
    # Prompt tokens the engine reused rather than computed, cumulative (the shim's credit check);
    # None: the engine does not count them.
    reused_tokens: int | None = None
    # KV pulls the engine failed, cumulative (worker_shim.transfer_failures); None: it does not count them.
    failed_transfers: int | None = None
    # The engine gave nothing new (TensorRT-LLM's /metrics answered [] or held its answer): these are
    # the last figures read, repeated. No time is stamped on it (the stall watchdog takes no silence
    # from it), and the load reports floor its requests at the shim's legs in flight.
    stale: bool = False
    # Of `waiting`, requests held for a P/D peer or a KV transfer (SGLang's bootstrap, prealloc,
    # inflight and transfer queues): no step of the engine's serves them, so the stall watchdog
    # judges none of them (its load reports count them all the same).
    peer_waiting: int = 0
    # A stale reading because the engine holds its answer while iterations run (TensorRT-LLM without
    # return_perf_metrics answers /metrics only 2 s after its last iteration): old figures, but
    # evidence that the engine works (the stall watchdog takes it for progress). A hung executor
    # runs no iteration, so it answers.
    iterating: bool = False


@dataclass(slots=True)
class LegRequest:
    request_id: str
    model: str
    token_ids: list[int]
    sampling: SamplingParams
    stream: bool = True
    prefill_only: bool = False
    transfer: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    endpoint: str = ""  # "" a token-id leg; else protocol's ENDPOINT_COMPLETIONS / ENDPOINT_CHAT
    params: dict[str, Any] = field(default_factory=dict)  # the client's body (GenerateRequest.params)
    engine_request_id: str = ""  # the engine's X-Request-Id (GenerateRequest.engine_request_id)
    # The engine's context, where it reports one: a prefill leg sends a max_tokens past it unchanged
    # (openai_http.pass_through_body), for the engine to refuse.
    max_model_len: int | None = None

    @property
    def engine_id(self) -> str:
        return self.engine_request_id or self.request_id


@dataclass(slots=True)
class LegOutcome:
    finish_reason: str | None
    usage: Usage
    transfer_params: dict[str, Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    body: bytes = b""  # a non-streaming pass-through leg: the engine's whole answer
    # A prefill leg whose transfer parameters come before its engine is done: the engine's outcome.
    engine_done: asyncio.Task[LegOutcome] | None = None


OnOutput = Callable[[int, list[bytes], list[int]], Awaitable[None]]
"""`on_output(tokens, events, token_ids)`: output as it arrives, what arrived together in one call;
`events` the engine's SSE payloads (pass-through legs, `token_ids` empty) or empty (token-id legs)."""


class EngineAdapter(ABC):
    kind: ClassVar[str]
    # Whether its engine, started for the decode role, prefills a request sent with no transfer
    # handle (a bypass): vLLM's does (NixlConnector prefills locally without kv_transfer_params),
    # TensorRT-LLM's generation server does (a context_and_generation request, upstream's own
    # conditional disaggregation), SGLang's does not (WorkerInfo.local_prefill).
    decode_prefills: ClassVar[bool] = True

    def __init__(self, config: ShimConfig) -> None:
        self.config = config
        self.event_health = EventHealth(config.events_timeout_s)
        # Decode legs fed by a KV transfer with no output yet, by request id, and since when
        # (time.monotonic()): the engine is pulling their KV from another worker, which shows no
        # step and no token while it lasts.
        self.pulling: dict[str, float] = {}
        # Prefill legs whose handle went to their decode peer, by request id: the engine waits for
        # that peer (SGLang's bootstrap queue) until it answers, which shows no step either.
        self.waiting_peer: set[str] = set()
        # How long the engine has left its probes and status reads unanswered (any HTTP status is an
        # answer): one silent this long with legs in flight is frozen or cut off (the stall
        # watchdog's count), where a busy one still answers one or the other.
        self.silence = EngineSilence()

    @contextlib.contextmanager
    def watch_pull(self, leg: LegRequest, on_output: OnOutput) -> Iterator[OnOutput]:
        """`on_output` for running `leg`; a leg with a transfer is in `pulling` until its first
        output or its end."""
        if leg.transfer is None:
            yield on_output
            return
        rid = leg.request_id

        async def output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
            self.pulling.pop(rid, None)
            await on_output(tokens, events, token_ids)

        self.pulling[rid] = time.monotonic()
        try:
            yield output
        finally:
            self.pulling.pop(rid, None)

    @abstractmethod
    async def open(self) -> None:
        """Create clients (HTTP sessions); called once before anything else."""

    @abstractmethod
    async def close(self) -> None:
        """Release everything `open` and `run_events` made; safe to call twice."""

    @abstractmethod
    async def health(self) -> EngineHealth: ...

    @abstractmethod
    async def limits(self) -> EngineLimits: ...

    @abstractmethod
    async def load(self) -> EngineLoad: ...

    @abstractmethod
    async def run_events(self, sink: EventSink, live: asyncio.Event) -> None: ...

    @abstractmethod
    def request_rebuild(self) -> None: ...

    async def misdirected(self) -> ConfigError | None:
        """Why the engine's health probes cannot pass at --engine-url whatever the engine does (a
        server answered, but serves no health route there); None where nothing says so."""
        return None

    def event_stats(self) -> dict[str, int]:
        """The event transport's counters since the adapter was made, by name (for /metrics)."""
        return {}

    def events_lag_s(self) -> float | None:
        """Seconds since the engine last answered a poll of its KV events (or since polling began),
        for /health and /metrics; None where events are pushed, or no poll runs."""
        return None

    def unknown_event_types(self) -> dict[str, int]:
        """Events of a type the shim does not know, dropped since the adapter was made, by type
        (worker_shim.unknown_event_types; for /metrics)."""
        return {}

    async def tokenizer_fingerprint(self) -> str | None:
        return None

    async def served_models(self) -> dict[str, ModelCard] | None:
        """The models and LoRA adapters the engine serves, by name; None when the engine cannot
        say."""
        return None

    async def event_sources(self) -> dict[int, EventSource] | None:
        """The engine's KV event endpoints by data-parallel rank; None when it does not list them."""
        return None

    async def serve_probe(self, token_ids: list[int], request_id: str) -> int:
        """Have the engine serve `token_ids` as a PROBE_OUTPUT_TOKENS completion of the base model, on the
        rank the shim serves (worker_shim.endpoint_probe); the answer's `created`, the engine's
        clock in whole seconds. EngineError when the engine fails it. Only where `serves_probe`."""
        raise NotImplementedError(f"the {self.kind} adapter does not probe its engine")

    def alive_transfer(self) -> dict[str, Any] | None:
        """The `transfer` of the shim's one-token request to an engine taken for hung with nothing
        to run (WorkerShim._serves_one_token): None, a plain request, unless its role needs more."""
        return None

    # vLLM answers 404 to a request naming a model it does not serve: a shim whose --model it does
    # not list would register a worker no request can use.
    requires_served_model: ClassVar[bool] = False
    # The engine runs a LoRA adapter for a request whose `model` names it, as vLLM does: only then
    # may the shim register the adapters its /v1/models lists.
    serves_adapters_by_name: ClassVar[bool] = False
    # serve_probe is implemented: the engine's events and answer let an endpoint probe be matched.
    serves_probe: ClassVar[bool] = False

    @abstractmethod
    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome: ...

    async def call(self, endpoint: str, body: dict[str, Any]) -> bytes:
        """The engine's whole answer to `body` on a utility route; EngineError (the engine's own
        refusal, or 404 for a route this engine does not serve: only those of
        protocol.messages.ENGINE_UTILITY_ENDPOINTS are asked, so a router never hears an answer
        the engine did not give)."""
        raise EngineError(404, "engine_rejected", f"a {self.kind} engine serves no /{endpoint} route")
