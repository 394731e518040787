"""aiperf 0.13 (NVIDIA's benchmark client) as a subprocess: one closed-loop run and its figures.

aiperf cannot be an extra of this package: it pins prometheus-client~=0.23 and pyzmq~=26.4, which
conflict with ours. `make bench-deps` installs it in its own venv (`.venv-bench`); `find_aiperf()`
looks there, then on PATH.

Each run: streaming `/v1/completions` at a fixed concurrency, synthetic prompts of exactly `isl`
tokens and `osl` output tokens (`ignore_eos`), a fixed `--random-seed` (so two runs send the same
prompts), warm-up requests first (they open the connections), server-reported token counts, and
the built-in tokenizer exported as a hub cache entry (bench.hf_tokenizer: offline, aiperf loads a
hub name from the cache but refuses a local path).

Figures come from aiperf's own export (`profile_export_aiperf.json`), in its definitions:
TTFT; time to second token (first to second chunk); inter-token latency per request
((latency - TTFT) / (output tokens - 1)), whose p50/p99 are over requests; output token
throughput over the profiling phase. The window the requests ran in (first start to last end, wall
clock) comes from the per-request export (`profile_export.jsonl`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.hf_tokenizer import HUB_NAME, write_hub_cache

__all__ = ["BENCH_VENV", "AiperfError", "AiperfResult", "AiperfRun", "find_aiperf", "parse_export"]

BENCH_VENV = Path(".venv-bench")


class AiperfError(RuntimeError):
    pass


def find_aiperf(explicit: str | None = None) -> str | None:
    """The aiperf executable: `explicit`, else `.venv-bench/bin/aiperf`, else `aiperf` on PATH."""
    if explicit:
        return explicit
    local = BENCH_VENV / "bin" / "aiperf"
    if local.exists():
        return str(local)
    return shutil.which("aiperf")


@dataclass(frozen=True)
class AiperfResult:
    """Latencies in seconds; `window` in Unix seconds."""

    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    ttst_p50: float
    ttst_p99: float
    output_tokens_per_s: float
    requests: int
    output_tokens: int
    errors: int
    window: tuple[float, float]


def _stat(export: dict[str, Any], metric: str, key: str) -> float:
    try:
        return float(export[metric][key])
    except (KeyError, TypeError, ValueError) as exc:
        raise AiperfError(f"aiperf's export has no {metric}.{key}") from exc


def parse_export(summary: dict[str, Any], records: Sequence[dict[str, Any]]) -> AiperfResult:
    """The figures of one run from aiperf's summary JSON and its per-request records."""
    spans = [
        (r["metadata"]["request_start_ns"], r["metadata"]["request_end_ns"])
        for r in records
        if r.get("metadata", {}).get("benchmark_phase") == "profiling"
    ]
    if not spans:
        raise AiperfError("aiperf's export holds no profiling-phase request")
    errors = sum(int(e.get("count", 0)) for e in summary.get("error_summary") or [])
    ms = 1e-3
    return AiperfResult(
        ttft_p50=_stat(summary, "time_to_first_token", "p50") * ms,
        ttft_p99=_stat(summary, "time_to_first_token", "p99") * ms,
        itl_p50=_stat(summary, "inter_token_latency", "p50") * ms,
        itl_p99=_stat(summary, "inter_token_latency", "p99") * ms,
        ttst_p50=_stat(summary, "time_to_second_token", "p50") * ms,
        ttst_p99=_stat(summary, "time_to_second_token", "p99") * ms,
        output_tokens_per_s=_stat(summary, "output_token_throughput", "avg"),
        requests=int(_stat(summary, "request_count", "avg")),
        output_tokens=int(_stat(summary, "total_output_tokens", "avg")),
        errors=errors,
        window=(min(s for s, _ in spans) / 1e9, max(e for _, e in spans) / 1e9),
    )


@dataclass(frozen=True)
class AiperfRun:
    """One aiperf invocation's settings; `run(urls, concurrency, out)` runs it."""

    binary: str
    model: str
    isl: int
    osl: int
    requests: int
    seed: int
    hf_home: Path
    timeout_s: float = 600.0

    def argv(self, urls: Sequence[str], concurrency: int, out: Path) -> list[str]:
        count = max(self.requests, 4 * concurrency)
        return [
            self.binary, "profile", "--model", self.model, *(a for u in urls for a in ("--url", u)),
            "--endpoint-type", "completions", "--streaming", "--tokenizer", HUB_NAME,
            "--concurrency", str(concurrency), "--request-count", str(count),
            "--warmup-request-count", str(max(concurrency, 4)),
            "--isl", str(self.isl), "--isl-stddev", "0", "--osl", str(self.osl), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--random-seed", str(self.seed), "--use-server-token-count",
            "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
        ]  # fmt: skip

    def run(self, urls: Sequence[str], concurrency: int, out: Path) -> AiperfResult:
        write_hub_cache(self.hf_home)
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HOME": str(self.hf_home), "HF_HUB_OFFLINE": "1"}
        with (out / "aiperf.log").open("wb") as log:
            try:
                proc = subprocess.run(
                    self.argv(urls, concurrency, out),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=self.timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise AiperfError(f"aiperf ran past {self.timeout_s:.0f} s; see {out / 'aiperf.log'}") from exc
        summary_path, records_path = out / "profile_export_aiperf.json", out / "profile_export.jsonl"
        if proc.returncode != 0 or not summary_path.exists() or not records_path.exists():
            raise AiperfError(f"aiperf exited with {proc.returncode}; see {out / 'aiperf.log'}")
        summary = json.loads(summary_path.read_text())
        records = [json.loads(line) for line in records_path.read_text().splitlines() if line.strip()]
        return parse_export(summary, records)
