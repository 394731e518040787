"""slo_aware's mean output length L and prompt length (router.policies.slo_aware) move once per
admitted request, each counted as no longer than its engine lets it be: one absurd max_tokens,
a waiter offered again, a retry or a /debug/route dry run cannot change any worker's room."""

from __future__ import annotations

import pytest

from router.policies.slo_aware import UNKNOWN_MAX_MODEL_LEN, SloAware
from tests.router.test_planner import MODEL, Fleet, _spill_fleet, winfo

WEIGHT = 0.02  # each request's weight in the means (slo_aware._EWMA_WEIGHT)


def _fleet(*decode: str, max_model_len: int | None = 32_768) -> tuple[Fleet, SloAware]:
    infos = [winfo(d, max_model_len=max_model_len) for d in decode]
    f = Fleet(*infos, winfo("p1", "prefill"), conditional_disagg=True, conditional_disagg_policy="slo_aware")
    policy = f.planner.disagg.policy
    assert isinstance(policy, SloAware)
    return f, policy


def test_one_absurd_max_tokens_leaves_busy_decode_workers_their_room() -> None:
    # h200 llama-8b: d1 with 8 running has room for more at the starting means (a step of ~10
    # sequences at ~4 k context, well under the 20 ms budget); a request asking 2**63-1 tokens
    # of a 32 k-context model counts as the 32,768 - 64 it could produce at most
    f, policy = _fleet("d1")
    f.report("d1", running=8)
    evil = f.planner.context("evil", MODEL, list(range(64)), 2**63 - 1)
    assert f.planner.take(evil) is not None
    assert policy.output_len == pytest.approx(128 + WEIGHT * (32_768 - 64 - 128))
    plan = f.planner.take(f.planner.context("next", MODEL, list(range(1000, 1064)), 128))
    assert plan is not None and plan.decode.worker == "d1"


def test_a_worker_that_does_not_say_its_context_counts_a_request_within_the_documented_cap() -> None:
    f, policy = _fleet("d1", max_model_len=None)
    f.report("d1", running=8)
    assert f.planner.take(f.planner.context("evil", MODEL, list(range(64)), 2**64 - 1)) is not None
    assert policy.output_len == pytest.approx(128 + WEIGHT * (UNKNOWN_MAX_MODEL_LEN - 64 - 128))
    assert f.planner.take(f.planner.context("next", MODEL, list(range(1000, 1064)), 128)) is not None


def test_a_prompt_longer_than_the_context_counts_as_the_context_and_its_output_as_one_token() -> None:
    f, policy = _fleet("d1", max_model_len=1024)
    assert f.planner.take(f.planner.context("long", MODEL, list(range(5000)), 500)) is not None
    assert policy.prompt_len == pytest.approx(4096 + WEIGHT * (1024 - 4096))
    assert policy.output_len == pytest.approx(128 + WEIGHT * (1 - 128))


def test_the_means_move_once_per_admitted_request_not_per_plan() -> None:
    f, policy = _fleet("d1", "d2")
    before = (policy.output_len, policy.prompt_len)
    for i in range(5):  # /debug/route's dry runs book and count nothing
        f.planner.explain(f.planner.context(f"dry{i}", MODEL, list(range(64)), 2**31))
    assert (policy.output_len, policy.prompt_len) == before
    ctx = f.planner.context("r", MODEL, list(range(64)), 16)
    plan = f.planner.take(ctx)
    assert plan is not None
    learnt = (128 + WEIGHT * (16 - 128), 4096 + WEIGHT * (64 - 4096))
    assert (policy.output_len, policy.prompt_len) == pytest.approx(learnt)
    retry = f.planner.plan_again(ctx, frozenset({plan.decode.worker}))  # a retry is the same request
    assert retry is not None and retry.decode.worker != plan.decode.worker
    assert (policy.output_len, policy.prompt_len) == pytest.approx(learnt)


def test_a_waiter_offered_again_moves_the_means_once_when_it_is_admitted() -> None:
    f, policy = _fleet("d1")
    f.report("d1", running=100)  # no room: the request waits and is offered at every notify
    ctx = f.planner.context("w", MODEL, list(range(64)), 16)
    for _ in range(5):
        assert f.planner.take(ctx) is None
    assert (policy.output_len, policy.prompt_len) == (128, 4096)
    f.report("d1", running=1)
    assert f.planner.take(ctx) is not None
    assert policy.output_len == pytest.approx(128 + WEIGHT * (16 - 128))


def test_a_request_spilled_to_a_prefill_worker_counts_too() -> None:
    f = _spill_fleet()
    policy = f.planner.disagg.policy
    assert isinstance(policy, SloAware)
    f.report("d1", running=100)
    plan = f.planner.take(f.planner.context("s", MODEL, list(range(64)), 16))
    assert plan is not None and plan.decode.worker == "p1"
    assert policy.output_len == pytest.approx(128 + WEIGHT * (16 - 128))
