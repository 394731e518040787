"""The booking ledger: what each routed attempt claims on its workers, from booking to release.

A booking is keyed by attempt (`{request_id}#{attempt}`), made the moment a plan is taken (so the
next request sees it, DESIGN.md step 5) and released when the attempt ends, whichever way. Its
figures are the request context's own arithmetic:

- bypass or aggregated: the decode worker prefills `ctx.uncached_tokens(d)` and allocates
  `ctx.new_blocks(d)`;
- remote: the prefill worker prefills `ctx.uncached_tokens(p)`; the decode worker allocates
  `ctx.new_blocks(d)` and prefills nothing;
- a remote prefill that falls back becomes the bypass booking (the prefill worker's claim goes).

The prompt's blocks also become pending prefixes on the workers that will hold them
(router.pending_prefixes), so requests routed before the KV events arrive already see them. The
booking's claim on a worker's entries is settled once that worker has prefilled the prompt (the
prefill worker's leg returned its transfer, the decode worker's first token, a clean final chunk),
and withdrawn when the attempt ends before that, or when a remote prefill falls back (the prefill
worker's): the next request, a retry first of all, must not be told a worker holds a prompt it
never cached.

Bookings go to a `BookingSink`: the replica's load view plus its peers (router.replica_sync), or in
the virtual-clock replay a sink that delivers to peers after a modelled delay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from protocol.hashing import endpoint_key
from router.disagg import RoutePlan
from router.load_view import LoadView
from router.pending_prefixes import Claim, PendingPrefixes
from router.policies import Path
from router.request_context import Candidate, RequestContext

__all__ = ["BookingSink", "Ledger", "LocalSink"]


class BookingSink(Protocol):
    def add(self, key: str, worker: str, tokens: int, blocks: int) -> None: ...
    def prefill_done(self, key: str, worker: str | None = None) -> None: ...
    def free(self, key: str) -> None: ...


class LocalSink:
    """Bookings in one load view, shared with nobody (a single replica, unit tests)."""

    def __init__(self, view: LoadView) -> None:
        self.view = view

    def add(self, key: str, worker: str, tokens: int, blocks: int) -> None:
        self.view.book(key, worker, tokens, blocks)

    def prefill_done(self, key: str, worker: str | None = None) -> None:
        self.view.prefill_done(key, worker=worker)

    def free(self, key: str) -> None:
        self.view.free(key)


class Ledger:
    def __init__(self, sink: BookingSink, pending: PendingPrefixes) -> None:
        self.sink = sink
        self.pending = pending
        self.live = 0  # bookings not yet freed
        self._claims: dict[str, list[Claim]] = {}  # booking -> its claims neither settled nor withdrawn

    def book(self, key: str, plan: RoutePlan) -> None:
        ctx, d, p = plan.ctx, plan.decode, plan.prefill
        self.live += 1
        claims = self._claims[key] = []
        if plan.path is Path.REMOTE and p is not None:
            self.sink.add(key, p.worker, ctx.uncached_tokens(p), 0)
            self.sink.add(key, d.worker, 0, ctx.new_blocks(d))
            self._pending(p, ctx, claims)
        else:
            self.sink.add(key, d.worker, ctx.uncached_tokens(d), ctx.new_blocks(d))
        self._pending(d, ctx, claims)

    def _pending(self, c: Candidate, ctx: RequestContext, claims: list[Claim]) -> None:
        """The prompt's blocks will be on `c`; on a hybrid model's worker, with its window cached
        where a resend of it resumes, before its last token (vLLM 0.32 replay_boundaries: a block
        short of its last full one when it is block-aligned), the hit end its shim will publish
        (worker_shim.window_endpoints)."""
        added = [self.pending.add(c.worker, ctx.hashes)]
        n = (ctx.isl - 1) // ctx.block_size
        if c.info.sliding_window and n > 0:  # an empty prompt makes n -1
            added.append(self.pending.add(c.worker, [endpoint_key(ctx.hashes[n - 1])]))
        claims.extend(claim for claim in added if claim is not None)

    def _end_claims(self, key: str, worker: str, end: Callable[[Claim], None]) -> None:
        """`end` the booking's claims on `worker`."""
        claims = self._claims.get(key, [])
        for claim in [c for c in claims if c.worker == worker]:
            claims.remove(claim)
            end(claim)

    def rebook_bypass(self, key: str, plan: RoutePlan) -> None:
        """The remote prefill failed: the decode worker prefills the prompt itself."""
        ctx, d = plan.ctx, plan.decode
        if plan.prefill is not None:
            self.sink.add(key, plan.prefill.worker, 0, 0)
            # Unless it prefilled after all (the decode worker's pull failed): that one was settled
            self._end_claims(key, plan.prefill.worker, self.pending.withdraw)
        self.sink.add(key, d.worker, ctx.uncached_tokens(d), ctx.new_blocks(d))

    def prefill_done(self, key: str, worker: str | None = None) -> None:
        """The first token came: prefill tokens leave every queue the attempt was booked on. With
        `worker`, only that worker's booking: the prefill worker's, when a remote prefill leg ends."""
        if worker is None:
            for claim in self._claims.pop(key, []):
                self.pending.settle(claim)
        else:
            self._end_claims(key, worker, self.pending.settle)
        self.sink.prefill_done(key, worker)

    def free(self, key: str, *, served: bool = False) -> None:
        """The attempt ended; `served`: by its decode leg's clean final chunk, its prefill done even
        where no first token was read before (a whole answer's `prefilled` chunk still queued). Its
        claims not settled are withdrawn."""
        self.live -= 1
        end = self.pending.settle if served else self.pending.withdraw
        for claim in self._claims.pop(key, []):
            end(claim)
        self.sink.free(key)
