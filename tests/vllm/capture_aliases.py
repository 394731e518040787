"""Captures what vLLM 0.32 does with a model served under several names (`--served-model-name
tiny-alias tiny-llama`: the name a shim is given second), run after `make test-vllm`. One server
with LoRA on (`tiny-lora`, make_lora.py's adapter), and:

- saves GET /v1/models as v1_models_aliases.json: a card per served name, then the adapter's,
  whose `parent` is the first name;
- completes one prompt (max_tokens 1, temperature 0) naming each served name and the adapter, and
  saves the one naming `tiny-llama` as completion_alias.json: its `model` is the first name;
- saves the 404 for a model it does not serve as error_unknown_model_aliases.json;
- writes the replay socket from seq 0 as aliases_replay_from_0.jsonl: the two served names' blocks
  are one chain (no LoRA id), the adapter's its own.

All in tests/fixtures/vllm-0.32/bs32/.

    .venv/bin/python -m tests.vllm.capture_aliases
"""

from __future__ import annotations

import json
import subprocess
import time

from kvswitch.servers import free_port
from tests.vllm.capture_lora import ADAPTER, LORA, PROMPT, Server, print_stored
from tests.vllm.run import MODEL, events_config
from tests.vllm.vllm_server import FIXTURES, ROOT, VENV, replay, vllm

ALIAS = "tiny-alias"


def main() -> None:
    make_lora = [str(VENV / "bin" / "python"), str(ROOT / "tests" / "vllm" / "make_lora.py")]
    subprocess.run([*make_lora, str(ADAPTER), str(VENV / "tiny-llama")], check=True)
    events, replay_port = free_port(), free_port()
    flags = ["--kv-events-config", events_config(events, replay_port), "--served-model-name", ALIAS, MODEL,
             "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={ADAPTER.name}"]  # fmt: skip
    with vllm("capture_aliases", *flags) as url:
        server = Server(url)
        status, models = server.call("GET", "/v1/models")
        assert status == 200, models
        (FIXTURES / "v1_models_aliases.json").write_bytes(models)
        print("/v1/models:", models.decode())
        for model in (MODEL, ALIAS, LORA):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
            status, raw = server.call("POST", "/v1/completions", body)
            assert status == 200, raw
            answer = json.loads(raw)
            print(f"{model}: model {answer['model']!r}, usage {answer['usage']}")
            if model == MODEL:
                (FIXTURES / "completion_alias.json").write_bytes(raw)
        status, error = server.call("POST", "/v1/completions", {"model": "nope", "prompt": PROMPT, "max_tokens": 1})
        print(f"model nope: HTTP {status} {error.decode()}")
        (FIXTURES / "error_unknown_model_aliases.json").write_bytes(error)
        time.sleep(1)
        lines = replay(replay_port)
        (FIXTURES / "aliases_replay_from_0.jsonl").write_text("\n".join(lines) + "\n")
        print_stored(lines)


if __name__ == "__main__":
    main()
