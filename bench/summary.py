"""The summary of a replay: latency percentiles, throughput, goodput, prefix hits and routing mix.

Definitions (so figures can be checked by hand):
- percentiles interpolate linearly between order statistics (NumPy's default): p50 of [1, 2, 3, 4]
  is 2.5; over successful requests only; ITL percentiles pool every gap of every request; TPOT
  percentiles are over each request's time per output token, TPOT = (last token's arrival - first
  token's) / (output tokens - 1) (requests with one token have none). A stream may carry several
  tokens in one chunk (the shim coalesces tokens within 5 ms, and a busy client or router delivers
  late ones together): ITL gaps are per chunk, TPOT per token. Simulated engines at a high speed-up
  emit tokens in bursts, so pooled ITL percentiles there say more about the simulator's pacing than
  the model; TPOT (and the goodput built on it) keeps the modelled mean;
- `duration_s`: from the first request sent to the last one finished (errors included);
- throughput: output tokens and successful requests per second of that duration;
- goodput (DistServe's): requests that succeeded with TTFT <= `slo_ttft_s` and a mean inter-token
  latency (TPOT) <= `slo_itl_s`, per second of `window_s`, the arrival window (from the first
  request due to the last, and one mean gap more; the run's duration for a burst, requests all due
  within the time one took); a one-token request
  has no TPOT and is judged on TTFT. At one offered load every configuration shares that window,
  so goodput is the offered rate times the share within both SLOs, and two configurations compare
  as their counts within the SLOs. Until 2026-12-06 it was per second of `duration_s`, which a
  request that finished late stretched, in SLO or not: on `make demo`'s slice one 191 k-token
  prompt that ended 14 s after every other request read `ttft_model` 0.96x `kv` where it met the
  SLOs on more requests (611 against 596);
- `latency_scale`: every latency and the duration are multiplied by it (throughputs divided), so a
  run against engines simulated at `--speedup X` is reported in the engines' simulated time with
  `latency_scale = X`. Client and router overhead are scaled up with it: at high speed-ups they
  weigh X times more than they would in real time;
- prefix hit rate: the engines' own `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`
  over the run (counters scraped before and after), i.e. tokens found cached over tokens looked up;
- prefill mix: the share of requests the router reported as `bypass`, `remote` or `agg`;
- `clock`: "virtual" for a replay on the virtual clock (bench.virtual), whose seconds are simulated
  ones with nothing but the model in them and whose requests are sent exactly when due.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import aiohttp
import msgspec
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.replay import RequestResult

__all__ = [
    "PrefixCounters",
    "Slo",
    "Summary",
    "format_summary",
    "results_clock",
    "scrape_prefix_counters",
    "summarize",
    "tpot",
]

QUERIES_METRIC = "vllm:prefix_cache_queries_total"
HITS_METRIC = "vllm:prefix_cache_hits_total"


class Slo(msgspec.Struct, frozen=True):
    ttft_s: float = 2.0
    itl_s: float = 0.025


class PrefixCounters(msgspec.Struct, frozen=True):
    queries: float = 0.0
    hits: float = 0.0

    def __sub__(self, other: PrefixCounters) -> PrefixCounters:
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


class Percentiles(msgspec.Struct, frozen=True):
    p50: float
    p90: float
    p99: float


class Summary(msgspec.Struct, kw_only=True):
    requests: int
    ok: int
    errors: int
    duration_s: float
    ttft_s: Percentiles | None
    itl_s: Percentiles | None
    tpot_s: Percentiles | None
    e2e_s: Percentiles | None
    output_tokens_per_s: float
    requests_per_s: float
    goodput_rps: float
    goodput_fraction: float
    send_lag_p99_s: float | None
    prefill_mix: dict[str, float]
    prefix_hit_rate: float | None
    latency_scale: float
    slo: Slo
    clock: str = "live"
    window_s: float = 0.0  # goodput's denominator: the arrival window, a burst's duration (0.0: no request)


def _percentiles(values: Sequence[float], scale: float) -> Percentiles | None:
    if not values:
        return None
    p50, p90, p99 = np.percentile(np.asarray(values, dtype=float) * scale, [50, 90, 99])
    return Percentiles(float(p50), float(p90), float(p99))


def tpot(r: RequestResult) -> float | None:
    """Time per output token after the first: the stream's span over its tokens, not its chunks."""
    if r.output_tokens < 2 or r.ttft_s is None:
        return None
    return sum(r.itl_s) / (r.output_tokens - 1)


def _meets_slo(r: RequestResult, slo: Slo, scale: float) -> bool:
    if not r.ok or r.ttft_s is None or r.ttft_s * scale > slo.ttft_s:
        return False
    t = tpot(r)
    return t is None or t * scale <= slo.itl_s


def results_clock(results: Sequence[RequestResult]) -> str:
    """The clock a results file was measured on: the virtual fleet (bench.virtual.fleet) stamps each
    request's url `virtual://<router>`, a live replay the router's http(s) URL."""
    return "virtual" if results and all(r.url.startswith("virtual://") for r in results) else "live"


def summarize(
    results: Sequence[RequestResult],
    *,
    slo: Slo | None = None,
    latency_scale: float = 1.0,
    prefix: PrefixCounters | None = None,
    clock: str = "live",
) -> Summary:
    if not 0 < latency_scale < math.inf:  # NaN fails too
        raise ValueError(f"latency scale must be a finite number > 0, got {latency_scale}")
    slo = slo or Slo()
    ok = [r for r in results if r.ok]
    if results:
        ends = [r.sent_s + (r.e2e_s or 0.0) for r in results]
        duration = (max(ends) - min(r.sent_s for r in results)) * latency_scale
        window = _arrival_window(results) * latency_scale or duration
    else:
        duration = window = 0.0
    per_s = 1.0 / duration if duration > 0 else 0.0
    good = sum(_meets_slo(r, slo, latency_scale) for r in results)
    mix = Counter(r.prefill for r in results if r.prefill is not None)
    reported = sum(mix.values())
    return Summary(
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        duration_s=duration,
        ttft_s=_percentiles([r.ttft_s for r in ok if r.ttft_s is not None], latency_scale),
        itl_s=_percentiles([gap for r in ok for gap in r.itl_s], latency_scale),
        tpot_s=_percentiles([t for r in ok if (t := tpot(r)) is not None], latency_scale),
        e2e_s=_percentiles([r.e2e_s for r in ok if r.e2e_s is not None], latency_scale),
        output_tokens_per_s=sum(r.output_tokens for r in ok) * per_s,
        requests_per_s=len(ok) * per_s,
        goodput_rps=good / window if window > 0 else 0.0,
        goodput_fraction=good / len(results) if results else 0.0,
        send_lag_p99_s=float(np.percentile([r.sent_s - r.due_s for r in results], 99)) if results else None,
        prefill_mix={mode: n / reported for mode, n in sorted(mix.items())},
        prefix_hit_rate=prefix.hit_rate if prefix is not None else None,
        latency_scale=latency_scale,
        slo=slo,
        clock=clock,
        window_s=window,
    )


def _arrival_window(results: Sequence[RequestResult]) -> float:
    """Unscaled seconds of the arrival window: first request due to last, and one mean gap more
    (first to last spans n - 1 gaps: a run of n requests at rate r is n / r long, so goodput with
    every request within the SLOs is r). 0.0 for a burst, requests due within the time a request
    took (the median end to end): it has no rate to speak of, and its goodput is per second of the
    run; one request due a millisecond after the rest read as 1,000 times the goodput."""
    n = len(results)
    due = [r.due_s for r in results]
    window = (max(due) - min(due)) * n / (n - 1) if n > 1 else 0.0
    took = float(np.median([r.e2e_s or 0.0 for r in results]))
    return window if window > took else 0.0


def _ms(p: Percentiles | None) -> str:
    return "-" if p is None else f"p50 {p.p50 * 1e3:.1f}  p90 {p.p90 * 1e3:.1f}  p99 {p.p99 * 1e3:.1f} ms"


def format_summary(s: Summary) -> str:
    clock = "virtual" if s.clock == "virtual" else "simulated" if s.latency_scale != 1.0 else "wall"
    lines = [
        f"requests   {s.requests} ({s.ok} ok, {s.errors} errors) over {s.duration_s:.1f} s ({clock} time)",
        f"TTFT       {_ms(s.ttft_s)}",
        f"ITL        {_ms(s.itl_s)}",
        f"TPOT       {_ms(s.tpot_s)}",
        f"e2e        {_ms(s.e2e_s)}",
        f"throughput {s.output_tokens_per_s:.1f} output tok/s, {s.requests_per_s:.2f} req/s",
        f"goodput    {s.goodput_rps:.2f} req/s ({s.goodput_fraction:.0%} of requests within "
        f"TTFT <= {s.slo.ttft_s} s and TPOT <= {s.slo.itl_s * 1e3:g} ms)",
    ]
    if s.prefix_hit_rate is not None:
        lines.append(f"prefix hit {s.prefix_hit_rate:.1%} of prompt tokens (engines' metrics)")
    if s.prefill_mix:
        lines.append("prefill    " + ", ".join(f"{mode} {share:.0%}" for mode, share in s.prefill_mix.items()))
    if s.send_lag_p99_s is not None and s.clock != "virtual":
        lines.append(f"send lag   p99 {s.send_lag_p99_s * 1e3:.1f} ms behind schedule (wall clock)")
    return "\n".join(lines)


async def scrape_prefix_counters(session: aiohttp.ClientSession, metrics_urls: Sequence[str]) -> PrefixCounters:
    """Sum the prefix cache counters over the engines' `/metrics` (base URLs or full /metrics URLs)."""
    queries = hits = 0.0
    for url in metrics_urls:
        full = url if url.rstrip("/").endswith("/metrics") else f"{url.rstrip('/')}/metrics"
        async with session.get(full) as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {full}: HTTP {resp.status}")
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == QUERIES_METRIC:
                    queries += sample.value
                elif sample.name == HITS_METRIC:
                    hits += sample.value
    return PrefixCounters(queries, hits)
