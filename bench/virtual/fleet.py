"""A whole fleet on the virtual clock: engines, their shims, router replicas and an open-loop client.

`VirtualFleet(spec)` builds the parts (engine_sim's Scheduler per engine, sized as `kvswitch sim`
sizes it; a shim per engine; `routers` replicas, each with its own index and load view); `run()`
replays a workload and returns what the client saw, as the live replay's RequestResults. Building
reads the wall clock once per engine (engine_sim's stats stamp their creation); `run()` never
does (tests/bench/test_virtual.py makes it fail if it did).

The client sends item i at `arrival_s / rate`, never late, to replica `i % routers` (the live
replay's round robin over router URLs); prompts are synthesised when their request is due.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from bench.replay import RequestResult
from bench.summary import PrefixCounters
from bench.trace import TokenSynth
from bench.virtual.clock import VirtualClock
from bench.virtual.delays import DEFAULT_DELAYS, Delays
from bench.virtual.engine import VirtualEngine
from bench.virtual.engine_hash import XxhChains
from bench.virtual.router import VirtualRequest, VirtualRouter
from bench.virtual.shim import POLL_S, VirtualShim
from bench.workloads import WorkItem
from engine_sim.config import SimConfig
from engine_sim.errors import SimConfigError
from engine_sim.scheduler import Scheduler
from protocol import WorkerInfo
from protocol.config import RouterSettings, add_flags, resolve
from protocol.messages import Role
from protocol.timing import TimingModel, profile_names
from router.calibration import MAX_SCALE, MIN_SCALE, Calibration
from router.planner import PrefixReach

__all__ = [
    "MAX_VIRTUAL_S",
    "SIMS_MAX_MODEL_LEN",
    "FleetSpec",
    "VirtualFleet",
    "VirtualRun",
    "check_max_model_len",
    "check_profile",
    "check_span",
    "settings_from_args",
]

DEFAULT_PROFILE = "h200:llama-3.1-8b"
SIMS_MAX_MODEL_LEN = SimConfig().max_model_len  # the sims', so `kvswitch up`'s and docker-compose.yml's
# The latest arrival a replay may have, in virtual seconds (about 32 years): float seconds that far
# still resolve 0.12 us, well under the engines' millisecond steps; at 1e10 s a rate of 1e-9 already
# moved TTFTs by 3e-8 s, and at 1e-300 times stopped advancing (every request an error).
MAX_VIRTUAL_S = 1e9


@dataclass
class FleetSpec:
    """The fleet and its routers. `router_profile` is the timing profile the workers register
    (what the routers' cost models read); "" registers none, None the engines' own `profile`.
    `calibrate`: routers fit each worker's timing from its reports (router.calibration);
    `router_profile_error` e: routers start with every engine time (1 + e) times the profile's.
    `seed`: the routers' random choices and each shim's first poll, uniform over one poll period."""

    prefill: int = 0
    decode: int = 0
    agg: int = 0
    routers: int = 1
    settings: RouterSettings = field(default_factory=RouterSettings)
    delays: Delays = DEFAULT_DELAYS
    profile: str = DEFAULT_PROFILE
    router_profile: str | None = None
    model: str = "sim-llama"
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = SIMS_MAX_MODEL_LEN
    num_gpu_blocks: int | None = None
    kv_transfer_gbps: float = 50.0
    kv_lease_duration: float = 30.0
    seed: int = 0
    calibrate: bool = True
    router_profile_error: float = 0.0

    def validate(self) -> FleetSpec:
        if min(self.prefill, self.decode, self.agg) < 0:
            raise ValueError("--prefill, --decode and --agg must be >= 0")
        if self.decode + self.agg < 1:
            raise ValueError("a fleet needs at least one decode or agg engine")
        if self.routers < 1:
            raise ValueError(f"--routers must be >= 1, got {self.routers}")
        if not MIN_SCALE <= 1 + self.router_profile_error <= MAX_SCALE:
            allowed = f"[{MIN_SCALE - 1:g}, {MAX_SCALE - 1:g}]"
            raise ValueError(f"--router-profile-error must be in {allowed}, got {self.router_profile_error}")
        self.delays.validate()
        self.settings.validate()
        # As vLLM refuses to start: a request of max_model_len tokens that no pool can hold would
        # wait for its blocks for ever, and the virtual clock with it.
        self.engine_config().check_kv_fits_max_model_len()
        return self

    def engine_config(self) -> SimConfig:
        """One engine, as `kvswitch sim` would be configured (its pool sized by the profile)."""
        return SimConfig(
            profile=self.profile,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
        )


@dataclass
class VirtualRun:
    requests: list[VirtualRequest]
    prefix: PrefixCounters
    virtual_s: float  # when the last request ended
    events: int  # callbacks the clock ran
    fallbacks: int
    refused: int
    reach: PrefixReach  # summed over the replicas

    def results(self) -> list[RequestResult]:
        """What the client saw, as the live replay records it (seconds, virtual)."""
        return [_result(r) for r in self.requests]


def _result(r: VirtualRequest) -> RequestResult:
    ok = r.status == 200
    end = r.ended_at if r.ended_at is not None else r.due
    return RequestResult(
        ok=ok,
        status=r.status,
        error=r.error,
        prompt_tokens=r.prompt_tokens,
        output_tokens=r.output_tokens,
        ttft_s=r.first_at - r.due if r.first_at is not None else None,
        itl_s=r.gaps,
        e2e_s=end - r.due,
        decode_worker=r.decode_worker if ok else None,
        prefill=r.prefill if ok else None,
        outcome=r.outcome if ok else None,
        index=r.index,
        tag=r.tag,
        url=r.url,
        due_s=r.due,
        sent_s=r.due,
    )


def check_profile(flag: str, name: str, *, none: bool = False) -> None:
    """`name` is a profile the timing tables define (with `none`, or "none") and that loads; else a
    ValueError naming `flag` (and the allowed values, or what is wrong with its table), before
    anything runs. A table the loader refuses passed a check of names alone: the routers then ran
    without a cost model, or the first measurement failed after --out-dir was created."""
    known = profile_names()
    if none and name == "none":
        return
    if name not in known:
        raise ValueError(f"{flag}: unknown {name}; allowed: {', '.join(['none', *known] if none else known)}")
    try:
        TimingModel.for_profile(name)
    except ValueError as exc:
        raise ValueError(f"{flag} {name}: {exc}") from None


def check_max_model_len(tokens: int, profile: str, *, what: str | None = None) -> None:
    """--max-model-len as `kvswitch up` checks it, by the sim's own rules: a positive length whose
    request one engine's KV cache holds. `what` says where `tokens` came from when no flag set it."""
    what = what or f"--max-model-len {tokens}"
    if tokens < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {tokens}")
    check_profile("--profile", profile)
    config = FleetSpec(profile=profile, max_model_len=tokens).engine_config()
    try:
        config.check_kv_fits_max_model_len()
    except SimConfigError:
        raise ValueError(
            f"{what} does not fit one engine's KV cache for --profile {profile}: at most "
            f"{config.longest_max_model_len} ({config.usable_gpu_blocks} blocks of {config.block_size} tokens)"
        ) from None


def check_span(flag: str, items: Sequence[WorkItem], rate: float) -> None:
    """ValueError naming `flag` when `items` at `rate` times their arrival rate arrive past MAX_VIRTUAL_S."""
    last = max((item.arrival_s for item in items), default=0.0)
    if last / rate > MAX_VIRTUAL_S:  # inf too
        least = last / MAX_VIRTUAL_S
        step = 10.0 ** (math.floor(math.log10(least)) - 2)
        raise ValueError(
            f"{flag} {rate:g}: the workload's last arrival, {last:g} s in, would come {last / rate:.3g} s into the "
            f"virtual clock, past its bound of {MAX_VIRTUAL_S:g} s (float seconds beyond lose the engines' timing); "
            f"raise {flag} to at least {math.ceil(least / step) * step:.3g}"
        )


def settings_from_args(args: Sequence[str]) -> RouterSettings:
    """RouterSettings from `kvswitch router` flags (a configuration's router_args), defaults for
    the rest; the environment and config files are not read, so a run depends on its flags alone."""
    parser = _Parser(prog="router settings", add_help=False, allow_abbrev=False)
    add_flags(parser, RouterSettings)
    ns = parser.parse_args(list(args))
    return resolve(RouterSettings, cli=vars(ns), env={})


class _Parser(argparse.ArgumentParser):
    """A bad flag is a ValueError for the caller to name (replay's --router-arg), not this internal
    parser's usage and an exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


class VirtualFleet:
    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec.validate()
        self.clock = VirtualClock()
        self.engines: dict[str, VirtualEngine] = {}
        self.shims: dict[str, VirtualShim] = {}
        infos: list[WorkerInfo] = []
        timing = TimingModel.for_profile(spec.profile)
        blocks = spec.engine_config().resolved_num_gpu_blocks
        kv_bytes = timing.profile.kv_bytes_per_token
        registered = spec.profile if spec.router_profile is None else (spec.router_profile or None)
        pools: list[tuple[Role, int]] = [("prefill", spec.prefill), ("decode", spec.decode), ("agg", spec.agg)]
        roles = [role for role, count in pools for _ in range(count)]
        counts: dict[str, int] = {}
        # Live shims start at moments of their own, well before a replay: each one's first poll comes
        # at a phase of its own in its period, drawn from the run's seed (a stream of its own, so the
        # routers' draws are as they were).
        period = POLL_S + spec.delays.engine_read_s
        phases = random.Random(f"shim-polls:{spec.seed}")
        for role in roles:
            n = counts[role] = counts.get(role, -1) + 1
            name = f"{role}-{n}"
            sched = Scheduler(
                block_size=spec.block_size,
                num_gpu_blocks=blocks,
                max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                max_model_len=spec.max_model_len,
                timing=timing,
                engine_id=name,
                hash_seed=f"virtual:{name}",
                kv_connector=role != "agg",
                # The virtual dispatch models no retry, so a failed pull (a pin expired) recomputes.
                recompute_kv_load_failures=True,
            )
            sched.chains = XxhChains(name)
            self.engines[name] = VirtualEngine(
                self.clock,
                sched,
                peers=self.engines,
                kv_transfer_gbps=spec.kv_transfer_gbps,
                kv_lease_duration=spec.kv_lease_duration,
            )
            info = WorkerInfo(
                worker=name,
                model=spec.model,
                role=role,
                engine="vllm",
                block_size=spec.block_size,
                kv_total_blocks=blocks,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                kv_bytes_per_token=kv_bytes,
                timing_profile=registered,
                tokenizer="builtin",
                # As a live shim registers its engine's (/v1/models): slo_aware counts a request's
                # length within it, and without it every prompt over 32 k read as 32 k.
                max_model_len=spec.max_model_len,
            )
            infos.append(info)
            self.shims[name] = VirtualShim(
                self.clock,
                self.engines[name],
                info,
                spec.delays,
                epoch=len(infos),
                poll_offset_s=phases.uniform(0.0, period),
            )
        self.routers = [
            VirtualRouter(
                f"router-{i}",
                self.clock,
                spec.settings,
                infos,
                self.shims,
                spec.delays,
                rng=random.Random(spec.seed * 1000 + i),
                calibration=self._calibration(),
                calibrate=spec.calibrate,
                on_done=self._done,
            )
            for i in range(spec.routers)
        ]
        for r in self.routers:
            r.peers = [p for p in self.routers if p is not r]
        for shim in self.shims.values():
            shim.routers = self.routers
            shim.quiet_until = self._quiet_until
        self._left = 0
        self._in_flight = 0
        self._next_arrival: float | None = None
        self._ended: set[int] = set()

    def _calibration(self) -> Calibration | None:
        """One per replica: each fits from the reports it receives."""
        spec = self.spec
        if not spec.calibrate and not spec.router_profile_error:
            return None
        return Calibration(prior_scale=1.0 + spec.router_profile_error, clock=self.clock.time)

    def run(self, items: Sequence[WorkItem], synth: TokenSynth, *, rate: float = 1.0) -> VirtualRun:
        """Replay `items` at `rate` times their arrival rate; returns when every request ended."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        check_span("rate", items, rate)
        ordered = sorted(enumerate(items), key=lambda pair: pair[1].arrival_s)
        requests: list[VirtualRequest] = []
        self._left = len(ordered)
        for shim in self.shims.values():
            shim.start()
        if ordered:
            self._next_arrival = ordered[0][1].arrival_s / rate
            self.clock.at(self._next_arrival, self._arrive, ordered, 0, synth, rate, requests)
        else:
            self._stop()
        # The replay allocates millions of acyclic, mostly long-lived objects (hash chains, blocks):
        # the cycle collector's passes over that heap would cost a third of the run and free nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.clock.run()
        finally:
            if collecting:
                gc.enable()
        requests.sort(key=lambda r: r.index)
        prefix = PrefixCounters(
            sum(e.scheduler.stats.prefix_cache_queries for e in self.engines.values()),
            sum(e.scheduler.stats.prefix_cache_hits for e in self.engines.values()),
        )
        return VirtualRun(
            requests=requests,
            prefix=prefix,
            virtual_s=max((r.ended_at or 0.0 for r in requests), default=0.0),
            events=self.clock.events,
            fallbacks=sum(r.fallbacks for r in self.routers),
            refused=sum(r.refused + r.timed_out for r in self.routers),
            reach=PrefixReach.summed([r.planner.reach for r in self.routers]),
        )

    def _arrive(
        self,
        ordered: list[tuple[int, WorkItem]],
        n: int,
        synth: TokenSynth,
        rate: float,
        requests: list[VirtualRequest],
    ) -> None:
        index, item = ordered[n]
        router = self.routers[n % len(self.routers)]
        tokens = synth.expand(item.segments)
        req = VirtualRequest(index, item.tag, self.clock.now, tokens, item.output_len, prompt_tokens=len(tokens))
        req.url = f"virtual://{router.name}"
        requests.append(req)
        self._in_flight += 1
        self.clock.after(self.spec.delays.client_s, router.receive, req)
        self._next_arrival = None
        if n + 1 < len(ordered):
            self._next_arrival = ordered[n + 1][1].arrival_s / rate
            self.clock.at(self._next_arrival, self._arrive, ordered, n + 1, synth, rate, requests)

    def _quiet_until(self) -> float | None:
        """The next arrival, while nothing but the shims' periodic ticks can happen before it: no
        request in flight and every engine quiet (VirtualShim skips its ticks to shortly before it)."""
        if self._in_flight or not all(e.quiet for e in self.engines.values()):
            return None
        return self._next_arrival

    def _done(self, req: VirtualRequest) -> None:
        if req.index in self._ended:
            raise RuntimeError(f"request {req.request_id} ended twice")
        self._ended.add(req.index)
        self._left -= 1
        self._in_flight -= 1
        if self._left == 0:
            self._stop()

    def _stop(self) -> None:
        for shim in self.shims.values():
            shim.running = False
