"""`bench overhead`'s verdicts judge only what the figures can show: failed requests (left out of
the latency percentiles), a client that could not keep to its schedule, a time to second token the
engines cannot make non-zero, and how few requests a p99 rests on. Same for `bench replicas`'
ceiling steps."""

from __future__ import annotations

from typing import Any

import pytest

from bench.cpu import CpuWindow
from bench.overhead import DIRECT, KVSWITCH, Phase, client_phase, format_table, lag_bound_s, target_lines
from bench.replay import RequestResult
from bench.replicas import CeilingStep, _step_line

RATE = 200.0
LOAD = "200/s"
CPU = CpuWindow({"router": 0.1, "shim": 0.1}, wall_s=5.0)


def _result(i: int, ttft: float | None, *, lag: float = 0.0, gaps: tuple[float, ...] = (0.0, 0.001)) -> RequestResult:
    due = i / RATE
    ok = ttft is not None
    return RequestResult(
        ok=ok,
        status=200 if ok else 503,
        ttft_s=ttft,
        itl_s=list(gaps) if ok else [],
        e2e_s=(ttft or 0.0005) + (sum(gaps) if ok else 0.0),
        output_tokens=len(gaps) + 1 if ok else 0,
        error=None if ok else "HTTP 503: overloaded",
        index=i,
        tag="t",
        url="u",
        due_s=due,
        sent_s=due + lag,
    )


def _fast_503_phases() -> list[Phase]:
    """The audit's case: direct serves 2% of 1,000 requests slowly (60 ms, the rest 4 ms); kvswitch
    adds 1.5 ms to every request it serves and answers those 2% with a fast 503."""
    slow = {i for i in range(1000) if i % 50 == 7}
    direct = [_result(i, 0.060 if i in slow else 0.004) for i in range(1000)]
    routed = [_result(i, None if i in slow else 0.0055) for i in range(1000)]
    return [
        client_phase(direct, load=LOAD, target=DIRECT, repeat=0, cpu=CPU),
        client_phase(routed, load=LOAD, target=KVSWITCH, repeat=0, cpu=CPU),
    ]


def _lines_for(phases: list[Phase], load: str = LOAD) -> list[str]:
    return [line for line in target_lines(phases) if line.startswith(f"client {load}:")]


def test_a_router_that_fails_its_slowest_requests_fast_is_not_met() -> None:
    phases = _fast_503_phases()
    routed = phases[1]
    # the percentiles, over successful requests only, make it look faster than direct
    assert routed.errors == 20 and routed.ttft_p99 < phases[0].ttft_p99
    lines = _lines_for(phases)
    assert lines and not any(line.endswith(": met") or ": met " in line for line in lines)
    assert all("MISSED (20 errors)" in line for line in lines)


def test_failures_in_direct_leave_the_load_unjudged() -> None:
    direct, routed = _fast_503_phases()
    swapped = [
        Phase(**{**_fields(routed), "target": DIRECT}),
        Phase(**{**_fields(direct), "target": KVSWITCH}),
    ]
    lines = _lines_for(swapped)
    assert lines and all("not judged (20 errors in direct)" in line for line in lines)


def _fields(p: Phase) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def _on_time_phases(lag: float) -> list[Phase]:
    direct = [_result(i, 0.004, lag=lag) for i in range(1000)]
    routed = [_result(i, 0.0045, lag=lag) for i in range(1000)]
    return [
        client_phase(direct, load=LOAD, target=DIRECT, repeat=0, cpu=CPU),
        client_phase(routed, load=LOAD, target=KVSWITCH, repeat=0, cpu=CPU),
    ]


def test_the_clients_send_lag_is_reported_and_ttft_from_the_due_time_counts_it() -> None:
    on_time, late = _on_time_phases(0.0)[1], _on_time_phases(0.2)[1]
    assert on_time.send_lag_p50 == pytest.approx(0.0) and on_time.send_lag_p99 == pytest.approx(0.0)
    assert late.send_lag_p50 == pytest.approx(0.2) and late.send_lag_p99 == pytest.approx(0.2)
    assert late.ttft_p50 == pytest.approx(0.0045)  # from the send, as before
    assert late.ttft_due_p50 == pytest.approx(0.2045)  # from when it was due


def test_the_table_shows_the_lag_and_marks_a_row_past_its_bound() -> None:
    table = format_table(_on_time_phases(0.2)).splitlines()
    assert table[0].split()[-4:] == ["lag", "p50", "lag", "p99"]
    kvswitch = next(line for line in table if " kvswitch " in line).split()
    assert kvswitch[-2:] == ["200.00", "200.00!"]
    on_time = next(line for line in format_table(_on_time_phases(0.0)).splitlines() if " kvswitch " in line)
    assert on_time.split()[-2:] == ["0.00", "0.00"]


def test_a_load_the_client_could_not_keep_is_not_judged() -> None:
    assert lag_bound_s(LOAD) == pytest.approx(0.0025)  # half the 5 ms gap
    assert lag_bound_s("c=8") is None  # closed loop: no schedule
    late = _lines_for(_on_time_phases(0.2))
    assert late and all("not judged (client late: " in line and "200.00 ms > 2.50 ms" in line for line in late)
    judged = _lines_for(_on_time_phases(0.001))
    assert any(line.startswith("client 200/s: added TTFT p50 +0.50 ms") and ": met (" in line for line in judged)


def _aiperf(target: str, *, ttst_p50: float, ttst_p99: float, itl_p50: float = 0.0011) -> Phase:
    return Phase(
        tool="aiperf",
        load="c=64",
        target=target,
        repeat=0,
        ttft_p50=0.1,
        ttft_p99=0.2,
        itl_p50=itl_p50,
        itl_p99=0.004,
        ttst_p50=ttst_p50,
        ttst_p99=ttst_p99,
        tokens_per_s=1000.0,
        requests=256,
        tokens=256 * 64,
        errors=0,
        cpu_s={"router": 0.1, "shim": 0.1},
        window_s=10.0,
    )


def test_ttst_is_not_judged_when_the_engines_send_their_first_two_tokens_together() -> None:
    # 12-01 quiet box, aiperf c=64: direct TTST p50 0.00, p99 25.55 ms; kvswitch +0.00 / +37.53 ms
    phases = [
        _aiperf(DIRECT, ttst_p50=0.0, ttst_p99=0.02555),
        _aiperf(KVSWITCH, ttst_p50=0.0, ttst_p99=0.02555 + 0.03753),
    ]
    (line,) = [line for line in target_lines(phases) if "time to second token" in line]
    assert ": met" not in line
    assert "not measurable here (direct TTST p50 0.00 ms against ITL p50 1.10 ms" in line
    assert line.endswith("(p99 +37.53 ms)")


def test_a_measured_ttst_miss_is_missed_even_when_the_engines_send_their_first_two_tokens_together() -> None:
    # direct sends tokens 1 and 2 together; kvswitch holds token 2 for 5 ms (the old fixed COALESCE_S)
    phases = [_aiperf(DIRECT, ttst_p50=1e-5, ttst_p99=0.001), _aiperf(KVSWITCH, ttst_p50=0.005, ttst_p99=0.006)]
    (line,) = [line for line in target_lines(phases) if "time to second token" in line]
    assert line == "aiperf c=64: added time to second token p50 +4.99 ms (<= 1): MISSED (p99 +5.00 ms)"


def test_ttst_is_judged_where_the_second_token_comes_a_decode_step_later() -> None:
    phases = [_aiperf(DIRECT, ttst_p50=0.0011, ttst_p99=0.002), _aiperf(KVSWITCH, ttst_p50=0.0016, ttst_p99=0.003)]
    (line,) = [line for line in target_lines(phases) if "time to second token" in line]
    assert line == "aiperf c=64: added time to second token p50 +0.50 ms (<= 1): met (p99 +1.00 ms)"


@pytest.mark.parametrize(("requests", "rank"), [(100, "2nd"), (200, "3rd"), (1000, "11th")])
def test_a_p99_verdict_says_how_many_requests_it_rests_on(requests: int, rank: str) -> None:
    phases = [
        Phase(**{**_fields(p), "load": "c=8", "requests": requests})
        for p in (_aiperf(DIRECT, ttst_p50=0.001, ttst_p99=0.002), _aiperf(KVSWITCH, ttst_p50=0.001, ttst_p99=0.002))
    ]
    (line,) = [line for line in target_lines(phases) if "added TTFT p50" in line]
    assert line.endswith(f": met (p99 of {requests} requests: about the {rank} slowest)")


def test_a_ceiling_step_the_client_could_not_deliver_is_not_held() -> None:
    step = CeilingStep(rate=200.0, added_p50_s=0.001, added_p99_s=0.002, c_own_s=0.001, errors=0)
    assert step.ok and not step.late
    late = CeilingStep(rate=200.0, added_p50_s=0.001, added_p99_s=0.002, c_own_s=0.001, errors=0, send_lag_p99_s=0.043)
    assert late.late and not late.ok


def test_a_ceiling_step_where_only_direct_failed_is_not_judged_not_missed() -> None:
    # as in `bench overhead`: the bare sims' failures are not kvswitch's, but the step still is not held
    step = CeilingStep(rate=50.0, added_p50_s=0.0, added_p99_s=0.0, c_own_s=0.0005, errors=0, direct_errors=4)
    assert not step.ok
    assert _step_line(step).endswith(", 0 errors  (not judged: 4 errors in direct)")
    missed = CeilingStep(rate=50.0, added_p50_s=0.0, added_p99_s=0.0, c_own_s=0.0005, errors=2, direct_errors=4)
    assert not missed.ok and _step_line(missed).endswith(", 2 errors  (MISSED: 2 errors)")


def test_a_peer_that_failed_requests_is_no_best_peer() -> None:
    phases = [
        _aiperf(DIRECT, ttst_p50=0.001, ttst_p99=0.002),
        _aiperf(KVSWITCH, ttst_p50=0.001, ttst_p99=0.002),
        Phase(
            **{**_fields(_aiperf("fast_but_failing", ttst_p50=0.001, ttst_p99=0.002)), "ttft_p50": 0.05, "errors": 9}
        ),
        Phase(**{**_fields(_aiperf("slow_peer", ttst_p50=0.001, ttst_p99=0.002)), "ttft_p50": 0.2}),
    ]
    (line,) = [line for line in target_lines(phases) if "ttft p50" in line and "best peer" in line]
    assert line == (
        "aiperf c=64: added ttft p50 +0.00 ms vs best peer slow_peer +100.00 ms (within 1 ms): met; "
        "fast_but_failing left out: 9 errors"
    )


def test_the_open_loop_clients_throughput_is_not_judged() -> None:
    # At a fixed sending rate tokens per second is the load offered: a router adding 100 ms to
    # every request read 0.980x, "met"
    direct = [_result(i, 0.004) for i in range(1000)]
    slow = [_result(i, 0.104) for i in range(1000)]
    phases = [
        client_phase(direct, load=LOAD, target=DIRECT, repeat=0, cpu=CPU),
        client_phase(slow, load=LOAD, target=KVSWITCH, repeat=0, cpu=CPU),
    ]
    (line,) = [line for line in _lines_for(phases) if "throughput" in line]
    assert line.endswith("(>= 0.97): not judged: open loop, the rate is the client's")


def test_a_time_to_second_token_never_measured_gets_no_verdict() -> None:
    # one output token per request (--client-osl 1): no second token, no TTST line (it read
    # "+nan ms: MISSED")
    one = [_result(i, 0.004, gaps=()) for i in range(100)]
    phases = [
        client_phase(one, load=LOAD, target=DIRECT, repeat=0, cpu=CPU),
        client_phase(one, load=LOAD, target=KVSWITCH, repeat=0, cpu=CPU),
    ]
    assert not [line for line in _lines_for(phases) if "second token" in line]
    assert not [line for line in _lines_for(phases) if "nan" in line]
