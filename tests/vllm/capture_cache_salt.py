"""Captures where vLLM 0.32 puts a request's `cache_salt` in its KV events (run after `make
test-vllm`, which builds the venv and the tiny Llama): one server, four completions of one prompt
(salt `tenant-1`, none, `tenant-1`, `tenant-2`), then its replay socket from seq 0, written as
tests/fixtures/vllm-0.32/bs32/cache_salt_replay_from_0.jsonl.

    .venv/bin/python -m tests.vllm.capture_cache_salt
"""

from __future__ import annotations

import json
import time
import urllib.request

from kvswitch.servers import free_port
from tests.vllm.run import MODEL, events_config
from tests.vllm.vllm_server import FIXTURES, replay, vllm

SALTS = ["tenant-1", None, "tenant-1", "tenant-2"]


def main() -> None:
    events, replay_port = free_port(), free_port()
    with vllm("capture_cache_salt", "--kv-events-config", events_config(events, replay_port)) as url:
        for salt in SALTS:
            body = {"model": MODEL, "prompt": list(range(100, 165)), "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            req = urllib.request.Request(
                url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            urllib.request.urlopen(req, timeout=60).read()
        time.sleep(1)
        (FIXTURES / "cache_salt_replay_from_0.jsonl").write_text("\n".join(replay(replay_port)) + "\n")


if __name__ == "__main__":
    main()
