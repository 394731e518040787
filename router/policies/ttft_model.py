"""ttft_model: predict time to first token on both paths and take the cheaper one (kvswitch's own).

With d the chosen decode worker, p the prefill worker the router would pick, and each worker's
TimingProfile from its record (`timing_profile`; unset means protocol.timing.DEFAULT_PROFILE):

    remote = prefill_s_p(queued_p)                          # p's prefill queue drained as one batch
           + prefill_s_p(isl - cached_p, cached_p)          # the uncached part on p
           + transfer_s_p(isl - cached_d, link_gbps)        # KV that d lacks, over the link
           + decode_s_d(running_d + 1, isl)                 # d's first decode step with the handle
    local  = prefill_s_d(queued_d)                          # d's own prefill queue
           + prefill_s_d(isl - cached_d, cached_d)          # the uncached part on d
           + stall_weight * decode_stall_s_d(isl - cached_d, cached_d) * running_d

    bypass iff local < remote   (strict: a tie keeps the remote prefill)

The last term is what a local prefill costs everyone else: each of d's running decodes waits
`decode_stall_s` longer for its next token. It is counted as a cost of the local path, weighted
by `stall_weight` (default 0.1: ten requests each delayed by x weigh as much as this request's
own TTFT growing by x, since an inter-token hiccup hurts less than a first-token wait).

Parameters (flags `--ttft-link-gbps`, `--ttft-stall-weight`, live-tunable like the others):
link_gbps (KV transfer link in GB/s, default 50, about one 400 Gb/s NIC per GPU), stall_weight
(>= 0, default 0.1). An unknown profile keeps the remote prefill and says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import ConfigError
from protocol.config import ConditionalDisaggConfig
from protocol.timing import DEFAULT_PROFILE, TimingProfile, load_profile
from router.policies.decision import Decision, Outcome
from router.request_context import Candidate, RequestContext

__all__ = ["DEFAULT_LINK_GBPS", "DEFAULT_STALL_WEIGHT", "NAME", "Prediction", "TtftModel", "TtftModelConfig"]

NAME = "ttft_model"
DEFAULT_LINK_GBPS = 50.0
DEFAULT_STALL_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class TtftModelConfig:
    link_gbps: float = DEFAULT_LINK_GBPS
    stall_weight: float = DEFAULT_STALL_WEIGHT

    def __post_init__(self) -> None:
        if self.link_gbps <= 0:
            raise ConfigError("link_gbps", self.link_gbps, "must be > 0")
        if self.stall_weight < 0:
            raise ConfigError("stall_weight", self.stall_weight, "must be >= 0")

    @classmethod
    def from_settings(cls, cfg: ConditionalDisaggConfig) -> TtftModelConfig:
        return cls(link_gbps=cfg.ttft_link_gbps, stall_weight=cfg.ttft_stall_weight)


@dataclass(frozen=True, slots=True)
class Prediction:
    remote_s: float
    local_s: float


def _profile(c: Candidate) -> TimingProfile:
    return load_profile(c.info.timing_profile or DEFAULT_PROFILE)


class TtftModel:
    name = NAME

    def __init__(self, config: TtftModelConfig) -> None:
        self.config = config

    def predict(self, ctx: RequestContext, d: Candidate, p: Candidate) -> Prediction:
        prof_d, prof_p = _profile(d), _profile(p)
        isl = ctx.isl
        cached_d, cached_p = ctx.cached_tokens(d), ctx.cached_tokens(p)
        remote = (
            prof_p.prefill_s(p.queued_prefill_tokens)
            + prof_p.prefill_s(isl - cached_p, cached_p)
            + prof_p.transfer_s(isl - cached_d, self.config.link_gbps)
            + prof_d.decode_s(d.running + 1, isl)
        )
        stall = prof_d.decode_stall_s(isl - cached_d, cached_d) * d.running
        local = (
            prof_d.prefill_s(d.queued_prefill_tokens)
            + prof_d.prefill_s(isl - cached_d, cached_d)
            + self.config.stall_weight * stall
        )
        return Prediction(remote_s=remote, local_s=local)

    def decide(self, ctx: RequestContext) -> Decision:
        d, p = ctx.decode, ctx.prefill
        if d is None or p is None:
            return Decision(False, Outcome.DECLINED_POLICY, "needs both a decode and a prefill worker")
        try:
            pred = self.predict(ctx, d, p)
        except ValueError as exc:
            return Decision(False, Outcome.DECLINED_POLICY, f"no timing profile: {exc}")
        why = f"predicted TTFT local {pred.local_s * 1e3:.2f} ms vs remote {pred.remote_s * 1e3:.2f} ms"
        if pred.local_s < pred.remote_s:
            return Decision(True, Outcome.BYPASS_TTFT, why)
        return Decision(False, Outcome.DECLINED_POLICY, why)
