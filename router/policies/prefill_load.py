"""prefill_load: bypass the remote prefill when the prefill worker it would use is busy.

Rule (DESIGN.md, the seed's semantics exactly):

    bypass iff queued_prefill_tokens(p) > prefill_busy_threshold * max_num_batched_tokens(p)

where p is the prefill worker the router would pick (selection over the prefill pool) and the
queue is the load view's (its last report plus every router's bookings). Strict: a queue exactly
at the threshold is not busy. It compares queued / max_num_batched_tokens with the threshold: the
float product rounds below limits such as 0.57 x 10000 and would call a queue at them busy. A
prefill worker whose record lacks max_num_batched_tokens cannot be judged busy, so the request
keeps its remote prefill (router.disagg warns once per such worker).

Parameters (ConditionalDisaggConfig): prefill_busy_threshold (multiple of max_num_batched_tokens,
>= 0); unset, it inherits queue_threshold; neither set is a startup error for this policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import ConfigError
from protocol.config import ConditionalDisaggConfig
from router.policies.decision import Decision, Outcome
from router.request_context import RequestContext

__all__ = ["NAME", "PrefillLoad", "PrefillLoadConfig"]

NAME = "prefill_load"


@dataclass(frozen=True, slots=True)
class PrefillLoadConfig:
    prefill_busy_threshold: float

    def __post_init__(self) -> None:
        if self.prefill_busy_threshold < 0:
            raise ConfigError("prefill_busy_threshold", self.prefill_busy_threshold, "must be >= 0")

    @classmethod
    def from_settings(cls, cfg: ConditionalDisaggConfig) -> PrefillLoadConfig:
        threshold = cfg.effective_prefill_busy_threshold
        if threshold is None:
            raise ConfigError("prefill_busy_threshold", None, f"policy {NAME} needs it (or queue_threshold)")
        return cls(prefill_busy_threshold=threshold)


class PrefillLoad:
    name = NAME

    def __init__(self, config: PrefillLoadConfig) -> None:
        self.config = config

    def decide(self, ctx: RequestContext) -> Decision:
        p = ctx.prefill
        if p is None:
            return Decision(False, Outcome.DECLINED_POLICY, "no prefill worker to judge")
        mnbt = p.info.max_num_batched_tokens
        if not mnbt:
            why = f"prefill worker {p.worker}: max_num_batched_tokens unknown"
            return Decision(False, Outcome.DECLINED_POLICY, why)
        threshold = self.config.prefill_busy_threshold
        why = f"prefill worker {p.worker} queue {p.queued_prefill_tokens} tokens"
        limit = f"{threshold} x max_num_batched_tokens {mnbt}"
        if p.queued_prefill_tokens / mnbt > threshold:
            return Decision(True, Outcome.BYPASS_LOAD, f"{why} > {limit}")
        return Decision(False, Outcome.DECLINED_POLICY, f"{why} <= {limit}")
