"""The one object a routing decision reads (STYLE.md #6): the prompt, its block hashes, and every
candidate worker with its prefix overlap and load as of the moment the request was planned.

The planner fills it (router.planner: hashes once per request, candidates at every (re)plan from
the index, the pending prefixes and the load view); selection and the policies only read it,
except that selection records its choice in `decode` and `prefill`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from protocol import WorkerInfo
from protocol.timing import TimingModel
from router.calibration import FULL_BATCH_TOKENS, WorkerTiming

__all__ = ["FULL_BATCH_TOKENS", "Candidate", "LoadLike", "RequestContext", "RequestShape"]


class LoadLike(Protocol):
    """What the load view reports per worker (router.load_view.WorkerLoad satisfies it)."""

    @property
    def running(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def kv_used_blocks(self) -> int: ...
    @property
    def kv_total_blocks(self) -> int | None: ...
    @property
    def prefill_tokens_queued(self) -> int: ...
    @property
    def active_blocks(self) -> int: ...
    @property
    def prefill_inflow(self) -> float: ...
    @property
    def decode_context(self) -> float: ...
    @property
    def booked_requests(self) -> int: ...


class Candidate(msgspec.Struct):
    """One worker that could serve the request, with a snapshot of its state.

    `queued_prefill_tokens` and `active_blocks` include every router's bookings (the load view
    merges them); `kv_total_blocks` falls back to the worker record when no report gave it.
    `cost` is written by selection. `timing`: the worker's calibrated timing (router.calibration),
    None when the router calibrates none. `pending_blocks`: of the `overlap_blocks`, how many are
    only pending (routed there, not in the index yet: router.pending_prefixes). `prefill_inflow`:
    prompt tokens per second booked on it lately, any router's (router.load_view). `decode_context`:
    its decoding requests' mean length as its shim last reported, 0.0 when unknown.
    `booked_requests`: requests booked on it (any router's) that its last report does not count yet
    in `running` or `waiting`.
    """

    info: WorkerInfo
    overlap_blocks: int = 0
    pending_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    active_blocks: int = 0
    prefill_inflow: float = 0.0
    decode_context: float = 0.0
    booked_requests: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int | None = None
    healthy: bool = True
    cost: float = 0.0
    timing: WorkerTiming | None = None

    @property
    def worker(self) -> str:
        return self.info.worker

    def prefill_rate(self) -> float | None:
        """Prompt tokens per second it prefills at full batches: by `timing`, else by its profile;
        None with neither."""
        if self.timing is None:
            return _profile_prefill_rate(self.info)
        return self.timing.prefill_rate(self.info.max_num_batched_tokens or FULL_BATCH_TOKENS)

    @classmethod
    def of(cls, info: WorkerInfo, overlap_blocks: int, load: LoadLike | None) -> Candidate:
        if load is None:
            return cls(info=info, overlap_blocks=overlap_blocks, kv_total_blocks=info.kv_total_blocks)
        return cls(
            info=info,
            overlap_blocks=overlap_blocks,
            running=load.running,
            waiting=load.waiting,
            queued_prefill_tokens=load.prefill_tokens_queued,
            active_blocks=load.active_blocks,
            prefill_inflow=load.prefill_inflow,
            decode_context=load.decode_context,
            booked_requests=load.booked_requests,
            kv_used_blocks=load.kv_used_blocks,
            kv_total_blocks=load.kv_total_blocks or info.kv_total_blocks,
        )

    def explain(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "role": self.info.role,
            "overlap_blocks": self.overlap_blocks,
            "pending_blocks": self.pending_blocks,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "active_blocks": self.active_blocks,
            "kv_used_blocks": self.kv_used_blocks,
            "kv_total_blocks": self.kv_total_blocks,
            "running": self.running,
            "decode_context": round(self.decode_context, 1),
            "cost": round(self.cost, 4),
        }


class RequestShape(msgspec.Struct, frozen=True):
    """What besides its tokens decides where a request can be served and what it finds cached."""

    sequences: int = 1  # the prompts of a batch times `n`
    prompt_logprobs: bool = False  # the prompt's own logits (protocol.asks_prompt_logprobs)
    cache_salt: str = ""  # vLLM's per-tenant cache isolation: its blocks match only the same salt's
    beam_search: bool = False  # use_beam_search: vLLM's beam search passes no kv_transfer_params on
    # vLLM's `priority` (X-Vllm-Priority over the body's; lower is sooner): the order it waits in at
    # the router (router.admission), as the engine orders it under --scheduling-policy priority
    priority: int = 0

    @property
    def local_prefill_only(self) -> bool:
        """No transfer handle can serve it (router.disagg): its decode worker prefills it. A
        handle names one sequence's blocks, transferred KV comes without the prompt's logits, and
        beam search neither returns nor loads a handle."""
        return self.sequences > 1 or self.prompt_logprobs or self.beam_search


@dataclass(slots=True)
class RequestContext:
    """A request as routing sees it. `decode_pool` holds decode and agg workers of the model,
    `prefill_pool` its prefill workers; both may be empty."""

    request_id: str
    model: str
    token_ids: list[int]
    block_size: int
    hashes: list[int]
    decode_pool: list[Candidate] = field(default_factory=list)
    prefill_pool: list[Candidate] = field(default_factory=list)
    max_tokens: int | None = 16  # the client's output limit; None: none set (a chat request)
    decode: Candidate | None = None
    prefill: Candidate | None = None
    text: bool = False  # the prompt came as text: only workers sharing the router's tokenizer
    shape: RequestShape = field(default_factory=RequestShape)
    excluded: list[dict[str, Any]] = field(default_factory=list)  # workers left out, and why
    isl: int = field(init=False)  # prompt tokens; a field, as it is read for every candidate

    def __post_init__(self) -> None:
        self.isl = len(self.token_ids)

    @property
    def request_blocks(self) -> int:
        """Blocks the prompt occupies, a partial last block included."""
        return -(-self.isl // self.block_size)

    def cached_tokens(self, candidate: Candidate) -> int:
        return min(candidate.overlap_blocks * self.block_size, self.isl)

    def uncached_tokens(self, candidate: Candidate) -> int:
        return self.isl - self.cached_tokens(candidate)

    def new_blocks(self, candidate: Candidate) -> int:
        """Blocks this request would allocate on `candidate` beyond the ones it already caches."""
        return max(self.request_blocks - candidate.overlap_blocks, 0)


def _profile_prefill_rate(info: WorkerInfo) -> float | None:
    """Prompt tokens per second the worker prefills at full batches, from its timing profile; None
    when it registered none (the worker is then never judged full by its backlog)."""
    if not info.timing_profile:
        return None
    return _profile_rate(info.timing_profile, info.max_num_batched_tokens or FULL_BATCH_TOKENS)


@functools.cache
def _profile_rate(profile: str, batch: int) -> float | None:
    try:
        seconds = TimingModel.for_profile(profile).prefill(batch)
    except ValueError:
        return None
    return batch / seconds if seconds > 0 else None
