"""What `kvswitch up --demo` sends through a running cluster: a few requests chosen so that
conditional disaggregation takes each path once, and the router's decision counters after them."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

from protocol.tokenizer import BuiltinTokenizer

__all__ = ["DemoResult", "run_demo_requests"]


@dataclass
class DemoResult:
    label: str
    prompt_tokens: int
    decode_worker: str
    prefill: str
    outcome: str
    ttft_s: float
    text: str


def _words(seed: int, n: int) -> list[int]:
    """`n` token ids of deterministic pseudo-words: valid in the built-in tokenizer's vocabulary."""
    return [300 + (seed * 7919 + i * 104729) % 31000 for i in range(n)]


def _post(url: str, model: str, prompt: list[int], max_tokens: int) -> DemoResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    ttft = 0.0
    text = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        headers = resp.headers
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if piece and not ttft:
                ttft = time.perf_counter() - started
            text.append(piece)
    return DemoResult(
        label="",
        prompt_tokens=len(prompt),
        decode_worker=headers.get("x-kvswitch-decode-worker", "?"),
        prefill=headers.get("x-kvswitch-prefill", "?"),
        outcome=headers.get("x-kvswitch-outcome", "?"),
        ttft_s=ttft,
        text="".join(text),
    )


def run_demo_requests(router_url: str, model: str) -> list[DemoResult]:
    system = _words(1, 4096)  # long enough that an uncached prompt is worth a remote prefill
    turns = [
        ("short prompt (uncached, 200 tokens)", _words(2, 200)),
        ("long prompt (uncached, 4,096+64 tokens)", system + _words(3, 64)),
        ("follow-up turn (same 4,096-token prefix)", system + _words(3, 64) + _words(4, 96)),
        ("another user, same system prompt", system + _words(5, 64)),
    ]
    results = []
    for label, prompt in turns:
        result = _post(router_url, model, prompt, max_tokens=16)
        result.label = label
        results.append(result)
    return results


def decision_counts(router_url: str) -> dict[str, float]:
    with urllib.request.urlopen(router_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvswitch_router_decisions_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def format_results(results: list[DemoResult], counts: dict[str, float]) -> str:
    tok = BuiltinTokenizer()
    lines = [f"{'request':<44} {'tokens':>6} {'decode worker':>17} {'prefill':>8} {'outcome':>24} {'TTFT':>8}"]
    for r in results:
        lines.append(
            f"{r.label:<44} {r.prompt_tokens:>6} {r.decode_worker:>17} {r.prefill:>8} {r.outcome:>24} "
            f"{r.ttft_s * 1000:>6.0f}ms"
        )
    lines.append(f"sample output: {tok.decode(tok.encode(results[-1].text))[:60]!r}")
    lines.append("router decisions: " + ", ".join(f"{k}={v:g}" for k, v in sorted(counts.items()) if v))
    return "\n".join(lines)
