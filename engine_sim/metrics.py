"""GET /metrics in vLLM's names, label sets and types (compare tests/fixtures/vllm-0.32/metrics_after.txt).

Every series has the labels `engine` (the engine's data-parallel rank: "0", as vLLM with one
engine) and `model_name`; counters come with vLLM's `_created` samples. Values are read from the
engine at scrape time: the per-request figures as the driver counts them at delivery, and the
step series (gauges, token and cache counters) as published at the end of the last step, as
vLLM's show them (engine_sim/stats.py StepSeries). Latency histograms are in simulated seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from protocol import vllm_metrics as vm

if TYPE_CHECKING:
    from engine_sim.server import SimServer

__all__ = ["CONTENT_TYPE", "render_metrics"]

# What vLLM 0.32 sent (tests/fixtures/vllm-0.32/*/requests_log.jsonl): its GET /metrics is
# prometheus_fastapi_instrumentator's route, which names its prometheus_client's CONTENT_TYPE_LATEST
# whatever the Accept header says. Written out: this package's prometheus_client is not vLLM's.
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
_LABELS = ["model_name", "engine"]
_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class _Collector:
    def __init__(self, server: SimServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        srv = self._server
        cfg = srv.config
        sched = srv.engine
        st = sched.stats
        shown = st.published  # the step series as of the last step's end, as vLLM's /metrics shows them
        lv = [cfg.model, str(cfg.data_parallel_rank)]
        created = st.created

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=_LABELS)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=_LABELS)
            c.add_metric(lv, value, created=created)
            return c

        waiting = shown.waiting
        yield gauge(vm.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", shown.running)
        yield gauge(vm.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", waiting)
        yield gauge(vm.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.", shown.kv_usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            shown.prefix_cache_queries,
        )
        yield counter(
            vm.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.", shown.prefix_cache_hits
        )
        yield counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            shown.external_prefix_cache_queries,
        )
        yield counter(
            vm.EXTERNAL_PREFIX_CACHE_HITS,
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            shown.external_prefix_cache_hits,
        )
        if sched.kv_connector:  # vLLM exports its NixlConnector's series only with that connector
            yield counter(
                vm.NIXL_NUM_FAILED_TRANSFERS,
                "Number of failed NIXL KV Cache transfers, including handshake and notification failures. "
                "NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
                shown.failed_transfers,
            )
        yield counter(vm.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.", shown.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", shown.prompt_tokens)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", labels=[*_LABELS, "source"]
        )
        local = max(0, shown.prompt_tokens - shown.prompt_tokens_cache_hit - shown.external_kv_tokens)
        for source, value in (
            ("local_compute", local),
            ("local_cache_hit", shown.prompt_tokens_cache_hit),
            ("external_kv_transfer", shown.external_kv_tokens),
        ):
            by_source.add_metric([*lv, source], value, created=created)
        yield by_source
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            shown.prompt_tokens_cache_hit + shown.external_kv_tokens,
        )
        cached_by_source = CounterMetricFamily(
            vm.PROMPT_TOKENS_CACHED_BY_SOURCE,
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. "
            "Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            labels=[*_LABELS, "source"],
        )
        # The sim's only connector is its P/D pull (vLLM's NixlConnector, whose hits are "p2p").
        for source, value in (
            (vm.SOURCE_DEVICE, shown.prefix_cache_hits),
            ("host", 0),
            (vm.SOURCE_P2P, shown.external_prefix_cache_hits),
            ("disk", 0),
            ("external_unspecified", 0),
        ):
            cached_by_source.add_metric([*lv, source], value, created=created)
        yield cached_by_source
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", shown.generation_tokens)
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason in _FINISH_REASONS:
            success.add_metric([*lv, reason], st.finished[reason], created=created)
        yield success
        for name, doc, hist in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", st.ttft),
            (vm.INTER_TOKEN_LATENCY, "Histogram of inter-token latency in seconds.", st.itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", st.e2e),
            (vm.ITERATION_TOKENS, "Histogram of number of tokens per engine_step.", shown.iteration_tokens),
            (
                vm.PREFILL_TIME,
                "Histogram of time spent in PREFILL phase for request.",
                st.prefill_time,
            ),
            (
                vm.PREFILL_KV_COMPUTED_TOKENS,
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                st.prefill_kv_computed,
            ),
        ):
            h = HistogramMetricFamily(name, doc, labels=_LABELS)
            h.add_metric(lv, hist.buckets(), hist.sum)
            yield h
        yield _cache_config_info(srv)


def _cache_config_info(srv: SimServer) -> GaugeMetricFamily:
    cfg, pool = srv.config, srv.engine.pool
    # Label names in vLLM's (sorted) order; the values a default vLLM on one engine reports.
    labels = {
        vm.LABEL_BLOCK_SIZE: str(cfg.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(cfg.enable_prefix_caching),
        "engine": str(cfg.data_parallel_rank),
        "gpu_memory_utilization": "0.9",
        "kv_cache_size_tokens": str(pool.num_blocks * cfg.block_size),
        vm.LABEL_NUM_GPU_BLOCKS: str(pool.num_blocks),
        "prefix_caching_hash_algo": "sha256_cbor",
    }
    info = GaugeMetricFamily(vm.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", labels=list(labels))
    info.add_metric(list(labels.values()), 1.0)
    return info


def render_metrics(server: SimServer) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(server))
    return bytes(generate_latest(registry))
