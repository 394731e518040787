"""What `kvswitch up --demo` sends through a running cluster: a few requests chosen so that
conditional disaggregation takes each path once, and the router's decision counters after them."""

from __future__ import annotations

import aiohttp

from kvswitch.client import Completion, CompletionClient

__all__ = ["decision_counts", "format_results", "run_demo_requests"]


def _words(seed: int, n: int) -> list[int]:
    """`n` token ids of deterministic pseudo-words: valid in the built-in tokenizer's vocabulary."""
    return [300 + (seed * 7919 + i * 104729) % 31000 for i in range(n)]


async def run_demo_requests(router_url: str, model: str) -> list[tuple[str, Completion]]:
    system = _words(1, 4096)  # long enough that an uncached prompt is worth a remote prefill
    turns = [
        ("short prompt (uncached, 200 tokens)", _words(2, 200)),
        ("long prompt (uncached, 4,096+64 tokens)", system + _words(3, 64)),
        ("follow-up turn (same 4,096-token prefix)", system + _words(3, 64) + _words(4, 96)),
        ("another user, same system prompt", system + _words(5, 64)),
    ]
    async with aiohttp.ClientSession() as session:
        client = CompletionClient(session, model, timeout_s=60.0)
        return [
            (label, await client.complete(router_url, prompt, 16, request_id=f"demo-{i}"))
            for i, (label, prompt) in enumerate(turns)
        ]


async def decision_counts(router_url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(router_url + "/metrics") as resp:
        text = await resp.text()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvswitch_router_decisions_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def format_results(results: list[tuple[str, Completion]], counts: dict[str, float]) -> str:
    lines = [f"{'request':<44} {'tokens':>6} {'decode worker':>17} {'prefill':>8} {'outcome':>24} {'TTFT':>8}"]
    for label, r in results:
        ttft = f"{r.ttft_s * 1000:>6.0f}ms" if r.ttft_s is not None else f"{'-':>8}"
        status = "" if r.ok else f"  FAILED: {r.error}"
        lines.append(
            f"{label:<44} {r.prompt_tokens:>6} {r.decode_worker or '?':>17} {r.prefill or '?':>8} "
            f"{r.outcome or '?':>24} {ttft}{status}"
        )
    lines.append("router decisions: " + ", ".join(f"{k}={v:g}" for k, v in sorted(counts.items()) if v))
    return "\n".join(lines)
