"""POST /v1/completions and /v1/chat/completions, as vLLM 0.32's OpenAI server answers them.

A call has prompts (completions may batch several) and `n` choices per prompt; each choice is one
engine request. Choices are numbered as vLLM numbers them: prompt i's choice j is `i * n + j`
(chat: j). Request ids: `cmpl-{id}` (`cmpl-{id}-{i}` per prompt of a batch, `{j}_...` per choice when
n > 1); `X-Request-Id` supplies {id} (echoed only with --enable-request-id-headers: http_api.py).

Per token, a choice's text goes through engine_sim/detokenizer.py (stop strings, stop token ids,
min_tokens) and, when asked, its logprobs through engine_sim/logprobs.py. A stop string ends the
choice at once and aborts its engine request, as vLLM does. Completions stream one chunk per token
(empty text while a stop string might be starting, as vLLM sends them); chat streams one role chunk
per choice first and then one chunk per token too (`content: ""` while a stop string might be
starting: vLLM 0.32 without a reasoning or tool parser sends those as well). Usage counts each
prompt once and every choice's tokens (with stream_options.continuous_usage_stats, every streamed
chunk also carries its choice's prompt and tokens so far, as vLLM's); prompt_tokens_details only with
--enable-prompt-tokens-details (a miss reports 0 cached tokens; chat also names the tokens the
prompt wrote to the cache, as vLLM's serving code fills them), taken from the last prompt
(non-streaming) or the first (streaming). A streamed choice's last chunk names the system
fingerprint unless a usage chunk follows.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from engine_sim import openai_format as fmt
from engine_sim.detokenizer import ChoiceText
from engine_sim.errors import SimRequestError
from engine_sim.http_context import (
    SERVER_KEY,
    check_model,
    engine_gone,
    error_response,
    fault_gate,
    json_body,
    json_response,
    request_id,
)
from engine_sim.logprobs import (
    Position,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    prompt_positions,
    sampled_position,
)
from engine_sim.openai_format import SSE_DONE, Output, sse
from engine_sim.openai_request import (
    ChatRequest,
    CompletionRequest,
    GenerateCall,
    chat_call,
    completion_call,
    parse_body,
)
from engine_sim.request import SimRequest
from engine_sim.runner import RequestStream, StreamClosed
from engine_sim.sampler import Sampler
from protocol.tokenizer import BuiltinTokenizer
from protocol.vllm_errors import VALIDATION_ERROR

if TYPE_CHECKING:
    from engine_sim.server import SimServer

__all__ = ["chat_completions", "completions"]

_tokenizer = BuiltinTokenizer()
Respond = Callable[[web.Request, "_Job"], Awaitable[web.StreamResponse]]
Body = TypeVar("Body", CompletionRequest, ChatRequest)


@dataclass(slots=True)
class _Choice:
    prompt: int
    index: int
    stream: RequestStream
    text: ChoiceText
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)
    positions: list[Position | None] = field(default_factory=list)


@dataclass(slots=True)
class _Piece:
    """One generated token and what its chunk carries; `last` ends the choice."""

    token: int
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    position: Position | None
    last: bool
    count: int  # the choice's tokens so far, this one included


class _Job:
    """One generate call: its choices, and what the client asked to get back."""

    def __init__(self, srv: SimServer, call: GenerateCall, base_id: str) -> None:
        self.srv = srv
        self.call = call
        self.base_id = base_id
        # vLLM names the adapter in its answer to a LoRA request, the served model otherwise.
        model = call.lora.name if call.lora is not None else srv.config.model
        self.head = fmt.Head(base_id, int(time.time()), model, srv.fingerprint)
        self.choices: list[_Choice] = []
        k = call.prompt_logprobs
        self.prompt_positions = [prompt_positions(p.token_ids, k) if k is not None else None for p in call.prompts]

    def submit(self) -> None:
        call = self.call
        params = call.kv_transfer_params or {}
        remote_decode = bool(params.get("do_remote_decode"))
        remote_prefill = params if params.get("do_remote_prefill") else None
        # Engine ids get a random suffix, as vLLM's (vllm#27987): a client's X-Request-Id names the
        # answer but need not be unique.
        unique = f"{self.base_id}-{secrets.token_hex(4)}"
        for i, p in enumerate(call.prompts):
            rid = unique if len(call.prompts) == 1 else f"{unique}-{i}"
            for j in range(call.n):
                req = SimRequest(
                    rid if call.n == 1 else f"{j}_{rid}",
                    p.token_ids,
                    max_tokens=call.max_tokens[i],  # vLLM's too: its proxies ask a prefill for one
                    stop_token_ids=call.stop_token_ids,
                    seed=call.seed,
                    choice=j,
                    min_tokens=call.min_tokens,
                    skip_prefix_cache=call.prompt_logprobs is not None,
                    remote_decode=remote_decode,
                    remote_prefill=remote_prefill,
                    cache_salt=call.cache_salt,
                    lora=call.lora,
                )
                text = ChoiceText(call.stops, include_stop=call.include_stop, min_tokens=call.min_tokens)
                self.choices.append(_Choice(i, i * call.n + j, self.srv.runner.submit(req), text, req.sampler))

    def abort_unfinished(self) -> None:
        for c in self.choices:
            if not c.stream.finished:
                self.srv.runner.abort(c.stream.request_id)

    def prompt_text(self, i: int) -> str:
        """What echo puts before the output: the prompt as given (decoded, for token ids)."""
        p = self.call.prompts[i]
        if self.call.want_ids:
            return ""
        return p.text if p.text is not None else _tokenizer.decode(p.token_ids)

    def running_usage(self, c: _Choice | None, count: int) -> dict[str, Any] | None:
        """A chunk's usage with continuous usage stats (`c`: the choice, `count` its tokens so far;
        None for chat's role and echo chunks, sent before any output), else None."""
        if not self.call.continuous_usage:
            return None
        prompt = self.call.prompts[c.prompt if c is not None else 0]
        return fmt.running_usage(len(prompt.token_ids), count, chat=self.call.chat)

    def usage(self, stream: bool) -> dict[str, Any]:
        n_in = sum(len(p.token_ids) for p in self.call.prompts)
        n_out = sum(len(c.tokens) for c in self.choices)
        cached = created = None
        if self.srv.config.enable_prompt_tokens_details:
            # vLLM reads the first prompt's result when streaming, the last one's otherwise
            source = (self.choices[0] if stream else self.choices[-1]).stream
            cached = source.num_cached_tokens
            created = source.num_cache_creation_tokens if self.call.chat else None  # completions name none
        return fmt.usage(n_in, n_out, cached, created)


async def _steps(job: _Job, c: _Choice) -> AsyncIterator[list[_Piece]]:
    """Choice c's tokens, one list per engine step."""
    stream, call = c.stream, job.call
    while new := await stream.next_tokens():
        pieces = []
        for k, t in enumerate(new):
            ends = stream.finished and k == len(new) - 1
            stop_token = t if ends and stream.finish_reason == "stop" and t in call.stop_token_ids else None
            text = c.text.add(_tokenizer.decode([t]), stop_token=stop_token)
            by_string = isinstance(c.text.stop_reason, str)
            last = by_string or ends
            if last:
                text += c.text.finish()
            finish = "stop" if by_string else (stream.finish_reason if last else None)
            pos = sampled_position(c.sampler, len(c.tokens), t, call.logprobs) if call.logprobs is not None else None
            c.tokens.append(t)
            c.positions.append(pos)
            pieces.append(_Piece(t, text, finish, c.text.stop_reason if last else None, pos, last, len(c.tokens)))
            if by_string:
                job.srv.runner.abort(stream.request_id, "stop")
                break
        yield pieces
        if pieces and pieces[-1].last:
            return


async def _run(job: _Job, c: _Choice) -> _Piece | None:
    """Choice c to the end; its last piece."""
    last = None
    async for pieces in _steps(job, c):
        last = pieces[-1] if pieces else last
    return last


def _failed(job: _Job) -> bool:
    """A choice ended with finish reason "error" (its KV pull failed): vLLM's GenerationError."""
    return any(c.stream.finish_reason == "error" for c in job.choices)


# What vLLM answers for a GenerationError: a 500, or on a stream an error event before [DONE].
_GENERATION_ERROR = fmt.error_body("Internal server error", "InternalServerError", None, 500)


def _ids(job: _Job, ids: list[int]) -> list[int] | None:
    return list(ids) if job.call.want_ids else None


async def _serve(
    request: web.Request,
    kind: type[Body],
    make: Callable[[Body, SimServer], GenerateCall],
    id_prefix: str,
    respond: Respond,
) -> web.StreamResponse:
    """Admit and submit one generate call (its body as `kind`, the call `make` makes of it), then
    `respond`; the engine requests end with the call. With --enable-server-load-tracking, GET /load
    counts it until answered (vLLM's load_aware_call)."""
    srv: SimServer = request.app[SERVER_KEY]
    if not srv.config.enable_server_load_tracking:
        return await _admit(request, kind, make, id_prefix, respond)
    srv.server_load += 1
    try:
        return await _admit(request, kind, make, id_prefix, respond)
    finally:
        srv.server_load -= 1


async def _admit(
    request: web.Request,
    kind: type[Body],
    make: Callable[[Body, SimServer], GenerateCall],
    id_prefix: str,
    respond: Respond,
) -> web.StreamResponse:
    srv: SimServer = request.app[SERVER_KEY]
    try:
        body = parse_body(await json_body(request), kind)
    except SimRequestError as exc:
        return error_response(exc)  # vLLM's request validation: its endpoint never runs
    try:
        call = make(body, srv)
        _check_rank(srv, request)
        if fault_gate(srv, request):
            return web.Response(status=500)
        job = _Job(srv, call, f"{id_prefix}-{request_id(request, call.request_id)}")
        job.submit()
    except SimRequestError as exc:
        if exc.kind != VALIDATION_ERROR:  # pydantic's checks that msgspec's types do not make: vLLM's too
            # vLLM 0.32's _with_kv_transfer_rejection_cleanup: a refused request frees the prefill
            # blocks its kv_transfer_params pin, rather than leave them to their lease
            srv.runner.reject(body.kv_transfer_params)
        return error_response(exc)
    try:
        return await respond(request, job)
    except StreamClosed:
        return engine_gone(request)
    except ConnectionResetError:
        # The client left: a choice's write (n > 1 writes from a task each) met its reset before the
        # handler was cancelled. vLLM aborts it and logs nothing; raised on, aiohttp logged a traceback.
        raise web.HTTPException() from None
    finally:
        job.abort_unfinished()


def _check_rank(srv: SimServer, request: web.Request) -> None:
    """vLLM's X-data-parallel-rank picks one of the engines its API server manages, by index (a
    value that is no integer is ignored). The sim is a server managing one engine (one
    `--data-parallel-rank R` server of an external load-balanced deployment, or a server without
    data parallelism): index 0 is its engine whatever its rank; any other is vLLM's 400
    (input_processor bounds the header to [0, data_parallel_size_local))."""
    value = request.headers.get("X-data-parallel-rank", "")
    if not value.lstrip("-").isdigit():
        return
    index = int(value)
    if index != 0:
        raise SimRequestError(f"data_parallel_rank {index} is out of range [0, 1).")
    srv.ranked_requests += 1


def _completion_call(body: CompletionRequest, srv: SimServer) -> GenerateCall:
    lora = check_model(srv, body.model)
    call = completion_call(body, srv.config.max_model_len)
    call.lora = lora
    return call


def _chat_call(body: ChatRequest, srv: SimServer) -> GenerateCall:
    lora = check_model(srv, body.model)
    cfg = srv.config
    call = chat_call(body, cfg.max_model_len, model=cfg.model, tool_parsing=cfg.enable_auto_tool_choice)
    call.lora = lora
    return call


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CompletionRequest, _completion_call, "cmpl", _respond_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, ChatRequest, _chat_call, "chatcmpl", _respond_chat)


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    return resp


async def _end_sse(resp: web.StreamResponse, job: _Job, obj: str) -> web.StreamResponse:
    """The usage chunk when the client asked for it (vLLM's error event instead when a choice
    failed), then [DONE]."""
    if _failed(job):
        await resp.write(sse(_GENERATION_ERROR))
    elif job.call.include_usage:
        await resp.write(sse(fmt.usage_chunk(job.head, obj, job.usage(stream=True))))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


# --- completions ---------------------------------------------------------------------------------


async def _respond_completion(request: web.Request, job: _Job) -> web.StreamResponse:
    if job.call.stream:
        return await _stream_completion(request, job)
    lasts = await asyncio.gather(*(_run(job, c) for c in job.choices))
    if _failed(job):
        return json_response(_GENERATION_ERROR, 500)
    choices = [_completion_choice(job, c, last) for c, last in zip(job.choices, lasts, strict=True)]
    kv = job.choices[0].stream.kv_transfer_params
    return json_response(fmt.completion_response(job.head, choices, job.usage(stream=False), kv))


def _completion_choice(job: _Job, c: _Choice, last: _Piece | None) -> dict[str, Any]:
    call = job.call
    prompt = call.prompts[c.prompt]
    prompt_pos = job.prompt_positions[c.prompt]
    text, tokens, positions = c.text.text, c.tokens, c.positions
    if call.echo:
        echoed = job.prompt_text(c.prompt)
        text = echoed if call.echo_only else echoed + text
        tokens = prompt.token_ids if call.echo_only else [*prompt.token_ids, *c.tokens]
        prompt_part: list[Position | None] = prompt_pos if prompt_pos is not None else [None] * len(prompt.token_ids)
        positions = prompt_part if call.echo_only else [*prompt_part, *c.positions]
    logprobs = None
    if call.logprobs is not None:
        logprobs = completion_logprobs(tokens, positions, call.logprobs, as_ids=call.as_ids)
    finish = last.finish_reason if last is not None else c.stream.finish_reason
    stop_reason = last.stop_reason if last is not None else None
    out = Output(text, finish, stop_reason, _ids(job, c.tokens), logprobs)
    prompt_lp = prompt_logprobs_json(prompt_pos) if prompt_pos is not None else None
    return fmt.completion_choice(c.index, out, _ids(job, prompt.token_ids), prompt_lp)


async def _stream_completion(request: web.Request, job: _Job) -> web.StreamResponse:
    resp = await _open_sse(request)
    call = job.call

    async def pump(c: _Choice) -> None:
        first, offset = True, 0
        prompt = call.prompts[c.prompt]
        async for pieces in _steps(job, c):
            buf = bytearray()
            for p in pieces:
                text, tokens, positions = p.text, [p.token], [p.position]
                if first and call.echo:
                    prompt_pos: list[Position | None] = job.prompt_positions[c.prompt] or [None] * len(prompt.token_ids)
                    echoed = job.prompt_text(c.prompt)
                    text = echoed if call.echo_only else echoed + text
                    tokens = prompt.token_ids if call.echo_only else [*prompt.token_ids, p.token]
                    positions = prompt_pos if call.echo_only else [*prompt_pos, p.position]
                # vLLM returns the prompt's ids with an echo even unasked.
                prompt_ids = prompt.token_ids if first and (call.echo or call.want_ids) else None
                logprobs = None
                if call.logprobs is not None:
                    logprobs = completion_logprobs(tokens, positions, call.logprobs, offset, call.as_ids)
                offset += len(p.text)
                out = Output(text, p.finish_reason, p.stop_reason, _ids(job, [p.token]), logprobs)
                usage = job.running_usage(c, p.count)
                buf += sse(fmt.completion_chunk(job.head, c.index, out, prompt_ids, not call.include_usage, usage))
                first = False
            await resp.write(bytes(buf))

    await asyncio.gather(*(pump(c) for c in job.choices))
    return await _end_sse(resp, job, "text_completion")


# --- chat ----------------------------------------------------------------------------------------


def _chat_logprobs(job: _Job, tokens: list[int], positions: list[Position | None]) -> dict[str, Any] | None:
    k = job.call.logprobs
    return chat_logprobs(tokens, positions, k, job.call.as_ids) if k is not None else None


async def _respond_chat(request: web.Request, job: _Job) -> web.StreamResponse:
    if job.call.stream:
        return await _stream_chat(request, job)
    lasts = await asyncio.gather(*(_run(job, c) for c in job.choices))
    if _failed(job):
        return json_response(_GENERATION_ERROR, 500)
    choices = []
    for c, last in zip(job.choices, lasts, strict=True):
        finish = last.finish_reason if last is not None else c.stream.finish_reason
        stop_reason = last.stop_reason if last is not None else None
        logprobs = _chat_logprobs(job, c.tokens, c.positions)
        text = job.call.chat_echo + c.text.text
        choices.append(fmt.chat_choice(c.index, Output(text, finish, stop_reason, _ids(job, c.tokens), logprobs)))
    prompt_ids = job.call.prompts[0].token_ids
    prompt_pos = job.prompt_positions[0]
    body = fmt.chat_response(
        job.head,
        choices,
        _ids(job, prompt_ids),
        job.usage(stream=False),
        job.choices[0].stream.kv_transfer_params,
        prompt_logprobs_json(prompt_pos) if prompt_pos is not None else None,
    )
    return json_response(body)


async def _stream_chat(request: web.Request, job: _Job) -> web.StreamResponse:
    resp = await _open_sse(request)
    prompt_ids = _ids(job, job.call.prompts[0].token_ids)
    usage = job.running_usage(None, 0)
    await resp.write(b"".join(sse(fmt.chat_first_chunk(job.head, c.index, prompt_ids, usage)) for c in job.choices))
    if job.call.chat_echo:
        echo = job.call.chat_echo
        await resp.write(b"".join(sse(fmt.chat_echo_chunk(job.head, c.index, echo, usage)) for c in job.choices))

    async def pump(c: _Choice) -> None:
        async for pieces in _steps(job, c):
            buf = bytearray()
            for p in pieces:
                logprobs = _chat_logprobs(job, [p.token], [p.position])
                out = Output(p.text, p.finish_reason, p.stop_reason, _ids(job, [p.token]), logprobs)
                usage = job.running_usage(c, p.count)
                buf += sse(fmt.chat_chunk(job.head, c.index, out, not job.call.include_usage, usage))
            await resp.write(bytes(buf))

    await asyncio.gather(*(pump(c) for c in job.choices))
    return await _end_sse(resp, job, "chat.completion.chunk")
