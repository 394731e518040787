"""TensorRT-LLM (`trtllm-serve`): HTTP-polled KV events and iteration stats, OpenAI completions.

- Events: `POST /kv_cache_events` every `POLL_S` (trtllm_events.py). Live after the first answer.
  Events from several attention data-parallel ranks end the session (trtllm-serve cannot run a
  request on a rank the shim names), and the next session's `limits()` refuses the engine. Some
  revisions hold a poll until 2 s pass with no new event (`get_kv_cache_events_async(2)`): under
  steady load, while the load lasts. The poll in flight is never given up (the events the engine
  drained for it would be lost: it has no replay; the health probe tells a dead engine), one held
  past EVENTS_HELD_SAY_S is said once, and `events_lag_s()` gives the time since the last answer.
  An answer that is no JSON list (a proxy's error page) is a lost poll, not the session's end
  (TrtllmEventTracker.lost).
- Cold start: until its first request trtllm-serve has no stats and no event stream (executor.py:
  `aget_stats` yields nothing, `aget_kv_events` asserts, which `/kv_cache_events` answers with a
  500). `limits()` with no limits held and `run_events` with a 500 before any answer raise
  EngineCold: the shim has the engine serve one one-token request and asks again.
- Limits and load: `GET /metrics` returns JSON iteration stats (tensorrt_llm/serve/openai_server.py
  `get_iteration_stats`); the newest entry's `kvCacheStats` gives maxNumBlocks, usedNumBlocks and
  tokensPerBlock, `numActiveRequests` and `numQueuedRequests` the request counts. Reading drains the
  engine's stats queue: an idle engine answers [] again after a read, so the limits read are held
  for the engine's life and stand for a later session's empty answer; a /health that says down, an
  events poll failing on the transport or answered 500 (a fresh engine), or event ids that start
  over (a restart) drop them. Ids that start over also end the session (EngineRestarted, before any
  of the new run is delivered); the new run's events that poll drained are the next session's first
  (folded with its limits; no answer of its engine), unless the engine may be another by then: ids
  going back on its first poll after them are that engine's start, a reset. Limits read anew start
  the ids' comparison over. A load read of []
  (no iteration since the last read, or a buffered /metrics not refilled until a request finishes)
  is the last load, marked stale. Both endpoints drain what they return: the shim must be their only
  reader. Without `return_perf_metrics` trtllm-serve answers `/metrics` only once 2 s pass with no
  new iteration (`get_stats_async(2)`), so under steady load it holds the answer while the load
  lasts: one read is in flight at a time, and a `load()` it keeps waiting reports the last load,
  stale (busy, not down), and a `limits()` with limits held takes them. What drops the limits held
  gives the read up too (its answer would be a gone engine's): a call waiting on it fails with 503.
  `return_perf_metrics` answers at once only from PR #13405 on: before it, a trtllm-serve with the
  Prometheus collector loop drains the stats in that loop too, and most reads answer [].
  EMPTY_SAY_READS reads of [] since the last with stats, each begun after a leg ended (an idle
  engine's [] between them is neither counted nor a reset), from an engine that has answered with
  stats (one without enable_iter_perf_stats never does), are said once, naming it (a stale load
  alone says nothing).
- Requests: the client's own OpenAI request (openai_http.pass_through_body), or a token-id leg
  (refused with a `cache_salt`: its CompletionRequest has none; `detokenize: false`, without which
  trtllm-serve returns text and no token ids).
- P/D via `disaggregated_params` (DisaggregatedParams in tensorrt_llm/serve/openai_protocol.py):
  the prefill leg sends `request_type: context_only` with max_tokens 1 (a chat leg under the one
  name of the two its client used: trtllm-serve refuses both together), non-streaming, and returns
  the choice's `disaggregated_params`; the decode leg sends them back with `request_type:
  generation_only`; the bypass and agg legs send `context_and_generation`. A context leg that
  ended other than "length" or "not_finished" was finished by its context worker, with no KV to
  transfer (`prefill_stopped` for "stop": its first token was an EOS or a stop); a handle without
  an integer `ctx_request_id` is a `bad_transfer_handle` (check_transfer_handle).
- Failures: trtllm-serve answers its engine's own failure of a request with 400 (a failed KV pull
  too), or cuts a streamed answer whose 200 went. Those are 500 `engine_error` here (_leg_failure),
  as vLLM's are, so that a failed pull reaches the routers' transfer health; a 400 that may be the
  client's own stays its refusal.
- Abort: closing the HTTP connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, ClassVar

import aiohttp
import msgspec

from protocol.messages import BAD_TRANSFER_HANDLE, ENDPOINT_CHAT, PREFILL_STOPPED, lax_int
from runtime import StopSteps, cancel_and_wait
from worker_shim.adapters.base import (
    EngineCold,
    EngineError,
    EngineHealth,
    EngineLimits,
    EngineLoad,
    LegOutcome,
    LegRequest,
    OnOutput,
    engine_limit,
)
from worker_shim.adapters.http_engine import NETWORK_ERRORS, PROBE_TIMEOUT, HttpEngineAdapter
from worker_shim.adapters.openai_http import ENDPOINT_PATHS, StreamCut, pass_through_body, post_completion
from worker_shim.adapters.trtllm_events import TrtllmEventTracker, attention_dp_error
from worker_shim.adapters.vllm import completion_body
from worker_shim.config import ShimConfig
from worker_shim.engine_events import EngineBatch, EngineRestarted, EventSink
from worker_shim.engine_kind import check_engine_kind
from worker_shim.prom_text import as_count

__all__ = ["POLL_S", "TrtllmAdapter", "check_transfer_handle", "disagg_body", "limits_from_stats", "load_from_stats"]

POLL_S = 0.05
# trtllm-serve revisions that answer with get_kv_cache_events_async(2) hold the poll until 2 s pass
# with no new event: under steady load, for as long as it lasts. A read deadline (the probes' 2 s
# until 2026-12-04, then 30 s) timed the poll out with the events the engine had handed over, lost
# for good (no replay), and ended the session: under load the worker re-registered every 30 s.
EVENTS_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
EVENTS_HELD_SAY_S = 10.0  # a poll held this long is said once: the index lags the engine under load
# /metrics without return_perf_metrics (get_stats_async(2)) answers 2 s after the last iteration:
# under steady load, only once the load pauses. A read given up on loses the stats the engine
# drained for it, so it is given up only with its engine (_forget_engine: the health probe tells a
# dead engine); `load()` waits LOAD_WAIT_S for it, `limits()` (a session's start) LIMITS_WAIT_S.
METRICS_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
LOAD_WAIT_S = 2.5
LIMITS_WAIT_S = 30.0
# /metrics reads answered [] since the last with stats, each begun after a leg of this shim ended
# (iterations ran since the read before), by an engine that has answered with stats, that are said
# once: the engine's stats go to another reader. An idle read's [] is no evidence either way: it
# neither counts nor resets.
EMPTY_SAY_READS = 3
# The hint: a trtllm-serve with the Prometheus collector loop but before PR #13405 drains the stats
# queue in that loop and in /metrics alike when return_perf_metrics is on (nvbug 6102381).
_WITHOUT_13405 = (
    "where it runs the Prometheus collector loop, that loop drains the stats queue /metrics reads, and most reads "
    "come back empty"
)
_RACING_COLLECTOR = (
    "A trtllm-serve without NVIDIA/TensorRT-LLM PR #13405 (merged 2026-04-24) that runs with return_perf_metrics "
    "and enable_iter_perf_stats has its Prometheus collector loop drain the same stats queue as /metrics, so most "
    "reads come back empty (each after about 2 s): turn return_perf_metrics off on such a release, or upgrade; "
    "any other reader of /metrics takes the stats likewise"
)

log = logging.getLogger(__name__)


def _newest(stats: Any) -> dict[str, Any] | None:
    if isinstance(stats, list) and stats and isinstance(stats[-1], dict):
        return stats[-1]
    return None


def limits_from_stats(stats: Any) -> EngineLimits:
    s = _newest(stats)
    kv = s.get("kvCacheStats") if s else None
    if not isinstance(kv, dict):
        return EngineLimits()
    return EngineLimits(
        block_size=engine_limit(kv.get("tokensPerBlock"), "kvCacheStats.tokensPerBlock"),
        kv_total_blocks=engine_limit(kv.get("maxNumBlocks"), "kvCacheStats.maxNumBlocks"),
    )


def _number(kv: dict[str, Any], name: str) -> Any:
    """kvCacheStats' `name`, None or a number; EngineError naming it otherwise ("512" raised TypeError
    in the division). Whether it is a count is the load reporter's to judge (load_reporter._unusable)."""
    value = kv.get(name)
    if value is not None and type(value) not in (int, float):
        raise EngineError(502, "engine_protocol", f"the engine's kvCacheStats.{name} is {value!r}, not a number")
    return value


def load_from_stats(stats: Any, previous: EngineLoad) -> EngineLoad:
    """The newest stats' load; `previous` marked stale where there is none (no iteration since the
    last read, or a buffered /metrics not refilled yet: nothing says the engine is still so)."""
    s = _newest(stats)
    if s is None:
        return replace(previous, stale=True)
    kv = s.get("kvCacheStats") or {}
    if not isinstance(kv, dict):  # .get raised AttributeError: an ERROR with a traceback, no field named
        raise EngineError(502, "engine_protocol", f"the engine's kvCacheStats is {kv!r}, not a JSON object")
    total, used = _number(kv, "maxNumBlocks"), _number(kv, "usedNumBlocks")
    return EngineLoad(
        running=as_count(s.get("numActiveRequests"), "numActiveRequests") or 0,
        waiting=as_count(s.get("numQueuedRequests"), "numQueuedRequests") or 0,
        kv_usage=used / total if total and used is not None else None,
        kv_total_blocks=total,
    )


_MAX_TOKENS = ("max_tokens", "max_completion_tokens")


class _NoJson(EngineError):
    """A 200 whose body is no JSON: the engine (or a proxy before it) answered, wrongly."""

    def __init__(self, message: str) -> None:
        super().__init__(502, "engine_protocol", message)


def disagg_body(leg: LegRequest) -> dict[str, Any]:
    """The body for one leg; EngineError (400) for a token-id leg with a `cache_salt`, which
    TensorRT-LLM's CompletionRequest has no field for: the request service counts the prompt as
    salted, and the engine would cache it unsalted. And for a `lora_request`: TensorRT-LLM caches an
    adapter's prompts apart from the base model's, and routers hash this one as the base model's,
    so they would credit it with the base model's prefixes (and its blocks, salted by the task id
    the events carry, to no request)."""
    if leg.params.get("lora_request") is not None:
        raise EngineError(
            400,
            "bad_request",
            "lora_request: TensorRT-LLM caches an adapter's prompts apart from the base model's, and routers hash "
            "this request as the base model's, so they would credit it with prefixes the engine will not reuse",
        )
    if leg.endpoint:
        body = pass_through_body(leg)
        if leg.prefill_only and leg.endpoint == ENDPOINT_CHAT:
            # trtllm-serve's chat request takes max_tokens as an alias of max_completion_tokens
            # (extra="forbid"): both names in one body are refused. Keep the client's one.
            kept = [k for k in _MAX_TOKENS if k in leg.params] or ["max_tokens"]
            for name in _MAX_TOKENS:
                if name not in kept:
                    body.pop(name, None)
    else:
        if isinstance(salt := leg.params.get("cache_salt"), str) and salt:
            raise EngineError(
                400, "bad_request", "cache_salt: TensorRT-LLM's /v1/completions takes no cache_salt on a token-id leg"
            )
        body = completion_body(leg)
        body.pop("kv_transfer_params", None)
        body.pop("return_token_ids", None)
        body["detokenize"] = False  # trtllm-serve's token_ids come only with it (text then "")
    if leg.prefill_only:
        body["disaggregated_params"] = {"request_type": "context_only"}
    elif leg.transfer is not None:
        body["disaggregated_params"] = {**leg.transfer, "request_type": "generation_only"}
    else:
        body["disaggregated_params"] = {"request_type": "context_and_generation"}
    return body


# A context-only leg ends so while its KV waits for a generation leg; with any other finish_reason
# its context worker finished the request itself (openai_disagg_service.py `_need_gen` sends no
# generation leg then).
_CONTEXT_PENDING = ("length", "not_finished")
_CONTEXT_STOPPED = ("stop", "tool_calls")  # the request's own first token ended it
# trtllm-serve answers a request its engine failed with 400 (openai_server.py: `except Exception as
# e: return self.create_error_response(str(e))`, BadRequestError by default); a failed KV pull
# (py_executor `_check_cache_transfer_errors`) and a failed step of the C++ executor say so.
_ENGINE_FAILURES = ("Error in kv cache transfer", "Encountered an error in ")
# Limits a generation-only leg meets at the client's max_tokens, where its context leg asked for 1: the
# PyTorch backend's names, and the C++ (TensorRT engine) executor's (LlmRequest::validate, executorImpl.cpp).
_LENGTH_LIMITS = (
    "max_seq_len",
    "max_num_tokens",
    "maximum input length",
    "max input length",
    "maximum sequence length",
)
# The C++ executor's answer to a request its validation refused (Executor::Impl::fetchNewRequests: the
# request's own fields, or an engine set up otherwise than its context peer's), on any leg: never a failed
# pull, which its validation runs before. Checked asynchronously, so a streamed leg's is a cut stream (no
# message to read).
_REQUEST_REFUSED = "Encountered an error when fetching new request:"


def check_transfer_handle(transfer: dict[str, Any]) -> None:
    """EngineError 502 `bad_transfer_handle` unless `transfer`, a context-only leg's
    disaggregated_params, names the context request to pull the KV from: an integer
    `ctx_request_id`. A context worker that finished the request itself returns null there (no KV
    to transfer: NVIDIA/TensorRT-LLM PR #15027), and a generation worker given it pulls nothing.
    Other keys are the engine's own."""
    rid = transfer.get("ctx_request_id")
    if type(rid) is not int:
        held = f"ctx_request_id {_json(rid)}" if "ctx_request_id" in transfer else "no ctx_request_id"
        raise EngineError(
            502,
            BAD_TRANSFER_HANDLE,
            f"the context-only leg returned disaggregated_params with {held}, not an integer (received "
            f"{_json(transfer)[:300]}): a generation worker given them has no context request to pull the KV from",
        )


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def _context_finished(reason: str | None) -> EngineError:
    """The error of a context-only leg that ended with `reason`, not one that leaves KV to pull."""
    finished = "its context worker finished the request itself and holds no KV to transfer"
    if reason in _CONTEXT_STOPPED:
        # the request's token (an EOS or a stop), not the engine: not held against the worker
        return EngineError(502, PREFILL_STOPPED, f"the context-only leg ended {reason!r} on its one token: {finished}")
    return EngineError(
        502, "engine_protocol", f"the context-only leg ended with finish_reason {_json(reason)}, not length: {finished}"
    )


def _leg_failure(leg: LegRequest, exc: EngineError, answered: bool) -> EngineError:
    """`exc`, a failed leg's error, as routers must read it (`answered`: the engine sent output for
    the leg). A 500 `engine_error` where trtllm-serve's 400 or cut stream is its engine's failure,
    as vLLM answers one, so that a generation-only leg's (most likely its KV pull) reaches the
    routers' transfer health (router.dispatch: a transfer-fed leg's engine_error before any
    output) and the shim's failed pulls: a 4xx naming the engine's failure on any leg; on a
    generation-only leg, a stream cut before any output (trtllm-serve's answer to a streamed
    request that failed after its 200), and a 400 to the body its context leg's engine took, but
    one that may be the client's own (_maybe_the_clients). Never the C++ executor's refusal of a
    request it validated (_REQUEST_REFUSED): the client's, or an engine configured otherwise than
    its peer's, and no pull was tried."""
    if exc.message.startswith(_REQUEST_REFUSED):
        return exc
    if 400 <= exc.code < 500 and any(words in exc.message for words in _ENGINE_FAILURES):
        return _engine_failed(exc, f"trtllm-serve answered {exc.code}: its engine failed the request")
    if leg.transfer is None or answered:
        return exc
    if isinstance(exc, StreamCut):
        return _engine_failed(
            exc, "a generation-only leg's stream cut before any output: its engine failed it, most likely its KV pull"
        )
    if exc.code == 400 and not _maybe_the_clients(leg, exc):
        return _engine_failed(
            exc,
            "trtllm-serve answered 400 to a generation-only leg whose context leg it took: its engine failed it, "
            "most likely its KV pull",
        )
    return exc


def _maybe_the_clients(leg: LegRequest, exc: EngineError) -> bool:
    """A generation-only leg's 400 that may be the client's own: one its context leg, which asked the
    engine for one token of one sequence, did not meet. trtllm-serve's request validation (its
    `{"error": ...}` answer, pydantic's "validation error"): the fields the context leg sent
    otherwise (n, max_tokens, min_tokens, stream); a sequence length limit (the client's
    max_tokens); or any refusal of a request for several sequences (n, best_of and beam width are
    checked at the client's n)."""
    if "validation error" in exc.message or _validation_answer(exc.body):
        return True
    if any(limit in exc.message for limit in _LENGTH_LIMITS):
        return True
    n = lax_int(leg.params.get("n")) if leg.endpoint else None  # a token-id leg sends no n
    return n is not None and n > 1


def _validation_answer(body: bytes) -> bool:
    """`body` is trtllm-serve's answer to a request its validation refused (openai_server.py's
    RequestValidationError handler: `{"error": str(exc)}`), not an ErrorResponse."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(data, dict) and data.keys() == {"error"} and isinstance(data["error"], str)


def _engine_failed(exc: EngineError, why: str) -> EngineError:
    return EngineError(500, "engine_error", f"{exc.message} ({why})")


class TrtllmAdapter(HttpEngineAdapter):
    kind: ClassVar[str] = "trtllm"

    def __init__(self, config: ShimConfig) -> None:
        super().__init__(config)
        self.tracker = TrtllmEventTracker()  # the adapter's: its counts outlive each session
        self._load = EngineLoad()
        self._metrics: asyncio.Task[bytes] | None = None  # the /metrics read in flight
        self._held_said = False
        self._held_limits_said = False
        self._legs_ended = 0  # legs the engine answered: it ran iterations for them
        self._ended_at_answer = 0  # _legs_ended when the last /metrics read answered
        self._ended_at_start = 0  # _legs_ended when the read in flight began
        self._empty_reads = 0  # reads answered [] since the last with stats, each after a leg ended
        self._stats_seen = False  # this engine answered with stats: without enable_iter_perf_stats it never does
        self._empty_said = False
        # The engine's limits as last read: its /metrics hands each stat out once, so an idle engine
        # answers [] to the next session. Dropped when it may have restarted (health(), run_events).
        self._limits: EngineLimits | None = None
        self._polled_at: float | None = None  # when the events poll last answered (or polling began)
        self._next_run: list[Any] = []  # the new run's events the poll that showed a restart drained
        # _next_run as a session folded it, kept until the engine answers that session or one after
        self._held_run: EngineBatch | None = None
        self._events_held_said = False

    async def close(self) -> None:
        task, self._metrics = self._metrics, None
        steps = StopSteps()  # the session closed though the wait was cut (a cancelled close), not left open
        if task is not None:
            with steps:
                await cancel_and_wait(task)  # its failure too is nobody's now
        with steps:
            await super().close()
        steps.end()

    async def _read_metrics(self, wait_s: float) -> bytes | None:
        """The body of the /metrics read in flight (started if none is), or None while the engine
        holds it past `wait_s`: it stays in flight for the next call (a second read would split the
        engine's stats with it)."""
        task = self._metrics
        if task is None:
            task = self._metrics = asyncio.create_task(self.fetch("/metrics", timeout=METRICS_TIMEOUT))
            self._ended_at_start = self._legs_ended
        await asyncio.wait([task], timeout=wait_s)
        if not task.done():
            return None
        if self._metrics is task:
            self._metrics = None
        if task.cancelled():  # by _forget_engine: the engine went down or restarted under the read
            why = f"{self.base}/metrics: the engine went down or restarted during the read"
            raise EngineError(503, "engine_unavailable", why)
        return task.result()

    async def _json(self, method: str, path: str, timeout: aiohttp.ClientTimeout = PROBE_TIMEOUT) -> Any:
        return self._decode(path, await self.fetch(path, method, timeout))

    def _decode(self, path: str, body: bytes) -> Any:
        try:
            return msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            # A 200 whose body is no JSON: the engine answered, wrongly (it was an "unavailable" 503).
            raise _NoJson(f"{self.base}{path} answered no JSON: {exc}") from exc

    async def health(self) -> EngineHealth:
        health = await super().health()
        if health is EngineHealth.DOWN:
            self._forget_engine()  # it may come back as another engine, which reports once it has served
        return health

    async def limits(self) -> EngineLimits:
        """The limits in the newest iteration stats, or those held from the engine's last answer
        with stats (an idle engine answers [], a busy one without return_perf_metrics holds its
        answer: LOAD_WAIT_S is waited then, LIMITS_WAIT_S with none held); EngineCold where
        neither is (it has served nothing yet). A /metrics of another kind of engine (vLLM's or
        SGLang's Prometheus text) is a wrong --engine, and an engine whose KV events came from
        several attention data-parallel ranks (the session that saw them ended) is refused."""
        if len(self.tracker.ranks) > 1:
            raise attention_dp_error(self.tracker.ranks)
        held = self._limits
        if held is None:
            # Read anew (the engine may be another): its event ids count from its own start, which
            # is no restart of the session's engine (a second one for a restart /health saw).
            self.tracker.last_id = None
        body = await self._read_metrics(LIMITS_WAIT_S if held is None else LOAD_WAIT_S)
        if body is None and held is not None:
            # Held: the engine runs iterations, so it is the one whose limits are held (a restart
            # drops them). Until 2026-12-07 a 503: any new session took a loaded worker out for
            # its busy period.
            if not self._held_limits_said:
                self._held_limits_said = True
                log.warning(
                    "%s/metrics held its answer for %.1fs while the engine works (trtllm-serve without "
                    "return_perf_metrics): the session takes the limits read before; set return_perf_metrics: true "
                    "on a trtllm-serve with NVIDIA/TensorRT-LLM PR #13405 (not on an older one: %s)",
                    self.base,
                    LOAD_WAIT_S,
                    _WITHOUT_13405,
                )
            return held
        if body is None:
            raise EngineError(
                503,
                "engine_unavailable",
                f"{self.base}/metrics held its answer for {LIMITS_WAIT_S:.0f}s: a trtllm-serve without "
                "return_perf_metrics answers only after 2 s with no iteration (set return_perf_metrics: true on a "
                f"trtllm-serve with NVIDIA/TensorRT-LLM PR #13405, not on an older one: {_WITHOUT_13405})",
            )
        check_engine_kind(self.kind, self.base, body)
        stats = self._stats(body)
        self._load = load_from_stats(stats, self._load)  # drained: no load read sees them again
        if stats != []:
            self._limits = limits_from_stats(stats)
        limits = self._limits
        # A full block for the tracker: the block size the shim runs with (_checked in shim.py).
        self.tracker.block_size = (limits.block_size if limits else None) or self.config.block_size
        if limits is None:
            raise EngineCold(
                f"the engine at {self.base} has reported no iteration stats yet (/metrics answered []): "
                "trtllm-serve has none until it has served a request (none at all without enable_iter_perf_stats)"
            )
        return limits

    async def load(self) -> EngineLoad:
        """The newest stats' load; the last one, stale, where the engine answers [] or holds its
        /metrics answer (busy: it answers once 2 s pass with no iteration; said once), and then
        marked iterating: the stall watchdog's evidence that the engine works."""
        body = await self._read_metrics(LOAD_WAIT_S)
        if body is not None:
            self._load = load_from_stats(self._stats(body), self._load)
            return self._load
        if not self._held_said:
            self._held_said = True
            log.warning(
                "%s/metrics has held its answer for %.1fs while the engine works (trtllm-serve without "
                "return_perf_metrics answers only after 2 s with no iteration): the last load read is "
                "reported, stale, until it answers; set return_perf_metrics: true for a current load on a trtllm-serve "
                "with NVIDIA/TensorRT-LLM PR #13405 (not on an older one: %s)",
                self.base,
                LOAD_WAIT_S,
                _WITHOUT_13405,
            )
        return replace(self._load, stale=True, iterating=True)

    def _forget_engine(self) -> None:
        """The engine may be another now (restarted, perhaps without enable_iter_perf_stats): its
        limits, and whether it gives stats at all, are read anew. The /metrics read in flight is
        given up: its answer would be the gone engine's, and one hung with it (no FIN, no read
        deadline) held every later limits() and load() until close()."""
        task, self._metrics = self._metrics, None
        if task is not None:
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody reads its failure now
        self._limits = None
        self._stats_seen = False
        self._empty_reads = 0
        self._next_run, self._held_run = [], None  # a run gone with the engine

    def _stats(self, body: bytes) -> Any:
        """A /metrics answer's stats. [] after legs ended since the read before, from an engine that
        has answered with stats, is one whose iterations ran and whose stats went elsewhere:
        EMPTY_SAY_READS such since the last read with stats are said once (an idle read's [] between
        them proves nothing either way; each reading is otherwise only stale, no failure: nothing
        else would tell). An engine that never answered with stats runs without
        enable_iter_perf_stats (said where the flags stand in for its limits): its [] is no race."""
        stats = self._decode("/metrics", body)
        ran = self._ended_at_start > self._ended_at_answer
        self._ended_at_answer = self._legs_ended
        if stats != []:
            self._empty_reads = 0
            self._stats_seen = True
        elif ran and self._stats_seen:
            self._empty_reads += 1
            if self._empty_reads >= EMPTY_SAY_READS and not self._empty_said:
                self._empty_said = True
                log.warning(
                    "%s/metrics answered [] %d times since its last answer with stats, each to a read begun after "
                    "this shim's requests ran on the engine: its iteration stats went to another reader, so the load "
                    "reported is the last one read, stale (said once). %s",
                    self.base,
                    self._empty_reads,
                    _RACING_COLLECTOR,
                )
        return stats

    async def run_events(self, sink: EventSink, live: asyncio.Event) -> None:
        """EngineCold for a 500 before the first answer (a trtllm-serve that has served nothing)."""
        await sink(EngineBatch(reset=True, complete=False))  # what the engine cached before this reader is unknown
        self._polled_at = time.monotonic()
        # The held-over events are no answer of the engine now at the URL: until 2026-12-08 they set
        # `live` and `answered`, and ids going back right after them ended this session too.
        answered = after_held = False
        try:
            if self._held_run is not None:
                # Folded by a session that ended before the engine answered (a proxy's 503, a stop,
                # LIVE_TIMEOUT_S): until 2026-12-08 lost with it, and this session started partial.
                await sink(self._held_run)
                after_held = True
            while True:
                # the new run's events the restart poll drained (no replay): folded first, with this session's limits
                held, self._next_run = self._next_run, []
                try:
                    events = held or await self._poll_events()
                except _NoJson as exc:
                    batch = self.tracker.lost(exc.message, "no JSON")
                except EngineError as exc:
                    if exc.code == 500 or isinstance(exc.__cause__, NETWORK_ERRORS):
                        # A 500 is a fresh engine's (aget_kv_events asserts), a transport error one
                        # gone: the next may have other limits. Until 2026-12-07 they held, and an
                        # engine restarted with another block size registered with the old one.
                        self._forget_engine()
                    if exc.code == 500 and not answered:
                        raise EngineCold(
                            f"{self.base}/kv_cache_events answered this stream's first poll with a 500: "
                            "trtllm-serve's event stream fails (KV Event IterationResult is not properly "
                            "instantiated) until it has served a request"
                        ) from exc
                    raise
                else:
                    # malformed events: counted, logged once, dropped
                    batch = self.tracker.fold(events, after_held=after_held)
                    if self.tracker.next_run:
                        # Another engine run, maybe with other limits: the session ends (as the ZMQ
                        # engines' do) and the next reads them anew. Until 2026-12-08 the stream was
                        # reset and the session kept the old run's limits and worker id.
                        self._forget_engine()
                        self._next_run = self.tracker.next_run  # no replay: the next session's first
                        assert self.tracker.went_back is not None, "set with next_run"
                        old, new = self.tracker.went_back
                        raise EngineRestarted("trtllm", f"its KV event ids went back from {old} to {new}")
                after_held = bool(held)
                if held:
                    self._held_run = batch
                else:
                    answered, self._polled_at, self._held_run = True, time.monotonic(), None
                    live.set()
                if batch.events or batch.reset:
                    await sink(batch)
                await asyncio.sleep(POLL_S)
        finally:
            self._polled_at = None

    async def _poll_events(self) -> Any:
        """One poll's answer, however long the engine holds it (said once past EVENTS_HELD_SAY_S)."""
        poll = asyncio.ensure_future(self._json("POST", "/kv_cache_events", EVENTS_TIMEOUT))
        try:
            await asyncio.wait([poll], timeout=EVENTS_HELD_SAY_S)
            if not poll.done() and not self._events_held_said:
                self._events_held_said = True
                log.warning(
                    "%s/kv_cache_events has held a poll for %.0fs: this trtllm-serve answers only once 2 s pass "
                    "with no new KV event (get_kv_cache_events_async(2)), so under load it cannot give a current "
                    "index: routers see this worker's cache as of its last answer (the lag: events_lag_s on the "
                    "shim's /health, kvswitch_shim_kv_events_poll_lag_seconds). The poll is kept, not given up; "
                    "a trtllm-serve that answers at once (get_kv_cache_events_async(0)) has no lag",
                    self.base,
                    EVENTS_HELD_SAY_S,
                )
            return await poll
        finally:
            poll.cancel()  # none once it answered; the session's end cancels the poll in flight

    def events_lag_s(self) -> float | None:
        at = self._polled_at
        return None if at is None else time.monotonic() - at

    def request_rebuild(self) -> None:
        """TensorRT-LLM cannot replay: the state stays partial until the engine restarts."""

    def event_stats(self) -> dict[str, int]:
        t = self.tracker
        return {
            "gaps": t.gaps,
            "restarts": t.restarts,
            "ignored": t.ignored,
            "partial": t.partial,
            "malformed": t.malformed,
        }

    def unknown_event_types(self) -> dict[str, int]:
        return dict(self.tracker.unknown.counts)

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        headers = {"Content-Type": "application/json", "X-Request-Id": leg.engine_id, **leg.headers}
        path = ENDPOINT_PATHS[leg.endpoint] if leg.endpoint else "/v1/completions"
        request = disagg_body(leg)
        answered = False

        async def output(tokens: int, events: list[bytes], token_ids: list[int]) -> None:
            nonlocal answered
            answered = True  # trtllm-serve streams nothing, a chat's role chunk neither, before the pull is done
            await on_output(tokens, events, token_ids)

        try:
            with self.watch_pull(leg, output) as watched:
                result = await post_completion(
                    self.session, self.base + path, request, headers, watched, pass_through=bool(leg.endpoint)
                )
        except EngineError as exc:
            failure = _leg_failure(leg, exc, answered)
            if failure is exc:
                raise
            raise failure from exc
        self._legs_ended += 1
        transfer = None
        if leg.prefill_only:
            if result.finish_reason not in _CONTEXT_PENDING:
                raise _context_finished(result.finish_reason)
            choices = result.last.get("choices") or [{}]
            transfer = choices[0].get("disaggregated_params") if isinstance(choices[0], dict) else None
            if not isinstance(transfer, dict):
                raise EngineError(502, "engine_protocol", "the context-only leg returned no disaggregated_params")
            check_transfer_handle(transfer)
        body = b"" if leg.prefill_only else result.body
        return LegOutcome(result.finish_reason, result.usage, transfer, result.token_ids, body)
