"""Legs failing before their first output are said once per episode of a worker and failure kind
(router.leg_failures): a dead engine failed every request sent to it with two WARNING lines each,
aiohttp's whole ConnectionKey in each (log-quality audit of 2026-12-07)."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import aiohttp
import pytest

from router.leg_failures import LegFailures
from tests.router.conftest import MODEL, Cluster
from tests.router.polling import until


def test_an_episode_is_said_once_then_counted_every_period_then_ended(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    failures = LegFailures(logging.getLogger("router.test"), every_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="router.test")
    for i in range(50):
        failures.failed("w1", "engine_unavailable", f"r{i}", "request %s: it failed", f"r{i}")
        now[0] += 1.0  # the 31st, 30 s after the first, says the count (no loop here: no timer)
    failures.failed("w2", "engine_unavailable", "x", "request %s: it failed", "x")
    failures.served("w1")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [
        (
            logging.WARNING,
            "request r0: it failed; further engine_unavailable failures on worker w1 are counted (said every 30s "
            "at most) until it serves again",
        ),
        (
            logging.WARNING,
            "worker w1: 30 more legs failed with engine_unavailable before their first output in the last 30s "
            "(31 since 30s ago), the last: request r30: it failed",
        ),
        (
            logging.WARNING,
            "request x: it failed; further engine_unavailable failures on worker w2 are counted (said every 30s "
            "at most) until it serves again",
        ),
        (
            logging.INFO,
            "worker w1 serves again: 50 of its legs failed with engine_unavailable before their first output "
            "over 50.0s",
        ),
    ]
    assert [r.__dict__["request_id"] for r in caplog.records if r.levelno == logging.DEBUG][:2] == ["r1", "r2"]
    failures.forget("w2")
    assert caplog.records[-1].getMessage().startswith("worker w2 left: 1 of its legs failed with engine_unavailable")


def test_a_count_says_the_last_failure_so_a_cause_changed_within_the_kind_is_at_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Connection refused, then a TLS error, then the engine's 503, all engine_unavailable: the
    changes were at DEBUG alone, the count naming no request and no cause (review of 2026-12-07)."""
    now = [0.0]
    failures = LegFailures(logging.getLogger("router.test"), every_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="router.test")
    causes = ["connection refused 127.0.0.1:1"] * 3 + ["cannot connect to 127.0.0.1:1: TLS error"] * 3 + ["engine 503"]
    for i, cause in enumerate(causes):
        failures.failed("w1", "engine_unavailable", f"r{i}", "request %s: %s; the client got a %d", f"r{i}", cause, 503)
        now[0] += 5.0  # the 7th, 30 s after the first, says the count
    said = [r.getMessage() for r in caplog.records]
    assert said[1:] == [
        "worker w1: 6 more legs failed with engine_unavailable before their first output in the last 30s "
        "(7 since 30s ago), the last: request r6: engine 503; the client got a 503"
    ], said


async def test_an_episode_with_no_failure_for_a_period_ends_on_its_timer(caplog: pytest.LogCaptureFixture) -> None:
    failures = LegFailures(logging.getLogger("router.test"), every_s=0.05)
    caplog.set_level(logging.INFO, logger="router.test")
    began = time.monotonic()
    failures.failed("w1", "timeout", "r1", "request %s: it failed", "r1")
    failures.failed("w1", "timeout", "r2", "request %s: it failed", "r2")
    await until(lambda: len(caplog.records) == 3, what="the count and the end")
    took = time.monotonic() - began
    said = [r.getMessage() for r in caplog.records]
    # The loop's timers, late under load: the count at a period or more, the end a period after it,
    # each said with the time it really took.
    count = re.fullmatch(
        r"worker w1: 1 more legs failed with timeout before their first output in the last (\d+)s "
        r"\(2 since (\d+)s ago\), the last: request r2: it failed",
        said[1],
    )
    assert count is not None and count[1] == count[2] and int(count[1]) <= round(took), said
    end = re.fullmatch(
        r"worker w1 had no timeout failure for 0.05s: 2 of its legs failed with timeout before their first output "
        r"over (\d+\.\d)s",
        said[2],
    )
    assert end is not None and 0.1 <= float(end[1]) <= round(took, 1), (said, took)


async def test_an_episode_ends_on_its_timer_only_a_period_after_its_last_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stalled loop fires the timer late, after a failure said the count: the episode was said to
    have had no failure for the period though one had just come (review of 2026-12-07)."""
    now = [0.0]
    failures = LegFailures(logging.getLogger("router.test"), every_s=0.05, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="router.test")
    failures.failed("w1", "timeout", "r1", "request %s: it failed", "r1")
    failures.failed("w1", "timeout", "r2", "request %s: it failed", "r2")
    now[0] += 0.3  # the loop stalled past the timer
    failures.failed("w1", "timeout", "r3", "request %s: it failed", "r3")  # says the count: the timer is late
    await asyncio.sleep(0.1)  # the late timer fires
    assert not any("had no timeout failure" in r.getMessage() for r in caplog.records), caplog.records
    now[0] += 0.1
    await until(lambda: "had no timeout failure for 0.05s" in caplog.records[-1].getMessage(), what="its end")
    assert ": 3 of its legs failed with timeout" in caplog.records[-1].getMessage()


async def test_failures_in_one_stalled_stretch_are_counted_once_per_period(caplog: pytest.LogCaptureFixture) -> None:
    """A stalled loop: a failure says the count as its timer is late, a second one comes before the
    overdue timer runs, which counted it at once: two count WARNINGs back to back (final read of
    2026-12-07)."""
    now = [0.0]
    failures = LegFailures(logging.getLogger("router.test"), every_s=0.3, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="router.test")
    failures.failed("w", "refused", "r0", "request %s: cause %s", "r0", "A")
    now[0] += 0.4  # the loop stalled past the timer
    failures.failed("w", "refused", "r1", "request %s: cause %s", "r1", "B")  # says the count: the timer is late
    failures.failed("w", "refused", "r2", "request %s: cause %s", "r2", "C")  # the same stalled stretch
    await asyncio.sleep(0.35)  # the overdue timer runs, and its next is not due (the clock stood still)
    counts = [r.getMessage() for r in caplog.records if "more legs failed" in r.getMessage()]
    assert len(counts) == 1 and "the last: request r1: cause B" in counts[0], counts
    now[0] += 0.35  # past the period from the count said at 0.4
    await until(
        lambda: any("the last: request r2: cause C" in r.getMessage() for r in caplog.records), what="its count"
    )
    failures.close()


async def test_requests_failing_on_dead_engines_are_said_once_per_worker(
    cluster: Cluster, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    # Health checks 5 s apart: the shims keep their dead engines registered through the 20 requests
    # (at 0.1 s they deregistered mid-test on a loaded box, and a worker's episode ended with it)
    workers = [await cluster.add_worker("agg", shim={"health_interval_s": 5.0}) for _ in range(2)]
    router = await cluster.add_ready_router(disagg="never")
    for w in workers:
        await w.sim.stop()  # its port refuses: the shim's leg fails at connect, engine_unavailable
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.clear()
    codes = []
    for _ in range(20):
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
        async with http.post(router.url + "/v1/completions", json=body) as resp:
            codes.append(resp.status)
    assert codes == [503] * 20, codes
    per_request = [
        r for r in caplog.records if r.levelno == logging.DEBUG and "failed before its first output" in r.getMessage()
    ]
    assert len(per_request) >= 15, len(per_request)  # the first of each worker's episode at WARNING
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("router")]
    engine_lines = [line for line in warned if "engine_unavailable" in line]
    assert 1 <= len(engine_lines) <= 4, warned  # per worker: its retry's episode, its 503s'
    assert all("ConnectionKey" not in line and "connection refused 127.0.0.1:" in line for line in engine_lines)
    await router.stop()
    ends = [
        r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "of its legs failed" in r.getMessage()
    ]
    assert ends and sum(int(e.split(": ")[1].split()[0]) for e in ends) >= 20, ends
