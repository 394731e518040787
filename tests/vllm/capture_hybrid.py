"""Captures what vLLM 0.32 publishes for a hybrid model (run after `make test-vllm`, which builds
.venv-vllm/tiny-hybrid): one server of the tiny Gemma 2 (a sliding-window group of 64 tokens and a
full-attention group), five completions whose prompts share prefixes, each one's cached tokens as
vLLM reports them, and the replay socket after each, into
tests/fixtures/vllm-0.32/bs32/hybrid_replay_from_0.jsonl (the replay after the last) and
hybrid_requests.json (per request: its prompt, `cached_tokens`, and how many batches the engine
had published before it).

    .venv/bin/python -m tests.vllm.capture_hybrid
"""

from __future__ import annotations

import json
import urllib.request

from kvswitch.servers import free_port
from tests.vllm.run import HYBRID_PROMPTS, MODEL, events_config
from tests.vllm.vllm_server import FIXTURES, replay, vllm


def main() -> None:
    events, replay_port = free_port(), free_port()
    flags = ["--enable-prompt-tokens-details", "--kv-events-config", events_config(events, replay_port)]
    requests = []
    with vllm("capture_hybrid", *flags, model="tiny-hybrid", blocks=200) as base:
        for prompt in HYBRID_PROMPTS:
            published = len(replay(replay_port)) - 2  # less the request and the end marker
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
            req = urllib.request.Request(
                base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                usage = json.loads(r.read())["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            requests.append({"prompt": prompt, "cached_tokens": cached, "batches_before": published})
            print(f"{len(prompt)} prompt tokens, {cached} cached, {published} batches before")
        lines = replay(replay_port)
    (FIXTURES / "hybrid_replay_from_0.jsonl").write_text("\n".join(lines) + "\n")
    (FIXTURES / "hybrid_requests.json").write_text(json.dumps(requests) + "\n")


if __name__ == "__main__":
    main()
