"""Captures what vLLM 0.32 publishes and reports with `--no-enable-prefix-caching` (run after
`make test-vllm`): one server, the same 100-token completion twice, then its replay socket from
seq 0 (printed: no batch) and /metrics as
tests/fixtures/vllm-0.32/bs32/metrics_no_prefix_caching.txt.

    .venv/bin/python -m tests.vllm.capture_no_prefix_caching
"""

from __future__ import annotations

import json
import time
import urllib.request

from kvswitch.servers import free_port
from tests.vllm.run import MODEL, events_config
from tests.vllm.vllm_server import FIXTURES, replay, vllm


def main() -> None:
    events, replay_port = free_port(), free_port()
    flags = ["--no-enable-prefix-caching", "--kv-events-config", events_config(events, replay_port)]
    with vllm("capture_no_prefix_caching", *flags) as base:
        body = json.dumps({"model": MODEL, "prompt": list(range(100, 200)), "max_tokens": 2}).encode()
        headers = {"Content-Type": "application/json"}
        for _ in range(2):
            req = urllib.request.Request(base + "/v1/completions", data=body, headers=headers)
            with urllib.request.urlopen(req, timeout=120) as r:
                print("usage:", json.loads(r.read())["usage"])
        time.sleep(1)
        print("replay from seq 0:", len(replay(replay_port)) - 2, "batches")  # less the request and end marker
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            (FIXTURES / "metrics_no_prefix_caching.txt").write_bytes(r.read())


if __name__ == "__main__":
    main()
