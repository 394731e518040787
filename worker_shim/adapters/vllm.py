"""vLLM (and engine_sim, which speaks vLLM's protocols): ZMQ KV events, /metrics, /v1/completions.

- Events: `zmq_events.ZmqEventSource` on `--kv-events` (vLLM's `endpoint`), replay on `--kv-replay`.
- Limits and load from /metrics (names: protocol/vllm_metrics.py): `vllm:cache_config_info{block_size, num_gpu_blocks}`,
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
  `vllm:num_preemptions_total` (summed over DP ranks), and for the routers' timing calibration the
  `_count`/`_sum` of `vllm:iteration_tokens_total`, `vllm:inter_token_latency_seconds`,
  `vllm:request_prefill_time_seconds` and `vllm:request_prefill_kv_computed_tokens`, and the
  `vllm:prefix_cache_hits_total` counter; for the shim's credit check (worker_shim.credit_check)
  that counter plus `vllm:external_prefix_cache_hits_total`, less the P/D pulls among them
  (`vllm:prompt_tokens_cached_by_source_total{source="p2p"}`); for the failed pulls
  (worker_shim.transfer_failures) `vllm:nixl_num_failed_transfers_total`.
  max_num_batched_tokens is not exported by vLLM: it comes from the flag only.
- Requests: the client's own OpenAI request on `/v1/completions` or `/v1/chat/completions`
  (openai_http.pass_through_body), the engine's answer passed back as it is; token-id legs
  (`leg.endpoint` "") as a token-id completion, with the client's `cache_salt` when its body has one.
- P/D as vLLM's NixlConnector expects from its proxy: the prefill leg sends `kv_transfer_params
  {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`, `max_tokens 1`, `min_tokens
  1` (engine_body), non-streaming, and returns the response's `kv_transfer_params`; the decode leg
  sends those params back unchanged. A prefill leg that answers none is a 502 `engine_protocol`
  (an engine without a KV connector), or `prefill_stopped` where it ended "stop" (its request's
  token, which routers do not hold against the worker); one that answers params a decode engine
  would not pull with (check_transfer_handle: no `do_remote_prefill: true`, no string
  `remote_host` or integer `remote_port`) is a 502 `bad_transfer_handle`. NixlConnector is the only
  P/D connector supported: another one's handle (MooncakeConnector's has no `remote_host`, and its
  decode side pulls by `remote_bootstrap_addr` and `transfer_id`) fails every prefill leg so.
  With --data-parallel-rank, every leg names that rank (`X-data-parallel-rank`: vLLM's API server
  sends it to that rank's engine) and load and limits are that rank's (`engine` label).
  X-Request-Id is the leg's engine id on both legs (the client's own X-Request-Id or body
  `request_id`, else the router's request id), so the engines' logs line up and the answer is named
  as the client would get it from vLLM directly.
- Abort: closing the HTTP connection (vLLM aborts a request whose client went away).
- Utility calls a router forwards: `/tokenize` and `/detokenize`, the client's body with `model`
  set, the answer as the engine gives it.
- Endpoint probe (worker_shim.endpoint_probe): a token-id `/v1/completions` of one token, the
  rank's header as on every leg, X-Request-Id the probe's; its answer's `created` is the engine's
  clock, which its KV batches' timestamps are read against.
- Tokenizer fingerprint: `POST /tokenize` with each of protocol.fingerprint's probes (texts, and
  chats with and without the generation prompt and with `tools`); a 4xx for a chat probe counts
  as refused (no chat template, or one that raises for it), as the router counts it, but a 408 or
  429 (a busy engine's "not now") fails the probe, which is tried again (tokenizer_probe).
"""

from __future__ import annotations

from typing import Any, ClassVar

import aiohttp
import msgspec

from protocol import ConfigError, SamplingParams
from protocol import vllm_metrics as vm
from protocol.client_errors import essence
from protocol.fingerprint import PROBES, ChatProbe, fingerprint
from protocol.messages import BAD_TRANSFER_HANDLE, PREFILL_STOPPED
from worker_shim.adapters.base import (
    PROBE_OUTPUT_TOKENS,
    EngineError,
    EngineLimits,
    EngineLoad,
    EngineTiming,
    EventSource,
    LegOutcome,
    LegRequest,
    OnOutput,
)
from worker_shim.adapters.http_engine import utf8_text
from worker_shim.adapters.openai_http import (
    ENDPOINT_PATHS,
    error_from,
    pass_through_body,
    post_completion,
    post_utility,
)
from worker_shim.adapters.zmq_events import ZmqEventsAdapter
from worker_shim.config import ShimConfig
from worker_shim.engine_kind import check_engine_kind
from worker_shim.prom_text import Sample, as_count, mean_samples, parse_samples, repeated_series, sum_samples
from worker_shim.tokenizer_probe import transient

__all__ = [
    "PREFILL_TRANSFER_PARAMS",
    "VllmAdapter",
    "check_load_series",
    "check_rank",
    "check_transfer_handle",
    "completion_body",
    "engine_body",
    "event_sources",
    "limits_from_metrics",
    "load_from_metrics",
]

PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREEMPTIONS = vm.total(vm.NUM_PREEMPTIONS)
_PREFIX_HITS = vm.total(vm.PREFIX_CACHE_HITS)
_EXTERNAL_HITS = vm.total(vm.EXTERNAL_PREFIX_CACHE_HITS)
_CACHED_BY_SOURCE = vm.total(vm.PROMPT_TOKENS_CACHED_BY_SOURCE)
_FAILED_TRANSFERS = vm.total(vm.NIXL_NUM_FAILED_TRANSFERS)
_GENERATION_TOKENS = vm.total(vm.GENERATION_TOKENS)
_TIMING_HISTOGRAMS = (vm.ITERATION_TOKENS, vm.INTER_TOKEN_LATENCY, vm.PREFILL_TIME, vm.PREFILL_KV_COMPUTED_TOKENS)
_METRICS = frozenset(
    {vm.CACHE_CONFIG_INFO, vm.NUM_REQUESTS_RUNNING, vm.NUM_REQUESTS_WAITING, vm.KV_CACHE_USAGE_PERC, _PREEMPTIONS}
    | {_PREFIX_HITS, _EXTERNAL_HITS, _CACHED_BY_SOURCE, _FAILED_TRANSFERS, _GENERATION_TOKENS}
    | {vm.count(h) for h in _TIMING_HISTOGRAMS}
    | {vm.histogram_sum(h) for h in _TIMING_HISTOGRAMS}
)


_TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
# No total: a probe queued behind a saturated engine is served in its turn. A timeout would close
# the connection, vLLM would abort it, and the engine's counters miss a probe the shim counted.
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10.0)


def _cache_config(samples: list[Sample], label: str) -> int | None:
    for n, labels, _ in samples:
        if n == vm.CACHE_CONFIG_INFO and labels.get(label, "").isdigit():
            return int(labels[label])
    return None


def _cache_label(samples: list[Sample], label: str) -> str | None:
    for n, labels, _ in samples:
        if n == vm.CACHE_CONFIG_INFO and labels.get(label):
            return labels[label]
    return None


def _samples(text: str, rank: int | None) -> list[Sample]:
    """The samples of `rank`'s engine (vLLM labels each data-parallel rank's `engine`), or all."""
    samples = parse_samples(text, _METRICS)
    if rank is None:
        return list(samples)
    engine = str(rank)
    return [s for s in samples if s[1].get(vm.LABEL_ENGINE) == engine]


def _kv_blocks(samples: list[Sample], rank: int | None) -> int | None:
    """KV capacity in blocks. vLLM's num_gpu_blocks label is the sum over its data-parallel ranks
    (core_client sums the engines'), kv_cache_size_tokens one engine's: a rank's is the latter."""
    tokens, block = _cache_config(samples, vm.LABEL_KV_CACHE_SIZE_TOKENS), _cache_config(samples, vm.LABEL_BLOCK_SIZE)
    if rank is not None and tokens and block:
        return tokens // block
    return _cache_config(samples, vm.LABEL_NUM_GPU_BLOCKS)


def check_rank(text: str, rank: int | None, url: str) -> tuple[int | None, int | None]:
    """ConfigError unless `rank` is one the engine at `url` runs (its /metrics `engine` labels), or,
    with no rank, unless it runs one: a shim for a server of several ranks would index their caches
    as one while vLLM places each request on any of them.

    Returns the X-data-parallel-rank to send for `rank` and the rank whose KV events these are.
    vLLM reads the header as an index into the engines that API server manages, which are the ranks
    it lists: all N on one server (0..N-1, the header is the rank), only its own on an external or
    hybrid load-balanced one (`--data-parallel-rank R`, or `--data-parallel-start-rank S
    --data-parallel-size-local L`: input_processor bounds it to [0, L), the client picks
    core_engines[header] over ranks S..S+L-1). So the header is the rank's position among the
    listed ranks, which must be contiguous. Without `rank`, no header and the one listed rank."""
    listed = sorted({s[1].get(vm.LABEL_ENGINE, "") for s in parse_samples(text, _METRICS)} - {""}, key=int)
    ranks = [int(r) for r in listed]
    if rank is None and len(ranks) > 1:
        why = (
            f"the engine at {url} runs data-parallel ranks {', '.join(listed)}, each with a cache of its own: "
            "run one shim per rank, each with --data-parallel-rank R"
        )
        raise ConfigError("data_parallel_rank", None, why)
    if rank is None:
        return None, ranks[0] if ranks else None
    if not ranks:
        return rank, rank
    if rank not in ranks:
        raise ConfigError(
            "data_parallel_rank", rank, f"the engine at {url} runs data-parallel ranks {', '.join(listed)}"
        )
    if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
        why = (
            f"the engine at {url} runs data-parallel ranks {', '.join(listed)}, not a contiguous range: vLLM's "
            "X-data-parallel-rank indexes the engines that server manages, and which index is rank "
            f"{rank} cannot be told"
        )
        raise ConfigError("data_parallel_rank", rank, why)
    return rank - ranks[0], rank


def limits_from_metrics(text: str, rank: int | None = None) -> EngineLimits:
    """What vLLM reports of its limits: block size, KV blocks, the cache dtype and whether prefix
    caching is on; it does not report max_num_batched_tokens. `rank`: one data-parallel rank's, else every rank's."""
    samples = _samples(text, rank)
    return EngineLimits(
        block_size=_cache_config(samples, vm.LABEL_BLOCK_SIZE),
        kv_total_blocks=_kv_blocks(samples, rank),
        cache_dtype=_cache_label(samples, vm.LABEL_CACHE_DTYPE),
        prefix_caching={"True": True, "False": False}.get(_cache_label(samples, vm.LABEL_ENABLE_PREFIX_CACHING) or ""),
    )


def load_from_metrics(text: str, rank: int | None = None) -> EngineLoad:
    """The engine's load; EngineError when /metrics has neither request count (`rank`'s, with a
    rank), which is no idle engine but one that does not say: vLLM started with --disable-log-stats
    exports none of its vllm: series, and read as 0 they advertised a busy engine as idle; or when
    it gives a series twice, which summed would count twice."""
    samples = _samples(text, rank)
    if (twice := repeated_series(samples)) is not None:
        raise EngineError(502, "engine_protocol", twice)
    running, waiting = sum_samples(samples, vm.NUM_REQUESTS_RUNNING), sum_samples(samples, vm.NUM_REQUESTS_WAITING)
    if running is None and waiting is None:
        raise EngineError(502, "engine_protocol", _no_load_series(samples, rank))
    return EngineLoad(
        running=as_count(running, vm.NUM_REQUESTS_RUNNING) or 0,
        waiting=as_count(waiting, vm.NUM_REQUESTS_WAITING) or 0,
        kv_usage=mean_samples(samples, vm.KV_CACHE_USAGE_PERC),
        kv_total_blocks=_kv_blocks(samples, rank),
        num_preemptions=_count(samples, _PREEMPTIONS) or 0,
        timing=_timing(samples),
        reused_tokens=_reused(samples),
        failed_transfers=_count(samples, _FAILED_TRANSFERS),
    )


def _count(samples: list[Sample], name: str) -> int | None:
    """The series summed as a count (prom_text.as_count), None when it is absent."""
    return as_count(sum_samples(samples, name), name)


def _no_load_series(samples: list[Sample], rank: int | None) -> str:
    names = [vm.NUM_REQUESTS_RUNNING, vm.NUM_REQUESTS_WAITING, vm.KV_CACHE_USAGE_PERC]
    absent = ", ".join(n for n in names if sum_samples(samples, n) is None)
    of = f" of engine {rank}" if rank is not None else ""
    return (
        f"the engine's /metrics has no {absent}{of}: a vLLM started with --disable-log-stats exports "
        "none (start it without that flag), else the metrics were renamed"
    )


def check_load_series(text: str, rank: int | None, url: str) -> None:
    """ConfigError when the engine's first /metrics has neither request count (`rank`'s, with a
    rank): every load reading would be unusable, so the worker would be registered and never
    routed to (a vLLM with --disable-log-stats). Series lost later are an unusable reading."""
    samples = _samples(text, rank)
    if sum_samples(samples, vm.NUM_REQUESTS_RUNNING) is None and sum_samples(samples, vm.NUM_REQUESTS_WAITING) is None:
        raise ConfigError("engine_url", url, _no_load_series(samples, rank))


def _reused(samples: list[Sample]) -> int | None:
    """Prompt tokens the engine found cached rather than computed, less those a P/D transfer
    brought (source "p2p"): a decode leg's pulled prompt is no reuse of this engine's cache, and
    counting it would hide a shortfall on the legs that prefill here. A vLLM without the by-source
    series counts the pulls in (docs/worker_shim.md)."""
    local, external = _count(samples, _PREFIX_HITS), _count(samples, _EXTERNAL_HITS)
    if local is None and external is None:
        return None
    pulled = sum(
        value
        for name, labels, value in samples
        if name == _CACHED_BY_SOURCE and labels.get(vm.LABEL_SOURCE) == vm.SOURCE_P2P
    )
    p2p = f'{_CACHED_BY_SOURCE}{{{vm.LABEL_SOURCE}="{vm.SOURCE_P2P}"}}'
    return (local or 0) + (external or 0) - (as_count(pulled, p2p) or 0)


def _timing(samples: list[Sample]) -> EngineTiming:
    def count(h: str) -> int:
        return _count(samples, vm.count(h)) or 0

    def tokens(h: str) -> int:  # a histogram of token counts: its sum is one too
        return _count(samples, vm.histogram_sum(h)) or 0

    def total(h: str) -> float:
        return sum_samples(samples, vm.histogram_sum(h)) or 0.0

    return EngineTiming(
        iterations=count(vm.ITERATION_TOKENS),
        iteration_tokens=tokens(vm.ITERATION_TOKENS),
        prefill_requests=count(vm.PREFILL_TIME),
        prefill_seconds=total(vm.PREFILL_TIME),
        prefill_computed_tokens=tokens(vm.PREFILL_KV_COMPUTED_TOKENS),
        prefix_hit_tokens=_count(samples, _PREFIX_HITS) or 0,
        itl_count=count(vm.INTER_TOKEN_LATENCY),
        itl_seconds=total(vm.INTER_TOKEN_LATENCY),
        generation_tokens=_count(samples, _GENERATION_TOKENS) or 0,
    )


def event_sources(raw: dict[str, Any]) -> dict[int, EventSource]:
    """A /kv_event_sources answer's ranks that publish over ZMQ."""
    out: dict[int, EventSource] = {}
    for rank, cfg in raw.items():
        if not (rank.isdigit() and isinstance(cfg, dict) and cfg.get("enable_kv_cache_events")):
            continue
        endpoint, replay, topic = cfg.get("endpoint"), cfg.get("replay_endpoint"), cfg.get("topic", "")
        if cfg.get("publisher", "zmq") in (None, "zmq") and isinstance(endpoint, str) and isinstance(topic, str):
            out[int(rank)] = EventSource(endpoint, replay if isinstance(replay, str) else None, topic)
    return out


def check_transfer_handle(transfer: dict[str, Any]) -> None:
    """EngineError 502 `bad_transfer_handle` unless `transfer`, a prefill leg's kv_transfer_params,
    holds what NixlConnector's request_finished gives, the one P/D connector the shim supports:
    `do_remote_prefill` true (the decode side pulls only for it; without it the decode engine
    prefills the whole prompt again, unseen), `remote_host` a string and `remote_port` an integer
    (where it pulls from). Other keys are the connector's own."""
    if transfer.get("do_remote_prefill") is not True:
        raise EngineError(502, BAD_TRANSFER_HANDLE, _bad_handle(transfer, "do_remote_prefill", "true"))
    for key, kind, wanted in (("remote_host", str, "a string"), ("remote_port", int, "an integer")):
        value = transfer.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):  # JSON's true is no port
            raise EngineError(502, BAD_TRANSFER_HANDLE, _bad_handle(transfer, key, wanted))


def _bad_handle(transfer: dict[str, Any], key: str, wanted: str) -> str:
    """The error for a handle whose `key` is not `wanted`, naming what it held and the handle."""
    held = f"{key} {_json(transfer[key])}" if key in transfer else f"no {key}"
    return (
        f"the prefill leg returned kv_transfer_params with {held}, not {wanted} (received "
        f"{_json(transfer)[:300]}): a decode engine given them would prefill the whole prompt again"
    )


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def completion_body(leg: LegRequest) -> dict[str, Any]:
    """The /v1/completions body for one leg (token-id prompt, token ids back)."""
    s: SamplingParams = leg.sampling
    body: dict[str, Any] = {
        "model": leg.model,
        "prompt": leg.token_ids,
        "max_tokens": 1 if leg.prefill_only else s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "ignore_eos": s.ignore_eos,
        "return_token_ids": True,
        "stream": leg.stream and not leg.prefill_only,
    }
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = s.stop
    if s.stop_token_ids:
        body["stop_token_ids"] = s.stop_token_ids
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    # The request service counts the prompt as salted by it: the engine must cache it so too.
    if isinstance(salt := leg.params.get("cache_salt"), str):
        body["cache_salt"] = salt
    if leg.prefill_only:
        body["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    elif leg.transfer is not None:
        body["kv_transfer_params"] = leg.transfer
    return body


def engine_body(leg: LegRequest) -> tuple[str, dict[str, Any]]:
    """The endpoint path and body for one leg. A prefill leg asks for min_tokens 1: vLLM's KV
    connectors return kv_transfer_params only for a request that ended on its length
    (NixlConnector.request_finished: FINISHED_LENGTH_CAPPED), and one whose token was an EOS or a
    client's stop token id ends "stop", with none. min_tokens masks those for its one token (and
    leaves stop strings unchecked); the decode leg samples the client's first token itself."""
    if not leg.endpoint:
        body = completion_body(leg)
        if leg.prefill_only:
            body["min_tokens"] = 1
        return "/v1/completions", body
    body = pass_through_body(leg, min_one=True)
    if leg.prefill_only:
        body["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    elif leg.transfer is not None:
        body["kv_transfer_params"] = leg.transfer
    return ENDPOINT_PATHS[leg.endpoint], body


class VllmAdapter(ZmqEventsAdapter):
    kind: ClassVar[str] = "vllm"
    requires_served_model: ClassVar[bool] = True
    serves_adapters_by_name: ClassVar[bool] = True
    serves_probe: ClassVar[bool] = True
    checks_rank: ClassVar[bool] = True

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        # The header naming this shim's rank: its index among the server's ranks, read with the
        # limits (check_rank); the rank itself until then.
        self._rank_header = config.data_parallel_rank

    async def limits(self) -> EngineLimits:
        """The limits on /metrics, whose load series are checked here too: routers use a worker
        only while its load reports are healthy. A /metrics that answers 404 has none; one of
        another kind of engine is a wrong --engine."""
        try:
            raw = await self.fetch("/metrics")
        except EngineError as exc:
            if exc.code == 404:
                raise ConfigError(
                    "engine_url", self.base, f"{exc.message}: kvswitch reads the engine's load there"
                ) from exc
            raise
        check_engine_kind(self.kind, self.base, raw)
        text = utf8_text(raw, self.base + "/metrics")
        self._rank_header, self.events_rank = check_rank(text, self.config.data_parallel_rank, self.base)
        check_load_series(text, self.config.data_parallel_rank, self.base)
        return limits_from_metrics(text, self.config.data_parallel_rank)

    async def event_sources(self) -> dict[int, EventSource] | None:
        """GET /kv_event_sources (vLLM 0.32): each rank's --kv-events-config, its endpoints offset by
        the rank; ranks without a ZMQ publisher are left out. None when the engine has no such route;
        EngineError when it did not answer (a failed session, retried, not a ConfigError)."""
        try:
            raw = msgspec.json.decode(await self.fetch("/kv_event_sources"))
        except EngineError as exc:
            if exc.code == 404:  # an older vLLM
                return None
            raise
        except msgspec.DecodeError:
            return None
        return event_sources(raw) if isinstance(raw, dict) else None

    async def load(self) -> EngineLoad:
        return load_from_metrics(await self.fetch_text("/metrics"), self.config.data_parallel_rank)

    async def _tokenize(self, body: dict[str, Any]) -> list[int]:
        url = self.base + "/tokenize"
        try:
            raw = await post_utility(self.session, url, body, timeout=_TOKENIZE_TIMEOUT)
        except EngineError as exc:
            if exc.kind == "engine_unavailable":
                raise  # no answer (refused, timed out): its message says so, with the address
            raise EngineError(
                exc.code,
                exc.kind,
                f"{url} answered {exc.code}: {exc.message[:300]}",
                exc.body,
                retry_after_s=exc.retry_after_s,
            ) from exc
        try:
            tokens = msgspec.json.decode(raw, type=dict[str, Any])["tokens"]
            return msgspec.convert(tokens, list[int])
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as exc:
            raise EngineError(502, "engine_protocol", f"{url} sent no token list: {exc}") from exc

    async def tokenizer_fingerprint(self) -> str | None:
        results: list[list[int] | None] = []
        for probe in PROBES:
            try:
                results.append(await self._tokenize({"model": self.config.model, **probe.body()}))
            except EngineError as exc:
                if transient(exc) or not isinstance(probe, ChatProbe):
                    raise  # a busy engine's 408 or 429 is no answer about its chat template: probed again
                results.append(None)  # no chat template, or one that refuses this chat (the router's too)
        return fingerprint(results)

    async def serve_probe(self, token_ids: list[int], request_id: str) -> int:
        url = self.base + "/v1/completions"
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if self._rank_header is not None:
            headers["X-data-parallel-rank"] = str(self._rank_header)
        body = {"model": self.config.model, "prompt": token_ids, "max_tokens": PROBE_OUTPUT_TOKENS, "temperature": 0.0}
        try:
            async with self.session.post(
                url, data=msgspec.json.encode(body), headers=headers, timeout=_PROBE_TIMEOUT
            ) as resp:
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise EngineError(503, "engine_unavailable", essence(exc, url)) from exc
        if resp.status != 200:
            raise error_from(resp.status, raw)
        try:
            created = msgspec.json.decode(raw, type=dict[str, Any]).get("created")
        except msgspec.DecodeError as exc:
            raise EngineError(502, "engine_protocol", f"{url} answered no JSON object: {exc}") from exc
        if not isinstance(created, int):
            raise EngineError(502, "engine_protocol", f"{url} answered without an integer `created`")
        return created

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        headers = {"Content-Type": "application/json", "X-Request-Id": leg.engine_id, **leg.headers}
        if self._rank_header is not None:
            headers["X-data-parallel-rank"] = str(self._rank_header)
        path, body = engine_body(leg)
        with self.watch_pull(leg, on_output) as output:
            result = await post_completion(
                self.session, self.base + path, body, headers, output, pass_through=bool(leg.endpoint)
            )
        transfer = result.last.get("kv_transfer_params") if leg.prefill_only else None
        if leg.prefill_only and not isinstance(transfer, dict):
            if result.finish_reason == "stop":
                # The request's token (an EOS or a stop id min_tokens did not mask), not the engine:
                # a kind routers do not hold against the worker (router.dispatch._prefill_fault).
                raise EngineError(
                    502,
                    PREFILL_STOPPED,
                    "the prefill leg stopped on its one token and returned no kv_transfer_params (vLLM's "
                    "connectors return them only for a leg that ends on its length)",
                )
            raise EngineError(502, "engine_protocol", "the prefill leg returned no kv_transfer_params")
        if transfer is not None:
            check_transfer_handle(transfer)
        return LegOutcome(
            finish_reason=result.finish_reason,
            usage=result.usage,
            transfer_params=transfer,
            token_ids=result.token_ids,
            body=b"" if leg.prefill_only else result.body,
        )
