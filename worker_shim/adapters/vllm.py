"""vLLM (and engine_sim, which speaks vLLM's protocols): ZMQ KV events, /metrics, /v1/completions.

- Events: `zmq_events.ZmqEventSource` on `--kv-events` (vLLM's `endpoint`), replay on `--kv-replay`.
- Limits and load from /metrics: `vllm:cache_config_info{block_size, num_gpu_blocks}`,
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
  `vllm:num_preemptions_total` (summed over DP ranks). max_num_batched_tokens is not exported by
  vLLM: it comes from the flag only.
- P/D as vLLM's NixlConnector expects from its proxy: the prefill leg sends `kv_transfer_params
  {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`, `max_tokens 1`, non-streaming,
  and returns the response's `kv_transfer_params`; the decode leg sends those params back unchanged.
  X-Request-Id is the router's request id on both legs, so the engines' logs line up.
- Abort: closing the HTTP connection (vLLM aborts a request whose client went away).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import aiohttp

from protocol import SamplingParams
from worker_shim.adapters.base import EngineAdapter, EngineError, EngineLimits, EngineLoad, LegOutcome, LegRequest
from worker_shim.adapters.openai_http import post_completion
from worker_shim.adapters.zmq_events import ZmqEventSource
from worker_shim.config import ShimConfig
from worker_shim.engine_events import EngineBatch
from worker_shim.prom_text import Sample, parse_samples, sum_samples

__all__ = ["PREFILL_TRANSFER_PARAMS", "VllmAdapter", "completion_body", "limits_from_metrics", "load_from_metrics"]

PREFILL_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_METRICS = frozenset(
    {
        "vllm:cache_config_info",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    }
)
_HTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0)
_PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


def _int_label(samples: list[Sample], name: str, label: str) -> int | None:
    for n, labels, _ in samples:
        if n == name and labels.get(label, "").isdigit():
            return int(labels[label])
    return None


def limits_from_metrics(text: str) -> EngineLimits:
    samples = list(parse_samples(text, _METRICS))
    return EngineLimits(
        block_size=_int_label(samples, "vllm:cache_config_info", "block_size"),
        kv_total_blocks=_int_label(samples, "vllm:cache_config_info", "num_gpu_blocks"),
    )


def load_from_metrics(text: str) -> EngineLoad:
    samples = list(parse_samples(text, _METRICS))
    usage = [v for n, _, v in samples if n == "vllm:kv_cache_usage_perc"]
    return EngineLoad(
        running=int(sum_samples(samples, "vllm:num_requests_running") or 0),
        waiting=int(sum_samples(samples, "vllm:num_requests_waiting") or 0),
        kv_usage=sum(usage) / len(usage) if usage else None,
        kv_total_blocks=_int_label(samples, "vllm:cache_config_info", "num_gpu_blocks"),
        num_preemptions=int(sum_samples(samples, "vllm:num_preemptions_total") or 0),
    )


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
    if leg.prefill_only:
        body["kv_transfer_params"] = dict(PREFILL_TRANSFER_PARAMS)
    elif leg.transfer is not None:
        body["kv_transfer_params"] = leg.transfer
    return body


class VllmAdapter(EngineAdapter):
    kind: ClassVar[str] = "vllm"

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        self.base = config.engine_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._events: ZmqEventSource | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("adapter not open")
        return self._session

    async def open(self) -> None:
        if self._session is None:
            # One connection per concurrent request: streams must not queue behind each other.
            self._session = aiohttp.ClientSession(
                timeout=_HTTP_TIMEOUT, connector=aiohttp.TCPConnector(limit=0, force_close=False)
            )

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def health(self) -> bool:
        try:
            async with self.session.get(self.base + "/health", timeout=_PROBE_TIMEOUT) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _metrics(self) -> str:
        try:
            async with self.session.get(self.base + "/metrics", timeout=_PROBE_TIMEOUT) as resp:
                if resp.status != 200:
                    raise EngineError(resp.status, "engine_error", f"{self.base}/metrics answered {resp.status}")
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineError(503, "engine_unavailable", f"{self.base}/metrics: {exc!r}") from exc

    async def limits(self) -> EngineLimits:
        return limits_from_metrics(await self._metrics())

    async def load(self) -> EngineLoad:
        return load_from_metrics(await self._metrics())

    async def run_events(self, sink: Callable[[EngineBatch], None], live: asyncio.Event) -> None:
        c = self.config
        assert c.kv_events is not None  # validated
        self._events = ZmqEventSource(
            self.kind, c.kv_events, c.kv_events_mode, c.kv_events_topic, c.kv_replay, c.engine_host
        )
        await self._events.run(sink, live)

    def request_rebuild(self) -> None:
        if self._events is not None:
            self._events.request_rebuild()

    async def generate(self, leg: LegRequest, on_tokens: Callable[[list[int]], Awaitable[None]]) -> LegOutcome:
        headers = {"Content-Type": "application/json", "X-Request-Id": leg.request_id, **leg.headers}
        result, last = await post_completion(
            self.session, self.base + "/v1/completions", completion_body(leg), headers, on_tokens
        )
        transfer = last.get("kv_transfer_params") if leg.prefill_only else None
        if leg.prefill_only and not isinstance(transfer, dict):
            raise EngineError(502, "engine_protocol", "the prefill leg returned no kv_transfer_params")
        return LegOutcome(
            finish_reason=result.finish_reason, usage=result.usage, transfer_params=transfer, token_ids=result.token_ids
        )
