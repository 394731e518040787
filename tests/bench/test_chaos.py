"""The CI-sized chaos subset: two scenarios of `kvswitch bench chaos` with short windows."""

from __future__ import annotations

from bench.chaos import SCENARIOS, format_table, run_scenario


def test_a_forged_batch_costs_no_request_and_the_index_stays_the_engines_truth() -> None:
    r = run_scenario(SCENARIOS["forged_seq"], rate=6.0, warmup_s=3.0, window_s=5.0, settle_s=2.0)
    print(format_table([r]))
    assert r.requests >= 50 and r.failed == 0 and r.refused == 0
    assert r.index_ok, r.index_detail


def test_kill_9_of_a_decode_shim_fails_only_its_streams_and_recovers_in_seconds() -> None:
    r = run_scenario(SCENARIOS["kill_decode_shim"], rate=6.0, warmup_s=3.0, window_s=6.0, settle_s=2.0)
    print(format_table([r]))
    assert r.requests >= 50
    assert r.failed <= 4, r.errors  # only what was streaming on the killed worker (6/s, ~0.5 s each)
    assert r.recovery_s <= 3.0
    assert r.index_ok, r.index_detail
