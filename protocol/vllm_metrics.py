"""The vLLM Prometheus series that cross a process boundary: engine_sim exports them on /metrics and
the worker shim reads them back for limits and load (tests/fixtures/vllm-0.32/*/metrics_after.txt).

Counters are named here without the `_total` that text exposition appends to their samples.
"""

from __future__ import annotations

__all__ = [
    "CACHE_CONFIG_INFO",
    "EXTERNAL_PREFIX_CACHE_HITS",
    "GENERATION_TOKENS",
    "INTER_TOKEN_LATENCY",
    "ITERATION_TOKENS",
    "KV_CACHE_USAGE_PERC",
    "LABEL_BLOCK_SIZE",
    "LABEL_CACHE_DTYPE",
    "LABEL_ENABLE_PREFIX_CACHING",
    "LABEL_ENGINE",
    "LABEL_KV_CACHE_SIZE_TOKENS",
    "LABEL_NUM_GPU_BLOCKS",
    "LABEL_SOURCE",
    "NIXL_NUM_FAILED_TRANSFERS",
    "NUM_PREEMPTIONS",
    "NUM_REQUESTS_RUNNING",
    "NUM_REQUESTS_WAITING",
    "PREFILL_KV_COMPUTED_TOKENS",
    "PREFILL_TIME",
    "PREFIX_CACHE_HITS",
    "PROMPT_TOKENS_CACHED_BY_SOURCE",
    "SOURCE_DEVICE",
    "SOURCE_P2P",
    "count",
    "histogram_sum",
    "total",
]

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
NUM_PREEMPTIONS = "vllm:num_preemptions"
# An info gauge (value 1) whose labels carry the cache config; the shim reads these labels.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LABEL_BLOCK_SIZE = "block_size"
LABEL_NUM_GPU_BLOCKS = "num_gpu_blocks"  # with data parallelism, the sum over the ranks
LABEL_KV_CACHE_SIZE_TOKENS = "kv_cache_size_tokens"  # one engine's capacity in tokens
# The KV cache's element type: "auto" (the model's dtype) or e.g. "fp8", "fp8_e4m3", "bfloat16".
LABEL_CACHE_DTYPE = "cache_dtype"
LABEL_ENABLE_PREFIX_CACHING = "enable_prefix_caching"  # "False" under --no-enable-prefix-caching
LABEL_ENGINE = "engine"  # each data-parallel rank's engine index, on every vLLM metric
# Histograms whose cumulative _count and _sum the shim forwards for the routers' timing calibration.
ITERATION_TOKENS = "vllm:iteration_tokens_total"  # tokens per engine step (a histogram, despite _total)
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"  # first scheduled -> first token
PREFILL_KV_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"  # prompt tokens computed, not cached
# A counter: tokens generated, every accepted draft token of speculative decoding included.
GENERATION_TOKENS = "vllm:generation_tokens"
# A counter: prompt tokens found in the prefix cache (at scheduling); the cached context prefills attend to.
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
# A counter: prompt tokens a KV connector supplied (a CPU offload tier, another instance) instead of
# the prefix cache. With PREFIX_CACHE_HITS, every prompt token the engine did not compute.
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
# A counter by `source`, summing to the two above (vLLM 0.32): which tier supplied the cached
# tokens. "p2p" is KV pulled from another instance (NixlConnector, Mooncake: a P/D transfer),
# which no prefix cache of this engine's provided; "device" is the prefix cache itself.
PROMPT_TOKENS_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
LABEL_SOURCE = "source"
# A counter on an engine with vLLM's NixlConnector: KV pulls that failed. Under vLLM's default
# kv_load_failure_policy "fail" each fails its request with a 500.
NIXL_NUM_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"
SOURCE_DEVICE = "device"
SOURCE_P2P = "p2p"


def total(counter: str) -> str:
    """The sample name of a counter in text exposition."""
    return counter + "_total"


def count(histogram: str) -> str:
    """The sample name of a histogram's observation count."""
    return histogram + "_count"


def histogram_sum(histogram: str) -> str:
    """The sample name of a histogram's sum of observations."""
    return histogram + "_sum"
