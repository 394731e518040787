"""Counters and histograms of one engine, read by /metrics (engine_sim/metrics.py) and by tests.

Histograms are cumulative bucket counts with vLLM's bucket bounds; latencies are in simulated
seconds (wall seconds times the speedup), i.e. what the modelled H200 engine would report.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from protocol.histogram import BucketCounts

__all__ = [
    "E2E_BUCKETS",
    "ITERATION_TOKENS_BUCKETS",
    "ITL_BUCKETS",
    "TTFT_BUCKETS",
    "EngineStats",
    "Histogram",
    "one_two_five_buckets",
]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def one_two_five_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's bounds for token-count histograms."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram(BucketCounts):
    """vLLM's exposition of the counts: `le` as Python writes a float ("1.0", "+Inf")."""

    __slots__ = ()

    def copy(self) -> Histogram:
        out = Histogram(self.bounds)
        out.counts, out.sum = list(self.counts), self.sum
        return out

    def buckets(self) -> list[tuple[str, float]]:
        """(le, cumulative count) pairs, as HistogramMetricFamily.add_metric takes them."""
        return [
            (str(float(bound)) if bound != float("inf") else "+Inf", float(acc)) for bound, acc in self.cumulative()
        ]


@dataclass(slots=True)
class StepSeries:
    """What vLLM 0.32's /metrics shows of its steps: its scheduler's gauges and the per-step
    counters as of the end of its last step (v1/core/sched/scheduler.py: make_stats at the end of
    update_from_output; v1/metrics/loggers.py records them with that step's outputs). Nothing
    moves while a step runs, and an idle engine shows its last step's."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    failed_transfers: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cache_hit: int = 0
    external_kv_tokens: int = 0
    generation_tokens: int = 0
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))


class EngineStats:
    """Plain counters; the scheduler and driver bump them, nothing else writes. The scheduler
    counts a step's series when it computes the step; the driver publishes them (`publish`) as the
    step ends, and /metrics and the virtual shim read `published`, as vLLM's /metrics shows them."""

    def __init__(self, max_model_len: int = 32768) -> None:
        self.created = time.time()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.prompt_tokens_cache_hit = 0
        self.external_kv_tokens = 0
        # vLLM's KV connector stats (an engine started with --kv-transfer-config): per admitted
        # request, the prompt tokens it asked the connector for (those past its local hit) and
        # those the connector supplied; every connector hit here is a P/D pull (NIXL: "p2p").
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.failed_transfers = 0  # vllm:nixl_num_failed_transfers: pulls that failed
        self.prefill_tokens_computed = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        # As vLLM counts them: a step's tokens are the prompt tokens it computed for requests that
        # got their first token in it plus the tokens it sampled (so the sum is computed prompt
        # tokens + generation tokens); steps that sample nothing are not observed.
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.prefill_time = Histogram(E2E_BUCKETS)  # first scheduled -> first token
        self.prefill_kv_computed = Histogram(one_two_five_buckets(max_model_len))
        self.published = StepSeries()

    def publish(self, running: int, waiting: int, kv_usage: float) -> None:
        """A step ended: its gauges (after it) and every step counter so far become what /metrics shows."""
        self.published = StepSeries(
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            failed_transfers=self.failed_transfers,
            preemptions=self.preemptions,
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_cache_hit=self.prompt_tokens_cache_hit,
            external_kv_tokens=self.external_kv_tokens,
            generation_tokens=self.generation_tokens,
            iteration_tokens=self.iteration_tokens.copy(),
        )
