"""The request service on `{ns}.gen.{role}.{worker}` and `{ns}.cancel.{worker}`.

Each GenerateRequest runs as its own task (kept in `inflight` until it ends). The subject's role
says what the leg is:
- prefill: the engine's remote-prefill leg; one final chunk with the TransferHandle and usage;
- decode: with `disagg` (and no bypass annotation) continue from the prefill leg's handle; with the
  bypass annotation or no handle, prefill locally and decode;
- agg: prefill and decode locally.
Responses go to the message's reply subject as ResponseChunks, `seq` from 0. Tokens go out at once
unless the previous chunk left less than `COALESCE_S` ago; then they wait for that 5 ms mark, so no
token is held longer than 5 ms. Every leg ends with exactly one final chunk: finish_reason and usage,
or `error` (engine failure, deadline, draining, bad request), or finish_reason "abort" on cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from protocol import (
    CancelRequest,
    ErrorInfo,
    GenerateRequest,
    ProtocolError,
    ResponseChunk,
    TransferHandle,
    Usage,
    decode_msg,
    encode_msg,
)
from protocol.messages import ANNOTATION_BYPASS
from worker_shim.adapters.base import EngineAdapter, EngineError, LegOutcome, LegRequest

__all__ = ["COALESCE_S", "RequestService"]

log = logging.getLogger(__name__)
COALESCE_S = 0.005


class _ChunkWriter:
    """Numbers and coalesces one leg's chunks to its reply subject."""

    def __init__(self, nc: Nats, reply: str, request_id: str, worker: str) -> None:
        self.nc = nc
        self.reply = reply
        self.request_id = request_id
        self.worker = worker
        self.seq = 0
        self.sent_tokens = 0
        self._pending: list[int] = []
        self._last_sent = 0.0
        self._timer: asyncio.Task[None] | None = None

    async def _send(self, chunk: ResponseChunk) -> None:
        self.seq += 1
        self._last_sent = time.monotonic()
        await self.nc.publish(self.reply, encode_msg(chunk))

    def _chunk(self, tokens: list[int], **final: object) -> ResponseChunk:
        self.sent_tokens += len(tokens)
        return ResponseChunk(request_id=self.request_id, seq=self.seq, token_ids=tokens, worker=self.worker, **final)  # type: ignore[arg-type]

    async def tokens(self, toks: list[int]) -> None:
        self._pending.extend(toks)
        if self._timer is not None:
            return
        wait = self._last_sent + COALESCE_S - time.monotonic()
        if wait <= 0:
            await self._flush()
        else:
            self._timer = asyncio.create_task(self._flush_later(wait))

    async def _flush_later(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._timer = None
        await self._flush()

    async def _flush(self) -> None:
        if self._pending:
            toks, self._pending = self._pending, []
            await self._send(self._chunk(toks))

    async def final(
        self,
        *,
        finish_reason: str | None = None,
        usage: Usage | None = None,
        transfer: TransferHandle | None = None,
        error: ErrorInfo | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await timer
        toks, self._pending = self._pending + (tokens or []), []
        await self._send(
            self._chunk(toks, final=True, finish_reason=finish_reason, usage=usage, transfer=transfer, error=error)
        )


@dataclass(slots=True)
class _Leg:
    request_id: str
    queued_tokens: int
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    shutdown: bool = False
    started: float = field(default_factory=time.monotonic)


class RequestService:
    """Runs legs against one adapter. `worker` is read per request (it changes on re-registration)."""

    def __init__(
        self,
        nc: Nats,
        adapter: EngineAdapter,
        worker: Callable[[], str],
        on_change: Callable[[], None],
        cached_tokens: Callable[[list[int]], int] = lambda _ids: 0,
    ) -> None:
        self.nc = nc
        # Prompt tokens the engine already caches: they cost no prefill, so they are not "queued".
        self.cached_tokens = cached_tokens
        self.adapter = adapter
        self.worker = worker
        self.on_change = on_change
        self.accepting = True
        self.inflight: dict[str, _Leg] = {}
        self.completed = 0
        self.failed = 0
        self.malformed = 0
        self._queued = 0

    @property
    def prefill_tokens_queued(self) -> int:
        return self._queued

    # --- NATS handlers --------------------------------------------------------------------------

    async def on_generate(self, msg: Msg) -> None:
        role = msg.subject.split(".")[-2]
        if not msg.reply:
            self.malformed += 1
            log.warning("generate request on %s has no reply subject: dropped", msg.subject)
            return
        writer_worker = self.worker()
        try:
            req = decode_msg(msg.data, GenerateRequest)
        except ProtocolError as exc:
            self.malformed += 1
            writer = _ChunkWriter(self.nc, msg.reply, "", writer_worker)
            await writer.final(error=ErrorInfo(code=400, kind="bad_request", message=str(exc)))
            return
        writer = _ChunkWriter(self.nc, msg.reply, req.request_id, writer_worker)
        if not self.accepting:
            await writer.final(error=ErrorInfo(code=503, kind="draining", message="the worker is shutting down"))
            return
        if req.request_id in self.inflight:
            await writer.final(
                error=ErrorInfo(code=409, kind="bad_request", message=f"request {req.request_id} is already running")
            )
            return
        leg = self._leg_request(req, role)
        if isinstance(leg, ErrorInfo):
            await writer.final(error=leg)
            return
        queued = 0 if leg.transfer is not None else len(req.token_ids) - self.cached_tokens(req.token_ids)
        state = _Leg(req.request_id, max(queued, 0))
        self.inflight[req.request_id] = state
        self._queued += state.queued_tokens
        self.on_change()
        state.task = asyncio.create_task(self._run(req, leg, state, writer, role), name=f"leg-{req.request_id}")

    async def on_cancel(self, msg: Msg) -> None:
        try:
            req = decode_msg(msg.data, CancelRequest)
        except ProtocolError as exc:
            self.malformed += 1
            log.warning("ignoring malformed cancel: %s", exc)
            return
        state = self.inflight.get(req.request_id)
        if state is not None and state.task is not None and not state.cancelled:
            state.cancelled = True
            state.task.cancel()

    # --- one leg --------------------------------------------------------------------------------

    def _leg_request(self, req: GenerateRequest, role: str) -> LegRequest | ErrorInfo:
        headers = {k: v for k, v in req.trace.items() if k in ("traceparent", "tracestate")}
        leg = LegRequest(
            request_id=req.request_id,
            model=req.model,
            token_ids=req.token_ids,
            sampling=req.sampling,
            stream=req.stream,
            headers=headers,
        )
        if not req.token_ids:
            return ErrorInfo(code=400, kind="bad_request", message="token_ids is empty")
        if role == "prefill":
            leg.prefill_only = True
        elif role == "decode" and req.disagg is not None and ANNOTATION_BYPASS not in req.annotations:
            if req.disagg.engine != self.adapter.kind:
                return ErrorInfo(
                    code=400,
                    kind="bad_request",
                    message=f"transfer handle from a {req.disagg.engine} engine cannot feed a {self.adapter.kind} one",
                )
            leg.transfer = req.disagg.params
        elif role not in ("decode", "agg"):
            return ErrorInfo(code=400, kind="bad_request", message=f"unknown role {role!r} in the subject")
        return leg

    def _first_token(self, state: _Leg) -> None:
        if state.queued_tokens:
            self._queued -= state.queued_tokens
            state.queued_tokens = 0
            self.on_change()

    async def _run(self, req: GenerateRequest, leg: LegRequest, state: _Leg, writer: _ChunkWriter, role: str) -> None:
        async def on_tokens(toks: list[int]) -> None:
            self._first_token(state)
            await writer.tokens(toks)

        try:
            try:
                remaining = None if req.deadline is None else req.deadline - time.time()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    outcome = await self.adapter.generate(leg, on_tokens)
            except TimeoutError:
                self.failed += 1
                await writer.final(error=ErrorInfo(code=504, kind="deadline", message="the request's deadline passed"))
                return
            except EngineError as exc:
                self.failed += 1
                await writer.final(error=ErrorInfo(code=exc.code, kind=exc.kind, message=exc.message))
                return
            except asyncio.CancelledError:
                if state.cancelled:
                    await writer.final(finish_reason="abort", usage=Usage(prompt_tokens=len(req.token_ids)))
                    return
                await writer.final(
                    error=ErrorInfo(code=503, kind="shutdown", message="the worker shut down before the request ended")
                )
                raise
            except Exception as exc:
                self.failed += 1
                log.exception("request %s failed", req.request_id)
                await writer.final(error=ErrorInfo(code=500, kind="internal", message=f"shim error: {exc!r}"))
                return
            self.completed += 1
            await self._finish(writer, outcome, role, leg)
        finally:
            self._first_token(state)
            self.inflight.pop(req.request_id, None)

    async def _finish(self, writer: _ChunkWriter, outcome: LegOutcome, role: str, leg: LegRequest) -> None:
        if role == "prefill":
            # The prefill leg's sampled token is not part of the answer: the decode leg produces it all.
            handle = TransferHandle(
                engine=self.adapter.kind, params=outcome.transfer_params or {}, prefill_worker=writer.worker
            )
            await writer.final(finish_reason=outcome.finish_reason, usage=outcome.usage, transfer=handle)
            return
        tokens = outcome.token_ids if not leg.stream else []
        await writer.final(finish_reason=outcome.finish_reason, usage=outcome.usage, tokens=tokens)

    # --- lifecycle --------------------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Stop taking requests; let in-flight ones run up to `grace_s`, then abort the rest."""
        self.accepting = False
        tasks = [s.task for s in self.inflight.values() if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)
        await self.abort_all()

    async def abort_all(self) -> None:
        """End every in-flight leg with an error chunk (the engine went away or the shim stops)."""
        tasks = []
        for s in list(self.inflight.values()):
            if s.task is not None and not s.task.done():
                s.shutdown = True
                s.task.cancel()
                tasks.append(s.task)
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
