"""Captures what vLLM 0.32 publishes and reports with `--no-enable-prefix-caching` (run after
`make test-vllm`): one server, the same 100-token completion twice, then its replay socket from
seq 0 (printed: no batch) and /metrics as
tests/fixtures/vllm-0.32/bs32/metrics_no_prefix_caching.txt.

    .venv/bin/python -m tests.vllm.capture_no_prefix_caching
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from kvswitch.servers import free_port
from tests.vllm.capture_lora import replay
from tests.vllm.run import BLOCK, MODEL, events_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32" / "bs32"
VENV = ROOT / ".venv-vllm"


def main() -> None:
    http, events, replay_port = free_port(), free_port(), free_port()
    cmd = [
        str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", "tiny-llama",
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--num-gpu-blocks-override", "80", "--enforce-eager", "--dtype", "bfloat16",
        "--no-enable-prefix-caching", "--kv-events-config", events_config(events, replay_port),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    (VENV / "logs").mkdir(exist_ok=True)
    with (VENV / "logs" / "capture_no_prefix_caching.log").open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=VENV, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{http}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        body = json.dumps({"model": MODEL, "prompt": list(range(100, 200)), "max_tokens": 2}).encode()
        for _ in range(2):
            req = urllib.request.Request(
                base + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                print("usage:", json.loads(r.read())["usage"])
        time.sleep(1)
        print("replay from seq 0:", len(replay(replay_port)) - 2, "batches")  # less the request and end marker
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            (FIXTURES / "metrics_no_prefix_caching.txt").write_bytes(r.read())
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


if __name__ == "__main__":
    main()
