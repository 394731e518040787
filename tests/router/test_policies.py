"""Every boundary of every policy: equal to a threshold never bypasses; the decode guard; config errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine_sim.request import SimRequest
from engine_sim.scheduler import Scheduler
from protocol import ConfigError
from protocol.config import ConditionalDisaggConfig, RouterSettings, resolve
from protocol.timing import TimingModel
from router.policies import POLICIES, DecodeGuard, Outcome, make_policy
from router.policies.isl_bounding import IslBounding, IslBoundingConfig
from router.policies.isl_or_load import IslOrLoad, IslOrLoadConfig
from router.policies.prefill_load import PrefillLoad, PrefillLoadConfig
from router.policies.ttft_model import Prediction, TtftModel, TtftModelConfig
from router.request_context import Candidate, RequestContext
from tests.router.builders import BLOCK, cand, ctx


def decided(isl: int, d: Candidate, p: Candidate | None = None) -> RequestContext:
    c = ctx(isl, [d], [p] if p is not None else [])
    c.decode, c.prefill = d, p
    return c


# --- isl_bounding ------------------------------------------------------------------------------

# (isl, cached blocks of 16, eff_isl_threshold, ratio threshold, bypass)
ISL_TABLE = [
    (4096, 128, 2048, 0.7, False),  # eff_isl 2048 == threshold
    (4095, 128, 2048, 0.7, True),  # eff_isl 2047, ratio 0.4998
    (160, 3, 2048, 0.7, False),  # eff_isl 112: ratio 112/160 == 0.7
    (160, 4, 2048, 0.7, True),  # ratio 0.6
    (3000, 0, 4096, 1.0, False),  # nothing cached: ratio 1.0 is never < 1.0
    (100, 7, 2048, 0.7, True),  # cache longer than the prompt: eff_isl 0
    (0, 0, 2048, 0.7, True),  # empty prompt: eff_isl 0, ratio 0 / max(0, 1)
    (500, 0, 0, 0.7, False),  # threshold 0: never
    (500, 30, 20, 0.7, False),  # eff_isl 20 == 20
    (500, 30, 21, 0.7, True),
]


@pytest.mark.parametrize(("isl", "cached_blocks", "threshold", "ratio", "bypass"), ISL_TABLE)
def test_isl_bounding_boundaries(isl: int, cached_blocks: int, threshold: int, ratio: float, bypass: bool) -> None:
    policy = IslBounding(IslBoundingConfig(eff_isl_threshold=threshold, eff_isl_ratio_threshold=ratio))
    decision = policy.decide(decided(isl, cand(overlap=cached_blocks)))
    assert decision.bypass is bypass
    assert decision.outcome is (Outcome.BYPASS_ISL if bypass else Outcome.DECLINED_POLICY)


def test_isl_bounding_uses_the_decode_workers_cache_not_the_prefill_workers() -> None:
    policy = IslBounding(IslBoundingConfig())
    c = decided(4096, cand("d1", overlap=0), cand("p1", "prefill", overlap=256))
    assert not policy.decide(c).bypass
    c = decided(4096, cand("d1", overlap=200), cand("p1", "prefill", overlap=0))
    assert policy.decide(c).bypass


# --- prefill_load ------------------------------------------------------------------------------

# (queued tokens on the prefill worker, max_num_batched_tokens, threshold, bypass)
LOAD_TABLE = [
    (2048, 2048, 1.0, False),  # equal to threshold x mnbt
    (2049, 2048, 1.0, True),
    (0, 2048, 0.0, False),  # threshold 0: an empty queue is not busy
    (1, 2048, 0.0, True),
    (3072, 2048, 1.5, False),
    (3073, 2048, 1.5, True),
    (10**6, None, 1.0, False),  # capacity unknown: cannot be judged busy
    (5700, 10000, 0.57, False),  # 0.57 x 10000 rounds to 5699.999999999999: at the threshold, not over
    (5701, 10000, 0.57, True),
    (870, 3000, 0.29, False),  # 0.29 x 3000 rounds to 869.9999999999999
    (871, 3000, 0.29, True),
]


@pytest.mark.parametrize(("queued", "mnbt", "threshold", "bypass"), LOAD_TABLE)
def test_prefill_load_boundaries(queued: int, mnbt: int | None, threshold: float, bypass: bool) -> None:
    policy = PrefillLoad(PrefillLoadConfig(prefill_busy_threshold=threshold))
    p = cand("p1", "prefill", queued_prefill_tokens=queued, max_num_batched_tokens=mnbt)
    decision = policy.decide(decided(8000, cand(), p))
    assert decision.bypass is bypass
    assert decision.outcome is (Outcome.BYPASS_LOAD if bypass else Outcome.DECLINED_POLICY)


def test_prefill_load_says_the_limit_as_configured() -> None:
    policy = PrefillLoad(PrefillLoadConfig(prefill_busy_threshold=0.57))
    p = cand("p1", "prefill", queued_prefill_tokens=5700, max_num_batched_tokens=10000)
    decision = policy.decide(decided(8000, cand(), p))
    assert decision.reason == "prefill worker p1 queue 5700 tokens <= 0.57 x max_num_batched_tokens 10000"


@pytest.mark.parametrize(
    ("prefill_busy", "queue", "queued", "bypass"),
    [
        (None, 0.5, 1024, False),  # inherits queue_threshold: 0.5 x 2048 == 1024
        (None, 0.5, 1025, True),
        (2.0, 0.5, 1025, False),  # its own threshold wins over queue_threshold
        (2.0, 0.5, 4097, True),
    ],
)
def test_prefill_busy_threshold_inherits_queue_threshold(
    prefill_busy: float | None, queue: float, queued: int, bypass: bool
) -> None:
    cfg = ConditionalDisaggConfig(
        conditional_disagg_policy="prefill_load", prefill_busy_threshold=prefill_busy, queue_threshold=queue
    ).validate()
    policy = make_policy(cfg)
    p = cand("p1", "prefill", queued_prefill_tokens=queued)
    assert policy.decide(decided(100, cand(), p)).bypass is bypass


@pytest.mark.parametrize("name", ["prefill_load", "isl_or_load"])
def test_load_policy_without_any_threshold_is_a_startup_error(name: str) -> None:
    cfg = ConditionalDisaggConfig(conditional_disagg_policy=name)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prefill_busy_threshold"):
        cfg.validate()
    with pytest.raises(ConfigError, match="prefill_busy_threshold"):
        make_policy(cfg)


# --- isl_or_load -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached_blocks", "queued", "outcome"),
    [
        (0, 2048, Outcome.DECLINED_POLICY),  # neither: eff_isl 4096 and queue == 1.0 x 2048
        (200, 2048, Outcome.BYPASS_ISL),
        (0, 2049, Outcome.BYPASS_LOAD),
        (200, 2049, Outcome.BYPASS_ISL),  # both: isl is asked first
    ],
)
def test_isl_or_load_bypasses_when_either_would(cached_blocks: int, queued: int, outcome: Outcome) -> None:
    policy = IslOrLoad(IslOrLoadConfig(isl=IslBoundingConfig(), load=PrefillLoadConfig(prefill_busy_threshold=1.0)))
    c = decided(4096, cand(overlap=cached_blocks), cand("p1", "prefill", queued_prefill_tokens=queued))
    decision = policy.decide(c)
    assert decision.outcome is outcome
    assert decision.bypass is (outcome is not Outcome.DECLINED_POLICY)


# --- ttft_model --------------------------------------------------------------------------------


def test_ttft_prediction_follows_the_documented_formula() -> None:
    tm = TimingModel.for_profile("h200:llama-3.1-8b")
    d = cand("d1", overlap=64, running=12, queued_prefill_tokens=700, kv_used_blocks=600)
    p = cand("p1", "prefill", overlap=16, queued_prefill_tokens=3000)
    c = decided(4000, d, p)
    pred = TtftModel(TtftModelConfig(link_gbps=25.0, stall_weight=0.3)).predict(c, d, p)
    x = 600 * 16 / 12  # mean context of d's running requests, from their blocks
    remote = (
        tm.prefill_time(3000, 0, budget=2048)
        + tm.prefill_time(4000 - 256, 256, budget=2048)
        + tm.transfer(4000 - 1024, 25.0)
        + tm.decode(13, (12 * x + 4000) / 13)
    )
    stall = tm.stall(4000 - 1024, 1024, 12, budget=2048)
    local = (
        tm.prefill_time(700, 0, budget=2048, decode_batch=12, decode_context=x)
        + tm.prefill_time(4000 - 1024, 1024, budget=2048, decode_batch=12, decode_context=x)
        + 0.3 * stall * 12
    )
    assert pred.remote_s == pytest.approx(remote)
    assert pred.local_s == pytest.approx(local)
    assert pred.stall_s == pytest.approx(stall)


def test_ttft_reads_the_shims_decode_context_over_the_kv_blocks() -> None:
    # Twelve requests sharing a prefix hold 600 blocks (800 tokens each, counted once) but each
    # decodes over 3,000 tokens: the shim's count is what the steps cost.
    tm = TimingModel.for_profile("h200:llama-3.1-8b")
    p = cand("p1", "prefill")
    counted = cand("d1", overlap=64, running=12, kv_used_blocks=600, decode_context=3000)
    from_blocks = cand("d1", overlap=64, running=12, kv_used_blocks=600)
    model = TtftModel(TtftModelConfig())
    pred = model.predict(decided(4000, counted, p), counted, p)
    assert pred.remote_s - model.predict(decided(4000, from_blocks, p), from_blocks, p).remote_s == pytest.approx(
        tm.decode(13, (12 * 3000 + 4000) / 13) - tm.decode(13, (12 * 800 + 4000) / 13)
    )


def test_ttft_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    # 4096 tokens all cached: the engine recomputes the last block (the last token must be computed).
    tm = TimingModel.for_profile("h200:llama-3.1-8b")
    d = cand("d1", overlap=256, running=4, kv_used_blocks=8)
    pred = TtftModel(TtftModelConfig()).predict(decided(4096, d, cand("p1", "prefill")), d, cand("p1", "prefill"))
    assert pred.stall_s == pytest.approx(tm.marginal(16, 4080, 4))


def test_ttft_prediction_uses_an_injected_wrong_model() -> None:
    d, p = cand("d1", overlap=64, running=12, kv_used_blocks=600), cand("p1", "prefill", queued_prefill_tokens=900)
    c = decided(4000, d, p)
    right = TtftModel(TtftModelConfig()).predict(c, d, p)
    wrong = TtftModel(TtftModelConfig(), models=lambda name: TimingModel.for_profile(name).scaled(1.25)).predict(
        c, d, p
    )
    assert wrong.remote_s == pytest.approx(1.25 * right.remote_s)
    assert wrong.local_s == pytest.approx(1.25 * right.local_s)
    assert wrong.stall_s == pytest.approx(1.25 * right.stall_s)


# --- ttft_model against the simulator it predicts ----------------------------------------------

DECODE_PROMPT = 31  # after its prefill step each decode is at context 32: two whole blocks


@dataclass
class SimCharge:
    ttft: float  # the steps from admission to the prompt's first token
    stall: float  # what those steps cost beyond the decode-only steps of the same batches
    decode_context: float
    blocks_in_use: int


def _sim_local_prefill(new: int, cached: int, batch: int, budget: int) -> SimCharge:
    """Drive engine_sim's scheduler: `batch` requests decoding, then a prompt of `cached` cached and
    `new` uncached tokens, until its first token. What the engine charged for it."""
    steps = new // max(budget - batch, 1) + 4
    blocks = (cached + new) // BLOCK + 2 + batch * ((DECODE_PROMPT + steps) // BLOCK + 2)
    s = Scheduler(block_size=BLOCK, num_gpu_blocks=blocks, max_num_batched_tokens=budget, max_num_seqs=batch + 2,
                  emit_events=False)  # fmt: skip
    prefix = list(range(1000, 1000 + cached))
    if cached:  # compute the prefix once so that it is cached (and free) when the prompt arrives
        s.add_request(SimRequest("warm", [*prefix, 7], max_tokens=1))
        while s.requests:
            s.step()
    for i in range(batch):
        s.add_request(
            SimRequest(f"d{i}", list(range(5000 + 100 * i, 5000 + 100 * i + DECODE_PROMPT)), max_tokens=10**6)
        )
    while any(not r.output_token_ids for r in s.running) or s.waiting:
        s.step()
    x = sum(r.num_computed_tokens + 1 for r in s.running) / batch if batch else 0.0
    used = s.num_blocks_in_use
    s.add_request(SimRequest("t", [*prefix, *range(20000, 20000 + new)], max_tokens=1))
    ttft = stall = 0.0
    while "t" in s.requests:
        ctx = [r.num_computed_tokens + 1 for r in s.running if r.output_token_ids]
        r = s.step()
        assert r.num_decode == batch
        ttft += r.duration
        if batch:  # with no decodes nobody waits
            stall += r.duration - s.timing.decode(batch, sum(ctx) / batch)
    return SimCharge(ttft, stall, x, used)


def _router_local(new: int, cached: int, batch: int, budget: int, used: int) -> Prediction:
    d = cand("d1", overlap=cached // BLOCK, running=batch, kv_used_blocks=used, max_num_batched_tokens=budget)
    p = cand("p1", "prefill")
    return TtftModel(TtftModelConfig(stall_weight=0.0)).predict(decided(cached + new, d, p), d, p)


def test_ttft_stall_is_what_the_sim_charges_in_the_issue_case() -> None:
    # 64 new tokens on a 4,096-token cached prefix, 32 running decodes: the case ttft_model decides.
    sim = _sim_local_prefill(64, 4096, 32, 8192)
    assert sim.decode_context == 32 and sim.blocks_in_use == 64
    pred = _router_local(64, 4096, 32, 8192, sim.blocks_in_use)
    assert pred.stall_s == pytest.approx(sim.stall, rel=1e-12)
    assert pred.stall_s == pytest.approx(0.00178, abs=1e-5)  # not the 4.94 ms the old predictor said
    assert pred.local_s == pytest.approx(sim.ttft, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    new=st.sampled_from([1, 15, 64, 700, 2048, 9000]),
    cached=st.sampled_from([0, 16, 256, 4096]),
    batch=st.sampled_from([0, 1, 7, 32, 64]),
    budget=st.sampled_from([512, 2048, 8192]),
)
def test_ttft_local_prediction_is_the_sim_charge(new: int, cached: int, batch: int, budget: int) -> None:
    assume(batch * DECODE_PROMPT <= budget - batch)  # every decode admitted in one step, room left
    sim = _sim_local_prefill(new, cached, batch, budget)
    pred = _router_local(new, cached, batch, budget, sim.blocks_in_use)
    assert pred.stall_s == pytest.approx(sim.stall, rel=1e-9, abs=1e-15)
    assert pred.local_s == pytest.approx(sim.ttft, rel=1e-9)


def test_ttft_remote_prediction_is_the_sim_charge() -> None:
    isl, cached_p, cached_d, batch, link = 3000, 1024, 512, 8, 25.0
    prompt = list(range(1000, 1000 + isl))
    # The prefill side, idle: the prompt's chunks with nothing beside them.
    pre = Scheduler(block_size=BLOCK, num_gpu_blocks=512, max_num_batched_tokens=2048, emit_events=False)
    pre.add_request(SimRequest("warm", [*prompt[:cached_p], 7], max_tokens=1))
    while pre.requests:
        pre.step()
    pre.add_request(SimRequest("r", prompt, max_tokens=1, remote_decode=True))
    prefill = 0.0
    while "r" in pre.requests:
        prefill += pre.step().duration
    # The decode side: `batch` decodes at context 32, then the request with the transferred KV.
    dec = Scheduler(block_size=BLOCK, num_gpu_blocks=512, max_num_batched_tokens=2048, emit_events=False)
    dec.add_request(SimRequest("warm", [*prompt[:cached_d], 7], max_tokens=1))
    while dec.requests:
        dec.step()
    for i in range(batch):
        dec.add_request(
            SimRequest(f"d{i}", list(range(9000 + 100 * i, 9000 + 100 * i + DECODE_PROMPT)), max_tokens=10**6)
        )
    dec.step()
    used = dec.num_blocks_in_use
    dec.add_request(SimRequest("r", prompt, max_tokens=2, remote_prefill={"do_remote_prefill": True}))
    result = dec.step()
    ((_, tokens),) = result.transfers
    transfer = dec.timing.transfer(tokens, link)  # what engine_sim's runner waits
    dec.finish_remote_load("r", ok=True)
    first = dec.step()
    assert first.num_decode == batch + 1 and any(o.request_id == "r" for o in first.outputs)
    d = cand("d1", overlap=cached_d // BLOCK, running=batch, kv_used_blocks=used)
    p = cand("p1", "prefill", overlap=cached_p // BLOCK)
    pred = TtftModel(TtftModelConfig(link_gbps=link)).predict(decided(isl, d, p), d, p)
    assert prefill == pytest.approx(dec.timing.prefill_time(isl - cached_p, cached_p, budget=2048), rel=1e-12)
    # The decodes grew two tokens while the KV moved, which the router cannot see: < 1 us apart.
    assert pred.remote_s == pytest.approx(prefill + transfer + first.duration, abs=1e-6)


def test_ttft_model_bypasses_a_cached_prompt_and_keeps_a_long_one_remote_on_a_busy_decoder() -> None:
    policy = TtftModel(TtftModelConfig())
    cached = decided(2048, cand("d1", overlap=127), cand("p1", "prefill"))
    assert policy.decide(cached).outcome is Outcome.BYPASS_TTFT
    long_busy = decided(16000, cand("d1", running=200, queued_prefill_tokens=30000), cand("p1", "prefill"))
    assert policy.decide(long_busy).outcome is Outcome.DECLINED_POLICY


def test_ttft_model_bypasses_when_the_prefill_queue_is_long() -> None:
    policy = TtftModel(TtftModelConfig())
    idle = decided(3000, cand("d1", running=4), cand("p1", "prefill"))
    swamped = decided(3000, cand("d1", running=4), cand("p1", "prefill", queued_prefill_tokens=200_000))
    assert not policy.decide(idle).bypass
    assert policy.decide(swamped).bypass


class _FixedPrediction(TtftModel):
    def __init__(self, local_s: float, remote_s: float) -> None:
        super().__init__(TtftModelConfig())
        self._pred = Prediction(remote_s=remote_s, local_s=local_s)

    def predict(self, ctx: RequestContext, d: Candidate, p: Candidate) -> Prediction:
        return self._pred


@pytest.mark.parametrize(("local", "remote", "bypass"), [(0.1, 0.1, False), (0.0999, 0.1, True), (0.1001, 0.1, False)])
def test_ttft_equal_predictions_do_not_bypass(local: float, remote: float, bypass: bool) -> None:
    assert _FixedPrediction(local, remote).decide(decided(100, cand(), cand("p1", "prefill"))).bypass is bypass


def test_ttft_unknown_profile_keeps_remote_prefill() -> None:
    d = cand()
    d.info = d.info.__class__(
        **{**{f: getattr(d.info, f) for f in d.info.__struct_fields__}, "timing_profile": "nope:x"}
    )
    decision = TtftModel(TtftModelConfig()).decide(decided(100, d, cand("p1", "prefill")))
    assert not decision.bypass
    assert "timing profile" in decision.reason


# --- decode guard ------------------------------------------------------------------------------

# (threshold, kv_used, active_blocks, isl, overlap, kv_total, vetoed)
GUARD_TABLE = [
    (0.5, 400, 0, 1600, 0, 1000, False),  # 400 + 100 new blocks == 0.5 x 1000
    (0.5, 400, 0, 1616, 0, 1000, True),  # 501
    # A cached prefix counts too: the engine's KV use leaves out a prefix no running request holds
    # (it is free until this request takes it), so admitting the prompt adds all its blocks.
    (0.5, 400, 0, 1616, 1, 1000, True),  # one of its 101 blocks cached: still 501
    (0.5, 399, 0, 1616, 100, 1000, False),  # 100 cached: 399 + 101 == 500
    (0.41, 4000, 0, 201 * 16, 200, 10000, True),  # 200 of 201 cached: 4201 (not 4001) > 4100
    (0.4201, 4000, 0, 201 * 16, 200, 10000, False),  # 4201 == 0.4201 x 10000
    (0.5, 0, 400, 1616, 101, 1000, True),  # all cached, over bookings: 400 + 101
    (0.5, 0, 450, 800, 0, 1000, False),  # bookings count: 450 + 50
    (0.5, 0, 451, 800, 0, 1000, True),
    (0.9, 0, 0, 16, 0, None, True),  # unknown capacity vetoes
    (None, 999, 999, 16000, 0, 1000, False),  # guard off
]


@pytest.mark.parametrize(("threshold", "used", "active", "isl", "overlap", "total", "vetoed"), GUARD_TABLE)
def test_decode_guard_boundaries(
    threshold: float | None, used: int, active: int, isl: int, overlap: int, total: int | None, vetoed: bool
) -> None:
    d = cand(overlap=overlap, kv_used_blocks=used, active_blocks=active, kv_total_blocks=total)
    assert (DecodeGuard(threshold).veto(decided(isl, d)) is not None) is vetoed


def test_decode_guard_counts_what_the_engine_holds_once_it_admits_the_request() -> None:
    # engine_sim's pool, as vLLM's: a finished turn's prefix stays cached but free, and the next
    # turn takes it back into use. The guard's count must be the engine's use after admission.
    prefix, new = 40 * BLOCK, 3 * BLOCK
    s = Scheduler(block_size=BLOCK, num_gpu_blocks=101, max_num_batched_tokens=4096, emit_events=False)
    s.add_request(SimRequest("turn1", [*range(1000, 1000 + prefix), 7], max_tokens=1))
    while s.requests:
        s.step()
    s.add_request(SimRequest("other", list(range(50000, 50000 + 10 * BLOCK - 4)), max_tokens=10**6))
    s.step()
    held = s.num_blocks_in_use
    assert held == 10  # the idle prefix is not in the engine's use
    d = cand(overlap=prefix // BLOCK, kv_used_blocks=held, kv_total_blocks=100)
    s.add_request(SimRequest("turn2", [*range(1000, 1000 + prefix), *range(9000, 9000 + new)], max_tokens=10**6))
    s.step()
    after = s.num_blocks_in_use
    assert after == held + (prefix + new) // BLOCK == 53
    assert DecodeGuard(after / 100).veto(decided(prefix + new, d)) is None  # at the threshold: allowed
    veto = DecodeGuard((after - 1) / 100).veto(decided(prefix + new, d))
    assert veto == f"decode worker d1 KV {after}/100 blocks > {(after - 1) / 100:g}"


# --- config -----------------------------------------------------------------------------------


def test_registry_lists_every_policy_of_the_config_schema() -> None:
    assert set(POLICIES) == {"isl_bounding", "prefill_load", "isl_or_load", "ttft_model", "slo_aware"}
    for name in POLICIES:
        cfg = ConditionalDisaggConfig(conditional_disagg_policy=name, queue_threshold=1.0)  # type: ignore[arg-type]
        assert make_policy(cfg.validate()).name == name


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        ({"conditional_disagg_policy": "bogus"}, "--conditional-disagg-policy"),
        ({"eff_isl_threshold": -1}, "--eff-isl-threshold"),
        ({"eff_isl_ratio_threshold": 1.5}, "--eff-isl-ratio-threshold"),
        ({"eff_isl_ratio_threshold": -0.1}, "--eff-isl-ratio-threshold"),
        ({"prefill_busy_threshold": -2}, "--prefill-busy-threshold"),
        ({"decode_busy_threshold": -0.5}, "--decode-busy-threshold"),
        ({"queue_threshold": -1}, "--queue-threshold"),
        ({"conditional_disagg_policy": "prefill_load"}, "--prefill-busy-threshold"),
        ({"routing": "fastest"}, "--routing"),
        ({"disagg": "sometimes"}, "--disagg"),
        ({"temperature": -1}, "--temperature"),
    ],
)
def test_invalid_settings_name_the_flag(flags: dict[str, object], names: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(RouterSettings, cli=flags, env={})
    assert names in str(info.value)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (IslBoundingConfig, {"eff_isl_threshold": -1}),
        (IslBoundingConfig, {"eff_isl_ratio_threshold": 2.0}),
        (PrefillLoadConfig, {"prefill_busy_threshold": -0.1}),
        (TtftModelConfig, {"link_gbps": 0.0}),
        (TtftModelConfig, {"stall_weight": -1.0}),
        (DecodeGuard, {"decode_busy_threshold": -1.0}),
    ],
)
def test_policy_configs_validate_themselves(cls: type, kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        cls(**kwargs)


def test_ttft_model_takes_its_parameters_from_the_settings() -> None:
    cfg = ConditionalDisaggConfig(ttft_link_gbps=12.5, ttft_stall_weight=2.0).validate()
    assert TtftModelConfig.from_settings(cfg) == TtftModelConfig(link_gbps=12.5, stall_weight=2.0)
    assert TtftModelConfig.from_settings(ConditionalDisaggConfig()) == TtftModelConfig()
