"""Peer routers in front of the same engine_sim fleet, when installed (`pip install kvswitch[peers]`
or any `sglang-router` / `vllm-router` executable on PATH). Never required: a peer that is not
installed is reported and skipped.

Peers speak to the sims as they would to vLLM; they bind 127.0.0.1 and each gets its own
`--prometheus-port`. sglang-router's `/v1/completions` takes text prompts only, so replays to peers
send the built-in tokenizer's text for the same token ids (it encodes back to the same ids).

Not covered: sglang-router's PD mode, which drives SGLang's own bootstrap-room transfer protocol;
the sims speak vLLM's (NixlConnector `kv_transfer_params`), which vllm-router's PD mode uses.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from kvswitch.servers import free_port

__all__ = ["PEERS", "Engine", "Peer", "PeerProcess", "connect_endpoint", "missing_binaries"]

Fleet = Literal["agg", "pd"]


class Engine(Protocol):
    """What a peer needs to know of an engine (LocalCluster's engines have these)."""

    role: str
    url: str
    events: str


def _sglang_cache_aware(engines: Sequence[Engine], block_size: int, model: str) -> list[str]:
    return ["--worker-urls", *(e.url for e in engines), "--policy", "cache_aware"]


def connect_endpoint(bind: str) -> str:
    """The address a subscriber connects to for an engine's ZMQ bind endpoint: engines bind
    `tcp://*:PORT`, and vllm-router refuses a wildcard host to connect to."""
    scheme, sep, rest = bind.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and colon and host in ("*", "0.0.0.0"):
        return f"{scheme}://127.0.0.1:{port}"
    return bind


def _vllm_kv_aware(engines: Sequence[Engine], block_size: int, model: str) -> list[str]:
    sources = [arg for e in engines for arg in ("--kv-event-source", f"{e.url}={connect_endpoint(e.events)}")]
    return [
        "--worker-urls", *(e.url for e in engines), "--policy", "kv_aware", *sources,
        "--kv-event-block-size", str(block_size), "--kv-event-model", model,
    ]  # fmt: skip


def _vllm_pd(engines: Sequence[Engine], block_size: int, model: str) -> list[str]:
    prefill = [arg for e in engines if e.role == "prefill" for arg in ("--prefill", e.url)]
    decode = [arg for e in engines if e.role == "decode" for arg in ("--decode", e.url)]
    return ["--vllm-pd-disaggregation", *prefill, *decode, "--policy", "cache_aware"]


@dataclass(frozen=True)
class Peer:
    """A peer configuration: `binary` started with `launch_args` (sglang-router has a `launch`
    subcommand) plus the host/port flags plus what `engine_args` builds from the fleet."""

    name: str
    binary: str
    launch_args: tuple[str, ...]
    fleet: Fleet
    engine_args: Callable[[Sequence[Engine], int, str], list[str]]
    same_mode_as: str  # the kvswitch configuration it is compared with


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("sglang_cache_aware", "sglang-router", ("launch",), "agg", _sglang_cache_aware, "kv"),
        Peer("vllm_kv_aware", "vllm-router", (), "agg", _vllm_kv_aware, "kv"),
        Peer("vllm_pd", "vllm-router", (), "pd", _vllm_pd, "kv_disagg"),
    )
}


def missing_binaries(peers: Sequence[Peer]) -> list[str]:
    return sorted({p.binary for p in peers if shutil.which(p.binary) is None})


class PeerProcess:
    """One peer router process on free loopback ports; `stop()` is idempotent."""

    def __init__(self, peer: Peer, engines: Sequence[Engine], *, block_size: int, model: str, log: Path | None) -> None:
        binary = shutil.which(peer.binary)
        if binary is None:
            raise FileNotFoundError(f"{peer.binary} is not installed (pip install kvswitch[peers])")
        self.peer = peer
        self.port, self.prometheus_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            binary, *peer.launch_args, "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            *peer.engine_args(engines, block_size, model),
        ]  # fmt: skip
        self._log = log
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.peer.name} is not running")
        return self._proc.pid

    def start(self, timeout: float = 30.0) -> None:
        out: int | object = subprocess.DEVNULL
        if self._log is not None:
            self._log.parent.mkdir(parents=True, exist_ok=True)
            out = self._log.open("ab")
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.peer.name} exited with {self._proc.returncode}: {' '.join(self.argv)}")
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.peer.name} not healthy after {timeout:.0f} s at {self.url}")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
