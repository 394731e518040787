"""A busy prefill pool through Planner.take: the policy and the decode guard decide where they should
(DESIGN.md, "Conditional disaggregation policies"), `prefill_pool_full` where no policy does, per engine."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from protocol import block_hashes
from protocol.messages import Stored
from router.policies import Outcome, Path
from tests.router.test_planner import BLOCK, Fleet, winfo

LONG = list(range(4096))  # uncached, past isl_bounding's 2048: every policy would keep it remote
BUSY = 8193  # queued on p1: over 1.0 x max_num_batched_tokens 8192


@pytest.mark.parametrize("policy", ["prefill_load", "isl_or_load"])
def test_a_load_policy_inheriting_queue_threshold_bypasses_a_busy_prefill_worker_as_bypass_load(policy: str) -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy=policy,
              queue_threshold=1.0)  # fmt: skip
    f.report("p1", prefill_tokens_queued=BUSY)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_LOAD)
    assert plan.reason == "prefill worker p1 queue 8193 tokens > 1.0 x max_num_batched_tokens 8192"


def test_the_guard_vetoes_a_load_bypass_over_queue_threshold_and_the_busy_worker_prefills() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="prefill_load",
              queue_threshold=1.0, decode_busy_threshold=0.5)  # fmt: skip
    f.report("d1", kv_used_blocks=9000)  # of 10,000
    f.report("p1", prefill_tokens_queued=BUSY)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.VETOED_DECODE_BUSY)
    assert plan.prefill is not None and plan.prefill.worker == "p1"
    assert "vetoed: decode worker d1 KV" in plan.reason


def test_a_prefill_worker_between_queue_threshold_and_a_larger_busy_threshold_keeps_the_remote_prefill() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="prefill_load",
              queue_threshold=1.0, prefill_busy_threshold=2.0)  # fmt: skip
    f.report("p1", prefill_tokens_queued=12_288)  # 1.5 x 8192: over queue_threshold, not busy by the policy
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.DECLINED_POLICY)
    assert plan.prefill is not None and plan.prefill.worker == "p1"


def test_isl_bounding_decides_over_a_prefill_pool_past_queue_threshold() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, queue_threshold=1.0,
              decode_busy_threshold=0.5)  # fmt: skip
    f.report("d1", kv_used_blocks=4000)
    f.report("p1", prefill_tokens_queued=BUSY)
    f.index.apply("d1", [Stored(hashes=block_hashes(LONG[:1024], BLOCK))])
    plan = f.planner.take(f.ctx(LONG[:1536], "short"))  # eff_isl 512, ratio 0.33
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_ISL)
    f.report("d1", kv_used_blocks=9000)  # the guard now vetoes that bypass
    plan = f.planner.take(f.ctx(LONG[:1536], "vetoed"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.VETOED_DECODE_BUSY)
    plan = f.planner.take(f.ctx(LONG, "long"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.DECLINED_POLICY)


def test_the_guard_vetoes_the_local_prefill_of_a_prefill_pool_past_the_ttft_backlog() -> None:
    # No queue_threshold, kvswitch's own policy: admission's backlog limit (half the TTFT SLO) makes
    # the pool full and d1 prefills, as a bypass the decode guard may veto like the policy's own.
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="ttft_model",
              decode_busy_threshold=0.5)  # fmt: skip
    f.report("p1", prefill_tokens_queued=200_000)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)
    assert plan.reason == "every vllm prefill worker's predicted prefill backlog is past half the TTFT SLO (1 s)"
    f.report("d1", kv_used_blocks=9000)
    plan = f.planner.take(f.ctx(LONG, "r2"))
    assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.VETOED_DECODE_BUSY)
    assert plan.prefill is not None and plan.prefill.worker == "p1"


def test_debug_route_does_not_list_the_vetoed_full_pools_prefill_worker_as_left_out_for_room() -> None:
    # The dry run said prefill_worker p1 and, in `excluded`, that p1 was left out for room (review1 D2).
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), winfo("p2", "prefill", engine="sglang"), conditional_disagg=True,
              conditional_disagg_policy="ttft_model", decode_busy_threshold=0.5)  # fmt: skip
    f.report("p1", prefill_tokens_queued=200_000)
    f.report("p2", prefill_tokens_queued=200_000)
    f.report("d1", kv_used_blocks=9000)
    info = f.planner.explain(f.ctx(LONG))
    assert (info["outcome"], info["prefill_worker"]) == ("vetoed_decode_busy", "p1")
    assert [c["worker"] for c in info["prefill_candidates"]] == ["p1"]
    # p2 (another engine's, never a candidate for d1) was left out for room, and still says why
    assert [(e["worker"], e["excluded"]) for e in info["excluded"]] == [("p2", "room")]
    assert "over half the TTFT SLO" in info["excluded"][0]["why"]


@pytest.mark.parametrize(
    ("policy", "busy", "outcome"),
    [
        ("isl_bounding", None, Outcome.DECLINED_POLICY),  # eff_isl 4096 >= 2048: remote, however busy p1 is
        ("prefill_load", 100.0, Outcome.DECLINED_POLICY),  # 300,000 <= 100 x 8192
        ("prefill_load", 30.0, Outcome.BYPASS_LOAD),  # 300,000 > 30 x 8192
        ("isl_or_load", 100.0, Outcome.DECLINED_POLICY),
    ],
)
def test_a_seed_policy_decides_over_a_prefill_worker_past_the_ttft_backlog(
    policy: str, busy: float | None, outcome: Outcome
) -> None:
    """DESIGN.md's seed policies bypass iff their rule says so: the router's backlog limit (half the
    TTFT SLO, with no queue_threshold) made the pool full first, so isl_bounding bypassed long
    uncached prompts and prefill_load's own threshold was capped at a 1 s backlog."""
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy=policy,
              prefill_busy_threshold=busy)  # fmt: skip
    f.report("p1", prefill_tokens_queued=300_000)  # seconds of prefill, past half the 2 s TTFT SLO
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and plan.outcome is outcome, plan.reason if plan else None
    assert plan.prefill is not None and plan.prefill.worker == "p1"


def test_without_a_policy_a_prefill_pool_past_queue_threshold_is_full_and_says_so() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), disagg="always", queue_threshold=1.0, decode_busy_threshold=0.5)
    f.report("d1", kv_used_blocks=9000)  # no policy decides: the guard has nothing to veto
    f.report("p1", prefill_tokens_queued=BUSY)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)
    assert plan.prefill is None
    assert plan.reason == "every vllm prefill worker's queue is over queue_threshold 1.0 x max_num_batched_tokens"


def test_a_full_prefill_pool_of_the_decode_workers_engine_is_full_though_another_engines_has_room() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), winfo("p2", "prefill", engine="sglang"), disagg="always",
              queue_threshold=1.0)  # fmt: skip
    f.report("p1", prefill_tokens_queued=9000)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)
    assert "every vllm prefill worker" in plan.reason


@pytest.mark.parametrize(("queued", "outcome"), [(5700, Outcome.REMOTE_PREFILL), (5701, Outcome.PREFILL_POOL_FULL)])
def test_queue_threshold_is_strict_at_a_limit_the_float_product_rounds_below(queued: int, outcome: Outcome) -> None:
    # 0.57 * 10000 == 5699.999999999999: a queue of exactly 5700 is at the threshold, not over it
    f = Fleet(winfo("d1"), winfo("p1", "prefill", max_num_batched_tokens=10_000), disagg="always",
              queue_threshold=0.57)  # fmt: skip
    f.report("p1", prefill_tokens_queued=queued)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and plan.outcome is outcome


def test_round_robin_rotates_each_pool_once_per_request_routed() -> None:
    """One cursor moved by both pools' rankings went two steps a request: with two decode and two
    prefill workers every request took d1 and p2. A dry run (/debug/route) moved it too."""
    f = Fleet(winfo("d1"), winfo("d2"), winfo("p1", "prefill"), winfo("p2", "prefill"), routing="round_robin",
              disagg="always")  # fmt: skip
    pairs = []
    for i in range(4):
        f.planner.explain(f.ctx(LONG, f"dry{i}"))
        plan = f.planner.take(f.ctx(LONG, f"r{i}"))
        assert plan is not None and plan.prefill is not None
        pairs.append((plan.decode.worker, plan.prefill.worker))
    assert pairs == [("d1", "p1"), ("d2", "p2"), ("d1", "p1"), ("d2", "p2")]


@pytest.mark.parametrize(
    ("queued", "fit", "remote"),
    [
        (40_000, 0.8, True),  # backlog 1.22 s > 1 s; answer 1.22 + 0.24 s of the prompt = 1.46 s <= 1.6 s
        (46_000, 0.8, False),  # 1.40 + 0.24 = 1.65 s > 1.6 s: full, and a local prefill breaks d1's TPOT
        (40_000, 0.0, False),  # slo_prefill_fit 0: the backlog bound alone
    ],
)
def test_slo_aware_keeps_a_prefill_worker_past_the_backlog_bound_while_its_answer_fits(
    queued: int, fit: float, remote: bool
) -> None:
    """The backlog bound (half the TTFT SLO) made p1 full, so the request waited for room to prefill
    on d1 while p1 would have answered it in time (docs/benchmarks.md, `make demo`'s slice)."""
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware",
              slo_prefill_fit=fit)  # fmt: skip
    f.report("d1", running=60)  # a local prefill of 8,000 tokens would push them over their TPOT
    f.report("p1", prefill_tokens_queued=queued)  # h200:llama-3.1-8b prefills 32.7 k tokens/s
    prompt = list(range(8000))
    plan = f.planner.take(f.ctx(prompt))
    if remote:
        assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.DECLINED_POLICY)
        assert plan.prefill is not None and plan.prefill.worker == "p1"
        return
    assert plan is None  # it waits at admission
    why = {e["worker"]: e["why"] for e in f.planner.explain(f.ctx(prompt, "r2"))["excluded"]}
    rule = ", and its queue and the prompt are predicted past slo_prefill_fit 0.8 x the TTFT SLO"
    assert why["p1"].endswith("over half the TTFT SLO (1 s)" + (rule if fit else ""))


def test_slo_aware_says_a_full_prefill_pool_missed_the_fit_too() -> None:
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware")
    f.report("p1", prefill_tokens_queued=46_000)
    plan = f.planner.take(f.ctx(list(range(8000))))  # idle d1: room to prefill it
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)
    assert plan.reason == (
        "every vllm prefill worker's predicted prefill backlog is past half the TTFT SLO (1 s), and its queue "
        "and the prompt are predicted past slo_prefill_fit 0.8 x the TTFT SLO"
    )


@pytest.mark.parametrize(
    "flags",
    [
        {"disagg": "always", "conditional_disagg_policy": "slo_aware"},
        {"disagg": "conditional", "conditional_disagg": False, "conditional_disagg_policy": "slo_aware"},
    ],
)
def test_the_prefill_room_rule_is_off_where_slo_aware_does_not_decide(flags: dict[str, Any]) -> None:
    """slo_prefill_fit is slo_aware's judgement: with no policy choosing the path, p1 past the
    backlog bound is full however well the request's answer would fit there (the first case above)."""
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), **flags)
    f.report("p1", prefill_tokens_queued=40_000)  # fits 0.8 x the TTFT SLO where slo_aware decides
    plan = f.planner.take(f.ctx(list(range(8000))))
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.PREFILL_POOL_FULL)
    assert plan.reason == "every vllm prefill worker's predicted prefill backlog is past half the TTFT SLO (1 s)"


QWEN: dict[str, Any] = {"timing_profile": "h200:qwen2.5-32b", "max_num_batched_tokens": 32_768}


@pytest.mark.parametrize(("fit", "kept"), [(0.45, True), (0.3, False), (0.0, False)])
def test_a_prefill_fit_at_most_half_keeps_a_worker_only_where_its_queue_prices_under_its_backlog(
    fit: float, kept: bool
) -> None:
    """The rule sees p1 only past the bound (its backlog over half the TTFT SLO at full batches),
    so a fit <= 0.5 keeps it only where its queue's partial chunk runs faster per token than a full
    one (slo_aware's docstring): qwen2.5-32b at 32,768 prefills 6,200 tokens in 0.73 s, 1.03 s at
    its full-batch rate."""
    f = Fleet(winfo("d1", **QWEN), winfo("p1", "prefill", **QWEN), conditional_disagg=True,
              conditional_disagg_policy="slo_aware", slo_prefill_fit=fit)  # fmt: skip
    f.report("p1", prefill_tokens_queued=6_200)
    excluded = [e["worker"] for e in f.planner.explain(f.ctx(list(range(16))))["excluded"]]
    assert excluded == ([] if kept else ["p1"])


def test_a_prefill_fit_under_half_keeps_no_worker_past_the_bound_at_llamas_8192_chunks() -> None:
    """h200:llama-3.1-8b prices a partial chunk of 8,192 at most 13 ms under its full-batch rate:
    below 0.5 - 0.013 / 2 the rule keeps nothing, whatever the queue."""
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware",
              slo_prefill_fit=0.49)  # fmt: skip
    kept = []
    for queued in range(32_000, 32_000 + 2 * 8192, 97):  # the bound is at 32.7 k
        f.report("p1", prefill_tokens_queued=queued)
        c = f.ctx(list(range(16)), f"r{queued}")
        f.planner.refresh(c)
        (p,) = c.prefill_pool
        if p.queued_prefill_tokens / (p.prefill_rate() or 1) > 1.0 and f.planner.disagg.prefill_fits(c, p):
            kept.append(queued)
    assert kept == []


UNJUDGED = "registered no max_num_batched_tokens"


def _unjudged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and UNJUDGED in r.getMessage()]


@pytest.mark.parametrize("policy", ["prefill_load", "isl_or_load"])
def test_a_load_policy_warns_once_per_prefill_worker_it_cannot_judge(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM shim started without --max-num-batched-tokens registers none (vLLM does not export
    it): the load rule never calls that worker busy. Said once per worker, not per request."""
    caplog.set_level(logging.WARNING, logger="router.disagg")
    f = Fleet(winfo("d1"), winfo("p1", "prefill", max_num_batched_tokens=None), conditional_disagg=True,
              conditional_disagg_policy=policy, queue_threshold=1.0)  # fmt: skip
    f.report("p1", prefill_tokens_queued=10**6)
    for i in range(3):
        plan = f.planner.take(f.ctx([10_000 * i + t for t in LONG], f"r{i}"))  # none cached anywhere
        assert plan is not None and (plan.path, plan.outcome) == (Path.REMOTE, Outcome.DECLINED_POLICY)
        assert "prefill worker p1: max_num_batched_tokens unknown" in plan.reason
    assert _unjudged(caplog) == [
        f"prefill worker p1 registered no max_num_batched_tokens: policy {policy}'s load rule cannot judge it busy, "
        "so no request is bypassed for its load; start its shim with --max-num-batched-tokens (the engine's "
        "value: vLLM does not export it). Said once per worker"
    ]
    f.planner.disagg.forget("p1")  # it left: one that comes back is said anew
    f.planner.take(f.ctx(LONG, "again"))
    assert len(_unjudged(caplog)) == 2


@pytest.mark.parametrize(
    ("flat", "mnbt"),
    [
        ({"conditional_disagg": True, "conditional_disagg_policy": "prefill_load", "queue_threshold": 1.0}, 8192),
        ({"conditional_disagg": True}, None),  # isl_bounding has no load rule
        ({"conditional_disagg": True, "conditional_disagg_policy": "ttft_model"}, None),
        ({"conditional_disagg_policy": "prefill_load", "queue_threshold": 1.0}, None),  # the policy is off
    ],
)
def test_no_warning_where_no_load_rule_misses_the_prefill_workers_limit(
    flat: dict[str, Any], mnbt: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.disagg")
    f = Fleet(winfo("d1"), winfo("p1", "prefill", max_num_batched_tokens=mnbt), **flat)
    plan = f.planner.take(f.ctx(LONG))
    assert plan is not None and plan.prefill is not None and plan.prefill.worker == "p1"
    assert _unjudged(caplog) == []
