"""One `vllm serve` of the tiny Llama for the capture scripts (after `make test-vllm`, which builds
.venv-vllm and the model): started from .venv-vllm (paths relative to it, so what the server
echoes holds no checkout path), block size 32 and 80 KV blocks, waited for, and stopped with its
process group; and reading its replay socket the way the fixtures record it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import zmq

from kvswitch.servers import free_port
from protocol.vllm_events import END_SEQ, decode_replay_reply, replay_request
from tests.vllm.run import BLOCK, MODEL

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vllm"
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32" / "bs32"


@contextlib.contextmanager
def vllm(
    name: str, *flags: str, env: dict[str, str] | None = None, model: str = "tiny-llama", blocks: int = 80
) -> Iterator[str]:
    """The base URL of a running server of `model` (a directory in .venv-vllm) with `blocks` KV
    blocks and `flags` added; its output in .venv-vllm/logs/NAME.log."""
    http = free_port()
    cmd = [
        str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--num-gpu-blocks-override", str(blocks), "--enforce-eager", "--dtype", "bfloat16",
        *flags,
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    (VENV / "logs").mkdir(exist_ok=True)
    log = VENV / "logs" / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=VENV, stdout=out, stderr=subprocess.STDOUT, env={**full_env, **(env or {})}, start_new_session=True
        )
    base = f"http://127.0.0.1:{http}"
    try:
        for _ in range(400):
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode}:\n" + log.read_text()[-4000:])
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(60)


def replay(port: int) -> list[str]:
    """The replay socket's answer from seq 0 as fixture lines: the request, then each reply's frames."""
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart(replay_request(0))
    lines = [json.dumps({"request_frames_hex": [f.hex() for f in replay_request(0)], "start_seq": 0})]
    while dealer.poll(5000):
        frames = dealer.recv_multipart()
        lines.append(
            json.dumps({"t_recv": time.time(), "n_frames": len(frames), "frames_hex": [f.hex() for f in frames]})
        )
        if decode_replay_reply(frames)[1] == END_SEQ:
            dealer.close(0)
            return lines
    raise SystemExit("the replay socket sent no end marker")
