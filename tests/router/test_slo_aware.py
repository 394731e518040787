"""slo_aware at hand-computed cases. The workers' timing is a linear profile written for the test:
prefill 0.1 ms per new token, a decode step 5 ms + 0.1 ms per sequence, 100 kB of KV per token
(so 2 us per token at 50 GB/s), a stall of n tokens = 0.1 ms * n - 5.1 ms. SLOs 2 s and 25 ms at
headroom 0.8: budgets 1.6 s and 20 ms. Requests ask 128 output tokens, so L stays 128; workers
prefill at most 2,048 tokens per step (the builders' max_num_batched_tokens)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.config import ConditionalDisaggConfig, RouterSettings
from protocol.timing import TimingModel, load_profile
from router.calibration import WorkerTiming
from router.policies import Outcome, make_policy
from router.policies.slo_aware import Forecast, SloAware, SloAwareConfig
from router.request_context import Candidate, RequestContext
from tests.router.builders import cand, ctx

PROFILE = "slolinear:lin"


@pytest.fixture(autouse=True)
def linear_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    prefill = [
        {"cached_tokens": c, "new_tokens": n, "seconds": n * 1e-4} for c in (0, 100_000) for n in (1000, 101_000)
    ]
    decode = [{"context_tokens": x, "batch": b, "seconds": 0.005 + 1e-4 * b} for x in (0, 100_000) for b in (1, 101)]
    table = {"models": [{"model": "lin", "kv_bytes_per_token_bf16": 100_000, "prefill": prefill, "decode": decode}]}
    (tmp_path / "slolinear.json").write_text(json.dumps(table))
    # the same, but a new token costs more over a cached context: 0.1 ms x (1 + cached / 100,000)
    attending = [{**row, "seconds": row["seconds"] * (1 + row["cached_tokens"] / 100_000)} for row in prefill]
    ctx = {"models": [{"model": "ctx", "kv_bytes_per_token_bf16": 100_000, "prefill": attending, "decode": decode}]}
    (tmp_path / "sloctx.json").write_text(json.dumps(ctx))
    monkeypatch.setenv("KVSWITCH_PROFILE_DIR", str(tmp_path))
    load_profile.cache_clear()
    yield
    load_profile.cache_clear()


def _timed(c: Candidate) -> Candidate:
    c.timing = WorkerTiming(TimingModel(load_profile(PROFILE)))
    return c


def _decide(
    isl: int, *, running: int = 0, queued_p: int = 0, queued_d: int = 0, cached_p: int = 0, cached_d: int = 0
) -> tuple[bool, Outcome, SloAware, RequestContext]:
    d = _timed(cand("d1", running=running, queued_prefill_tokens=queued_d, overlap=cached_d // 16))
    p = _timed(cand("p1", "prefill", queued_prefill_tokens=queued_p, overlap=cached_p // 16))
    c = ctx(isl, [d], [p])
    c.max_tokens = 128
    c.decode, c.prefill = d, p
    policy = SloAware(SloAwareConfig())
    decision = policy.decide(c)
    return decision.bypass, decision.outcome, policy, c


def test_short_prompt_on_an_idle_fleet_is_faster_locally() -> None:
    bypass, outcome, policy, c = _decide(1000)
    assert c.decode is not None and c.prefill is not None
    td = c.decode.timing
    assert td is not None
    f = policy.forecast(c, c.decode, c.prefill, td, td)
    assert f.local_s == pytest.approx(0.1)  # 1000 tokens, no decode batch to interleave
    assert f.remote_s == pytest.approx(0.1 + 0.002 + 0.0051)  # prefill, transfer, d's first step
    assert (bypass, outcome) == (True, Outcome.BYPASS_SLO)


def test_both_fit_and_the_faster_way_wins() -> None:
    # no cache: local 1.0 s + 5 steps x 6 ms = 1.03 s; remote 1.0 + 0.02 + 0.0061 = 1.0261 s
    assert _decide(10_000, running=10)[0] is False
    # 8,000 cached on d: local 0.2 + 1 x 6 ms = 0.206 s; TPOT 6.1 -> 6.1 + 0.1949 / 128 = 7.6 ms
    assert _decide(10_000, running=10, cached_d=8000)[0] is True


def test_a_local_prefill_that_pushes_running_decodes_over_their_tpot_goes_remote() -> None:
    # B = 120, 6,000 cached on d: local 0.4 + 2 x 17 ms = 0.434 s, remote 1.0 + 0.008 + 0.0171 = 1.025 s;
    # TPOT 17.1 ms -> 17.1 + stall / 128, the stall being the 4,000-token chunk's marginal beside 120
    # decodes (protocol.timing: the reference fit scaled to this profile, 414.6 ms) = 20.339 ms:
    # 120 x 0.339 / 3.239 = 12.56 requests lost
    bypass, _, policy, c = _decide(10_000, running=120, cached_d=6000)
    assert c.decode is not None and c.decode.timing is not None and c.prefill is not None
    f = policy.forecast(c, c.decode, c.prefill, c.decode.timing, c.decode.timing)
    assert f.local_s < f.remote_s <= 1.6
    assert policy.lost(f, 120)[0] == pytest.approx(120 * (f.itl_local_s - 0.02) / (f.itl_local_s - f.itl_now_s))
    assert c.decode.timing.stall_s(4000, 6000, 120) == pytest.approx(0.4146, abs=1e-4)
    assert policy.lost(f, 120) == pytest.approx((12.56, 0.0), abs=0.01)
    assert bypass is False


def test_a_queue_is_priced_as_prompts_that_do_not_attend_to_each_other() -> None:
    t = WorkerTiming(TimingModel(load_profile("sloctx:ctx")), chunk_tokens=2048)
    # 20,000 queued tokens: 9 full steps of 2,048 and one of 1,568, none over a cached context
    assert t.queue_s(20_000) == pytest.approx(20_000 * 1e-4)
    # one prompt of as many tokens: each chunk attends to those before it, 0.1 ms x (1 + c / 100,000)
    one_prompt = sum(n * 1e-4 * (1 + c / 100_000) for n, c in [(2048, 2048 * k) for k in range(9)] + [(1568, 18_432)])
    assert t.prefill_s(20_000) == pytest.approx(one_prompt)
    assert t.queue_s(0) == 0.0


def test_the_forecast_prices_each_queue_as_queued_prompts() -> None:
    d = cand("d1", running=10, queued_prefill_tokens=30_000)
    p = cand("p1", "prefill", queued_prefill_tokens=12_000)
    td = WorkerTiming(TimingModel(load_profile("sloctx:ctx")), chunk_tokens=2048)
    d.timing = p.timing = td
    c = ctx(1000, [d], [p])
    c.max_tokens = 128
    c.decode, c.prefill = d, p
    policy = SloAware(SloAwareConfig())
    f = policy.forecast(c, d, p, td, td)
    # local: d's 30,000 queued at 0.1 ms a token (3.0 s), its own 1,000 (0.1 s), 16 steps beside 10 decodes
    steps = math.ceil(31_000 / 2048)
    assert f.local_s == pytest.approx(3.0 + 0.1 + steps * td.decode_s(10, policy.context))
    # remote: p's 12,000 queued (1.2 s) and the prompt (0.1 s): 1.3 s, under the 1.6 s budget, where
    # pricing the queue as one prompt read 1.26 s + 0.1 s
    assert f.prefill_answer_s == pytest.approx(1.2 + 0.1)
    assert td.prefill_s(12_000) == pytest.approx(1.26, abs=0.001)  # as one prompt: its chunks over 0..10 k cached


def test_a_saturated_prefill_worker_sends_the_request_local() -> None:
    # remote 2.0 s of queue + 1.0 s > 1.6 s; local 1.0 s fits and nobody runs on d
    assert _decide(10_000, queued_p=20_000)[0] is True


def test_one_lost_request_is_better_than_seven_pushed() -> None:
    # remote misses its TTFT (1 lost); local would push 12.6 of d's 120 requests over their TPOT
    assert _decide(10_000, running=120, cached_d=6000, queued_p=20_000)[0] is False


def test_a_cached_prefix_on_the_prefill_worker_makes_remote_faster() -> None:
    # 8,000 cached on p: remote 0.2 + 0.02 + 0.0061 s; local 1.0 s + 5 x 6 ms
    assert _decide(10_000, running=10, cached_p=8000)[0] is False


def test_at_a_budget_a_prediction_still_fits() -> None:
    policy = SloAware(SloAwareConfig())
    ttft_b, itl_b = 0.8 * 2.0, 0.8 * 0.025
    at_budget = Forecast(local_s=ttft_b, remote_s=ttft_b, itl_now_s=0.01, itl_local_s=itl_b)
    assert policy.lost(at_budget, 50) == (0.0, 0.0)
    over = Forecast(local_s=ttft_b + 1e-9, remote_s=ttft_b + 1e-9, itl_now_s=0.01, itl_local_s=itl_b + 1e-3)
    lost_local, lost_remote = policy.lost(over, 50)
    assert lost_remote == 1.0 and lost_local == pytest.approx(1.0 + 50 * 1e-3 / (itl_b + 1e-3 - 0.01))
    # d's requests are over their budget already: TPOT is a mean over a request's life, so they can
    # still recover, and a stall keeps every one of them over
    already_over = Forecast(local_s=0.1, remote_s=0.1, itl_now_s=itl_b + 1e-3, itl_local_s=itl_b + 2e-3)
    assert policy.lost(already_over, 50) == (50.0, 0.0)
    no_stall = Forecast(local_s=0.1, remote_s=0.1, itl_now_s=itl_b + 1e-3, itl_local_s=itl_b + 1e-3)
    assert policy.lost(no_stall, 50) == (0.0, 0.0)  # a prompt all cached: its prefill stalls nobody


def test_when_both_miss_the_faster_way_wins_unless_it_harms_others() -> None:
    # queued 30,000 on d and 10,000 on p: local 4.0 s + 5 x 5 ms... vs remote 1.0 + 1.0 + ...
    assert _decide(10_000, queued_d=30_000, queued_p=10_000)[0] is False
    assert _decide(10_000, queued_d=10_000, queued_p=30_000)[0] is True


def test_no_timing_keeps_the_remote_prefill() -> None:
    d, p = cand("d1"), cand("p1", "prefill")
    d.info = d.info.__class__(**{**{f: getattr(d.info, f) for f in d.info.__struct_fields__}, "timing_profile": None})
    c = ctx(1000, [d], [p])
    c.decode, c.prefill = d, p
    decision = SloAware(SloAwareConfig()).decide(c)
    assert not decision.bypass and "no timing" in decision.reason


def test_the_registry_builds_it_with_the_routers_slos() -> None:
    settings = RouterSettings(
        slo_ttft_s=3.0, slo_itl_s=0.05, conditional=ConditionalDisaggConfig(conditional_disagg_policy="slo_aware")
    )
    policy = make_policy(settings.conditional, settings)
    assert isinstance(policy, SloAware)
    assert (policy.config.slo_ttft_s, policy.config.slo_itl_s, policy.config.headroom) == (3.0, 0.05, 0.8)


@pytest.mark.parametrize("headroom", [0.0, 1.5])
def test_headroom_outside_0_1_is_refused(headroom: float) -> None:
    with pytest.raises(ValueError, match="slo_headroom"):
        ConditionalDisaggConfig(conditional_disagg_policy="slo_aware", slo_headroom=headroom).validate()


def test_room_on_a_decode_worker_ends_where_one_more_request_breaks_the_tpot_budget() -> None:
    # a step of B + 1 sequences: 5 ms + 0.1 ms x (B + 1) <= 20 ms while B <= 149; waiting ones count
    policy = SloAware(SloAwareConfig())
    c = ctx(64, [], [])
    assert policy.has_room(c, _timed(cand("d1", running=149)), local=False)
    assert not policy.has_room(c, _timed(cand("d1", running=150)), local=False)
    assert not policy.has_room(c, _timed(cand("d1", running=100, waiting=50)), local=False)
    assert policy.has_room(c, _timed(cand("d1")), local=False)  # idle: always
    untimed = cand("d1", running=1000)
    untimed.info = untimed.info.__class__(
        **{**{f: getattr(untimed.info, f) for f in untimed.info.__struct_fields__}, "timing_profile": None}
    )
    assert policy.has_room(c, untimed, local=False)  # no timing: nothing to judge by


def test_room_to_prefill_locally_adds_the_prefills_stall_per_output_token() -> None:
    policy = SloAware(SloAwareConfig())
    d = _timed(cand("d1", running=100))  # a step: 15.1 ms, so 4.9 ms per token is left for the stall
    assert d.timing is not None
    fits, breaks = ctx(2000, [d], []), ctx(10_000, [d], [])
    assert d.timing.stall_s(2000, 0, 100) / 128 < 0.0049 < d.timing.stall_s(10_000, 0, 100) / 128
    assert policy.has_room(fits, d, local=False) and policy.has_room(fits, d, local=True)
    assert policy.has_room(breaks, d, local=False) and not policy.has_room(breaks, d, local=True)


def test_room_on_a_prefill_worker_to_spill_to_stretches_its_tpot_by_its_share_of_prefill_time() -> None:
    # p prefills 10,000 tokens/s at full 2,048-token batches. Running 40, a 64-token prompt: a step
    # of 9.1 ms plus its own stall, 18.66 / 128 = 0.146 ms: 9.246 ms. Booked prompts at 5,000
    # tokens/s keep p half busy: 18.49 ms, in the 20 ms budget; at 5,500, 20.55 ms is not
    policy = SloAware(SloAwareConfig())
    c = ctx(64, [], [])
    assert policy.has_room(c, _timed(cand("p1", "prefill", running=40, prefill_inflow=5000)), local=True)
    assert not policy.has_room(c, _timed(cand("p1", "prefill", running=40, prefill_inflow=5500)), local=True)
    assert not policy.has_room(c, _timed(cand("p1", "prefill", prefill_inflow=10_000)), local=True)  # always busy
    # idle: room unless the stretch takes it past the budget (9,000 tokens/s: 5.23 ms x 10)
    assert policy.has_room(c, _timed(cand("p1", "prefill")), local=True)
    assert not policy.has_room(c, _timed(cand("p1", "prefill", prefill_inflow=9000)), local=True)
    # a decode worker's room does not read the inflow (its own prompts are what it is there for)
    assert policy.has_room(c, _timed(cand("d1", running=40, prefill_inflow=9000)), local=True)


def test_what_a_request_gets_alone_on_an_idle_prefill_worker_is_never_over_budget() -> None:
    # a 1 ms TPOT SLO that no decode step meets: an idle prefill worker still has room
    policy = SloAware(SloAwareConfig(slo_itl_s=0.001))
    assert policy.has_room(ctx(64, [], []), _timed(cand("p1", "prefill")), local=True)
    assert not policy.has_room(ctx(64, [], []), _timed(cand("p1", "prefill", running=1)), local=True)


def test_a_chat_request_with_no_limit_leaves_the_mean_output_length_alone() -> None:
    _, _, policy, c = _decide(1000)
    learnt = policy.output_len
    c.max_tokens = None
    policy.admitted(c, None)
    assert policy.output_len == learnt
    c.max_tokens = 16
    policy.admitted(c, None)
    assert policy.output_len < learnt


@pytest.mark.parametrize(("queued_p", "bypass"), [(229_000, False), (230_100, True)])
def test_a_remote_prefill_predicted_past_the_headrooms_share_of_prefill_timeout_is_no_path(
    queued_p: int, bypass: bool
) -> None:
    """B = 120, 10,000 uncached tokens: a local prefill pushes d's running decodes over their TPOT,
    so the remote way wins while it is a way at all. p answers in queued_p x 0.1 ms + 1.0 s; from
    0.8 x prefill_timeout_s (30 s) = 24 s on its leg would time out, the request prefill here anyway
    30 s late, and p be left out as failing: 22.9 + 1.0 s stays remote, 23.01 + 1.0 s does not."""
    got, outcome, _, _ = _decide(10_000, running=120, queued_p=queued_p)
    assert (got, outcome) == (bypass, Outcome.BYPASS_SLO if bypass else Outcome.DECLINED_POLICY)


@pytest.mark.parametrize(
    ("queued", "isl", "cached", "fit", "fits"),
    [
        (5_000, 10_000, 0, 0.8, True),  # 0.5 s of queue + 1.0 s of prompt = 1.5 s <= 0.8 x 2 s
        (7_000, 10_000, 0, 0.8, False),  # 0.7 + 1.0 = 1.7 s > 1.6 s
        (7_000, 10_000, 0, 1.0, True),  # ... <= 1.0 x 2 s
        (5_000, 20_000, 10_000, 0.8, True),  # half the prompt cached on p: 0.5 + 1.0 s of the rest
        (5_000, 20_000, 0, 0.8, False),  # ... none: 0.5 + 2.0 s
        (0, 64, 0, 0.0, False),  # 0 turns the rule off, however idle p is
    ],
)
def test_a_prefill_worker_fits_while_its_queue_and_the_uncached_rest_answer_within_the_fit(
    queued: int, isl: int, cached: int, fit: float, fits: bool
) -> None:
    # the planner asks only past its backlog bound: half the TTFT SLO, 10,000 tokens at 0.1 ms each
    p = _timed(cand("p1", "prefill", queued_prefill_tokens=queued, overlap=cached // 16))
    policy = SloAware(SloAwareConfig(prefill_fit=fit))
    assert policy.prefill_fits(ctx(isl, [], [p]), p) is fits
    assert (policy.prefill_rule is None) is (fit == 0)


def test_the_prefill_room_rule_prices_a_prompt_once_per_timing_and_cache_and_not_past_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The planner asks the rule of every prefill worker past the bound on each request, and each
    priced the prompt chunk by chunk: 16 workers x a 128 k-token prompt cost 324 us of 22."""
    priced: list[tuple[int, int]] = []
    real = WorkerTiming.prefill_s

    def counting(self: WorkerTiming, new_tokens: int, cached_tokens: int = 0) -> float:
        priced.append((new_tokens, cached_tokens))
        return real(self, new_tokens, cached_tokens)

    monkeypatch.setattr(WorkerTiming, "prefill_s", counting)
    timing = WorkerTiming(TimingModel(load_profile(PROFILE)))
    same = [cand(f"p{i}", "prefill", queued_prefill_tokens=5_000) for i in range(4)]
    cached = cand("p4", "prefill", queued_prefill_tokens=5_000, overlap=10_000 // 16)
    past = cand("p5", "prefill", queued_prefill_tokens=17_000)  # 1.7 s of queue alone > 1.6 s
    for w in (*same, cached, past):
        w.timing = timing
    policy = SloAware(SloAwareConfig())
    c = ctx(20_000, [], [*same, cached, past])
    assert [policy.prefill_fits(c, p) for p in (*same, cached, past)] == [False] * 4 + [True, False]
    assert priced == [(20_000, 0), (10_000, 10_000)]
    again = ctx(20_000, [], [*same, cached, past])  # a new request prices afresh
    assert not policy.prefill_fits(again, same[0])
    assert priced[2:] == [(20_000, 0)]


@pytest.mark.parametrize("fit", [0.55, 0.8, 1.0])
def test_the_prefill_room_rule_decides_as_its_formula(fit: float) -> None:
    policy = SloAware(SloAwareConfig(prefill_fit=fit))
    for queued in range(0, 24_000, 1_500):
        for isl, cached in ((64, 0), (8_000, 0), (8_000, 4_000), (30_000, 16)):
            p = _timed(cand("p1", "prefill", queued_prefill_tokens=queued, overlap=cached // 16))
            tp = p.timing
            assert tp is not None
            c = ctx(isl, [], [p])
            want = tp.queue_s(queued) + tp.prefill_s(isl - cached, cached) <= fit * 2.0
            assert policy.prefill_fits(c, p) is want, (queued, isl, cached)


def test_a_prefill_worker_without_timing_never_fits() -> None:
    p = cand("p1", "prefill", timing_profile=None)
    assert not SloAware(SloAwareConfig()).prefill_fits(ctx(64, [], [p]), p)


@pytest.mark.parametrize("fit", [-0.1, 1.5])
def test_a_prefill_fit_outside_0_1_is_refused(fit: float) -> None:
    with pytest.raises(ValueError, match="slo_prefill_fit"):
        ConditionalDisaggConfig(conditional_disagg_policy="slo_aware", slo_prefill_fit=fit).validate()
    with pytest.raises(ValueError, match="slo_prefill_fit"):
        SloAwareConfig(prefill_fit=fit)
