"""Captures where vLLM 0.32 puts a request's `cache_salt` in its KV events (run after `make
test-vllm`, which builds the venv and the tiny Llama): one server, four completions of one prompt
(salt `tenant-1`, none, `tenant-1`, `tenant-2`), then its replay socket from seq 0, written as
tests/fixtures/vllm-0.32/bs32/cache_salt_replay_from_0.jsonl.

    .venv/bin/python -m tests.vllm.capture_cache_salt
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from kvswitch.servers import free_port
from tests.vllm.capture_lora import replay as replay_from_0
from tests.vllm.run import BLOCK, MODEL, events_config

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "vllm-0.32" / "bs32" / "cache_salt_replay_from_0.jsonl"
SALTS = ["tenant-1", None, "tenant-1", "tenant-2"]


def main() -> None:
    venv = ROOT / ".venv-vllm"
    events, replay, http = free_port(), free_port(), free_port()
    cmd = [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(venv / "tiny-llama"),
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--num-gpu-blocks-override", "80", "--enforce-eager", "--dtype", "bfloat16",
        "--kv-events-config", events_config(events, replay),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        for salt in SALTS:
            body = {"model": MODEL, "prompt": list(range(100, 165)), "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            req = urllib.request.Request(
                f"http://127.0.0.1:{http}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            urllib.request.urlopen(req, timeout=60).read()
        time.sleep(1)
        OUT.write_text("\n".join(replay_from_0(replay)) + "\n")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


if __name__ == "__main__":
    main()
