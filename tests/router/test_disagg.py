"""The decision framework: modes, policy, guard, outcomes; planning is a dry run."""

from __future__ import annotations

import logging

import msgspec
import pytest

from protocol import WorkerInfo
from router.disagg import Disaggregator
from router.policies import Outcome, Path
from router.request_context import Candidate, RequestShape
from tests.router.builders import cand, ctx, settings
from tests.router.test_planner import MODEL, Fleet, winfo


@pytest.mark.parametrize(
    ("flags", "with_prefill", "path", "outcome"),
    [
        ({"disagg": "never"}, True, Path.AGG, Outcome.AGGREGATED),
        ({"disagg": "always"}, False, Path.AGG, Outcome.NO_PREFILL_POOL),
        ({"disagg": "always"}, True, Path.REMOTE, Outcome.REMOTE_PREFILL),
        ({"disagg": "conditional"}, True, Path.REMOTE, Outcome.REMOTE_PREFILL),  # conditional_disagg off
        ({"conditional_disagg": True}, True, Path.BYPASS, Outcome.BYPASS_ISL),
        ({"conditional_disagg": True, "eff_isl_threshold": 10}, True, Path.REMOTE, Outcome.DECLINED_POLICY),
        ({"conditional_disagg": True, "decode_busy_threshold": 0.001}, True, Path.REMOTE, Outcome.VETOED_DECODE_BUSY),
    ],
)
def test_modes_and_outcomes(flags: dict[str, object], with_prefill: bool, path: Path, outcome: Outcome) -> None:
    r = ctx(100, [cand("d1", overlap=4)], [cand("p1", "prefill")] if with_prefill else [])
    plan = Disaggregator(settings(**flags)).plan(r)
    assert plan is not None
    assert (plan.path, plan.outcome) == (path, outcome)
    assert plan.decode.worker == "d1"
    assert plan.reason


def test_an_agg_worker_serves_aggregated_even_with_a_prefill_pool() -> None:
    plan = Disaggregator(settings(disagg="always")).plan(ctx(100, [cand("a1", "agg")], [cand("p1", "prefill")]))
    assert plan is not None and plan.outcome is Outcome.AGGREGATED


@pytest.mark.parametrize(
    "flags",
    [{"disagg": "always"}, {"conditional_disagg": True, "eff_isl_threshold": 10}, {"conditional_disagg": True}],
)
def test_a_batch_or_n_samples_prefill_on_the_decode_worker(flags: dict[str, object]) -> None:
    """One transfer handle carries one sequence's KV: handing it to several would give one prompt's
    KV to another. A long prompt the policy would send remote still prefills locally, and the
    guard has nothing to veto (decode_busy_threshold tiny), since remote is no option."""
    r = ctx(3000, [cand("d1")], [cand("p1", "prefill")])
    r.shape = RequestShape(sequences=2)
    plan = Disaggregator(settings(decode_busy_threshold=0.001, **flags)).plan(r)
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_SEQUENCES)
    assert "2 sequences" in plan.reason
    r.shape = RequestShape()
    plan = Disaggregator(settings(decode_busy_threshold=0.001, **flags)).plan(r)
    assert plan is not None and plan.path is Path.REMOTE
    agg = ctx(3000, [cand("a1", "agg")], [cand("p1", "prefill")])
    agg.shape = RequestShape(sequences=4, prompt_logprobs=True)
    plan = Disaggregator(settings(**flags)).plan(agg)
    assert plan is not None and plan.outcome is Outcome.AGGREGATED
    alone = ctx(3000, [cand("d1")], [])
    alone.shape = RequestShape(sequences=4, prompt_logprobs=True)
    plan = Disaggregator(settings(**flags)).plan(alone)
    assert plan is not None and plan.outcome is Outcome.NO_PREFILL_POOL, "no handle was in question"


def test_plan_counts_nothing_and_record_counts_once() -> None:
    dis = Disaggregator(settings(conditional_disagg=True))
    plan = dis.plan(ctx(100, [cand(overlap=4)]))
    assert plan is not None
    assert not dis.counts
    dis.record(plan.outcome)
    assert dis.counts == {Outcome.BYPASS_ISL: 1}


def test_the_policy_sees_the_prefill_worker_selection_would_pick() -> None:
    busy = cand("p_busy", "prefill", overlap=100, queued_prefill_tokens=10_000)
    dis = Disaggregator(
        settings(conditional_disagg=True, conditional_disagg_policy="prefill_load", queue_threshold=1.0)
    )
    # p_busy holds the prefix but is over the queue threshold, so p_idle is picked: not busy, no bypass.
    plan = dis.plan(ctx(3000, [cand()], [busy, cand("p_idle", "prefill")]))
    assert plan is not None
    assert plan.prefill is not None and plan.prefill.worker == "p_idle"
    assert plan.outcome is Outcome.DECLINED_POLICY
    plan = dis.plan(ctx(3000, [cand()], [busy]))
    assert plan is not None and plan.outcome is Outcome.BYPASS_LOAD


def test_exclude_and_empty_pool() -> None:
    dis = Disaggregator(settings())
    r = ctx(100, [cand("d1"), cand("d2")])
    plan = dis.plan(r, exclude=frozenset({"d1"}))
    assert plan is not None and plan.decode.worker == "d2"
    assert dis.plan(r, exclude=frozenset({"d1", "d2"})) is None


def test_configure_swaps_policy_and_keeps_old_one_on_error() -> None:
    from protocol import ConfigError
    from protocol.config import ConditionalDisaggConfig, RouterSettings

    dis = Disaggregator(settings(conditional_disagg=True))
    dis.configure(settings(conditional_disagg=True, conditional_disagg_policy="ttft_model"))
    assert dis.policy.name == "ttft_model"
    bad = RouterSettings(conditional=ConditionalDisaggConfig(conditional_disagg_policy="prefill_load"))
    with pytest.raises(ConfigError):
        dis.configure(bad)
    assert dis.policy.name == "ttft_model"


def test_explain_lists_every_candidate_with_overlap_and_cost() -> None:
    plan = Disaggregator(settings(conditional_disagg=True)).plan(ctx(100, [cand("d1", overlap=3), cand("d2")]))
    assert plan is not None
    info = plan.explain()
    assert info["outcome"] == "bypass_isl" and info["bypass"] is True
    assert {c["worker"]: c["overlap_blocks"] for c in info["decode_candidates"]} == {"d1": 3, "d2": 0}
    assert all(c["cost"] > 0 for c in info["decode_candidates"])


# --- a prefill pool left out for failing its legs (router.eligibility's prefill_failing) ------------


def _failing(*prefill: tuple[str, str]) -> Fleet:
    """d1 (vllm) and prefill workers (name, engine), each left out as prefill_failing."""
    f = Fleet(winfo("d1"), *(winfo(w, "prefill", engine=e) for w, e in prefill), disagg="always")
    for w, _ in prefill:
        f.planner.eligibility.prefill_leg(w, "its engine failed a prefill leg (engine_error 500)")
    return f


def test_a_failing_prefill_worker_of_another_engine_leaves_no_prefill_pool_as_it_was() -> None:
    """An SGLang prefill worker's failures say nothing of a vLLM decode worker's pool: it has none."""
    f = _failing(("p_sg", "sglang"))
    plan = f.planner.take(f.ctx(list(range(64)), "r0"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.AGG, Outcome.NO_PREFILL_POOL)
    assert "runs vllm" in plan.reason


def test_a_request_no_transfer_handle_serves_keeps_its_own_outcome_while_the_prefill_pool_is_failing() -> None:
    f = _failing(("p1", "vllm"))
    reasons = {}
    for shape, outcome in [
        (RequestShape(sequences=2), Outcome.BYPASS_SEQUENCES),
        (RequestShape(prompt_logprobs=True), Outcome.BYPASS_PROMPT_LOGPROBS),
        (RequestShape(beam_search=True), Outcome.BYPASS_BEAM_SEARCH),
        (RequestShape(), Outcome.BYPASS_TRANSFER_FAILING),
    ]:
        plan = f.planner.take(f.planner.context(f"r{outcome}", MODEL, list(range(64)), shape=shape))
        assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, outcome)
        assert plan.prefill is None
        reasons[outcome] = plan.reason
    assert (
        "every vllm prefill worker of model m left is failing its prefill legs (p1)"
        in reasons[Outcome.BYPASS_TRANSFER_FAILING]
    )


def test_only_a_same_engine_pool_wholly_failing_bypasses_for_it() -> None:
    # d1's own engine's prefill worker failing, another engine's healthy: d1 has none to pair with
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), winfo("p_sg", "prefill", engine="sglang"), disagg="always")
    f.planner.eligibility.prefill_leg("p1", "its engine failed a prefill leg (engine_error 500)")
    plan = f.planner.take(f.ctx(list(range(64)), "r0"))
    assert plan is not None and plan.outcome is Outcome.BYPASS_TRANSFER_FAILING and "(p1)" in plan.reason
    # another engine's failing, d1's own healthy: remote as usual
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), winfo("p_sg", "prefill", engine="sglang"), disagg="always")
    f.planner.eligibility.prefill_leg("p_sg", "its engine failed a prefill leg (engine_error 500)")
    plan = f.planner.take(f.ctx(list(range(64)), "r1"))
    assert plan is not None and plan.outcome is Outcome.REMOTE_PREFILL and plan.prefill is not None
    assert plan.prefill.worker == "p1"


def _no_local(c: Candidate) -> Candidate:
    """`c` as an SGLang decode server registers: no local prefill."""
    c.info = msgspec.structs.replace(c.info, local_prefill=False)
    return c


@pytest.mark.parametrize(
    ("flags", "prefill_full"),
    [
        ({"conditional_disagg": True}, False),  # isl_bounding: a short uncached prompt
        ({"conditional_disagg": True, "conditional_disagg_policy": "prefill_load", "queue_threshold": 1.0}, False),
        ({"disagg": "always"}, True),  # every prefill worker past its room: prefill_pool_full
    ],
    ids=["isl_bounding", "prefill_load", "prefill_pool_full"],
)
def test_a_decode_worker_that_cannot_prefill_locally_is_planned_no_bypass(
    flags: dict[str, object], prefill_full: bool
) -> None:
    """The review of 20d8bb4, finding 1: an SGLang decode server has no local prefill, so a bypass
    planned for it waited for KV that never came, to the client's deadline. It goes remote on the
    best prefill worker of its engine (a full one too), counted and said as an override."""
    p1 = cand("p1", "prefill", queued_prefill_tokens=10_000)
    r = ctx(100, [_no_local(cand("d1", overlap=4))], [] if prefill_full else [p1])
    dis = Disaggregator(settings(**flags))
    plan = dis.plan(r, prefill_full=[p1] if prefill_full else [])
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.REMOTE_NO_LOCAL_PREFILL)
    assert plan.prefill is not None and plan.prefill.worker == "p1" and "cannot prefill locally" in plan.reason
    dis.chosen(plan)
    assert dis.counts == {Outcome.REMOTE_NO_LOCAL_PREFILL: 1}


def test_a_departed_decode_worker_is_forgotten_and_said_again_if_it_returns(caplog: pytest.LogCaptureFixture) -> None:
    """The workers whose overridden bypasses were said are kept while they are in the fleet only:
    until 2026-12-07 every departed one's name stayed for the router's life (one per restart of a
    decode pod under a new id)."""
    caplog.set_level(logging.INFO, logger="router.disagg")
    dis = Disaggregator(settings(disagg="never"))
    r = ctx(100, [_no_local(cand("d1"))], [cand("p1", "prefill")])
    for _ in range(2):
        plan = dis.plan(r)
        assert plan is not None and plan.outcome is Outcome.REMOTE_NO_LOCAL_PREFILL
        dis.chosen(plan)
    said = [m for m in caplog.messages if "decode worker d1 cannot prefill locally" in m]
    assert len(said) == 1
    dis.forget("d1")
    assert not dis._no_local_said
    assert plan is not None
    dis.chosen(plan)
    said = [m for m in caplog.messages if "decode worker d1 cannot prefill locally" in m]
    assert len(said) == 2


def test_a_request_no_handle_serves_skips_a_decode_worker_that_cannot_prefill_locally() -> None:
    """n > 1 (or prompt logprobs, beam search) takes no transfer handle: it goes to a decode worker
    that prefills, or to none, rather than to one that would hold it for KV."""
    r = ctx(3000, [_no_local(cand("d1", overlap=40)), cand("d2")], [cand("p1", "prefill")])
    r.shape = RequestShape(sequences=2)
    plan = Disaggregator(settings(disagg="always")).plan(r)
    assert plan is not None and (plan.decode.worker, plan.outcome) == ("d2", Outcome.BYPASS_SEQUENCES)
    alone = ctx(3000, [_no_local(cand("d1"))], [cand("p1", "prefill")])
    alone.shape = RequestShape(sequences=2)
    assert Disaggregator(settings(disagg="always")).plan(alone) is None
    no_pool = ctx(3000, [_no_local(cand("d1"))], [])
    assert Disaggregator(settings(disagg="always")).plan(no_pool) is None


def test_an_old_record_reads_as_one_that_prefills_locally() -> None:
    old = msgspec.json.encode({"worker": "d1", "model": "m", "role": "decode", "engine": "sglang", "block_size": 16})
    assert msgspec.json.decode(old, type=WorkerInfo).local_prefill is True
