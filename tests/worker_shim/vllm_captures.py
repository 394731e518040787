"""Loading the real vLLM 0.32 captures in tests/fixtures/vllm-0.32 (see its README)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"
CAPTURES = {"bs32": 32, "bs16_patched": 16}


def _frames(record: dict[str, list[str]]) -> list[bytes]:
    if "frames_b64" in record:
        return [base64.b64decode(f) for f in record["frames_b64"]]
    return [bytes.fromhex(f) for f in record["frames_hex"]]


def frames(path: Path) -> list[list[bytes]]:
    return [_frames(json.loads(line)) for line in path.read_text().splitlines()]


def pub_frames(capture: str, extra: bool = False) -> list[list[bytes]]:
    out = frames(FIXTURES / capture / "zmq_events_raw.jsonl")
    if extra:
        out += frames(FIXTURES / capture / "extra_probe_events_raw.jsonl")
    return out


def replay_frames(capture: str, start: str) -> list[list[bytes]]:
    lines = (FIXTURES / capture / f"replay_from_{start}.jsonl").read_text().splitlines()[1:]
    return [_frames(json.loads(line)) for line in lines]
