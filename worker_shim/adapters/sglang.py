"""SGLang: ZMQ KV events (vLLM's transport and format), `sglang:` metrics, native /generate.

- Events (python/sglang/srt/disaggregation/kv_events.py, mem_cache/kv_cache_event_mixin.py):
  `BlockStored` with `block_size` = page size, hashes a chained SHA-256 cut to a *signed* int64
  (`hash_str_to_int64`), the first page's parent is the last page of the parent radix node (None
  under the root). Two wire forms, both read by the vLLM decoder (signed hashes are just other
  opaque keys): before sglang PR #37482 (merged 2026-09) positional arrays, a salted request's
  `cache_salt` in a map after the positional fields (BlockStoredWithMetadata); since, tagged
  msgpack maps (`{"type": "BlockStored", "block_hashes": ...}`), `cache_salt` (and `session_id`,
  unused here) a field of BlockStored. One event per page or a radix node's consecutive pages in
  one event: the older radix caches sent one per page, and the event recorder
  (mem_cache/events.py, KVCacheEventRecorder.enqueue) merges them already in array-form releases;
  the decoder takes both. The salt salts the chain as the router salts such a prompt. Page size 1
  (SGLang's default) makes every token a block: register with the events' block size (the page
  size, times --dcp-size), and expect a router to match per token. Its PUB binds `*`, `::` and
  `0.0.0.0` endpoints (vLLM's connects to `0.0.0.0`); with a `snapshot_endpoint` (SGLang's main
  branch, not 0.5.23) the live topic carries the publisher's epoch (both: zmq_events.py).
- Server info: `GET /server_info`, else `/get_server_info` (its deprecated alias, all an older
  SGLang serves): server args plus scheduler info. Checked at every session's start
  (ConfigError, the shim exits): `dp_size` 1 unless the engine caches nothing (each
  data-parallel rank keeps its own cache and publishes on its own port, endpoint + rank, and
  SGLang spreads requests over the ranks: one shim would hear rank 0 alone; a server without a
  radix cache, a P/D decode server's default, publishes nothing and is routed by load, which
  /metrics gives per rank), `disaggregation_mode` the role's (null for agg: a P/D engine serves
  only requests with a bootstrap room, and a plain one ignores the bootstrap fields), and a
  prefill role's `disaggregation_bootstrap_port` reported (what decode engines are told). SGLang's
  Rust HTTP frontend (SGLANG_RUST_SERVER=1) serves a fixed subset without the server args: its
  mode is read from `/model_info` (else `/get_model_info`), and an engine that reports it nowhere
  is refused.
- Limits from the server info: the event block size (`kv_events.block_size`, else `page_size`
  times `dcp_size`), `max_total_num_tokens` (capacity in tokens, rank 0's: times `dp_size` for the
  server's; in logical tokens, DCP's widening counted already), `chunked_prefill_size` (the
  per-step prefill budget). Load from /metrics: `sglang:num_running_reqs`, `sglang:num_queue_reqs` (each summed
  over the DP ranks, one scheduler's series each: _first_rank), and KV use as
  `sglang:num_used_tokens` over `max_total_num_tokens`. SGLang rounds its own
  `sglang:token_usage` to two decimals: 1% of an H200's pool is thousands of tokens, so one long
  decode could leave it still for minutes (the stall watchdog would take the engine for hung) and
  free blocks were off by that much. The rounded gauge (its mean over the ranks) stands in only
  where the exact pair is not one sample of each (DP ranks).
- P/D (sgl-model-gateway's protocol): both legs carry the same `bootstrap_host`,
  `bootstrap_port`, `bootstrap_room` and must run concurrently, as the prefill server waits for its
  decode peer. So the prefill leg starts the prefill request and returns the triple at once, with
  the request's task as `engine_done` (the engine's outcome, for the request service to await);
  the decode leg sends the triple with its own request. `close()` aborts the prefill requests left
  (`/abort_request` while the session is open) and awaits them. The P/D queues (_PD_QUEUES) count
  as waiting, beside `sglang:num_queue_reqs`.
- Requests: the client's own OpenAI request on SGLang's `/v1/completions` or
  `/v1/chat/completions` (openai_http.pass_through_body) with `rid` and the bootstrap triple; its
  `cache_salt` goes along (SGLang's OpenAI protocol takes it). A text prompt (chat messages too)
  with `truncate_prompt_tokens` is refused: SGLang has no such field and would serve it whole. So
  is `extra_key`: SGLang keeps a prefix cache per extra_key that its KV events do not name.
  Token-id legs use the native `/generate`, with the client's `cache_salt` when its body has one.
- Output of `/generate`: it streams `output_ids` with `meta_info.completion_tokens`; the new tokens are
  the last (completion_tokens - sent) ids, which holds whether the engine streams incrementally or
  cumulatively. A request it refuses (a ValueError: validation, such as a prompt longer than the
  context) is a 400 `{"error": {"message"}}`, or with streaming that object as the only event
  before `[DONE]`; one its scheduler refuses or fails (a prompt past its input limit, a failed P/D
  KV transfer) ends with an abort finish that carries the status (_failed_abort). A stream is
  whole only at its `[DONE]`: an EOF before it is a 502
  `engine_protocol`. Abort: closing the stream and `POST /abort_request {"rid"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import aiohttp
import msgspec

from protocol import ConfigError, Usage
from protocol.client_errors import essence
from protocol.messages import ENDPOINT_CHAT
from runtime import StopSteps, cancel_and_wait
from worker_shim.adapters.base import (
    EngineError,
    EngineLimits,
    EngineLoad,
    LegOutcome,
    LegRequest,
    OnOutput,
    engine_limit,
)
from worker_shim.adapters.http_engine import PROBE_TIMEOUT
from worker_shim.adapters.openai_http import (
    ENDPOINT_PATHS,
    error_from,
    line_batches,
    pass_through_body,
    post_completion,
)
from worker_shim.adapters.zmq_events import ZmqEventsAdapter
from worker_shim.config import ShimConfig, ShimRole
from worker_shim.engine_kind import check_engine_kind
from worker_shim.prom_text import Sample, as_count, mean_samples, parse_samples, repeated_series, sum_samples

__all__ = [
    "MODEL_INFO_PATHS",
    "SERVER_INFO_PATHS",
    "SglangAdapter",
    "StreamFolder",
    "bootstrap_port_from_server_info",
    "check_server_info",
    "generate_body",
    "limits_from_server_info",
    "load_from_metrics",
    "openai_body",
    "prefix_caching",
    "without_server_args",
]

log = logging.getLogger(__name__)
_LOAD = ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage")
_USED = "sglang:num_used_tokens"
# The P/D queues (metrics/collector.py), requests that `num_queue_reqs` and `num_running_reqs` leave
# out, counted as waiting: a prefill server's bootstrap queue (waiting for the decode peer; its later
# name num_prefill_bootstrap_queue_reqs) and its prefilled requests whose KV is still going out; a
# decode server's requests waiting for KV room or their prefill peer, and those receiving KV. Until
# 2026-12-07 they were not read: a prefill server holding 30 requests for their peers read idle.
_PD_QUEUES = (
    "sglang:num_prefill_prealloc_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
_METRICS = frozenset({*_LOAD, _USED, *_PD_QUEUES})
# The canonical route first; then its deprecated alias, all an older SGLang serves.
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
# Where the Rust HTTP frontend, whose server info has no server args, reports its P/D mode (both serve it).
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
# Server args every Python-served server info has, and the Rust frontend's has none of.
_SERVER_ARGS = ("dp_size", "page_size", "disaggregation_mode")
# server_args.disaggregation_mode for each --role ("null": no P/D).
_MODE_OF_ROLE: dict[str, str] = {"agg": "null", "prefill": "prefill", "decode": "decode"}
_ROLE_OF_MODE = {mode: role for role, mode in _MODE_OF_ROLE.items()}
# SGLang's own (disaggregation/utils.py): a P/D request bootstrapped from this host moves no KV
# (a fake sender or receiver); its /health generates its one token so on a prefill or decode server.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def limits_from_server_info(info: dict[str, Any], path: str = SERVER_INFO_PATHS[0]) -> EngineLimits:
    """EngineError naming `page_size` or `max_total_num_tokens` (as read on `path`) when either is
    there but no positive integer (engine_limit): until 2026-12-07 True registered a block size of
    1, 0 or a negative crashed the normaliser with a ValueError, and a string was read as not
    reported. So does a `chunked_prefill_size` that is no integer (it was read as not reported),
    and a `max_total_num_tokens` below `page_size` (it registered 0 blocks)."""
    page = engine_limit(info.get("page_size"), f"{path} page_size")
    tokens = engine_limit(info.get("max_total_num_tokens"), f"{path} max_total_num_tokens")
    if tokens is not None and page is not None and tokens < page:
        raise EngineError(
            502,
            "engine_protocol",
            f"the engine's {path} max_total_num_tokens is {tokens}, below its page_size {page}: "
            "no room for one block, so it can serve nothing",
        )
    # -1 (or any integer <= 0, as SGLang's scheduler reads it): chunked prefill off, no per-step budget.
    budget = info.get("chunked_prefill_size")
    if budget is not None and type(budget) is not int:
        raise EngineError(
            502,
            "engine_protocol",
            f"the engine's {path} chunked_prefill_size is {budget!r}, not an integer (-1 or 0: chunked prefill off)",
        )
    # max_total_num_tokens is rank 0's pool; each data-parallel rank has one of its own, and the load
    # (running, waiting, the mean KV use) is the whole server's, so the capacity is too.
    ranks = dp_ranks(info, path)
    # Under decode context parallelism SGLang reports max_total_num_tokens in logical tokens already
    # (ModelRunner.logical_max_total_num_tokens: the per-rank rows times attn_dcp_size), so only the
    # block widens.
    dcp = engine_limit(info.get("dcp_size"), f"{path} dcp_size") or 1
    block = _event_block_size(info, path, page, dcp)
    return EngineLimits(
        block_size=block,
        kv_total_blocks=tokens // block * ranks if tokens is not None and block is not None else None,
        max_num_batched_tokens=budget if budget is not None and budget > 0 else None,
        prefix_caching=prefix_caching(info),
    )


def _event_block_size(info: dict[str, Any], path: str, page: int | None, dcp: int) -> int | None:
    """The width SGLang's KV events come at: `kv_events.block_size` (its advertised publisher, absent
    or null for one it cannot advertise: ipc://, inproc://), else `page_size * dcp_size`, the same
    (arg_groups/overrides.py kv_event_block_size_of: under decode context parallelism the radix
    tree pages at that width). Until 2026-12-07 the page size: with --dcp-size 2 every event's
    block_size disagreed with it, and the normaliser dropped each as malformed."""
    events = info.get("kv_events")
    if isinstance(events, dict) and events.get("block_size") is not None:
        return engine_limit(events["block_size"], f"{path} kv_events.block_size")
    return page * dcp if page is not None else None


def dp_ranks(info: dict[str, Any], path: str) -> int:
    """How many data-parallel ranks the server runs, each with a KV cache of its own: `dp_size`
    replicas times `attn_dp_size` attention-DP groups (runtime_context.num_dp_ranks_of). SGLang
    0.5.23 resolves DP attention (`--attn-dp-size N`, or the deprecated `--dp-size N
    --enable-dp-attention`) to dp_size 1 and attn_dp_size N; read as dp_size alone, such a server
    counted as one rank until 2026-12-07."""
    dp = engine_limit(info.get("dp_size"), f"{path} dp_size") or 1
    return dp * (engine_limit(info.get("attn_dp_size"), f"{path} attn_dp_size") or 1)


def prefix_caching(info: dict[str, Any]) -> bool | None:
    """Whether the engine keeps a radix cache (and so publishes KV events), as its server args say;
    None where they do not. --disable-radix-cache turns it off, and a P/D decode server runs without
    one unless started with --disaggregation-decode-enable-radix-cache, from which server_args.py
    resolves its disable_radix_cache ("KV cache is forced as chunk cache for decode server"): a
    decode server caches only where both say so."""
    radix_off = info.get("disable_radix_cache")
    if not isinstance(radix_off, bool):
        return None
    if info.get("disaggregation_mode") == "decode":
        return info.get("disaggregation_decode_enable_radix_cache") is True and not radix_off
    return not radix_off


def without_server_args(info: dict[str, Any]) -> bool:
    """Whether the server info lacks SGLang's server args: its Rust HTTP frontend (SGLANG_RUST_SERVER=1,
    `frontend` "rust") serves a fixed subset (model, context and KV capacity, version, internal
    states), with neither the P/D mode nor dp_size nor page_size."""
    return info.get("frontend") == "rust" or not any(name in info for name in _SERVER_ARGS)


def check_server_info(info: dict[str, Any], path: str, role: ShimRole, url: str, mode_path: str | None = None) -> None:
    """ConfigError where the engine at `url` is one this shim cannot serve in `role`, as its server
    info (read on `path`; its mode on `mode_path` where given, a Rust frontend's /model_info) says;
    EngineError (502 `engine_protocol`) naming a field that is no value SGLang gives it. Until
    2026-12-07 neither was read:
    - `dp_size` > 1 on an engine that caches (prefix_caching not False): each data-parallel rank
      keeps a cache of its own and publishes its KV events on the endpoint's port + rank
      (disaggregation/kv_events.py), and SGLang spreads requests over the ranks, so the shim heard
      rank 0 alone and routers credited rank 0's prefixes to requests any rank served. Refused
      rather than served a rank per shim: pinning legs (`routed_dp_rank`) would leave the load,
      capacity, probes and P/D bootstrap (the prefill rank a decode engine pulls from) still the
      whole server's. An engine without a radix cache (a P/D decode server's default) publishes
      nothing, and its load is the sum of its ranks' (each reports on /metrics): served whole,
      routed by load alone;
    - `disaggregation_mode` other than the role's: a prefill or decode engine cannot serve a
      request without a bootstrap room (a decode waits for a prefill peer that never comes; the
      data-parallel controller asserts one), so a shim without --role sent it every request, its
      own alive probe too; and a plain engine ignores the bootstrap fields, so a P/D role on one
      paired nothing. Server info with server args but no `disaggregation_mode` is an SGLang
      before P/D: it serves --role agg only."""
    dp = dp_ranks(info, path)
    caches = prefix_caching(info)
    if dp > 1 and caches is not False:
        cache = "with a radix cache" if caches else "and no disable_radix_cache (whether it caches)"
        raise ConfigError(
            "engine_url",
            url,
            f"the SGLang engine there reports {_ranks_said(info, dp)} on {path} {cache}: its {dp} data-parallel "
            "ranks each keep a cache of their own and publish KV events on a port of their own (the endpoint's + "
            "rank), and SGLang spreads requests over them, so one shim would index rank 0's cache as the whole "
            "server's. Run SGLang with --dp-size 1 and no attention DP (the defaults): one server per replica, "
            "each with a shim of its own, and the routers balance over them (a server started with "
            "--disable-radix-cache, or a P/D decode server without --disaggregation-decode-enable-radix-cache, "
            "caches nothing and is served whole, routed by load)",
        )
    mode = info.get("disaggregation_mode")
    mode_path = mode_path or path
    if mode is not None and mode not in _ROLE_OF_MODE:
        raise EngineError(
            502,
            "engine_protocol",
            f"the engine's {mode_path} disaggregation_mode is {mode!r}, not one of {', '.join(_ROLE_OF_MODE)}",
        )
    want = _MODE_OF_ROLE[role]
    if mode == want or (mode is None and role == "agg"):
        return
    started = "without --disaggregation-mode" if want == "null" else f"with --disaggregation-mode {want}"
    if mode is None:
        why = (
            f"the SGLang engine at {url} reports no disaggregation_mode on {path}: an SGLang without P/D, "
            f"which serves --role agg only; point --engine-url at an engine started {started}"
        )
    else:
        why = (
            f"the SGLang engine at {url} runs disaggregation_mode {mode!r} (its {mode_path}): give --role "
            f"{_ROLE_OF_MODE[mode]}, or point --engine-url at an engine started {started}"
        )
    raise ConfigError("role", role, why)


def _ranks_said(info: dict[str, Any], ranks: int) -> str:
    attn = info.get("attn_dp_size")
    if type(attn) is int and attn > 1:
        return f"dp_size {info.get('dp_size', 1)} and attn_dp_size {attn} ({ranks} data-parallel ranks)"
    return f"dp_size {ranks}"


def bootstrap_port_from_server_info(info: dict[str, Any], path: str, role: ShimRole, url: str) -> int | None:
    """The engine's `disaggregation_bootstrap_port`, where decode engines reach a prefill engine's
    bootstrap server; EngineError (502 `engine_protocol`) when it is there but no port. A prefill
    role's engine must report it (ConfigError otherwise): until 2026-12-07 the shim then told
    decode engines SGLang's default, 8998, whatever port the engine listened on."""
    port = info.get("disaggregation_bootstrap_port")
    if port is not None and (type(port) is not int or not 0 < port < 65536):  # int() raised ValueError
        raise EngineError(
            502, "engine_protocol", f"the engine's {path} disaggregation_bootstrap_port is {port!r}, not a port"
        )
    if port is None and role == "prefill":
        way_out = (
            "run the prefill engine with SGLang's Python HTTP server (without SGLANG_RUST_SERVER=1): its Rust "
            "frontend reports no server args"
            if without_server_args(info)
            else "point --engine-url at the prefill engine's own HTTP server (an SGLang reports the port among "
            "its server args)"
        )
        raise ConfigError(
            "role",
            role,
            f"the SGLang engine at {url} reports no disaggregation_bootstrap_port on {path}, so decode engines "
            f"cannot be told where its bootstrap server listens: {way_out}",
        )
    return port


def load_from_metrics(text: str, kv_total_blocks: int | None, kv_total_tokens: int | None = None) -> EngineLoad:
    """The engine's load; EngineError when /metrics has neither request count: read as 0, a /metrics
    without the sglang: series advertised a busy engine as idle, or one that gives a series twice.
    `kv_total_tokens` is the server info's `max_total_num_tokens`, for the exact KV use."""
    samples = list(parse_samples(text, _METRICS))
    if (twice := repeated_series(samples)) is not None:
        raise EngineError(502, "engine_protocol", twice)
    samples = _first_rank(samples)
    running, waiting = sum_samples(samples, "sglang:num_running_reqs"), sum_samples(samples, "sglang:num_queue_reqs")
    if running is None and waiting is None:
        absent = ", ".join(n for n in _LOAD if sum_samples(samples, n) is None)
        raise EngineError(502, "engine_protocol", f"the engine's /metrics has no {absent}: were its metrics renamed?")
    queued = as_count(waiting, "sglang:num_queue_reqs") or 0
    peer_waiting = 0
    for name in _PD_QUEUES:
        peer_waiting += as_count(sum_samples(samples, name), name) or 0
    queued += peer_waiting
    used = [v for n, _, v in samples if n == _USED]
    if len(used) == 1 and kv_total_tokens is not None and kv_total_tokens > 0:
        kv_usage: float | None = min(used[0] / kv_total_tokens, 1.0)
    else:
        kv_usage = mean_samples(samples, "sglang:token_usage")
    return EngineLoad(
        running=as_count(running, "sglang:num_running_reqs") or 0,
        waiting=queued,
        peer_waiting=peer_waiting,
        kv_usage=kv_usage,
        kv_total_blocks=kv_total_blocks,
    )


def _first_rank(samples: list[Sample]) -> list[Sample]:
    """Each series of the lowest `pp_rank`, then `tp_rank`, among those of its name and `dp_rank`.
    By default one scheduler per data-parallel rank and pipeline stage exports (its attention-TP
    rank 0, whatever its `pp_rank`: metrics_collector.py); with --enable-metrics-for-all-schedulers
    every TP rank does (scheduler.py). Each reads the same: a stage runs the same requests and
    holds its own layers' KV for the same tokens (the pool's size is the minimum over the stages),
    and summed they counted the load TP-size times and pp_size times (until 2026-12-07). Per
    `dp_rank`: under DP attention each rank's exporter has a `tp_rank` of its own, not 0."""
    lowest: dict[tuple[str, str | None], tuple[int, int]] = {}
    for name, labels, _ in samples:
        if (rank := _rank(labels)) is not None:
            key = (name, labels.get("dp_rank"))
            lowest[key] = min(rank, lowest.get(key, rank))
    return [
        sample
        for sample in samples
        if (rank := _rank(sample[1])) is None or rank == lowest[(sample[0], sample[1].get("dp_rank"))]
    ]


def _rank(labels: dict[str, str]) -> tuple[int, int] | None:
    """(pp_rank, tp_rank); a series without a pp_rank is stage 0's."""
    tp, pp = labels.get("tp_rank"), labels.get("pp_rank", "0")
    if tp is None or not tp.isdigit():
        return None
    return (int(pp) if pp.isdigit() else 0, int(tp))


def generate_body(leg: LegRequest, bootstrap: dict[str, Any] | None) -> dict[str, Any]:
    s = leg.sampling
    params: dict[str, Any] = {
        "max_new_tokens": 1 if leg.prefill_only else s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "ignore_eos": s.ignore_eos,
    }
    if s.stop:
        params["stop"] = s.stop
    if s.stop_token_ids:
        params["stop_token_ids"] = s.stop_token_ids
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    body: dict[str, Any] = {
        "input_ids": leg.token_ids,
        "sampling_params": params,
        "stream": leg.stream and not leg.prefill_only,
        "rid": leg.request_id,
    }
    # The request service counts the prompt as salted by it: the engine must cache it so too.
    if isinstance(salt := leg.params.get("cache_salt"), str):
        body["cache_salt"] = salt
    if bootstrap:
        body.update(bootstrap)
    return body


def _text_prompt(leg: LegRequest) -> bool:
    """Whether SGLang tokenizes the leg's prompt itself: chat messages, or a completions prompt
    of text (without `prompt` the routed ids go)."""
    if leg.endpoint == ENDPOINT_CHAT:
        return True
    prompt = leg.params.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and any(isinstance(p, str) for p in prompt))


# A client's field SGLang caches a prompt apart by, which routers cannot see: why (openai_body).
_APART = {
    "extra_key": "its KV events do not name it",
    "lora_path": "routers salt a prompt by the adapter its `model` names, not by lora_path",
}


def openai_body(leg: LegRequest, bootstrap: dict[str, Any] | None) -> dict[str, Any]:
    """A pass-through leg's body: `rid` for abort, the bootstrap triple for P/D. EngineError (400)
    for a text prompt with `truncate_prompt_tokens`: SGLang's OpenAI protocol has no such field and
    ignores it, so it would serve the whole prompt where the router counted the truncated ids. And
    for `extra_key`: SGLang caches such a prompt apart from every other extra_key's, and its KV
    events do not name it (mem_cache/utils.py: "omit extra_key"), so the shim would index it as a
    plain prompt's and routers credit plain requests with a prefix SGLang never reuses for them.
    And for `lora_path`: SGLang keys an adapter's cache by it as by an extra_key. SGLang 0.5.23
    names the adapter on such a request's BlockStored (`lora_name`) and namespaces its hashes
    (mem_cache/events.py), so the shim salts that chain by the adapter as vLLM's, but routers salt
    a prompt by the adapter its `model` names, never by `lora_path`: they would match the
    request against the base model's prefixes."""
    if leg.params.get("truncate_prompt_tokens") is not None and _text_prompt(leg):
        raise EngineError(
            400, "bad_request", "truncate_prompt_tokens: SGLang cannot truncate a text prompt or chat messages"
        )
    for name, why in _APART.items():
        if leg.params.get(name) is not None:
            raise EngineError(
                400,
                "bad_request",
                f"{name}: SGLang keeps a separate prefix cache per {name} and {why}, so routers would credit the "
                "wrong prefixes",
            )
    body = pass_through_body(leg)
    body["rid"] = leg.request_id
    if bootstrap:
        body.update(bootstrap)
    return body


def _object(data: object, what: str) -> dict[str, Any]:
    """`data` as the JSON object the folder reads; EngineError (502 `engine_protocol`) otherwise: a
    `[...]`, `null` or `"oops"` failed in the folder as the shim's own error, a 500 `internal` that
    blamed kvswitch and kept the router from judging the engine faulty."""
    if not isinstance(data, dict):
        raise EngineError(502, "engine_protocol", f"{what} is not a JSON object")
    return data


class StreamFolder:
    """Folds /generate responses (streamed or not) into new token ids and the final outcome."""

    def __init__(self) -> None:
        self.sent = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.usage = Usage()

    def fold(self, data: dict[str, Any]) -> list[int]:
        if "error" in data:
            # Before any token it is a refusal: SGLang streams only ValueErrors (request validation) so.
            if not self.sent:
                raise error_from(400, msgspec.json.encode(data))
            err = data["error"]
            message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            raise EngineError(500, "engine_error", message)
        meta = data.get("meta_info")
        if meta is None:
            meta = {}
        elif not isinstance(meta, dict):  # as in _object: the engine's fault, not the shim's
            raise EngineError(502, "engine_protocol", "a /generate event's meta_info is not a JSON object")
        ids = data.get("output_ids")
        if ids is None:
            ids = []
        elif not isinstance(ids, list):  # len() or slicing raised TypeError: the shim's 500 `internal`
            raise EngineError(502, "engine_protocol", f"a /generate event's output_ids is {ids!r}, not a list")
        if (failed := _failed_abort(meta.get("finish_reason"))) is not None:
            raise failed
        if self._uncounted_abort(meta, ids):
            self.finish_reason = "abort"  # the count and usage folded so far stand
            return []
        count = self._completion_tokens(meta)
        done = count or len(ids)
        prompt, cached = _meta_count(meta, "prompt_tokens"), _meta_count(meta, "cached_tokens")
        if done < self.sent:  # no count: len(output_ids) stood in, and the next event's ids would go again
            raise EngineError(
                502,
                "engine_protocol",
                f"a /generate event with no meta_info.completion_tokens has {len(ids)} output_ids, fewer "
                f"than the {self.sent} tokens already folded",
            )
        # SGLang sends every id so far (cumulative) or those past the last event (incremental); with
        # any other number the slice lost ids or sent some twice while usage billed `done`.
        if count is not None and len(ids) not in (done, done - self.sent):
            went = f"rose from {self.sent} to {done}" if done > self.sent else f"stayed at {done}"
            raise EngineError(
                502,
                "engine_protocol",
                f"a /generate event's meta_info.completion_tokens {went}, but it has "
                f"{'only ' if len(ids) < done - self.sent else ''}{len(ids)} output_ids, neither all {done} nor "
                f"the {done - self.sent} new",
            )
        new = list(ids[len(ids) - (done - self.sent) :]) if done > self.sent else []
        if not all(type(t) is int for t in new):
            raise EngineError(502, "engine_protocol", f"a /generate event's output_ids hold {new!r}, not token ids")
        self.sent = done
        self.token_ids.extend(new)
        fr = meta.get("finish_reason")
        if isinstance(fr, dict):
            self.finish_reason = str(fr.get("type"))
        self.usage = Usage(
            prompt_tokens=prompt or 0,
            completion_tokens=done,
            cached_tokens=cached,
        )
        return new

    def _uncounted_abort(self, meta: dict[str, Any], ids: list[Any]) -> bool:
        """Whether the event is an abort whose zero or missing count is not the leg's: SGLang's
        _handle_abort_req ends any request aborted in its waiting queue, one retracted there after
        tokens streamed too, with "Abort before prefill", no output_ids and counts of 0. Until
        2026-12-07 that 0 after tokens was a 502 "went back" (before 65cca9f, the leg's usage)."""
        finish, count = meta.get("finish_reason"), meta.get("completion_tokens")
        return (
            isinstance(finish, dict)
            and finish.get("type") == "abort"
            and (count is None or (type(count) is int and count == 0))
            and len(ids) <= self.sent
        )

    def _completion_tokens(self, meta: dict[str, Any]) -> int | None:
        """The event's count of the leg's output tokens; EngineError naming it when negative or below
        the count already folded. Until 2026-12-07 either was taken: -3 set `sent` to -3 and 3 after
        5 to 3, so the next event's ids were sliced from that count and sent again as new tokens."""
        done = _meta_count(meta, "completion_tokens")
        if done is not None and done < self.sent:
            raise EngineError(
                502,
                "engine_protocol",
                f"the engine's /generate meta_info.completion_tokens went back from {self.sent} to {done}",
            )
        return done


def _failed_abort(finish: object) -> EngineError | None:
    """The error a streamed event's abort finish carries, None for any other finish: the scheduler
    ends a request it refuses or fails (a prompt past max_req_input_len, a failed P/D KV transfer,
    memory exhausted mid-decode) with `{"type": "abort", "message", "status_code", "err_type"}`;
    unstreamed, SGLang answers that status (tokenizer_manager._handle_abort_finish_reason), streamed
    it sends the finish as an ordinary event, then [DONE]. The error is the one its unstreamed
    answer gives (400: `{"error": {"message"}}`, the client's refusal as it is), before tokens or
    after them. An abort without a status is a client's (or /abort_request's): a plain `abort`.
    Until 2026-12-07 each was a plain `abort`: a streamed client got an empty completion for
    SGLang's 400, and the router never saw a failed KV transfer or an engine's 5xx."""
    if not isinstance(finish, dict) or finish.get("type") != "abort":
        return None
    status = finish.get("status_code")
    if type(status) is not int or not 400 <= status < 600:  # SGLang's own test
        return None
    message = str(finish.get("message") or "Aborted")
    if status == 400:
        body: dict[str, Any] = {"error": {"message": message}}  # http_server._create_error_response
    else:  # a fastapi.HTTPException, answered as an ErrorResponse
        body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return error_from(status, msgspec.json.encode(body))


def _meta_count(meta: dict[str, Any], name: str) -> int | None:
    """A /generate event's meta_info count (as_count), None where absent; EngineError naming it when
    negative. Until 2026-12-07 a negative prompt_tokens or cached_tokens went on in the leg's usage."""
    field = f"/generate meta_info.{name}"
    count = as_count(meta.get(name), field)
    if count is not None and count < 0:
        raise EngineError(502, "engine_protocol", f"the engine's {field} is {count}, not a count")
    return count


class SglangAdapter(ZmqEventsAdapter):
    kind: ClassVar[str] = "sglang"
    # A --disaggregation-mode decode server skips the prefill forward and waits for a prefill
    # peer's KV (upstream disaggregation/decode.py): a bypass leg there would wait to its deadline.
    decode_prefills: ClassVar[bool] = False

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        self._kv_total: int | None = None
        self._kv_tokens: int | None = None
        self._bootstrap_port: int | None = None  # the engine's, from its server info (limits)
        self._said_loopback = False
        self._background: set[asyncio.Task[LegOutcome]] = set()  # prefill requests (engine_done)

    async def close(self) -> None:
        """Prefill requests still running are aborted first, each sending its `/abort_request` on the
        open session, and awaited: until 2026-12-07 the session closed under them, and each was cut
        unaborted with "Task exception was never retrieved" (RuntimeError: adapter not open)."""
        steps = StopSteps()  # the session closed though the wait was cut (a cancelled close), not left open
        with steps:
            await cancel_and_wait(*self._background)
        with steps:
            await super().close()
        steps.end()

    @property
    def bootstrap_host(self) -> str:
        """Where decode engines reach this prefill engine's bootstrap server: they run elsewhere,
        so the shim's own way to the engine (often 127.0.0.1) is no answer unless told."""
        return self.config.bootstrap_host or self.config.engine_host

    def _say_loopback(self, port: int) -> None:
        if self.config.role != "prefill" or self._said_loopback:
            return
        host = self.bootstrap_host
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if loopback:
            self._said_loopback = True
            log.warning(
                "SGLang prefill worker: decode engines are told to reach its bootstrap server at %s:%d, "
                "which only an engine on this host can; give --bootstrap-host the address other hosts reach",
                host,
                port,
            )

    def alive_transfer(self) -> dict[str, Any] | None:
        """On a prefill or decode server a request without a bootstrap host waits for a peer that
        never comes (decode) or has none to send to (prefill): the one-token request goes as SGLang's
        own health generation does, with its fake bootstrap host, which moves no KV."""
        if self.config.role not in ("prefill", "decode"):
            return None
        return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": 0}

    async def limits(self) -> EngineLimits:
        """The server info's limits, once the engine is shown to be one this shim can serve
        (check_server_info, and a prefill engine's bootstrap port)."""
        info, path = await self._server_info()
        c = self.config
        mode_path = None
        if without_server_args(info):
            info, mode_path = await self._rust_frontend_mode(info, path)
        check_server_info(info, path, c.role, c.engine_url, mode_path)
        self._bootstrap_port = port = bootstrap_port_from_server_info(info, path, c.role, c.engine_url)
        if port is not None:
            self._say_loopback(port)
        limits = limits_from_server_info(info, path)
        self._kv_total = limits.kv_total_blocks
        self._kv_tokens = info.get("max_total_num_tokens")  # None or a positive integer: checked just now
        return limits

    async def _server_info(self) -> tuple[dict[str, Any], str]:
        """The engine's server info and the path that served it (SERVER_INFO_PATHS in turn). Where
        none does: a ConfigError for another kind of engine (its /metrics tells), or for a P/D role,
        whose engine's mode and bootstrap port cannot be read then; else the 404 (no limits
        reported: the flags stand in). An answer that is no JSON object is the engine's protocol
        error: until 2026-12-07 it read as no limits reported."""
        if (found := await self._first_object(SERVER_INFO_PATHS)) is not None:
            return found
        await self._check_kind()
        neither = f"{self.base} serves neither {' nor '.join(SERVER_INFO_PATHS)}"
        role = self.config.role
        if role != "agg":
            unread = "its P/D mode and bootstrap port" if role == "prefill" else "its P/D mode"
            raise ConfigError(
                "role",
                role,
                f"{neither}, so {unread} cannot be read: point --engine-url at the SGLang engine's own HTTP server",
            )
        raise EngineError(404, "engine_error", neither)

    async def _rust_frontend_mode(self, info: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
        """`info` with the P/D mode its engine reports on its model info, and that path. ConfigError
        where it reports none: until 2026-12-07 such server info (SGLang's Rust HTTP frontend) read as
        an SGLang before P/D, so a P/D role was refused as if the engine had none, and --role agg
        was accepted before a P/D engine."""
        found = await self._first_object(MODEL_INFO_PATHS)
        if found is not None and found[0].get("disaggregation_mode") is not None:
            return {**info, "disaggregation_mode": found[0]["disaggregation_mode"]}, found[1]
        unread = (
            f"reports no disaggregation_mode on {found[1]}"
            if found is not None
            else f"serves neither {' nor '.join(MODEL_INFO_PATHS)}"
        )
        raise ConfigError(
            "engine_url",
            self.config.engine_url,
            f"the SGLang engine there serves {path} without its server args (SGLang's Rust HTTP frontend, "
            f"SGLANG_RUST_SERVER=1) and {unread}, so whether it runs P/D cannot be read: run it with SGLang's "
            "Python HTTP server (without SGLANG_RUST_SERVER=1), or an SGLang whose /model_info reports "
            "disaggregation_mode",
        )

    async def _first_object(self, paths: tuple[str, ...]) -> tuple[dict[str, Any], str] | None:
        """The JSON object the first of `paths` the engine serves answers, and that path; None where
        each answers 404. An answer that is no JSON object is the engine's protocol error."""
        for path in paths:
            try:
                raw = await self.fetch(path)
            except EngineError as exc:
                if exc.code == 404:
                    continue
                raise
            try:
                return _object(msgspec.json.decode(raw), f"the engine's {path}"), path
            except msgspec.DecodeError as exc:
                raise EngineError(502, "engine_protocol", f"the engine's {path} is no JSON: {exc}") from exc
        return None

    async def _check_kind(self) -> None:
        """ConfigError when /metrics is another kind of engine's (a vLLM's `vllm:` series); an
        unreadable one (SGLang serves it only with --enable-metrics) tells nothing."""
        try:
            metrics = await self.fetch("/metrics")
        except EngineError:
            return
        check_engine_kind(self.kind, self.base, metrics)

    async def load(self) -> EngineLoad:
        return load_from_metrics(await self.fetch_text("/metrics"), self._kv_total, self._kv_tokens)

    async def _post(
        self, leg: LegRequest, body: dict[str, Any], on_tokens: Callable[[list[int]], Awaitable[None]] | None
    ) -> StreamFolder:
        folder = StreamFolder()
        headers = {"Content-Type": "application/json", **leg.headers}
        try:
            async with self.session.post(self.base + "/generate", data=msgspec.json.encode(body), headers=headers) as r:
                if r.status != 200:
                    raise error_from(r.status, await r.read(), r.headers.get("Retry-After"))
                if not body["stream"]:
                    folder.fold(_object(msgspec.json.decode(await r.read()), "the /generate response"))
                    return folder
                # SGLang streams output_ids cumulatively by default: a long leg's events grow past aiohttp's
                # readline bound (512 KiB), whose LineTooLong was the shim's own 500 `internal`.
                async with contextlib.aclosing(line_batches(r.content)) as batches:
                    async for lines in batches:
                        for line in lines:
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                return folder
                            new = folder.fold(_object(msgspec.json.decode(payload), "a streamed /generate event"))
                            if new and on_tokens is not None:
                                await on_tokens(new)
                # SGLang's /generate ends every stream with [DONE], after an error event too
                # (http_server.generate_request): one cut short (the engine gone, a proxy) is no answer.
                raise EngineError(502, "engine_protocol", f"{self.base}/generate: the stream ended without [DONE]")
        except asyncio.CancelledError:
            await self._abort(leg.request_id)
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(503, "engine_unavailable", essence(exc, f"{self.base}/generate")) from exc
        except msgspec.DecodeError as exc:
            raise EngineError(502, "engine_protocol", f"malformed /generate response: {exc}") from exc

    async def _abort(self, rid: str) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self.session.post(self.base + "/abort_request", json={"rid": rid}, timeout=PROBE_TIMEOUT):
                pass

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        if leg.prefill_only:
            bootstrap = {
                "bootstrap_host": self.bootstrap_host,
                "bootstrap_port": self._bootstrap_port,
                "bootstrap_room": secrets.randbits(63),
            }
            # Built here, so that a refused body fails the leg rather than the engine's task.
            body = openai_body(leg, bootstrap) if leg.endpoint else generate_body(leg, bootstrap)
            task = asyncio.create_task(self._prefill(leg, body, bootstrap), name=f"sglang-prefill-{leg.request_id}")
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            rid = leg.request_id
            self.waiting_peer.add(rid)  # until the engine answers (the stall watchdog)
            task.add_done_callback(lambda _: self.waiting_peer.discard(rid))
            return LegOutcome(
                finish_reason=None,
                usage=Usage(prompt_tokens=len(leg.token_ids)),
                transfer_params=bootstrap,
                engine_done=task,
            )
        with self.watch_pull(leg, on_output) as output:
            if leg.endpoint:
                return await self._openai(leg, openai_body(leg, leg.transfer), output)

            async def on_tokens(toks: list[int]) -> None:
                await output(len(toks), [], toks)

            folder = await self._post(leg, generate_body(leg, leg.transfer), on_tokens)
        return LegOutcome(folder.finish_reason, folder.usage, None, folder.token_ids)

    async def _openai(self, leg: LegRequest, body: dict[str, Any], on_output: OnOutput | None) -> LegOutcome:
        headers = {"Content-Type": "application/json", **leg.headers}
        try:
            result = await post_completion(
                self.session,
                self.base + ENDPOINT_PATHS[leg.endpoint],
                body,
                headers,
                on_output,
                pass_through=True,
            )
        except asyncio.CancelledError:
            await self._abort(leg.request_id)
            raise
        return LegOutcome(result.finish_reason, result.usage, None, result.token_ids, result.body)

    async def _prefill(self, leg: LegRequest, body: dict[str, Any], bootstrap: dict[str, Any]) -> LegOutcome:
        """The engine's outcome of a prefill leg's request (EngineError when it failed): it answers
        once the KV went to the decode peer. Until 2026-12-07 a failure here was only logged, and the
        router sent the decode leg on to wait for KV that never came."""
        if leg.endpoint:
            out = await self._openai(leg, body, None)
            return LegOutcome(out.finish_reason, out.usage, bootstrap)
        folder = await self._post(leg, body, None)
        return LegOutcome(folder.finish_reason, folder.usage, bootstrap)
