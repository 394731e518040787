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
import time
import urllib.request

from kvswitch.servers import free_ports
from protocol.vllm_events import END_SEQ, decode_batch, decode_replay_reply
from tests.vllm.run import MODEL, events_config
from tests.vllm.vllm_server import FIXTURES, replay, vllm

RANKS = (1, 0, 1)  # the rank each completion names, with its own prompt


def main() -> None:
    # Rank r binds port + r: two ports each (free_port() twice gives neighbours, overlapping ranges).
    events, replay_port = free_ports(2), free_ports(2)
    flags = ["--data-parallel-size", "2", "--kv-events-config", events_config(events, replay_port)]
    with vllm("capture_dp", *flags) as base:
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


if __name__ == "__main__":
    main()
