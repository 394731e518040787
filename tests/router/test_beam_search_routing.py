"""Beam search prefills on its decode worker: vLLM 0.32's beam search builds its own sampling
params, which carry no kv_transfer_params, so a prefill leg would return no handle (a wasted
prefill, then a fallback blamed on the prefill worker)."""

from __future__ import annotations

import pytest

from router.disagg import Disaggregator
from router.policies import Outcome, Path
from router.request_context import RequestShape
from tests.router.builders import cand, ctx, settings


@pytest.mark.parametrize(
    "flags",
    [{"disagg": "always"}, {"conditional_disagg": True, "eff_isl_threshold": 10}, {"conditional_disagg": True}],
)
def test_beam_search_prefills_on_the_decode_worker(flags: dict[str, object]) -> None:
    r = ctx(3000, [cand("d1")], [cand("p1", "prefill")])
    r.shape = RequestShape(beam_search=True)
    plan = Disaggregator(settings(decode_busy_threshold=0.001, **flags)).plan(r)
    assert plan is not None and (plan.path, plan.outcome) == (Path.BYPASS, Outcome.BYPASS_BEAM_SEARCH)
    assert "beam search" in plan.reason
    agg = ctx(3000, [cand("a1", "agg")], [cand("p1", "prefill")])
    agg.shape = RequestShape(beam_search=True)
    plan = Disaggregator(settings(**flags)).plan(agg)
    assert plan is not None and plan.outcome is Outcome.AGGREGATED


def test_a_beam_search_is_local_prefill_only() -> None:
    assert RequestShape(beam_search=True).local_prefill_only
    assert not RequestShape().local_prefill_only
