"""A model's fleet going out of routing, and back, is one line each (router.fleet_news)."""

from __future__ import annotations

import logging

import pytest

from router.eligibility import Exclusion, WorkerStatus
from router.fleet_news import BOOTSTRAP_GRACE_S, CHECK_S, DEPARTED_AT_MOST, WINDOW_CHECKS, FleetNews
from tests.router.conftest import Cluster
from tests.router.polling import until


def fleet(n: int, **excluded: Exclusion | None) -> list[WorkerStatus]:
    """`n` decode workers of model m (w00...), routable unless named in `excluded`, and a prefill one."""
    ids = [f"w{i:02d}" for i in range(n)]
    out = [WorkerStatus(w, "m", "decode", excluded.get(w), "", True) for w in ids]
    return [*out, WorkerStatus("p", "m", "prefill", Exclusion.SILENT, "", True)]


def every(n: int, reason: Exclusion | None, first: int | None = None) -> list[WorkerStatus]:
    """`n` decode workers, the first `first` (all: None) excluded as `reason`."""
    cut = n if first is None else first
    return fleet(n, **{f"w{i:02d}": reason for i in range(cut)})


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    out = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.fleet_news"]
    caplog.clear()
    return out


def test_a_fleet_gone_silent_is_one_warning_counting_it_and_its_recovery_one_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(20, None), 0.0)
    assert lines(caplog) == []
    news.check(every(20, Exclusion.SILENT), 1.0)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "model m: none of its 20 decode or agg workers" in text, text
    assert "silent: 20" in text and "w07 (silent)" in text and "w08" not in text and "and 12 more" in text
    for t in range(2, 10):  # once per episode
        news.check(every(20, Exclusion.SILENT), float(t))
    assert lines(caplog) == []
    news.check(every(20, Exclusion.SILENT, first=19), 10.0)
    ((level, text),) = lines(caplog)
    assert level == "INFO" and "1 of its 20 decode or agg workers take requests again" in text, text


def test_a_fleet_left_out_softly_still_takes_requests(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(4, Exclusion.ENGINE_UNHEALTHY), 0.0)  # /ready's rule: they take its requests
    assert lines(caplog) == []


def test_a_fleet_bootstrapping_is_said_only_once_it_has_had_the_grace(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(20, Exclusion.BOOTSTRAPPING), 100.0)  # a fresh router
    news.check(every(20, Exclusion.BOOTSTRAPPING), 100.0 + BOOTSTRAP_GRACE_S - 1)
    assert lines(caplog) == []
    news.check(every(20, Exclusion.BOOTSTRAPPING), 100.0 + BOOTSTRAP_GRACE_S)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "bootstrapping: 20" in text, text
    # A reason other than bootstrapping is said at once.
    news.check(fleet(2, w00=Exclusion.BOOTSTRAPPING, w01=Exclusion.EVENTS_DOWN), 0.0)
    news.check(fleet(2), 1.0)
    news.check(fleet(2, w00=Exclusion.BOOTSTRAPPING, w01=Exclusion.EVENTS_DOWN), 2.0)
    assert [level for level, _ in lines(caplog)] == ["INFO", "WARNING"]


def unrouted(*ids: str) -> list[WorkerStatus]:
    """Decode workers of model m left out of routing for their max_model_len: they take no request, ever."""
    return [WorkerStatus(w, "m", "decode", Exclusion.CONTEXT_CONFLICT, "", True) for w in ids]


def test_a_worker_left_out_for_its_max_model_len_leaves_a_fresh_router_its_startup_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In the pool, its reason (not bootstrapping) ended the grace at the first check: a fresh
    # router said every request was refused (review of 2026-12-06).
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check([*every(2, Exclusion.BOOTSTRAPPING), *unrouted("c1")], 100.0)  # a fresh router
    news.check([*every(2, Exclusion.BOOTSTRAPPING), *unrouted("c1")], 100.0 + BOOTSTRAP_GRACE_S - 1)
    assert lines(caplog) == []
    assert news.excluded["m"] == {Exclusion.BOOTSTRAPPING: 2, Exclusion.CONTEXT_CONFLICT: 1}  # the figures keep it
    news.check([*every(2, Exclusion.BOOTSTRAPPING), *unrouted("c1")], 100.0 + BOOTSTRAP_GRACE_S)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "none of its 2 decode or agg workers" in text, text
    assert "(bootstrapping: 2)" in text and "c1" not in text, text


def test_workers_left_out_for_their_max_model_len_are_no_part_of_the_half_rules_fleet(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 2 of the 3 routed workers gone silent at once, beside 2 never routed: counted in the pool,
    # 2 of 5 was not more than half, and nothing was said (review of 2026-12-06).
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check([*every(3, None), *unrouted("c1", "c2")], 0.0)
    news.check([*every(3, Exclusion.SILENT, first=2), *unrouted("c1", "c2")], 1.0)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "2 of its 3 decode or agg workers went from routable to silent" in text, text
    assert news.routable == {"m": 1} and news.excluded["m"] == {Exclusion.SILENT: 2, Exclusion.CONTEXT_CONFLICT: 2}


def test_more_than_half_of_a_fleet_out_for_one_reason_at_once_is_a_fleet_wide_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(20, None), 0.0)
    news.check(every(20, Exclusion.EVENTS_DOWN, first=10), 1.0)  # half: each worker's own, maybe
    assert lines(caplog) == []
    news.check(every(20, None), 2.0)
    news.check(every(20, Exclusion.EVENTS_DOWN, first=11), 3.0)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "11 of its 20 decode or agg workers went from routable to events_down" in text
    news.check(every(20, Exclusion.EVENTS_DOWN, first=15), 4.0)  # the same episode
    assert lines(caplog) == []
    news.check(every(20, Exclusion.EVENTS_DOWN, first=10), 5.0)
    assert [level for level, _ in lines(caplog)] == ["INFO"]


def test_a_cut_that_reaches_the_fleet_over_two_checks_is_a_fleet_wide_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cut reaches the workers over one report period: each goes silent when its own last report
    # ages past SILENT_PERIODS periods. Judged between two checks, 9 of 20 then 9 more were each
    # half or fewer, and nothing was said while 2 of 20 served (review of 2026-12-06).
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(20, None), 0.0)
    news.check(every(20, Exclusion.SILENT, first=9), 1.0)
    assert lines(caplog) == []
    news.check(every(20, Exclusion.SILENT, first=18), 2.0)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "18 of its 20 decode or agg workers went from routable to silent within 2.0 s" in text
    assert "2 take requests" in text, text
    news.check(every(20, Exclusion.SILENT, first=18), 3.0)  # the same episode
    assert lines(caplog) == []


def test_the_fleet_wide_window_is_as_long_as_the_longest_report_period_takes_to_go_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    slow = FleetNews()  # shims reporting every 2 s go silent over 2 s, said within SILENT_PERIODS of them
    slow.check(every(20, None), 0.0, period_s=2.0)
    slow.check(every(20, Exclusion.SILENT, first=9), 1.0, period_s=2.0)
    slow.check(every(20, Exclusion.SILENT, first=18), 6.0, period_s=2.0)
    assert [level for level, _ in lines(caplog)] == ["WARNING"]
    # Workers going out one by one, slower than the window, are each worker's own cause.
    churn = FleetNews()
    churn.check(every(20, None), 0.0)
    churn.check(every(20, Exclusion.SILENT, first=9), 1.0)
    churn.check(every(20, Exclusion.SILENT, first=18), 1.0 + WINDOW_CHECKS * CHECK_S + 1)
    assert lines(caplog) == []


def test_a_model_whose_workers_left_while_out_keeps_its_episode_until_one_takes_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(2, Exclusion.SILENT), 0.0)
    assert [level for level, _ in lines(caplog)] == ["WARNING"]
    news.check([], 1.0)  # their leases expired: /ready is still 503, nothing recovered
    assert lines(caplog) == []
    news.check(every(2, Exclusion.BOOTSTRAPPING), 2.0)  # new workers, not yet taking requests
    assert lines(caplog) == []
    news.check(every(2, Exclusion.BOOTSTRAPPING, first=1), 4.0)
    ((level, text),) = lines(caplog)
    assert (
        level == "INFO" and "model m: 1 of its 2 decode or agg workers take requests again (none did for 4 s)" in text
    ), text


def test_a_model_whose_workers_all_left_is_a_warning_and_its_return_an_info(caplog: pytest.LogCaptureFixture) -> None:
    # Before, the model was dropped without a line while /ready said 503 for it.
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(3, None), 0.0)
    news.check([WorkerStatus("p", "m", "prefill", None, "", True)], 1.0)
    ((level, text),) = lines(caplog)
    assert level == "WARNING" and "model m: no decode or agg worker registered any more (1 prefill workers" in text
    for t in range(2, 5):  # once per episode
        news.check([], float(t))
    assert lines(caplog) == []
    news.check(every(3, None), 5.0)
    ((level, text),) = lines(caplog)
    assert level == "INFO", text
    assert "model m: 3 of its 3 decode or agg workers take requests again (none did for 4 s)" in text


def test_models_gone_for_good_are_forgotten_past_a_cap(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    news = FleetNews()
    models = [f"m{i:03d}" for i in range(DEPARTED_AT_MOST + 2)]
    for t, model in enumerate(models):  # a model renamed again and again: each name never comes back
        news.check([WorkerStatus("w", model, "agg", None, "", True)], float(t))
    news.check([], float(len(models)))
    said = lines(caplog)
    assert [level for level, _ in said].count("WARNING") == len(models)
    forgot = [text for level, text in said if level == "INFO"]
    assert len(forgot) == 2, forgot
    assert forgot[0].startswith(f"model m000 has had no decode or agg worker for {DEPARTED_AT_MOST} s"), forgot
    assert len(news._models) == DEPARTED_AT_MOST


def fleet_news_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """FleetNews's own lines: another logger's INFO (a reconnect, a repair) is no recovery."""
    return [r for r in caplog.records if r.name == "router.fleet_news"]


async def test_workers_that_stop_reporting_are_one_warning_naming_the_model_then_one_info(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, a whole fleet going silent took /ready to 503 with no line at INFO or above, nor
    # its recovery (log-volume audit, 2026-12-06): exclusions are computed only when read.
    workers = [await cluster.add_worker("decode") for _ in range(2)]
    router = await cluster.add_ready_router()
    caplog.set_level(logging.INFO, logger="router.fleet_news")
    (model,) = router.models()
    reporters = [w.shim.load_reporter for w in workers]
    for reporter in reporters:
        assert reporter is not None
        await reporter.stop()
    await until(lambda: any(r.levelname == "WARNING" for r in fleet_news_lines(caplog)), timeout=15, what="the warning")
    await until(lambda: not router.ready, what="/ready 503")
    for reporter in reporters:
        assert reporter is not None
        reporter.start()
    await until(lambda: any(r.levelname == "INFO" for r in fleet_news_lines(caplog)), timeout=15, what="the recovery")
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "router.fleet_news"]
    assert [level for level, _ in said] == ["WARNING", "INFO"], said
    assert f"model {model}: none of its 2 decode or agg workers" in said[0][1] and "silent: 2" in said[0][1], said
    assert all(w.id in said[0][1] for w in workers), said
    assert f"model {model}: 2 of its 2" in said[1][1] or f"model {model}: 1 of its 2" in said[1][1], said


def test_a_fleet_gone_engine_unhealthy_names_its_engines_not_nats_and_says_why_it_still_takes_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Until 2026-12-07: "2 of its 2 ... went from routable to engine_unhealthy ..., a cause common to
    the fleet (NATS, the network, a setting pushed to every worker), ...; 2 take requests": NATS had
    carried the shims' word, and 2 of 2 unhealthy taking requests read as a contradiction."""
    caplog.set_level(logging.WARNING, logger="router.fleet_news")
    news = FleetNews()
    news.check(every(2, None), 0.0)
    news.check(every(2, Exclusion.ENGINE_UNHEALTHY), 1.0)
    ((level, text),) = lines(caplog)
    assert (level, text) == (
        "WARNING",
        "model m: 2 of its 2 decode or agg workers went from routable to engine_unhealthy within 1.0 s, a cause "
        "common to the fleet (their engines or the hosts they run on: a shared GPU driver or model store, a request "
        "that crashes every engine; not NATS, which carried their shims' word of it), not each worker's; none is "
        "routable: the 2 engine_unhealthy ones take requests only because no other can (logged once until no more "
        "than half are engine_unhealthy)",
    )
    news.check(every(4, None), 2.0)
    news.check(every(4, Exclusion.ENGINE_UNHEALTHY, first=3), 3.0)  # one routable: it alone takes them
    ((_, text),) = lines(caplog)
    assert "not NATS" in text and "; 1 take requests (logged once" in text, text


def test_a_fleet_silent_while_the_routers_own_nats_does_not_answer_names_nats(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="router.fleet_news")
    nats_said = (
        "; this router's own NATS connection did not answer a round trip within 1s either: NATS (hung, or the "
        "network to it), not the workers, is the likely cause"
    )
    news = FleetNews()
    news.check(every(2, None), 0.0)
    news.check(every(2, Exclusion.SILENT), 1.0, nats_unanswered=True)
    ((_, text),) = lines(caplog)
    assert f"none of its 2 decode or agg workers can take requests (silent: 2){nats_said}, so every" in text, text
    news = FleetNews()
    news.check(every(4, None), 0.0)
    news.check(every(4, Exclusion.SILENT, first=3), 1.0, nats_unanswered=True)
    ((_, text),) = lines(caplog)
    assert (
        f"went from routable to silent within 1.0 s, a cause common to the fleet (NATS, the network, or this "
        f"router's own host){nats_said}, not each worker's; 1 take requests" in text
    ), text
    news = FleetNews()
    news.check(every(4, None), 0.0)
    news.check(every(4, Exclusion.SILENT, first=3), 1.0)  # it answered
    ((_, text),) = lines(caplog)
    assert "round trip" not in text, text
