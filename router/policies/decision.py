"""What a policy answers (STYLE.md #5): bypass or not, and why, as one counted outcome."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from router.request_context import Candidate, RequestContext

__all__ = ["Decision", "DecodeRoom", "Outcome", "Path", "Policy", "PrefillRoom"]


class Outcome(StrEnum):
    """Every way a routing decision can end; each is a label of the decisions counter."""

    BYPASS_ISL = "bypass_isl"  # isl_bounding: short uncached prompt, prefilled on the decode worker
    BYPASS_LOAD = "bypass_load"  # prefill_load: the prefill worker it would use is busy
    BYPASS_TTFT = "bypass_ttft"  # ttft_model: local prefill predicted faster
    BYPASS_SLO = "bypass_slo"  # slo_aware: local prefill meets the SLOs (and remote does not, or is slower)
    DECLINED_POLICY = "declined_policy"  # the policy kept the remote prefill
    VETOED_DECODE_BUSY = "vetoed_decode_busy"  # the decode guard refused a bypass
    REMOTE_PREFILL = "remote_prefill"  # disagg=always (or conditional switched off): remote, no policy
    FALLBACK_PREFILL_FAILED = "fallback_prefill_failed"  # remote prefill failed or timed out -> bypass
    # the prefill engine refused the request (a 4xx) -> bypass: the decode engine answers it
    FALLBACK_PREFILL_REFUSED = "fallback_prefill_refused"
    FALLBACK_TRANSFER_FAILED = "fallback_transfer_failed"  # the decode engine failed to load the KV -> bypass
    # the decode leg with its transfer handle would be over NATS's max_payload -> bypass (router.dispatch)
    FALLBACK_HANDLE_TOO_LARGE = "fallback_handle_too_large"
    AGGREGATED = "aggregated"  # disagg=never, or the chosen worker is an agg worker
    NO_PREFILL_POOL = "no_prefill_pool"  # disaggregation wanted but the model has no prefill worker
    PREFILL_POOL_FULL = "prefill_pool_full"  # every prefill worker of its engine past the room limit -> local
    SPILLED_TO_PREFILL = "spilled_to_prefill"  # no decode worker had room: a prefill worker serves it whole
    BYPASS_SEQUENCES = "bypass_sequences"  # n > 1 or a batch: a transfer handle carries one sequence's KV
    BYPASS_PROMPT_LOGPROBS = "bypass_prompt_logprobs"  # prompt logprobs need the prompt's own forward pass
    BYPASS_BEAM_SEARCH = "bypass_beam_search"  # vLLM's beam search neither returns nor loads a transfer handle
    BYPASS_TRANSFER_FAILING = "bypass_transfer_failing"  # pulls into the decode worker fail from every prefill worker
    # a bypass (any of the above, or no prefill pool room) on a decode worker that cannot prefill
    # locally (WorkerInfo.local_prefill false: an SGLang decode server) -> remote after all
    REMOTE_NO_LOCAL_PREFILL = "remote_no_local_prefill"


class Path(StrEnum):
    """How the prompt is prefilled; the `x-kvswitch-prefill` header's value."""

    BYPASS = "bypass"
    REMOTE = "remote"
    AGG = "agg"


@dataclass(frozen=True, slots=True)
class Decision:
    bypass: bool
    outcome: Outcome
    reason: str


class Policy(Protocol):
    """One question: should this request skip the remote prefill? `ctx.decode` and `ctx.prefill`
    (the workers the router would use) are set before `decide` is called."""

    name: str

    def decide(self, ctx: RequestContext) -> Decision: ...


@runtime_checkable
class DecodeRoom(Protocol):
    """A policy that also says whether a worker may decode the request now (a decode worker, or a
    prefill worker the request would spill to). False keeps the request waiting at admission (which
    sheds it once the queue cannot drain in time) instead of letting it cost the worker's running
    requests their service level. `local`: the worker would prefill the request too."""

    def has_room(self, ctx: RequestContext, c: Candidate, *, local: bool) -> bool: ...


@runtime_checkable
class PrefillRoom(Protocol):
    """A policy that lets a prefill worker past the router's backlog bound (router.planner) still
    take the request's remote prefill when it predicts that worker's answer in time. `prefill_rule`:
    what a worker it refuses misses, for the reasons the router gives; None while the rule is off."""

    @property
    def prefill_rule(self) -> str | None: ...

    def prefill_fits(self, ctx: RequestContext, c: Candidate) -> bool: ...
