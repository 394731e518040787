"""slo_aware: prefill where the fewest requests lose their service level.

Goodput counts requests that meet both SLOs (RouterSettings.slo_ttft_s on time to first token,
slo_itl_s on the mean inter-token latency, TPOT). Per request, with d the chosen decode worker, p
the prefill worker the router would pick, each worker's timing T (router.calibration: its
profile's shape times its fitted factors), n prompt tokens of which c_d / c_p are cached on d / p,
Q the prefill tokens queued on a worker, B = running(d), m = d's max_num_batched_tokens, and L and
C the mean output length (`max_tokens`; a chat request with no limit does not count) and mean
context (prompt + L / 2) of recently admitted requests (`admitted`: once per request, each counted
as no longer than its worker's max_model_len lets it be):

    local   = T_d.queue(Q_d) + T_d.prefill(n - c_d | c_d) + ceil((Q_d + n - c_d) / m) * T_d.decode(B, C)
    remote  = T_p.queue(Q_p) + T_p.prefill(n - c_p | c_p) + transfer(n - c_d) + T_d.decode(B + 1, C)
    itl_now = T_d.decode(B + 1, C) + T_d.stall(Q_d) / L      (d's running requests' TPOT)
    itl_loc = itl_now + T_d.stall(n - c_d | c_d) / L         (... after this local prefill: its stall,
                                                              spread over their tokens)

With the budgets ttft_b = headroom * slo_ttft_s and itl_b = headroom * slo_itl_s, the expected
requests each path loses:

    pushed      = B * min(1, (itl_loc - itl_b) / (itl_loc - itl_now))   if itl_now < itl_loc and itl_b < itl_loc,
                                                                      else 0
    lost_local  = [local > ttft_b] + pushed      (this request's TTFT, and d's running requests
                                                  pushed over their TPOT budget)
    lost_remote = [remote > ttft_b]

    bypass iff lost_local < lost_remote, or lost_local == lost_remote and local < remote,
           or T_p.queue(Q_p) + T_p.prefill(n - c_p | c_p) >= headroom * prefill_timeout_s

(T.prefill prices a prompt in the chunks of its worker's max_num_batched_tokens, as its engine runs
it, each chunk attending to those before it; T.queue prices the queued prompts, which do not attend
to each other, in full chunks over no cached context. Priced as one prompt, as ttft_model still
prices it, a queue of many prompts read dearer than it runs: on the sweep's 4P+12D x4 point
`slo_spill` went from 1.05x to 1.29x the better fixed mode with this price, docs/benchmarks.md.)
The last: a leg predicted past the headroom's share of prefill_timeout_s is no path. It would time
out, the request prefill here anyway that much later, the prefill worker's work on it be lost and
the worker left out as failing for a cooldown (router.eligibility), every request then prefilling
on its decode worker. Without it, on the shipped
trace's 191 k-token prompts (33 s of prefill each), the virtual replay's prefill worker was left out
for 60 s of `make demo`'s 200 s slice.

So a request goes the way it meets its TTFT; between two that both do, the faster one, unless the
local prefill would cost d's running requests their TPOT; a request that misses either way goes the
faster way unless that costs others theirs. Ties keep the remote prefill. (A request that misses
its TTFT on both paths is counted once on each, so the comparison is its harm to others.) Running
requests already over itl_b count as pushed too: TPOT is a mean over a request's life, so one that
is over now recovers once the stalls stop, and every further stall keeps it over.

Room (router.policies.DecodeRoom): the planner offers d a request only while d's B + W running and
waiting requests keep their TPOT in budget with one more,

    T_d.decode(B + W + 1, C) + T_d.stall(Q_d) / L <= itl_b        (an idle d always has room)

and, when every prefill worker is full so that d would prefill the request itself, with that
prefill's stall T_d.stall(n - c_d | c_d) / L added. Otherwise the request waits at admission, and
is shed there (429) when the queue cannot drain within half the TTFT SLO. The fixed modes cannot
wait for room by construction: past the knee they prefill on decode workers whose running requests
then all miss their TPOT (docs/benchmarks.md, the sweep).

Prefill room (router.policies.PrefillRoom): the planner leaves a prefill worker past its backlog
bound (half the TTFT SLO, router.planner) out of the remote path, unless its answer fits,

    T_p.queue(Q_p) + T_p.prefill(n - c_p | c_p) <= prefill_fit * slo_ttft_s

Without it a request the prefill worker would answer in time prefilled on its decode worker,
costing that worker's running requests their TPOT, or waited at admission for room to: on `make
demo`'s slice, 0.8 read 3.40 r/s against 3.26 without (0.6, 0.7, 1.0: 3.24, 3.31, 3.31;
docs/benchmarks.md).
The rule is asked only past the bound, Q_p / rate_p > slo_ttft_s / 2 (rate_p: full batches of
m_p, p's max_num_batched_tokens), while T_p.queue prices Q_p as full chunks and one partial chunk
r = Q_p mod m_p. A prefill_fit of 0.5 or less therefore keeps a worker only where that partial
chunk runs faster per token than a full one, T_p.prefill(r) < r / rate_p, and only above
0.5 - (Q_p / rate_p - T_p.queue(Q_p)) / slo_ttft_s, a gap under one chunk's time. h200:llama-3.1-8b
at m_p 8192 prices a partial chunk at most 13 ms under the rate (0.007 of a 2 s SLO), so there
(0, 0.5] acts as 0; larger chunks open it wider (h200:qwen2.5-32b at 32768: up to 0.5 s, and 0.45
keeps a worker with 6,200 tokens queued; tests/router/test_planner_prefill_room.py).

Spill (`--spill-to-prefill`): while no decode worker has room, the planner asks the same of prefill
workers, which would prefill and decode the request themselves. A prefill worker keeps prefilling
what is routed to it, a share u = inflow / rate of its time (inflow: the prompt tokens per second
booked on it lately, router.load_view; rate: its prefill speed at full batches), and every decode
step there stretches by 1 / (1 - u):

    (T_p.decode(B + W + 1, C) + T_p.stall(Q_p) / L + T_p.stall(n - c_p | c_p) / L) / (1 - u) <= itl_b

u >= 1 is no room; an idle prefill worker's room is judged too, but what the request would get
alone there never exceeds the budget.

Parameters: slo_ttft_s, slo_itl_s (RouterSettings); headroom (`--slo-headroom`, in (0, 1],
default 0.8: the share of each SLO the predictions may use, for what they do not see);
prefill_fit (`--slo-prefill-fit`, in [0, 1], default 0.8; 0 turns the prefill room rule off, and
0.5 or less acts only as above);
link_gbps (`--ttft-link-gbps`, shared with ttft_model). A worker without timing (no profile and
no calibration) keeps the remote prefill and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol import ConfigError
from protocol.config import RouterSettings
from router.calibration import FULL_BATCH_TOKENS, WorkerTiming, timing_of
from router.policies.decision import Decision, Outcome
from router.request_context import Candidate, RequestContext

__all__ = ["NAME", "UNKNOWN_MAX_MODEL_LEN", "Forecast", "SloAware", "SloAwareConfig"]

NAME = "slo_aware"
_INITIAL_OUTPUT_LEN = 128.0
_INITIAL_PROMPT_LEN = 4096.0
_EWMA_WEIGHT = 0.02  # each request's weight in L and C
UNKNOWN_MAX_MODEL_LEN = 32_768
"""The context a request counts within in L and C when its worker does not say its max_model_len."""


@dataclass(frozen=True, slots=True)
class SloAwareConfig:
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.025
    headroom: float = 0.8
    link_gbps: float = 50.0
    prefill_timeout_s: float = 30.0
    prefill_fit: float = 0.8

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_itl_s", "link_gbps", "prefill_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        if not 0 < self.headroom <= 1:
            raise ConfigError("slo_headroom", self.headroom, "must be in (0, 1]")
        if not 0 <= self.prefill_fit <= 1:
            raise ConfigError("slo_prefill_fit", self.prefill_fit, "must be in [0, 1]")

    @classmethod
    def from_settings(cls, settings: RouterSettings) -> SloAwareConfig:
        c = settings.conditional
        return cls(
            slo_ttft_s=settings.slo_ttft_s,
            slo_itl_s=settings.slo_itl_s,
            headroom=c.slo_headroom,
            link_gbps=c.ttft_link_gbps,
            prefill_timeout_s=settings.prefill_timeout_s,
            prefill_fit=c.slo_prefill_fit,
        )


@dataclass(frozen=True, slots=True)
class Forecast:
    local_s: float
    remote_s: float
    itl_now_s: float
    itl_local_s: float
    prefill_answer_s: float = 0.0  # the remote path's wait for its prefill leg's answer


class SloAware:
    name = NAME

    def __init__(self, config: SloAwareConfig) -> None:
        self.config = config
        self.output_len = _INITIAL_OUTPUT_LEN
        self.prompt_len = _INITIAL_PROMPT_LEN
        self._priced_for = 0  # id() of the request _priced holds prompt prices for
        self._priced: dict[tuple[WorkerTiming, int, int], float] = {}

    @property
    def context(self) -> float:
        """A running request's mean context: its prompt and half its output, as recently seen."""
        return self.prompt_len + self.output_len / 2

    def forecast(self, ctx: RequestContext, d: Candidate, p: Candidate, td: WorkerTiming, tp: WorkerTiming) -> Forecast:
        n = ctx.isl
        cd, cp = ctx.cached_tokens(d), ctx.cached_tokens(p)
        new_d, new_p = n - cd, n - cp
        batch = d.running
        context = self.context
        mnbt = d.info.max_num_batched_tokens or FULL_BATCH_TOKENS
        q_d, q_p = d.queued_prefill_tokens, p.queued_prefill_tokens
        steps = math.ceil((q_d + new_d) / mnbt)
        local = td.queue_s(q_d) + td.prefill_s(new_d, cd) + steps * td.decode_s(batch, context)
        answer = tp.queue_s(q_p) + tp.prefill_s(new_p, cp)
        remote = answer + tp.transfer_s(new_d, self.config.link_gbps) + td.decode_s(batch + 1, context)
        itl_now = self._tpot(td, batch, q_d)
        itl_local = itl_now + td.stall_s(new_d, cd, batch) / self.output_len
        return Forecast(local, remote, itl_now, itl_local, answer)

    def _tpot(self, td: WorkerTiming, batch: int, queued: int) -> float:
        """The TPOT of a worker's running requests with one more: a step, plus the stall of its
        queued prefill spread over their tokens."""
        return td.decode_s(batch + 1, self.context) + td.stall_s(queued, 0, batch) / self.output_len

    def has_room(self, ctx: RequestContext, c: Candidate, *, local: bool) -> bool:
        batch = c.running + c.waiting
        td = timing_of(c.info, c.timing)
        spill = c.info.role == "prefill"
        if td is None or (batch == 0 and not spill):
            return True
        own = 0.0
        if local:
            cached = ctx.cached_tokens(c)
            own = td.stall_s(ctx.isl - cached, cached, batch) / self.output_len
        tpot = self._tpot(td, batch, c.queued_prefill_tokens) + own
        budget = self.config.headroom * self.config.slo_itl_s
        if spill:
            # The prefill worker keeps prefilling while the request decodes there: at a share u of
            # its time busy with the prompts booked on it, each step stretches by 1 / (1 - u). What
            # the request would get alone on the idle engine is never a reason to refuse it.
            rate = td.prefill_rate(c.info.max_num_batched_tokens or FULL_BATCH_TOKENS)
            busy = c.prefill_inflow / rate if rate else 0.0
            if busy >= 1.0:
                return False
            tpot /= 1.0 - busy
            budget = max(budget, self._tpot(td, 0, 0) + own)
        return tpot <= budget

    @property
    def prefill_rule(self) -> str | None:
        fit = self.config.prefill_fit
        if not fit:
            return None
        return f"its queue and the prompt are predicted past slo_prefill_fit {fit:g} x the TTFT SLO"

    def prefill_fits(self, ctx: RequestContext, p: Candidate) -> bool:
        """Prefill worker `p`, past the router's backlog bound, still takes the request's remote
        prefill while its answer (its queue, then the prompt's uncached rest) is predicted within
        prefill_fit x the TTFT SLO (router.policies.PrefillRoom)."""
        fit = self.config.prefill_fit
        tp = timing_of(p.info, p.timing)
        if not fit or tp is None:
            return False
        limit = fit * self.config.slo_ttft_s
        queue = tp.queue_s(p.queued_prefill_tokens)
        if queue > limit:  # the prompt's price (never negative) could only add to it: skip its chunk loop
            return False
        cached = ctx.cached_tokens(p)
        return queue + self._prompt_s(ctx, tp, ctx.isl - cached, cached) <= limit

    def _prompt_s(self, ctx: RequestContext, tp: WorkerTiming, new: int, cached: int) -> float:
        """tp.prefill_s(new, cached), priced once per request for each timing and cache: the planner
        asks prefill_fits of every prefill worker past the bound, and a 128 k-token prompt's chunk
        loop cost 20 us a worker (bench.bench_router prefill-room). The key is all the price depends
        on; the request only bounds the memo's size."""
        if self._priced_for != id(ctx):
            self._priced_for, self._priced = id(ctx), {}
        key = (tp, new, cached)
        price = self._priced.get(key)
        if price is None:
            price = self._priced[key] = tp.prefill_s(new, cached)
        return price

    def lost(self, f: Forecast, running: int) -> tuple[float, float]:
        """Requests expected to miss their SLO: (on the local path, on the remote path)."""
        c = self.config
        ttft_budget, itl_budget = c.headroom * c.slo_ttft_s, c.headroom * c.slo_itl_s
        pushed = 0.0
        if running and f.itl_now_s < f.itl_local_s and itl_budget < f.itl_local_s:
            pushed = running * min(1.0, (f.itl_local_s - itl_budget) / (f.itl_local_s - f.itl_now_s))
        return float(f.local_s > ttft_budget) + pushed, float(f.remote_s > ttft_budget)

    def admitted(self, ctx: RequestContext, max_model_len: int | None) -> None:
        """A request was admitted (router.disagg.Learns): it moves L and C, once; decide() and
        has_room() run on every plan, a waiter's re-offers and /debug/route's included. It counts
        as no longer than its engine lets it be (`max_model_len`, the chosen worker's): a prompt
        within that context, an output within what the prompt leaves of it, so one absurd
        max_tokens cannot price every decode step at a huge context."""
        limit = max_model_len or UNKNOWN_MAX_MODEL_LEN
        prompt = min(ctx.isl, limit)
        if ctx.max_tokens is not None:  # a request with no limit says nothing of its length
            output = min(max(ctx.max_tokens, 1), max(limit - prompt, 1))
            self.output_len += _EWMA_WEIGHT * (output - self.output_len)
        self.prompt_len += _EWMA_WEIGHT * (prompt - self.prompt_len)

    def decide(self, ctx: RequestContext) -> Decision:
        d, p = ctx.decode, ctx.prefill
        if d is None or p is None:
            return Decision(False, Outcome.DECLINED_POLICY, "needs both a decode and a prefill worker")
        td, tp = timing_of(d.info, d.timing), timing_of(p.info, p.timing)
        if td is None or tp is None:
            return Decision(False, Outcome.DECLINED_POLICY, "no timing for a worker (no profile, no calibration)")
        f = self.forecast(ctx, d, p, td, tp)
        if f.prefill_answer_s >= self.config.headroom * self.config.prefill_timeout_s:
            # The leg would time out: the request then prefills here anyway, prefill_timeout_s late,
            # the prefill worker's work on it is lost, and the worker is left out as failing.
            why = (
                f"the prefill worker's answer is predicted in {f.prefill_answer_s:.1f} s, past the headroom's share "
                f"of prefill_timeout_s ({self.config.prefill_timeout_s:g} s)"
            )
            return Decision(True, Outcome.BYPASS_SLO, why)
        lost_local, lost_remote = self.lost(f, d.running)
        why = (
            f"TTFT local {f.local_s * 1e3:.1f} ms vs remote {f.remote_s * 1e3:.1f} ms; decode TPOT "
            f"{f.itl_now_s * 1e3:.1f} -> {f.itl_local_s * 1e3:.1f} ms locally; requests lost: local "
            f"{lost_local:.2f}, remote {lost_remote:.2f}"
        )
        if lost_local < lost_remote or (lost_local == lost_remote and f.local_s < f.remote_s):
            return Decision(True, Outcome.BYPASS_SLO, why)
        return Decision(False, Outcome.DECLINED_POLICY, why)
