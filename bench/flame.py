"""Profiles of live processes with py-spy, and where their time goes.

`Recording(py_spy, pid, out_stem)` samples a process for as long as the `with` block lasts, into
`<out_stem>.svg` (a flame graph) and `<out_stem>.txt` (the same kind of samples as collapsed
stacks: `frame;frame;... count`, root first). Two py-spy processes sample side by side, one per
format, at `rate` Hz, with `--native` (C frames too: uvloop, msgspec, the libc call a process is
in), which pauses the target for each sample; py-spy leaves idle threads out. A thread that is
runnable but waiting for a CPU is not idle to py-spy: on a machine with more runnable threads than
cores, samples over-count the code where a process gets preempted
(typically a socket write that wakes the reader). Compare the share of samples that found the
process active with its CPU use from /proc (bench.overhead prints both) before reading shares.

`breakdown(stacks, rules)` attributes every sample to one category (`Rules` says how: a named
piece of work such as tokenization wins over the package it runs in). A frame is matched by
substring on py-spy's `function (file:line)`. Unmatched samples are `other`.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.stop_signals import held

__all__ = [
    "IDLE",
    "ROUTER_RULES",
    "SAMPLE_HZ",
    "SHIM_RULES",
    "Recording",
    "Rules",
    "breakdown",
    "find_py_spy",
    "format_breakdown",
    "read_stacks",
]

SAMPLE_HZ = 100
Rule = tuple[str, tuple[str, ...]]  # (category, substrings of a frame)


@dataclass(frozen=True)
class Rules:
    """`specific` rules match any frame of a stack, first rule first; a stack none of them matches
    goes to the `generic` rule of its innermost frame that one matches (so a stack under a
    package's entry point is charged to the deepest package it reached, not to the root)."""

    specific: Sequence[Rule]
    generic: Sequence[Rule]


# asyncio/streams.py is left out: its writes are charged to the package that writes (nats-py's flush).


IDLE = "epoll wait (idle, caught waking)"


def _libc(*calls: str) -> tuple[str, ...]:
    return tuple(f"{call} (libc" for call in calls)


# With --native a sample in a system call ends in libc's wrapper; under CPU contention these also
# hold the time a process spent preempted there (a write wakes its reader, which may take the core).
_SYSCALLS: list[Rule] = [
    ("socket writes (write, writev, send; with time preempted in them)", _libc("write", "writev", "send", "sendmsg")),
    ("socket reads (read, recv)", _libc("read", "recv", "recvmsg")),
    (IDLE, _libc("epoll_wait", "epoll_pwait")),
]
_LOOP: Rule = (
    "event loop (asyncio/uvloop: I/O, callbacks, task switches)",
    ("asyncio/runners.py", "asyncio/base_events.py", "asyncio/events.py", "asyncio/tasks.py", "uvloop"),
)

ROUTER_RULES = Rules(
    specific=[
        *_SYSCALLS,
        ("KV digest check (index scan per load report)", ("check_digest", "BlockIndex.digest", "worker_hashes")),
        ("detokenization (ids -> text)", ("push (router/tokenization.py", "decode (protocol/tokenizer.py")),
        ("tokenization (prompt text -> ids)", ("router/tokenization.py:", "protocol/tokenizer.py:")),
        ("block hashing", ("block_hashes", "_fasthash", "protocol/hashing.py")),
        ("SSE / OpenAI chunk formatting", ("_sse (router/http_api.py", "delta (router/http_api.py", "usage_chunk")),
        ("chunk decode (msgpack ResponseChunk)", ("_on_reply (router/dispatch.py",)),
        ("GenerateRequest encode + NATS publish", ("_open (router/dispatch.py", "_cancel (router/dispatch.py")),
        (
            "planning (index match, load view, selection, policy, booking)",
            (
                "router/planner.py",
                "router/selection.py",
                "router/disagg.py",
                "router/admission.py",
                "router/load_view.py",
                "router/ledger.py",
                "router/block_index.py",
                "router/policies/",
                "router/eligibility.py",
                "router/request_context.py",
                "router/pending_prefixes.py",
            ),
        ),
        ("replica sync", ("router/replica_sync.py",)),
        ("KV events and load reports in", ("router/kv_ingest.py", "router/gap_repair.py", "router/service.py")),
        ("tracing (OpenTelemetry)", ("opentelemetry", "router/tracing.py")),
        ("metrics (prometheus_client)", ("prometheus_client", "router/metrics.py")),
        ("logging", ("logging/__init__.py",)),
        ("request JSON parse + validation", ("parse_request", "_json_body")),
        ("HTTP response write (aiohttp, send)", ("web_response.py", "http_writer.py")),
    ],
    generic=[
        ("HTTP server (aiohttp: parse, dispatch)", ("aiohttp/",)),
        ("NATS client (nats-py: parse, flush, send)", ("nats/",)),
        ("kvswitch request path (handler, dispatch, stream glue)", ("router/",)),
        _LOOP,
    ],
)

SHIM_RULES = Rules(
    specific=[
        *_SYSCALLS,
        ("engine SSE line parse + JSON decode", ("_take_choice", "_json.decode", "openai_http.py:11")),
        ("ResponseChunk encode + NATS publish", ("_send (worker_shim/request_service.py",)),
        ("GenerateRequest decode + leg setup", ("on_generate (worker_shim",)),
        (
            "KV events (ZMQ, normalise, publish)",
            (
                "worker_shim/adapters/zmq_events.py",
                "worker_shim/adapters/vllm_events.py",
                "worker_shim/normaliser.py",
                "worker_shim/kv_publisher.py",
                "worker_shim/engine_events.py",
                "worker_shim/event_log.py",
                "zmq/",
                "protocol/vllm_events.py",
            ),
        ),
        ("load reports, heartbeats, digest", ("worker_shim/load_reporter.py", "worker_shim/kv_digest.py")),
        ("tracing (OpenTelemetry)", ("opentelemetry",)),
        ("metrics (prometheus_client)", ("prometheus_client", "worker_shim/metrics.py")),
        ("logging", ("logging/__init__.py",)),
    ],
    generic=[
        ("engine HTTP client (aiohttp: request, stream read)", ("aiohttp/",)),
        ("NATS client (nats-py: parse, flush, send)", ("nats/",)),
        ("chunk writer, coalescing, leg glue", ("worker_shim/",)),
        _LOOP,
    ],
)


def find_py_spy(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit
    local = Path(".venv-bench/bin/py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


# py-spy writes its output on SIGINT, which a child inherits ignored from a background job (`cmd &`
# in a script): then a sampler never stops. Each sampler starts through this, which restores it.
_SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); os.execvp(sys.argv[1], sys.argv[1:])"
)


class Recording:
    """py-spy on `pid` for the duration of the `with` block (see the module docstring)."""

    def __init__(self, py_spy: str, pid: int, out_stem: Path, *, rate: int = SAMPLE_HZ) -> None:
        self.svg = out_stem.with_suffix(".svg")
        self.stacks = out_stem.with_suffix(".txt")
        common = [py_spy, "record", "--pid", str(pid), "--rate", str(rate), "--native"]
        outputs = (("flamegraph", self.svg), ("raw", self.stacks))
        self._argv = [[*common, "--format", fmt, "--output", str(out)] for fmt, out in outputs]
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Recording:
        self.svg.parent.mkdir(parents=True, exist_ok=True)
        for argv in self._argv:
            self._procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _SIGINT_DEFAULT, *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        return self

    def __exit__(self, *exc: object) -> None:
        with held():  # a signal raised in it left py-spy running, its output unwritten
            self._stop()

    def _stop(self) -> None:
        for proc in self._procs:  # py-spy writes its output on SIGINT
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        failures = []
        for proc, argv in zip(self._procs, self._argv, strict=True):
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            out = Path(argv[-1])
            if proc.returncode not in (0, -signal.SIGINT) or not out.exists():
                why = f"exit {proc.returncode}" if out.exists() else f"exit {proc.returncode}, wrote no {out.name}"
                failures.append(f"{' '.join(argv)}: {why}: {err.decode(errors='replace')[-300:]}")
        if failures:
            raise RuntimeError("py-spy failed: " + "; ".join(failures))


def read_stacks(lines: Iterable[str]) -> Iterator[tuple[list[str], int]]:
    """Collapsed stacks (`a;b;c 12`, root first) as (frames, count); blank lines skipped; a sample
    with no Python frame (` 12`) has no frames."""
    for raw in lines:
        line = raw.rstrip("\n")
        if not line.strip():
            continue
        stack, sep, count = line.rpartition(" ")
        if not sep or not count.isdigit():
            raise ValueError(f"not a collapsed stack line: {line[:120]!r}")
        yield (stack.split(";") if stack else []), int(count)  # no Python frame: native code only


def _category(frames: Sequence[str], rules: Rules) -> str:
    for name, needles in rules.specific:
        if any(n in frame for frame in frames for n in needles):
            return name
    for frame in reversed(frames):
        for name, needles in rules.generic:
            if any(n in frame for n in needles):
                return name
    return "other"


def breakdown(stacks: Iterable[tuple[list[str], int]], rules: Rules) -> Counter[str]:
    """Samples per category (see `Rules`); `other` for the unmatched."""
    out: Counter[str] = Counter()
    for frames, count in stacks:
        out[_category(frames, rules)] += count
    return out


def format_breakdown(counts: Counter[str], *, cpu_us_per_request: float | None = None) -> str:
    """One line per category, largest first: its share of the busy samples (all but `IDLE`), and
    that share of the measured CPU per request when given. Idle samples are listed, unshared."""
    busy = sum(n for name, n in counts.items() if name != IDLE)
    lines = []
    for name, n in counts.most_common():
        if name == IDLE:
            lines.append(f"{'idle':>6}  {n} samples  {name}")
            continue
        share = n / busy if busy else 0.0
        us = f"  {share * cpu_us_per_request:7.0f} us/req" if cpu_us_per_request is not None else ""
        lines.append(f"{share:6.1%}{us}  {name}")
    return "\n".join(lines)
