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
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

from kvswitch.servers import free_port
from protocol.vllm_events import END_SEQ, BlockStored, decode_batch, decode_replay_reply
from tests.vllm.run import MODEL, events_config
from tests.vllm.vllm_server import FIXTURES, ROOT, VENV, replay, vllm

ADAPTER = VENV / "tiny-lora"
LORA = "tiny-lora"
PROMPT = list(range(100, 165))
# (model, cache_salt) of the max_tokens 1 completions whose KV events the replay holds.
REQUESTS: list[tuple[str, str | None]] = [(LORA, None), (MODEL, None), (LORA, None), (LORA, "tenant-1")]


class Server:
    def __init__(self, url: str) -> None:
        self.url = url

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
    events, replay_port = free_port(), free_port()
    # The adapter's path relative to .venv-vllm, where the server runs: the cards' `root` is the
    # path as given.
    flags = ["--kv-events-config", events_config(events, replay_port),
             "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={ADAPTER.name}"]  # fmt: skip
    with vllm("capture_lora", *flags, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        server = Server(url)
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


if __name__ == "__main__":
    main()
