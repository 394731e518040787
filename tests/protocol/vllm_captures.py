"""The real vLLM 0.32 captures in tests/fixtures/vllm-0.32 (see its README), for every package's tests.

`expected_set` is an oracle independent of the shim's normaliser: it replays the raw msgpack with no
schema and hashes each held block's whole token prefix.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec

from protocol import block_hashes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"
CAPTURES = {"bs32": 32, "bs16_patched": 16}


def fixture_path(name: str, variant: str = "bs16_patched") -> Path:
    return FIXTURES / variant / name


def fixture_json(name: str, variant: str = "bs16_patched") -> Any:
    return json.loads(fixture_path(name, variant).read_text())


def fixture_lines(name: str, variant: str = "bs16_patched") -> list[dict[str, Any]]:
    return [json.loads(line) for line in fixture_path(name, variant).read_text().splitlines() if line.strip()]


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


def expected_set(messages: list[list[bytes]], bs: int) -> set[int]:
    """Canonical hashes of the blocks the engine holds after `messages`, references counted."""
    prefix: dict[int, list[int]] = {}
    refs: dict[int, int] = {}
    dec = msgspec.msgpack.Decoder()
    for f in messages:
        for ev in dec.decode(f[2])[1]:
            if ev["type"] == "BlockStored":
                base = prefix[ev["parent_block_hash"]] if ev["parent_block_hash"] is not None else []
                for i, h in enumerate(ev["block_hashes"]):
                    prefix[h] = base + ev["token_ids"][: (i + 1) * bs]
                    refs[h] = refs.get(h, 0) + 1
            elif ev["type"] == "BlockRemoved":
                for h in ev["block_hashes"]:
                    refs[h] -= 1
            else:
                refs.clear()
    return {block_hashes(prefix[h], bs)[-1] for h, r in refs.items() if r > 0}
