"""TransferFailures: the engine's failed-pull counter, read with the load polls, less the pulls
whose legs failed (the router saw those); and which failed legs the request service counts (a real
nats-server, an engine adapter that fails every leg)."""

from __future__ import annotations

import logging
from typing import cast

import pytest

from protocol import GenerateRequest, SamplingParams
from protocol.messages import TransferHandle
from tests.worker_shim.cluster import decode_leg_final
from worker_shim.adapters.base import EngineAdapter, EngineError, LegOutcome, LegRequest, OnOutput
from worker_shim.transfer_failures import LEG_READINGS, TransferFailures


def test_a_rise_no_failed_leg_explains_by_the_next_reading_is_silent() -> None:
    t = TransferFailures("e")
    assert not t.reading(3, 0.0)  # the first reading is the baseline
    assert not t.reading(5, 0.25)  # two failures seen: judged at the next reading
    assert t.reading(5, 0.5) and t.total == 2
    assert not t.reading(0, 0.75)  # the engine restarted: a new baseline
    assert not t.reading(1, 1.0)
    assert t.reading(1, 1.25) and t.total == 3
    assert not t.reading(None, 1.5)  # no counter: nothing, and the next reading is a baseline
    assert not t.reading(9, 1.75) and not t.reading(9, 2.0) and t.total == 3


def test_pulls_whose_legs_failed_are_not_silent_whichever_comes_first() -> None:
    t = TransferFailures("e")
    t.reading(0, 0.0)
    assert not t.reading(1, 0.25)  # the engine counted it; the leg's 500 is still on its way
    t.leg_failed()
    assert not t.reading(1, 0.5) and t.total == 0
    t.leg_failed()  # the leg's 500 came before the reading that holds its count
    assert not t.reading(2, 0.75) and not t.reading(2, 1.0) and t.total == 0
    assert not t.reading(3, 1.25) and t.reading(3, 1.5) and t.total == 1  # a third, silent


def test_a_warning_when_silent_failures_start_after_a_quiet_minute(caplog: pytest.LogCaptureFixture) -> None:
    t = TransferFailures("http://engine", quiet_s=60.0)
    with caplog.at_level(logging.WARNING, logger="worker_shim.transfer_failures"):
        for at, count in ((0.0, 0), (1.0, 1), (2.0, 1), (30.0, 4), (31.0, 4), (89.0, 5), (90.0, 5), (150.0, 6)):
            t.reading(count, at)
        t.reading(6, 151.0)  # 61 s after the last: a new episode
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "http://engine failed 1 KV pull(s) without failing the request" in warned[0]
    assert t.total == 6


def test_a_failed_leg_the_engine_never_counted_hides_no_later_silent_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A leg that failed with a 500 of another cause is forgotten within LEG_READINGS readings, not
    banked against the silent pull failures that come later."""
    t = TransferFailures("e")
    t.reading(0, 0.0)
    for _ in range(3):
        t.leg_failed()
    for i in range(1, 1 + LEG_READINGS):
        assert not t.reading(0, i * 0.25)  # no rise to match: they age out
    with caplog.at_level(logging.WARNING, logger="worker_shim.transfer_failures"):
        assert not t.reading(3, 1.0)  # three silent failures, judged at the next reading
        assert t.reading(3, 1.25)
    assert (t.failed_legs, t.total) == (3, 3) and len(caplog.records) == 1


def test_the_failed_legs_of_an_engine_run_are_forgotten_when_its_counter_restarts() -> None:
    t = TransferFailures("e")
    t.reading(5, 0.0)
    t.leg_failed()
    t.leg_failed()
    assert not t.reading(0, 0.25)  # the engine restarted: those legs died with the old run
    assert not t.reading(2, 0.5)
    assert t.reading(2, 0.75) and t.total == 2


def test_a_leg_explains_at_most_one_rise_and_only_one_near_it() -> None:
    t = TransferFailures("e")
    t.reading(0, 0.0)
    t.leg_failed()
    assert not t.reading(1, 0.25) and not t.reading(1, 0.5) and t.total == 0  # its own pull
    assert not t.reading(2, 0.75) and t.reading(2, 1.0) and t.total == 1  # the next one is silent


@pytest.mark.parametrize("leg_first", [True, False])
def test_a_rise_its_leg_explained_stays_explained_when_the_engine_restarts_next(
    leg_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine failed a pull with its own 500 and went down before the next good poll: the first
    reading of its new run still judges that rise against the leg, and finds nothing silent."""
    t = TransferFailures("e")
    t.reading(5, 0.0)
    t.reading(5, 0.25)
    if leg_first:
        t.leg_failed()
    assert not t.reading(6, 0.5)  # the rise, judged at the next reading
    if not leg_first:
        t.leg_failed()
    with caplog.at_level(logging.WARNING, logger="worker_shim.transfer_failures"):
        assert not t.reading(0, 60.0)  # the restarted engine's first reading
        assert not t.reading(0, 60.25)
    assert (t.total, t.rises, t.failed_legs) == (0, 1, 1) and not caplog.records


class _Failing:
    """An engine adapter whose every leg ends with `error` before any output."""

    kind = "vllm"

    def __init__(self, error: EngineError) -> None:
        self.error = error

    async def generate(self, leg: LegRequest, on_output: OnOutput) -> LegOutcome:
        raise self.error


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        (EngineError(500, "engine_error", "the engine failed the request"), True),  # vLLM's failed pull
        (EngineError(503, "engine_unavailable", "connection refused"), False),  # the engine is gone
        (EngineError(502, "engine_protocol", "the stream was cut"), False),
    ],
)
async def test_only_the_engines_own_500_on_a_transfer_fed_leg_counts_as_a_failed_pull(
    nats_url: str, ns: str, error: EngineError, counted: bool
) -> None:
    """An engine that crashes with transfer-fed legs queued fails them with `engine_unavailable`; its
    failed-pull counter never counts those, so they must not offset later silent failures."""
    req = GenerateRequest(
        request_id="r1", model="m", token_ids=[1] * 32, sampling=SamplingParams(max_tokens=4),
        disagg=TransferHandle(engine="vllm", params={"do_remote_prefill": True}),
    )  # fmt: skip
    final, failed = await decode_leg_final(nats_url, ns, cast(EngineAdapter, _Failing(error)), req)
    assert final.error is not None and final.error.kind == error.kind
    assert failed == (["leg"] if counted else [])
