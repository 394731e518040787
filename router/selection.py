"""Worker selection: the cost function and the comparison modes.

Cost of serving the request on worker w (lower is better), in KV blocks:

    prefill_blocks(w) = (uncached_tokens(w) + queued_prefill_tokens(w) - shared_pending(w)) / block_size
    decode_blocks(w)  = active_blocks(w) + request_blocks
    cost(w)           = overlap_weight * prefill_blocks(w) + decode_blocks(w)

`uncached_tokens(w) = isl - min(overlap_blocks(w) * block_size, isl)`: the prompt tokens w would
have to prefill; `queued_prefill_tokens` and `active_blocks` are the load view's figures (the
worker's last report plus every router's bookings); `request_blocks = ceil(isl / block_size)`.
`overlap_weight` (RouterSettings, default 4) trades cache affinity against decode load.

`shared_pending(w) = min(pending_blocks(w) * block_size, queued_prefill_tokens(w))`: the part of w's
queue that is this prompt's own prefix, routed to w by an earlier request and not in the index yet
(router.pending_prefixes). w computes it once for both requests (the engine finds blocks it is
computing in its prefix cache), so it is neither work this request adds nor a wait it would avoid
elsewhere, where it would compute that prefix itself. Without it, a burst of requests on one new
prefix would spread over every idle worker, each recomputing the prefix.

Recomputation (`recompute_weight` rho, RouterSettings, default 2): a worker that would recompute
prefix tokens another worker of the pool holds pays for them again,

    cost(w) += overlap_weight * rho * max(held_tokens - cached_tokens(w), 0) / block_size

where `held_tokens` is the longest prefix of this prompt cached (or pending) on a worker of the
pool that could take it within half the TTFT SLO: its predicted prefill backlog plus this prompt's
uncached prefill, by its timing (fitted when the router calibrates, else its profile's; the
admission bound, router.planner). The seed cost
counts only the request's own prefill, so an idle worker beats a holder with a short queue and
the fleet computes the prefix twice: capacity every later request waits for. A holder past the
bound (or with no timing to judge it by) sets no charge, so a hot prefix never piles onto one
worker beyond what the SLO allows. rho = 0 is the seed cost; docs/benchmarks.md has the sweep
that chose 2.

Near-ties: with temperature T = 0 the lowest cost wins and exact ties are broken uniformly at
random. With T > 0 a worker is drawn with probability proportional to
`exp(-(cost(w) - min_cost) / (T * max(min_cost, 1)))`, i.e. by its relative excess over the best:
with T = 0.1 a worker 10% costlier than the best is picked e^-1 as often, one 50% costlier
e^-5 as often. Replicas that see the same state thus spread near-ties instead of herding.

Comparison modes (`routing`): `kv` (the cost above), `round_robin` (rotates over the pool sorted
by worker id), `random` (uniform), `least_loaded` (fewest running + waiting requests, with those
routed there since its last report, then fewest active blocks; ignores the cache).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

from protocol.config import RouterSettings
from router.calibration import timing_of
from router.request_context import Candidate, RequestContext

__all__ = ["Selector", "held_tokens", "over_queue_threshold", "worker_cost"]


def worker_cost(
    ctx: RequestContext, c: Candidate, overlap_weight: float, held_tokens: int = 0, recompute_weight: float = 0.0
) -> float:
    shared_pending = min(c.pending_blocks * ctx.block_size, c.queued_prefill_tokens)
    recomputed = max(held_tokens - ctx.cached_tokens(c), 0)
    prefill_tokens = ctx.uncached_tokens(c) + c.queued_prefill_tokens - shared_pending + recompute_weight * recomputed
    decode_blocks = c.active_blocks + ctx.request_blocks
    return overlap_weight * prefill_tokens / ctx.block_size + decode_blocks


def held_tokens(ctx: RequestContext, pool: Sequence[Candidate], max_wait_s: float) -> int:
    """The longest prefix of the prompt cached on a worker of `pool` that would start it within
    `max_wait_s`: its queued prefill plus this prompt's uncached part, at its predicted speed
    (fitted, else its profile's). Workers with neither are not judged, and count for nothing."""
    best = 0
    for c in pool:
        cached = ctx.cached_tokens(c)
        if cached <= best:
            continue
        timing = timing_of(c.info, c.timing)
        if timing is None:
            continue
        rate = c.prefill_rate()
        wait = (c.queued_prefill_tokens / rate if rate else 0.0) + timing.prefill_s(ctx.uncached_tokens(c), cached)
        if wait <= max_wait_s:
            best = cached
    return best


def over_queue_threshold(c: Candidate, queue_threshold: float | None) -> bool:
    """A worker whose queued prefill tokens exceed `queue_threshold` x its max_num_batched_tokens.

    Unknown max_num_batched_tokens or no threshold: never over. The ratio is compared, not the
    product: a correctly rounded quotient equals the threshold when the queue is exactly at it,
    where `0.57 * 10000` is 5699.999999999999 and would call a queue of 5700 over.
    """
    mnbt = c.info.max_num_batched_tokens
    if queue_threshold is None or not mnbt:
        return False
    return c.queued_prefill_tokens / mnbt > queue_threshold


class Selector:
    """Ranks a pool for one request. Holds the round-robin cursors and the random source."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        # One cursor per pool ("decode", "prefill", "spill"), moved only by a request routed
        # (`advance`): one shared by both pools moved twice per request, so with two prefill
        # workers every request took the same decode worker, and a dry run moved it too.
        self._rr: Counter[str] = Counter()

    def advance(self, kind: str) -> None:
        """A request was routed with the `kind` pool's choice: round robin moves on there."""
        self._rr[kind] += 1

    def rank(
        self, ctx: RequestContext, pool: Sequence[Candidate], settings: RouterSettings, kind: str = "decode"
    ) -> list[Candidate]:
        """The pool, best first (the first is the choice). Workers over the queue threshold go
        last while any other is below it. Costs are written onto every candidate. `kind`: which
        pool it is, for round robin's cursor."""
        if not pool:
            return []
        rho = settings.recompute_weight if settings.routing == "kv" else 0.0
        held = held_tokens(ctx, pool, settings.slo_ttft_s / 2) if rho > 0 and len(pool) > 1 else 0
        for c in pool:
            c.cost = worker_cost(ctx, c, settings.overlap_weight, held, rho)
        qt = settings.conditional.queue_threshold
        open_ = [c for c in pool if not over_queue_threshold(c, qt)]
        busy = [c for c in pool if over_queue_threshold(c, qt)]
        return self._order(open_, settings, kind) + self._order(busy, settings, kind)

    def _order(self, pool: list[Candidate], settings: RouterSettings, kind: str) -> list[Candidate]:
        if len(pool) <= 1:
            return list(pool)
        mode = settings.routing
        if mode == "round_robin":
            ordered = sorted(pool, key=lambda c: c.worker)
            start = self._rr[kind] % len(ordered)
            return ordered[start:] + ordered[:start]
        if mode == "random":
            shuffled = list(pool)
            self._rng.shuffle(shuffled)
            return shuffled
        if mode == "least_loaded":
            return sorted(
                pool, key=lambda c: (c.running + c.waiting + c.booked_requests, c.active_blocks, self._rng.random())
            )
        by_cost = sorted(pool, key=lambda c: (c.cost, self._rng.random()))
        if settings.temperature > 0:
            chosen = self._sample(by_cost, settings.temperature)
            by_cost.remove(chosen)
            by_cost.insert(0, chosen)
        return by_cost

    def _sample(self, by_cost: list[Candidate], temperature: float) -> Candidate:
        best = by_cost[0].cost
        scale = temperature * max(best, 1.0)
        weights = [math.exp(-(c.cost - best) / scale) for c in by_cost]
        return self._rng.choices(by_cost, weights=weights, k=1)[0]
