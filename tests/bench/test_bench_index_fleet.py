"""bench_index_fleet's reading of nats-server's log."""

from __future__ import annotations

from pathlib import Path

from bench.bench_index_fleet import count_slow_consumers
from kvswitch.servers import NatsServer


def test_the_slow_consumers_are_counted_in_the_whole_log(tmp_path: Path) -> None:
    # They were counted in log_tail's lines, which since 6b061dd come from the log's last 16 KB
    # only: a run's 500 (about 55 KB of log) were counted as about 100.
    log = tmp_path / "nats.log"
    said = b"[1] 2026/12/08 01:00:00.000000 [INF] 127.0.0.1:%d - cid:%d - Slow Consumer Detected\n"
    with log.open("wb") as out:
        out.write(b"[1] [INF] Server is ready\n")
        for n in range(500):
            out.write(said % (40000 + n, n) + b"[1] [INF] a line between\n")
    assert log.stat().st_size > 3 * 16384
    assert count_slow_consumers(NatsServer(workdir=tmp_path, log=log).log_path) == 500
