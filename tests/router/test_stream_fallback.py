"""A streamed chat request whose KV pull fails falls back to a local prefill, as a whole one does.

vLLM 0.32's chat stream (and engine_sim's) sends its role chunk before the error event of a failed
KV pull (kv_load_failure_policy "fail"). Before 2026-12-05 the router took that token-less chunk
for the first token: the pull counted as a success, nothing fell back, and the client got a 502
error event mid-stream where the same request unstreamed got a 200 (review14 S2)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.router.conftest import MODEL, Cluster


def _events(text: str) -> list[Any]:
    payloads = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]", text
    return [json.loads(p) for p in payloads[:-1]]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_streamed_chat_whose_kv_pull_fails_is_prefilled_on_its_decode_worker(
    cluster: Cluster, http: aiohttp.ClientSession, include_usage: bool
) -> None:
    # engine_sim as vLLM: its pins expire at once, so the pull fails (kv_load_failure_policy "fail")
    await cluster.add_worker("prefill", kv_lease_duration=1e-6)
    d = await cluster.add_worker("decode")
    router = await cluster.add_ready_router(disagg="always")
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(300))}],
        "max_tokens": 3,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
        text = (await resp.read()).decode()
        assert resp.status == 200, text
        assert resp.headers["x-kvswitch-outcome"] == "fallback_transfer_failed", text
    events = _events(text)
    assert not any("error" in e for e in events), text
    # The failed leg's role chunk was held back: the client gets the fallback's, once, first.
    roles = [e for e in events for c in e.get("choices", []) if c["delta"].get("role") == "assistant"]
    assert roles == [events[0]], text
    content = [c for e in events for c in e.get("choices", []) if c["delta"].get("content")]
    assert len(content) == 3, text
    if include_usage:
        assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["choices"] == []
    assert d.sim.engine.stats.failed_transfers == 1
    assert router.dispatcher.transfer_fallbacks == 1 and router.dispatcher.retries == 0
