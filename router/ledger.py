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
(router.pending_prefixes), so requests routed before the KV events arrive already see them.

Bookings go to a `BookingSink`: the replica's load view plus its peers (router.replica_sync), or in
the virtual-clock replay a sink that delivers to peers after a modelled delay.
"""

from __future__ import annotations

from typing import Protocol

from protocol.hashing import endpoint_key
from router.disagg import RoutePlan
from router.load_view import LoadView
from router.pending_prefixes import PendingPrefixes
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

    def book(self, key: str, plan: RoutePlan) -> None:
        ctx, d, p = plan.ctx, plan.decode, plan.prefill
        self.live += 1
        if plan.path is Path.REMOTE and p is not None:
            self.sink.add(key, p.worker, ctx.uncached_tokens(p), 0)
            self.sink.add(key, d.worker, 0, ctx.new_blocks(d))
            self._pending(p, ctx)
        else:
            self.sink.add(key, d.worker, ctx.uncached_tokens(d), ctx.new_blocks(d))
        self._pending(d, ctx)

    def _pending(self, c: Candidate, ctx: RequestContext) -> None:
        """The prompt's blocks will be on `c`; on a hybrid model's worker, with its window cached
        where a resend of it resumes, before its last token (vLLM 0.32 replay_boundaries: a block
        short of its last full one when it is block-aligned), the hit end its shim will publish
        (worker_shim.window_endpoints)."""
        self.pending.add(c.worker, ctx.hashes)
        n = (ctx.isl - 1) // ctx.block_size
        if c.info.sliding_window and n > 0:  # an empty prompt makes n -1
            self.pending.add(c.worker, [endpoint_key(ctx.hashes[n - 1])])

    def rebook_bypass(self, key: str, plan: RoutePlan) -> None:
        """The remote prefill failed: the decode worker prefills the prompt itself."""
        ctx, d = plan.ctx, plan.decode
        if plan.prefill is not None:
            self.sink.add(key, plan.prefill.worker, 0, 0)
        self.sink.add(key, d.worker, ctx.uncached_tokens(d), ctx.new_blocks(d))

    def prefill_done(self, key: str, worker: str | None = None) -> None:
        """The first token came: prefill tokens leave every queue the attempt was booked on. With
        `worker`, only that worker's booking: the prefill worker's, when a remote prefill leg ends."""
        self.sink.prefill_done(key, worker)

    def free(self, key: str) -> None:
        self.live -= 1
        self.sink.free(key)
