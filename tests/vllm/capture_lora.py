"""Captures what vLLM 0.32 does with LoRA adapters, in its /v1/models cards and its KV events (run
after `make test-vllm`, which builds the venv and the tiny Llama). It builds the adapter
make_lora.py writes into .venv-vllm/tiny-lora (with the vLLM venv's python), then starts one server
with `--enable-lora --max-lora-rank 8 --lora-modules tiny-lora=<dir>` and runtime adapter loading
allowed, and:

- saves GET /v1/models as v1_models_lora.json;
- sends completions of one 65-token prompt (max_tokens 1, temperature 0) as `tiny-lora`,
  `tiny-llama`, `tiny-lora` again and `tiny-lora` with `cache_salt` `tenant-1`;
- compares greedy 8-token completions of the base model and the adapter (printed);
- saves the 404 for an adapter that is not loaded (`nope`) as error_unknown_model.json (with runtime
  loading allowed, vLLM first asks its LoRA resolvers for `nope`, which takes a LoRA id: the adapter
  loaded next gets id 3, not 2);
- loads the same adapter as `tiny-lora-2` through /v1/load_lora_adapter, saves /v1/models then as
  v1_models_lora_loaded.json, completes the prompt with it, unloads it and prints /v1/models;
- writes the replay socket from seq 0 as lora_replay_from_0.jsonl and prints each BlockStored.

All in tests/fixtures/vllm-0.32/bs32/.

    .venv/bin/python -m tests.vllm.capture_lora
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import zmq

from kvswitch.servers import free_port
from protocol.vllm_events import END_SEQ, BlockStored, decode_batch, decode_replay_reply, replay_request
from tests.vllm.run import BLOCK, MODEL, events_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-0.32" / "bs32"
VENV = ROOT / ".venv-vllm"
ADAPTER = VENV / "tiny-lora"
LORA = "tiny-lora"
PROMPT = list(range(100, 165))
# (model, cache_salt) of the max_tokens 1 completions whose KV events the replay holds.
REQUESTS: list[tuple[str, str | None]] = [(LORA, None), (MODEL, None), (LORA, None), (LORA, "tenant-1")]


class Server:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def complete(self, model: str, max_tokens: int = 1, salt: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        status, raw = self.call("POST", "/v1/completions", body)
        if status != 200:
            raise SystemExit(f"{model} (salt {salt}): {status} {raw.decode()}")
        answer: dict[str, Any] = json.loads(raw)
        return answer


def greedy_ids(server: Server, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    status, raw = server.call("POST", "/v1/completions", body)
    if status != 200:
        raise SystemExit(f"greedy {model}: {status} {raw.decode()}")
    choice = json.loads(raw)["choices"][0]
    return list(choice.get("token_ids") or []) or [choice["text"]]


def replay(port: int) -> list[str]:
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


def print_stored(lines: list[str]) -> None:
    for line in lines[1:]:
        _, seq, payload = decode_replay_reply([bytes.fromhex(f) for f in json.loads(line)["frames_hex"]])
        if seq == END_SEQ:
            continue
        for ev in decode_batch(payload).events:
            if isinstance(ev, BlockStored):
                print(
                    f"seq {seq} BlockStored hashes={ev.block_hashes} parent={ev.parent_block_hash} "
                    f"lora_id={ev.lora_id} lora_name={ev.lora_name!r} extra_keys={ev.extra_keys} "
                    f"n_tokens={len(ev.token_ids)}"
                )
            else:
                print(f"seq {seq} {type(ev).__name__} {ev}")


def main() -> None:
    make_lora = [str(VENV / "bin" / "python"), str(ROOT / "tests" / "vllm" / "make_lora.py")]
    subprocess.run([*make_lora, str(ADAPTER), str(VENV / "tiny-llama")], check=True)
    events, replay_port, http = free_port(), free_port(), free_port()
    cmd = [
        str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", "tiny-llama",
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(http), "--block-size", str(BLOCK),
        "--max-model-len", "2048", "--num-gpu-blocks-override", "80", "--enforce-eager", "--dtype", "bfloat16",
        "--kv-events-config", events_config(events, replay_port),
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={ADAPTER.name}",
    ]  # fmt: skip
    # Paths relative to .venv-vllm, where the server runs: the cards' `root` is the path as given.
    env = {
        **os.environ,
        "PYTHONHASHSEED": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
    }
    (VENV / "logs").mkdir(exist_ok=True)
    log = VENV / "logs" / "capture_lora.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=VENV, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(http)
    try:
        for _ in range(300):
            if proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {proc.returncode}:\n" + log.read_text()[-4000:])
            try:
                urllib.request.urlopen(f"{server.url}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        status, models = server.call("GET", "/v1/models")
        assert status == 200, models
        (FIXTURES / "v1_models_lora.json").write_bytes(models)
        print("/v1/models:", models.decode())

        for model, salt in REQUESTS:
            server.complete(model, salt=salt)
        base, adapted = greedy_ids(server, MODEL), greedy_ids(server, LORA)
        print(f"greedy 8 tokens: base {base}, {LORA} {adapted}, differ: {base != adapted}")

        status, error = server.call("POST", "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 1})
        print(f"model nope: HTTP {status} {error.decode()}")
        (FIXTURES / "error_unknown_model.json").write_bytes(error)

        load = {"lora_name": "tiny-lora-2", "lora_path": ADAPTER.name}
        status, loaded = server.call("POST", "/v1/load_lora_adapter", load)
        print(f"load_lora_adapter: HTTP {status} {loaded.decode()}")
        if status == 200:
            _, models = server.call("GET", "/v1/models")
            (FIXTURES / "v1_models_lora_loaded.json").write_bytes(models)
            print("/v1/models after loading:", models.decode())
            server.complete("tiny-lora-2")
            status, unloaded = server.call("POST", "/v1/unload_lora_adapter", {"lora_name": "tiny-lora-2"})
            print(f"unload_lora_adapter: HTTP {status} {unloaded.decode()}")
            _, models = server.call("GET", "/v1/models")
            print("/v1/models after unloading:", models.decode())
        time.sleep(1)
        lines = replay(replay_port)
        (FIXTURES / "lora_replay_from_0.jsonl").write_text("\n".join(lines) + "\n")
        print_stored(lines)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


if __name__ == "__main__":
    main()
