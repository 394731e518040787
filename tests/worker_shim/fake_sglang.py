"""A stand-in for an SGLang P/D server's `/generate` and `/abort_request`, as its http_server and
tokenizer_manager answer them: a prompt past the context is refused at once, on prefill and decode
servers alike (400 `{"error": {"message"}}`; streamed, that object as the only event before
`[DONE]`); any other request waits, as the prefill server's bootstrap queue and the decode server's
prealloc queue hold it, until the test answers it (`answer`) or it is aborted (`POST /abort_request
{"rid"}`: "Abort before prefill", no tokens)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from tests.worker_shim.cluster import served

CONTEXT = 8192
TOO_LONG = f"The input ({CONTEXT + 808} tokens) is longer than the model's context length ({CONTEXT} tokens)."
_ABORTED = {"output_ids": [], "meta_info": {"completion_tokens": 0, "finish_reason": {"type": "abort"}}}


class FakeSglang:
    def __init__(self) -> None:
        self.got: list[dict[str, Any]] = []  # the /generate bodies, as they came
        self.aborted: list[str] = []
        self.held: dict[str, asyncio.Future[tuple[int, dict[str, Any]]]] = {}  # by rid, until answered

    def answer(self, rid: str, status: int = 200, body: dict[str, Any] | None = None, tokens: int = 1) -> None:
        """End the held request `rid` with `body`, or its `tokens` output tokens (a prefill's one
        once its KV went) ending on its length."""
        if body is None:
            prompt = len(next(b["input_ids"] for b in self.got if b["rid"] == rid))
            meta = {"completion_tokens": tokens, "prompt_tokens": prompt, "finish_reason": {"type": "length"}}
            body = {"output_ids": list(range(11, 11 + tokens)), "meta_info": meta}
        self.held.pop(rid).set_result((status, body))

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.got.append(body)
        if len(body["input_ids"]) > CONTEXT:
            return await _respond(request, body["stream"], 400, {"error": {"message": TOO_LONG}})
        held = self.held[body["rid"]] = asyncio.get_running_loop().create_future()
        status, answer = await held
        return await _respond(request, body["stream"], status, answer)

    async def _abort(self, request: web.Request) -> web.Response:
        rid = (await request.json())["rid"]
        self.aborted.append(rid)
        if (held := self.held.pop(rid, None)) is not None:
            held.set_result((200, _ABORTED))
        return web.Response()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """Its base URL while it serves; requests still held end as aborted on the way out."""
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        async with served(app) as url:
            try:
                yield url
            finally:
                for held in self.held.values():
                    held.set_result((200, _ABORTED))
                self.held.clear()


async def _respond(request: web.Request, stream: bool, status: int, body: dict[str, Any]) -> web.StreamResponse:
    if not stream or (status != 200 and "error" not in body):  # a refusal streams as its one event
        return web.json_response(body, status=status)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp
