"""`CreditCheck`: whether the engine reuses the cached prefixes its KV events promise.

Routers credit a worker with the prefix its KV events say it holds. If the engine then recomputes
that prefix (a cache kind kvswitch does not model, speculative decoding that drops the last
matched block, a router and engine that tokenize differently), every such request costs a full
prefill on the worker picked to avoid one, and nothing else says so. The shim can tell: it knows
what its own index promised for each leg, and the engine counts what it reused.

Each leg that reads the prefix cache on this engine (not a leg fed by a KV transfer, nor one that
asks for prompt logprobs) is *predicted* to reuse the prompt's leading blocks the index holds at
dispatch, at most all but the last token (vLLM recomputes it). The leg counts once the engine has
scheduled it (its first output, or its answer). The engine's side is its cumulative reuse counter
(vLLM's `prefix_cache_hits` plus `external_prefix_cache_hits`), read with the load polls.

A window runs from one reading of the counter to a later one. It takes the legs dispatched after
its start reading came back whose first output arrived before its end reading was asked for:
exactly those whose reuse the counter's difference holds, as an engine counts a leg's reuse when it
schedules it, before that output leaves (vLLM records a step's stats before its API server sends
the step's outputs on). A leg that spans a reading (its prefill
was still running, or it waited in the engine's queue) is left out, as its reuse may be counted
before the window. Once a window holds `min_legs` legs and `min_tokens` predicted tokens it is
judged: reused / predicted below `low` is a shortfall, logged at WARNING once with the figures and
the likely causes, until a window reaches `recover`. Reuse the index did not predict (events still
in flight, legs fed by a transfer, legs left out) only raises the ratio, so the check never blames
a worker for reusing more; blocks evicted between dispatch and scheduling lower it, hence the wide
margin.

A counter that goes down (the engine restarted) or a failed poll starts over. Synchronous: the
caller passes times in, so it is tested without a clock.
"""

from __future__ import annotations

import logging
from collections import deque

__all__ = ["RECOVERED_AT", "SHORT_BELOW", "CreditCheck", "reusable"]

log = logging.getLogger(__name__)
SHORT_BELOW = 0.5  # reused / promised of a window that falls short
RECOVERED_AT = 0.8  # ... and of one that ends a shortfall


def reusable(held: int, prompt_tokens: int, block_size: int) -> int:
    """Of `held` leading prompt tokens in the cache, those vLLM reuses: whole blocks short of the
    prompt's last token, which it computes to sample from."""
    return min(held, (prompt_tokens - 1) // block_size * block_size)


class CreditCheck:
    def __init__(
        self,
        engine: str = "",
        *,
        min_legs: int = 8,
        min_tokens: int = 4096,
        low: float = SHORT_BELOW,
        recover: float = RECOVERED_AT,
    ) -> None:
        self.engine = engine  # names it in the log
        self.min_legs = min_legs
        self.min_tokens = min_tokens
        self.low = low
        self.recover = recover
        self.short = False
        self.ratio: float | None = None  # the last judged window's reused / predicted
        self.windows = 0
        self.short_windows = 0  # judged below `low`
        self.lowest: float | None = None  # the lowest judged window's ratio
        self.predicted_total = 0  # over judged windows
        self.reused_total = 0
        # (scheduled at, dispatched at, predicted) of legs not yet in a window, in scheduling order
        self._legs: deque[tuple[float, float, int]] = deque()
        self._base: tuple[float, float, int] | None = None  # the start reading: asked, came back, counter
        self._in_legs = 0
        self._in_tokens = 0

    def scheduled(self, dispatched: float, at: float, predicted: int) -> None:
        """The engine scheduled, by `at`, a leg dispatched at `dispatched` whose prefix the index
        promised `predicted` tokens of."""
        if predicted > 0:
            self._legs.append((at, dispatched, predicted))

    def lost(self) -> None:
        """The engine's counter could not be read: it may restart, so start over."""
        self._base = None

    def reading(self, asked: float, done: float, reused: int | None) -> None:
        """The engine's cumulative reused tokens, from a poll asked for at `asked` that came back at
        `done`; None: the engine does not count them, and nothing is judged."""
        if reused is None:
            self._base = None
            self._legs.clear()
            return
        base = self._base
        if base is None or reused < base[2]:
            self._start(asked, done, reused)
            return
        legs = self._legs
        while legs and legs[0][0] < asked:
            _, dispatched, predicted = legs.popleft()
            if dispatched >= base[1]:
                self._in_legs += 1
                self._in_tokens += predicted
        if self._in_legs >= self.min_legs and self._in_tokens >= self.min_tokens:
            self._judge(asked - base[0], reused - base[2])
            self._start(asked, done, reused)

    def _start(self, asked: float, done: float, reused: int) -> None:
        self._base = (asked, done, reused)
        self._in_legs = self._in_tokens = 0

    def _judge(self, span_s: float, reused: int) -> None:
        predicted = self._in_tokens
        self.ratio = reused / predicted
        self.windows += 1
        self.short_windows += self.ratio < self.low
        self.lowest = self.ratio if self.lowest is None else min(self.lowest, self.ratio)
        self.predicted_total += predicted
        self.reused_total += reused
        if not self.short and self.ratio < self.low:
            self.short = True
            log.warning(
                "engine %s reused %d of the %d prompt tokens its KV events promised on %d legs "
                "over %.1fs (%.2f, below %.2f): routers credit its worker with prefixes it recomputes. "
                "Likely causes: a KV cache kind kvswitch does not model (Mamba, chunked local attention: "
                "see kvswitch_shim_kv_other_group_events_total), speculative decoding, a router that tokenizes "
                "differently from the engine, or a cache so full that blocks are evicted while requests wait",
                self.engine or "?",
                reused,
                predicted,
                self._in_legs,
                span_s,
                self.ratio,
                self.low,
            )
        elif self.short and self.ratio >= self.recover:
            self.short = False
            log.info(
                "engine %s reuses the prefixes its KV events promise again (%.2f)",
                self.engine or "?",
                self.ratio,
            )
