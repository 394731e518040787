"""A model whose requests the settings send to prefill workers it does not have: said once.

`kvswitch up --agg 1 --disagg always` came up healthy and aggregated every request without a word;
only `kvswitch_router_decisions_total{outcome="aggregated"}` (or `no_prefill_pool` on a decode
worker) told it from `--disagg never`."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from protocol.messages import WorkerInfo
from router.policies import Outcome, Path
from tests.router.test_planner import Fleet, winfo

UNPAIRED = "asks for remote prefills, but no prefill worker of it is registered"


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and UNPAIRED in r.getMessage()]


@pytest.mark.parametrize(
    ("worker", "flat", "outcome", "asked"),
    [
        (winfo("a1", "agg"), {"disagg": "always"}, Outcome.AGGREGATED, "disagg=always"),
        (winfo("d1"), {"disagg": "always"}, Outcome.NO_PREFILL_POOL, "disagg=always"),
        (
            winfo("d1"),
            {"conditional_disagg": True},
            Outcome.NO_PREFILL_POOL,
            "disagg=conditional with conditional_disagg on",
        ),
    ],
)
def test_a_model_with_no_prefill_worker_is_a_warning_once_where_remote_prefills_are_asked_for(
    worker: WorkerInfo, flat: dict[str, Any], outcome: Outcome, asked: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.disagg")
    f = Fleet(worker, **flat)
    for i in range(3):
        plan = f.planner.take(f.ctx(list(range(100 * i, 100 * i + 64)), f"r{i}"))
        assert plan is not None and plan.outcome is outcome
        f.planner.ledger.free(plan.key)
    said = _said(caplog)
    assert len(said) == 1, said
    assert said[0].startswith(f"model m: {asked} asks for remote prefills") and f"outcome {outcome}" in said[0]
    assert f.planner.disagg.counts[outcome] == 3  # the counter shows it too, as before


@pytest.mark.parametrize("flat", [{}, {"disagg": "never"}])
def test_an_aggregated_fleet_as_asked_is_no_warning(flat: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """The default (disagg=conditional, the policy off) prefills remotely only where prefill
    workers exist: a fleet without any is aggregated as asked, and says nothing."""
    caplog.set_level(logging.WARNING, logger="router.disagg")
    f = Fleet(winfo("a1", "agg"), winfo("d1"), **flat)
    for i in range(2):
        plan = f.planner.take(f.ctx(list(range(64)), f"r{i}"))
        assert plan is not None and plan.path is Path.AGG
    assert _said(caplog) == []


def test_prefill_workers_of_the_model_registered_but_left_out_are_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefill worker registered, but not routable now (repairing), is /ready's to name: the
    warning is for a model with none at all."""
    caplog.set_level(logging.WARNING, logger="router.disagg")
    f = Fleet(winfo("d1"), winfo("p1", "prefill"), sync={"p1": ("repairing", "gap")}, disagg="always")
    plan = f.planner.take(f.ctx(list(range(64))))
    assert plan is not None and plan.outcome is Outcome.NO_PREFILL_POOL
    assert _said(caplog) == []


def test_the_warning_is_said_again_after_the_model_had_a_prefill_worker(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.disagg")
    f = Fleet(winfo("d1"), disagg="always")
    f.planner.take(f.ctx(list(range(64)), "a"))
    f.infos.append(winfo("p1", "prefill"))
    f.planner.eligibility.added("p1")
    f.report("p1")
    remote = f.planner.take(f.ctx(list(range(64)), "b"))
    assert remote is not None and remote.path is Path.REMOTE
    f.infos.pop()
    f.planner.take(f.ctx(list(range(64)), "c"))
    f.planner.take(f.ctx(list(range(64)), "d"))
    assert len(_said(caplog)) == 2
