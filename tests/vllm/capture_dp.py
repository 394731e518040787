"""Captures what vLLM 0.32 does with two data-parallel ranks behind one API server
(`--data-parallel-size 2`, run after `make test-vllm`): three completions that name their rank
with `X-data-parallel-rank` (1, 0, 1), then /metrics as
tests/fixtures/vllm-0.32/bs32/metrics_dp2.txt, GET /kv_event_sources as kv_event_sources_dp2.json,
and rank 1's replay socket from seq 0 (vLLM offsets each rank's event and replay endpoints by the
rank) as dp2_rank1_replay_from_0.jsonl.

    .venv/bin/python -m tests.vllm.capture_dp
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

from kvswitch.servers import free_port
from protocol.vllm_events import END_SEQ, decode_batch, decode_replay_reply
from tests.vllm.capture_lora import replay
from tests.vllm.run import BLOCK, MODEL, events_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32" / "bs32"
VENV = ROOT / ".venv-vllm"
RANKS = (1, 0, 1)  # the rank each completion names, with its own prompt


def main() -> None:
    http = free_port()
    events, replay_port = free_port(), free_port()  # rank r publishes on port + r: two ports each
    cmd = [
        str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", "tiny-llama",
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--num-gpu-blocks-override", "80", "--enforce-eager", "--dtype", "bfloat16",
        "--data-parallel-size", "2", "--kv-events-config", events_config(events, replay_port),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    (VENV / "logs").mkdir(exist_ok=True)
    with (VENV / "logs" / "capture_dp.log").open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=VENV, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{http}"
    try:
        for _ in range(400):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        for i, rank in enumerate(RANKS):
            body = {"model": MODEL, "prompt": list(range(1000 * (i + 1), 1000 * (i + 1) + 70)), "max_tokens": 2}
            req = urllib.request.Request(
                base + "/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
            )
            with urllib.request.urlopen(req, timeout=120) as r:
                print(f"completion {i} on rank {rank}: HTTP {r.status}")
        time.sleep(1)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            (FIXTURES / "metrics_dp2.txt").write_bytes(r.read())
        with urllib.request.urlopen(base + "/kv_event_sources", timeout=10) as r:
            (FIXTURES / "kv_event_sources_dp2.json").write_bytes(r.read())
        lines = replay(replay_port + 1)
        (FIXTURES / "dp2_rank1_replay_from_0.jsonl").write_text("\n".join(lines) + "\n")
        for line in lines[1:]:
            _, seq, payload = decode_replay_reply([bytes.fromhex(f) for f in json.loads(line)["frames_hex"]])
            if seq != END_SEQ:
                batch = decode_batch(payload)
                firsts = [getattr(e, "token_ids", [None])[0] for e in batch.events]
                print(f"rank 1 replay seq {seq}: data_parallel_rank {batch.data_parallel_rank}, first tokens {firsts}")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


if __name__ == "__main__":
    main()
