"""ttft_model: predict time to first token on both paths and take the cheaper one (kvswitch's own).

Every term is a function of protocol.timing.TimingModel, the model engine_sim charges its steps
with, so on simulated engines the prediction is what the engine will do (up to the load estimates
below). With d the chosen decode worker, p the prefill worker the router would pick, each worker's
model from its record (`timing_profile`; unset means protocol.timing.DEFAULT_PROFILE), its token
budget M from `max_num_batched_tokens` (unset: DEFAULT_MAX_NUM_BATCHED_TOKENS), B = d's running
requests at mean context x (LoadReport.decode_context, the shim's count; from a shim without it d's
used KV blocks x block size / B; the prompt length when unknown):

    h_w    = min(cached_w, (isl - 1) // block * block)   # the engine's hit: the last token is computed
    remote = prefill_time_p(queued_p, 0, M_p)              # p's prefill queue, chunked
           + prefill_time_p(isl - h_p, h_p, M_p)           # the uncached part on p, chunked
           + transfer_d(isl - h_d, link_gbps)              # the KV that d lacks, over the link
           + decode_d(B + 1, (B*x + isl) / (B + 1))        # d's first step with the request
    local  = prefill_time_d(queued_d, 0, M_d, B, x)        # d's own prefill queue, beside its decodes
           + prefill_time_d(isl - h_d, h_d, M_d, B, x)     # the uncached part, chunk by chunk
           + stall_weight * stall_d(isl - h_d, h_d, B, M_d) * B

    bypass iff local < remote   (strict: a tie keeps the remote prefill)

prefill_time is the sum of the steps the engine's scheduler would run (B decode tokens first, the
rest of the budget to the prompt), stall the sum of those chunks' marginals: how much longer each
of d's running decodes waits for its next tokens. It is counted as a cost of the local path,
weighted by `stall_weight` (default 0.1: ten requests each delayed by s weigh as much as this
request's own TTFT growing by s, since an inter-token hiccup hurts less than a first-token wait).

Parameters (flags `--ttft-link-gbps`, `--ttft-stall-weight`, live-tunable like the others):
link_gbps (KV transfer link in GB/s, default 50, about one 400 Gb/s NIC per GPU), stall_weight
(>= 0, default 0.1). An unknown profile keeps the remote prefill and says why. `models` (a
constructor argument, not a setting) maps a profile name to the TimingModel to predict with; a
robustness run passes one that is deliberately wrong (`TimingModel.for_profile(n).scaled(1.25)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protocol import ConfigError
from protocol.config import ConditionalDisaggConfig
from protocol.timing import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PROFILE, TimingModel
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
    """Both paths' predicted TTFT, seconds. `stall_s` is what a local prefill adds to each of the
    decode worker's running requests (before weighting)."""

    remote_s: float
    local_s: float
    stall_s: float = 0.0


def cache_hit(ctx: RequestContext, c: Candidate) -> int:
    """Prompt tokens the engine takes from its cache: whole cached blocks, but never the last
    prompt token, which it computes to sample from (vLLM's and engine_sim's rule)."""
    return min(ctx.cached_tokens(c), max(ctx.isl - 1, 0) // ctx.block_size * ctx.block_size)


def _budget(c: Candidate) -> int:
    return c.info.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS


def _decode_context(ctx: RequestContext, c: Candidate) -> float:
    """Mean context of the worker's running requests: as its shim counts them, else from the KV
    blocks they hold (which count a prefix they share once)."""
    if c.decode_context > 0:
        return c.decode_context
    if c.running > 0 and c.kv_used_blocks > 0:
        return c.kv_used_blocks * ctx.block_size / c.running
    return float(ctx.isl)


class TtftModel:
    name = NAME

    def __init__(self, config: TtftModelConfig, models: Callable[[str], TimingModel] = TimingModel.for_profile) -> None:
        self.config = config
        self._models = models

    def _model(self, c: Candidate) -> TimingModel:
        if c.timing is not None:  # the router calibrates: the worker's profile at its fitted speed
            return c.timing.model()
        return self._models(c.info.timing_profile or DEFAULT_PROFILE)

    def predict(self, ctx: RequestContext, d: Candidate, p: Candidate) -> Prediction:
        md, mp = self._model(d), self._model(p)
        isl, batch = ctx.isl, d.running
        hit_d, hit_p = cache_hit(ctx, d), cache_hit(ctx, p)
        budget_d, budget_p = _budget(d), _budget(p)
        x = _decode_context(ctx, d)
        remote = (
            mp.prefill_time(p.queued_prefill_tokens, 0, budget=budget_p)
            + mp.prefill_time(isl - hit_p, hit_p, budget=budget_p)
            + md.transfer(isl - hit_d, self.config.link_gbps)
            + md.decode(batch + 1, (batch * x + isl) / (batch + 1))
        )
        stall = md.stall(isl - hit_d, hit_d, batch, budget=budget_d)
        local = (
            md.prefill_time(d.queued_prefill_tokens, 0, budget=budget_d, decode_batch=batch, decode_context=x)
            + md.prefill_time(isl - hit_d, hit_d, budget=budget_d, decode_batch=batch, decode_context=x)
            + self.config.stall_weight * stall * batch
        )
        return Prediction(remote_s=remote, local_s=local, stall_s=stall)

    def decide(self, ctx: RequestContext) -> Decision:
        d, p = ctx.decode, ctx.prefill
        if d is None or p is None:
            return Decision(False, Outcome.DECLINED_POLICY, "needs both a decode and a prefill worker")
        try:
            pred = self.predict(ctx, d, p)
        except ValueError as exc:
            return Decision(False, Outcome.DECLINED_POLICY, f"no timing profile: {exc}")
        why = (
            f"predicted TTFT local {pred.local_s * 1e3:.2f} ms (stalls {d.running} running by "
            f"{pred.stall_s * 1e3:.2f} ms) vs remote {pred.remote_s * 1e3:.2f} ms"
        )
        if pred.local_s < pred.remote_s:
            return Decision(True, Outcome.BYPASS_TTFT, why)
        return Decision(False, Outcome.DECLINED_POLICY, why)
