"""`bench replicas`: the N-replica model's arithmetic, the ceiling's verdict, and one short
two-replica run on a real local cluster."""

from __future__ import annotations

import pytest

from bench.overhead import Phase
from bench.replicas import (
    CeilingStep,
    ModelPhaseError,
    ReplicaSpec,
    _check_served,
    measure_replicas,
    predicted_cpu,
    project,
    r_max,
)


def test_one_replica_spends_its_own_cost_per_request() -> None:
    assert predicted_cpu(1, rate=100.0, c_own=0.002, c_peer=0.0005) == pytest.approx(0.2)


def test_each_of_n_replicas_serves_a_share_and_pays_for_the_rest() -> None:
    # 3 replicas at 120 req/s: 40 served (x 2 ms) + 80 of peers (x 0.5 ms) = 0.08 + 0.04 core
    assert predicted_cpu(3, rate=120.0, c_own=0.002, c_peer=0.0005) == pytest.approx(0.12)


def test_without_a_peer_cost_replicas_add_up_linearly() -> None:
    assert [v for _, v in project(100.0, 0.002, 0.0, [1, 2, 16])] == pytest.approx([100.0, 200.0, 1600.0])


def test_the_peer_cost_caps_scaling_at_r1_times_c_own_over_c_peer() -> None:
    assert r_max(2, 100.0, 0.002, 0.0005) == pytest.approx(200 / 1.25)
    assert r_max(16, 100.0, 0.002, 0.0005) == pytest.approx(1600 / 4.75)
    assert r_max(10_000, 100.0, 0.002, 0.0005) == pytest.approx(400.0, rel=1e-3)


@pytest.mark.parametrize(
    ("p50", "p99", "errors", "ok"),
    [(0.002, 0.005, 0, True), (0.0021, 0.001, 0, False), (0.001, 0.0051, 0, False), (0.0, 0.0, 1, False)],
)
def test_a_ceiling_step_holds_only_within_both_ttft_targets_and_without_errors(
    p50: float, p99: float, errors: int, ok: bool
) -> None:
    assert CeilingStep(rate=50.0, added_p50_s=p50, added_p99_s=p99, c_own_s=0.001, errors=errors).ok is ok


def test_two_replicas_on_a_real_cluster_both_work_when_spread_and_the_idle_one_pays_for_its_peer() -> None:
    # 2 req/s: the client may send each request up to 250 ms late (half the gap) before the bench
    # refuses the phase as off its schedule. At 40 req/s (12.5 ms) a loaded 2-core CI machine's
    # scheduler made it 20.6 ms late, and 35 to 147 ms with two CPU hogs beside the suite.
    spec = ReplicaSpec(check_rate=2.0, seconds=3.0, client_osl=4, speedup=10.0)
    run = measure_replicas(spec, 2)
    assert run.n == 2 and run.requests == 6
    assert len(run.c_peer_s) == 1 and len(run.spread_cpu_s) == 2
    assert all(cpu > 0 for cpu in run.spread_cpu_s)


def _phase(errors: int = 0, requests: int = 100, lag: float | None = 0.0) -> Phase:
    return Phase(
        tool="client", load="50/s", target="router-0", repeat=0, ttft_p50=0.01, ttft_p99=0.02, itl_p50=0.001,
        itl_p99=0.002, ttst_p50=0.001, ttst_p99=0.002, tokens_per_s=100.0, requests=requests, tokens=1000,
        errors=errors, cpu_s={}, window_s=2.0, send_lag_p99=lag,
    )  # fmt: skip


def test_the_model_is_built_only_from_phases_served_as_asked() -> None:
    """Its CPU per request divided by requests sent, failed ones included: a router failing every
    request fast read as a tiny c_own and a projection of 10,000+ req/s, with no word of the errors."""
    _check_served(_phase(), "spread", 2)
    with pytest.raises(ModelPhaseError, match=r"200 of 200 requests failed in the 'spread' phase"):
        _check_served(_phase(errors=200, requests=200), "spread", 2)
    with pytest.raises(ModelPhaseError, match=r"fell behind its schedule in the 'router-0 only' phase"):
        _check_served(_phase(lag=0.5), "router-0 only", 1)
    with pytest.raises(ModelPhaseError, match="sent no request"):
        _check_served(_phase(requests=0), "spread", 1)
