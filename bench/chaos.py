"""`kvswitch bench chaos`: break a local cluster on purpose, under steady load, and measure.

Each scenario gets a fresh `LocalCluster` (1 prefill + 3 decode simulated engines at 5x, a shim per
engine, 2 router replicas with conditional disaggregation), a steady open-loop load of token-id
requests over both routers (a few shared system prompts, so the index matters), `warmup_s` of
calm, then one fault, `window_s` of load with it, the fault healed where that makes sense, and
`settle_s` of calm load. Then the load stops and, once events settle and every worker whose shim
was killed has left the routers (its lease expired), every router's index is compared with what
each engine really caches.

The table, one row per scenario:
- requests / failed / refused: sent, failed (any error but 429), answered 429 (overload only);
- max added: the worst TTFT of a request sent after the fault, minus the calm p50 before it;
- recovery: from the fault to the end of the last request sent after it that failed or took more
  than twice the calm p90 TTFT (and 0.25 s more than it: this machine's noise) (0: nothing noticed);
- index ok: every router's index of every live worker equals the canonical hashes of the engine's
  own cached blocks (`/sim/state?canonical=1`), compared by digest (count and XOR), and no router
  still lists a worker whose shim was killed `LEASE_TTL_S` (and a margin) after the kill.

Latencies are wall seconds of this machine (the engines run 5x faster than an H200: multiply by 5
for modelled time); the fault times are wall seconds too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.flag_numbers import check_non_negative, check_positive
from bench.results_file import ResultsFile, fresh_path
from bench.stop_signals import held
from discovery import Discovery, put_config
from kvswitch.client import Completion, CompletionClient
from kvswitch.cluster import ClusterSpec, LocalCluster
from kvswitch.up import check_log_dir
from protocol import KvEventBatch, Stored, WorkerInfo, encode_msg, subjects
from protocol.config import EtcdSettings
from protocol.timing import TimingModel
from runtime.nats_flush import flush

__all__ = ["SCENARIOS", "ChaosResult", "add_arguments", "error_kind", "format_table", "run", "run_scenario"]

MODEL = "sim-llama"
BLOCK = 16
LEASE_TTL_S = 10  # the shims' --lease-ttl
# After a worker's lease runs out (within LEASE_TTL_S of its last renewal): etcd's expiry sweep and
# the routers' watch, on a loaded 2-core box.
_DEPART_MARGIN_S = 5.0


@dataclass
class Chaos:
    """What a scenario's fault can reach: the cluster, an HTTP session, the routers' views."""

    cluster: LocalCluster
    http: aiohttp.ClientSession
    notes: list[str] = field(default_factory=list)
    heal: Callable[[], Awaitable[None]] | None = None
    killed: dict[str, float] = field(default_factory=dict)  # worker -> when its shim was killed (monotonic)

    async def index_state(self, router: str) -> dict[str, Any]:
        async with self.http.get(router + "/debug/index") as r:
            return dict(await r.json())

    async def decode_worker(self) -> tuple[str, dict[str, Any]]:
        state = await self.index_state(self.cluster.router_urls[0])
        worker = sorted(w for w, s in state.items() if s["role"] == "decode")[0]
        return worker, state[worker]

    def child(self, role: str, engine_url: str) -> Any:
        port = engine_url.rsplit(":", 1)[-1]
        return next(c for c in self.cluster.children if c.name == f"shim-{role}-{port}")

    async def etcd(self) -> Discovery:
        assert self.cluster.etcd is not None
        return await Discovery(EtcdSettings(endpoints=self.cluster.etcd.urls), self.cluster.spec.namespace).connect()

    async def publish(self, subject: str, payload: bytes) -> None:
        import nats

        assert self.cluster.nats is not None
        nc = await nats.connect(servers=self.cluster.nats.urls)
        try:
            await nc.publish(subject, payload)
            await flush(nc)
        finally:
            await nc.close()


Fault = Callable[[Chaos], Awaitable[None]]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    fault: Fault | None
    sim_args: tuple[str, ...] = ()
    capacity_factor: float | None = None  # instead of the steady rate: this many times the fleet's capacity
    prompt_tokens: int | None = None  # instead of the steady mix: prompts this long (a shared 512 first)
    speedup: float | None = None  # instead of the cluster's
    heal_after_s: float | None = None  # the fault is healed this long after it starts (None: at the window's end)


async def _hanging_worker(c: Chaos) -> None:
    d = await c.etcd()
    lease = await d.register_worker(
        lambda wid: WorkerInfo(
            worker=wid, model=MODEL, role="decode", engine="vllm", block_size=BLOCK, tokenizer="builtin"
        )
    )
    c.notes.append(f"registered {lease.hex_id}, which answers nothing")

    async def heal() -> None:
        await d.close()  # revokes the lease

    c.heal = heal


async def _forged(c: Chaos, *, epoch_change: bool) -> None:
    worker, state = await c.decode_worker()
    epoch = int(state["epoch"] or 0)
    batch = KvEventBatch(
        worker=worker,
        epoch=epoch ^ 1 if epoch_change else epoch,
        seq=1 if epoch_change else int(state["seq"]) + 1000,
        ts=time.time(),
        events=[Stored(hashes=[0xF0F0])],
    )
    await c.publish(subjects.kv(c.cluster.spec.namespace, worker), encode_msg(batch))
    c.notes.append(f"forged a batch for {worker}")


async def _kill_shim(c: Chaos, role: str) -> None:
    state = await c.index_state(c.cluster.router_urls[0])
    worker, info = sorted((w, s) for w, s in state.items() if s["role"] == role)[0]
    child = c.child(role, info["engine_url"])
    os.kill(child.proc.pid, signal.SIGKILL)
    c.killed[worker] = time.monotonic()
    c.notes.append(f"kill -9 of {child.name} (worker {worker})")


async def _etcd_outage(c: Chaos) -> None:
    assert c.cluster.etcd is not None
    (etcd,) = c.cluster.etcd.members  # the local cluster's single member
    etcd.stop()
    c.notes.append("etcd stopped")

    async def heal() -> None:
        await asyncio.get_running_loop().run_in_executor(None, etcd.restart)

    c.heal = heal


async def _nats_restart(c: Chaos) -> None:
    assert c.cluster.nats is not None
    (nats,) = c.cluster.nats.nodes
    await asyncio.get_running_loop().run_in_executor(None, _restart, nats)
    c.notes.append("nats-server restarted")


def _restart(server: Any) -> None:
    server.stop()
    server.start()


async def _bad_live_config(c: Chaos) -> None:
    d = await c.etcd()
    try:
        await d.put_raw(f"/{c.cluster.spec.namespace}/config/router-canary", b'{"overlap_weight": 0}')
        await put_config(d, {"overlap_weight": float("nan")})
    finally:
        await d.close()
    c.notes.append("a canary key and a NaN setting")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("baseline", "no fault", None),
        Scenario("hanging_worker", "a new worker registers and never answers", _hanging_worker),
        Scenario("forged_seq", "a batch 1,000 seqs ahead for one worker", lambda c: _forged(c, epoch_change=False)),
        Scenario("forged_epoch", "a batch of an unknown epoch for one worker", lambda c: _forged(c, epoch_change=True)),
        Scenario("kill_decode_shim", "kill -9 of a decode worker's shim", lambda c: _kill_shim(c, "decode")),
        Scenario("kill_prefill_shim", "kill -9 of the prefill worker's shim", lambda c: _kill_shim(c, "prefill")),
        Scenario("etcd_down_15s", "etcd stopped for 15 s", _etcd_outage, heal_after_s=15.0),
        Scenario("nats_restart", "nats-server restarted", _nats_restart),
        Scenario(
            "event_loss_10pct", "every engine drops 10% of its KV batches", None, ("--drop-event-fraction", "0.1")
        ),
        Scenario("live_config", "a canary key and a NaN in the live config", _bad_live_config),
        Scenario(
            "overload_5x",
            "5x what the fleet can prefill: 4k-token prompts at H200 speed",
            None,
            capacity_factor=5.0,
            prompt_tokens=4096,
            speedup=1.0,
        ),
    )
}


class ChaosResult(msgspec.Struct, kw_only=True):
    scenario: str
    requests: int
    asked_rps: float = 0.0  # the load asked for
    sent_rps: float = 0.0  # what the generator sent: below asked, the box could not keep up
    failed: int
    refused: int
    calm_ttft_p50_s: float | None
    max_added_s: float | None
    recovery_s: float
    admitted_ttft_p99_s: float | None
    index_ok: bool
    index_detail: str
    notes: list[str]
    errors: dict[str, int]  # the failed requests by kind (status and message), most first


@dataclass
class _Sent:
    at: float
    done: Completion


async def _load(
    c: Chaos,
    rate: float,
    until: float,
    out: list[_Sent],
    rng: random.Random,
    *,
    max_tokens: int = 24,
    prompt_tokens: int | None = None,
) -> None:
    client = CompletionClient(c.http, MODEL, timeout_s=60.0)
    systems = [[rng.randrange(1, 30_000) for _ in range(512)] for _ in range(6)]
    tasks: list[asyncio.Task[None]] = []
    n = 0
    start = time.monotonic()

    async def one(url: str, prompt: list[int], at: float) -> None:
        out.append(_Sent(at, await client.complete(url, prompt, max_tokens, request_id=uuid.uuid4().hex)))

    while time.monotonic() < until:
        tail = prompt_tokens - 512 if prompt_tokens is not None else rng.randrange(32, 512)
        prompt = rng.choice(systems) + [rng.randrange(1, 30_000) for _ in range(tail)]
        url = c.cluster.router_urls[n % len(c.cluster.router_urls)]
        tasks.append(asyncio.create_task(one(url, prompt, time.monotonic())))
        n += 1
        await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
    await asyncio.gather(*tasks)


async def _quiet(c: Chaos, timeout_s: float = 60.0) -> None:
    """Until no engine runs or queues a request (after an overload they work on for a while), then
    a moment for their last events to land."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0
        for engine in c.cluster.engines:
            async with c.http.get(engine.url + "/sim/state") as r:
                st = await r.json()
            busy += st["running"] + st["waiting"]
        if not busy:
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(2.0)


async def _departed(c: Chaos) -> list[str]:
    """Until no router lists a worker whose shim was killed, or past its lease's TTL and the margin:
    what some router still lists then. Such a worker is no live one: its engine may have cached
    blocks its dead shim never published (a request in flight at the kill), and the routers keep
    what it last said until etcd drops its lease (a CI run compared one 10 s after the kill, as its
    10 s lease ran out: 159 blocks against its engine's 168)."""
    deadline = max(c.killed.values(), default=0.0) + LEASE_TTL_S + _DEPART_MARGIN_S
    while True:
        listed = [f"{url} {w}" for url in c.cluster.router_urls for w in await c.index_state(url) if w in c.killed]
        if not listed or time.monotonic() >= deadline:
            return listed
        await asyncio.sleep(0.25)


async def _truth_matches(c: Chaos) -> tuple[bool, str]:
    """Every router's digest of every live worker equals the engine's own cache."""
    truths: dict[str, tuple[int, int]] = {}
    for engine in c.cluster.engines:
        async with c.http.get(engine.url + "/sim/state", params={"canonical": "1"}) as r:
            hashes = set((await r.json())["cached_canonical_hashes"])
        xor = 0
        for h in hashes:
            xor ^= h
        truths[engine.url] = (len(hashes), xor)
    problems = []
    for url in c.cluster.router_urls:
        for worker, s in (await c.index_state(url)).items():
            truth = truths.get(s["engine_url"])
            if truth is None:
                continue  # a fake or departed worker
            held = (s["blocks"], int(s["xor"], 16))
            if held != truth:
                problems.append(f"{url} {worker}: {held[0]} blocks, engine {truth[0]}")
    return not problems, "; ".join(problems) or "equal"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


async def _measure(
    scenario: Scenario, cluster: LocalCluster, rate: float, warmup_s: float, window_s: float, settle_s: float, seed: int
) -> ChaosResult:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        c = Chaos(cluster, http)
        sent: list[_Sent] = []
        rng = random.Random(seed)
        t0 = time.monotonic()
        load_s = warmup_s + window_s + settle_s
        load = asyncio.create_task(_load(c, rate, t0 + load_s, sent, rng, prompt_tokens=scenario.prompt_tokens))
        await asyncio.sleep(warmup_s)
        fault_at = time.monotonic()
        if scenario.fault is not None:
            await scenario.fault(c)
        # The fault lasts what its name says (etcd_down_15s was down for --window, 20 s by default)
        heal_at = scenario.heal_after_s if scenario.heal_after_s is not None else window_s
        await asyncio.sleep(heal_at)
        if c.heal is not None:
            await c.heal()
            c.notes.append(f"healed after {heal_at:g} s")
        await asyncio.sleep(max(window_s - heal_at, 0.0))
        await load
        await _quiet(c)
        if lingering := await _departed(c):
            late = LEASE_TTL_S + _DEPART_MARGIN_S
            ok, detail = False, f"listed {late:g} s after its shim was killed: {'; '.join(lingering)}"
        else:
            ok, detail = await _truth_matches(c)
    calm = [s.done.ttft_s for s in sent if s.at < fault_at and s.done.ok and s.done.ttft_s is not None]
    after = [s for s in sent if s.at >= fault_at]
    p50, p90 = _pct(calm, 0.5), _pct(calm, 0.9)
    failed = [s for s in sent if not s.done.ok and s.done.status != 429]
    refused = [s for s in sent if s.done.status == 429]
    worst = max((s.done.ttft_s for s in after if s.done.ok and s.done.ttft_s is not None), default=None)
    slow = max(2 * p90, p90 + 0.25) if p90 is not None else None  # noise on a shared 2-core box
    bad_after = [
        s for s in after
        if (not s.done.ok and s.done.status != 429) or (slow is not None and (s.done.ttft_s or 0.0) > slow)
    ]  # fmt: skip
    recovery = max((s.at + (s.done.e2e_s or 0.0) - fault_at for s in bad_after), default=0.0)
    admitted = [s.done.ttft_s for s in sent if s.done.ok and s.done.ttft_s is not None]
    return ChaosResult(
        scenario=scenario.name,
        requests=len(sent),
        asked_rps=rate,
        sent_rps=len(sent) / load_s if load_s > 0 else 0.0,
        failed=len(failed),
        refused=len(refused),
        calm_ttft_p50_s=p50,
        max_added_s=(worst - p50) if worst is not None and p50 is not None else None,
        recovery_s=round(recovery, 3),
        admitted_ttft_p99_s=_pct(admitted, 0.99),
        index_ok=ok,
        index_detail=detail,
        notes=c.notes,
        errors=dict(Counter(error_kind(s.done.error or "") for s in failed).most_common(8)),
    )


def error_kind(error: str) -> str:
    """A failed request's kind: its status and the OpenAI error's message, or the client's exception."""
    head, sep, body = error.partition(": ")
    if sep and head.startswith("HTTP "):
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            return f"{head}: {json.loads(body)['error']['message']}"
    return error[:80]


def fleet_capacity(engines: int, prompt_tokens: int, speedup: float, profile: str = "h200:llama-3.1-8b") -> float:
    """Requests per second `engines` can prefill when each prompt's first 512 tokens are cached:
    the timing model's own prefill time, at the engines' speed-up."""
    seconds = TimingModel.for_profile(profile).prefill_time(prompt_tokens - 512, 512, budget=8192)
    return engines * speedup / seconds


def run_scenario(
    scenario: Scenario,
    *,
    rate: float = 6.0,
    warmup_s: float = 6.0,
    window_s: float = 20.0,
    settle_s: float = 8.0,
    speedup: float = 5.0,
    seed: int = 0,
    keep: Callable[[ChaosResult], None] = lambda r: None,
    log_dir: Path | None = None,
) -> ChaosResult:
    """One scenario on a cluster of its own, its result given to `keep` before the cluster stops: a
    signal that stops the run there (held to the stop's end, bench.stop_signals) loses nothing.
    With `log_dir`, every process's output is kept under `log_dir/<scenario>/` (else it goes with
    the cluster)."""
    speedup = scenario.speedup or speedup
    if scenario.capacity_factor is not None:
        rate = scenario.capacity_factor * fleet_capacity(4, scenario.prompt_tokens or 1024, speedup)
    spec = ClusterSpec(
        prefill=1, decode=3, routers=2, speedup=speedup, namespace="chaos" + uuid.uuid4().hex[:8],
        router_args=["--conditional-disagg"], sim_args=list(scenario.sim_args),
        shim_args=["--lease-ttl", str(LEASE_TTL_S)],
        log_dir=log_dir / scenario.name if log_dir is not None else None,
    )  # fmt: skip
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        cluster.wait_ready(timeout=90)
        result = asyncio.run(_measure(scenario, cluster, rate, warmup_s, window_s, settle_s, seed))
        keep(result)
    finally:
        with held():
            cluster.stop()
    return result


def format_table(results: list[ChaosResult]) -> str:
    def s(v: float | None, unit: str = "s") -> str:
        return "-" if v is None else f"{v:.2f}{unit}"

    header = [
        "scenario",
        "requests",
        "sent/asked r/s",
        "failed",
        "429",
        "max added",
        "recovery",
        "TTFT p99",
        "index ok",
    ]
    rows = [
        [r.scenario, str(r.requests), f"{r.sent_rps:.1f}/{r.asked_rps:.1f}", str(r.failed), str(r.refused),
         s(r.max_added_s), s(r.recovery_s), s(r.admitted_ttft_p99_s), "yes" if r.index_ok else "NO"]
        for r in results
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [header, *rows]]  # fmt: skip
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default="all", help=f"comma list of: {', '.join(SCENARIOS)} (default all)")
    parser.add_argument("--rate", type=float, default=6.0, help="steady requests per second over both routers (> 0)")
    parser.add_argument("--warmup", type=float, default=6.0, help="seconds of calm load before the fault (>= 0)")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of load with the fault (>= 0)")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds of load after healing (>= 0)")
    parser.add_argument("--out", default="bench/out", help="directory for the JSON results")
    parser.add_argument(
        "--log-dir", type=Path, help="keep every process's output, under DIR/<scenario>/ (default: none kept)"
    )


def _check_flags(args: argparse.Namespace, names: list[str]) -> None:
    """Before a cluster starts: a --rate of 0 divided by zero once one had, and a NaN, infinite or
    negative number ran for ever (a NaN --warmup slept for ever, an infinite --rate sent with no pause);
    a --log-dir that cannot be made or written failed the first cluster's start, a traceback after
    'stopped early: nothing was measured'."""
    check_positive("--rate", args.rate)
    for flag, value in (("--warmup", args.warmup), ("--window", args.window), ("--settle", args.settle)):
        check_non_negative(flag, value)
    if args.log_dir is not None:
        for name in names:  # a directory per scenario (a file in its place failed its cluster's start)
            check_log_dir(args.log_dir / name, [])


def run(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if args.scenarios == "all" else [n.strip() for n in args.scenarios.split(",")]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"kvswitch bench chaos: unknown scenarios {unknown}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    try:
        _check_flags(args, names)
    except ValueError as exc:
        print(f"kvswitch bench chaos: {exc}", file=sys.stderr)
        return 2
    path = fresh_path(Path(args.out), "chaos", ".json")
    saved = ResultsFile[ChaosResult](path, indent=2)
    results = saved.items
    with saved.kept_on_failure("kvswitch bench chaos"):
        for name in names:
            print(f"[chaos {name}] {SCENARIOS[name].what}", file=sys.stderr, flush=True)
            run_scenario(
                SCENARIOS[name], rate=args.rate, warmup_s=args.warmup, window_s=args.window, settle_s=args.settle,
                keep=saved.add, log_dir=args.log_dir,
            )  # fmt: skip
            print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(format_table(results))
    for r in results:
        if r.errors or r.index_detail != "equal":
            print(f"{r.scenario}: {'; '.join(r.notes)}; errors: {r.errors}; index: {r.index_detail}")
    print(f"results: {path}")
    bad = [r for r in results if not r.index_ok or (r.failed and r.scenario not in _FAILS_BY_DESIGN)]
    return 1 if bad else 0


# Killing a decode shim ends the streams it was serving mid-way: those fail by design (in
# <= 3 heartbeats); the table shows how many.
_FAILS_BY_DESIGN = frozenset({"kill_decode_shim", "nats_restart"})
