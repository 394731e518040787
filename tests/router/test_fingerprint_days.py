"""router.fingerprint_days: a template that writes today's date (Llama 3.2's and 3.3's) gives a
worker of the router's own tokenizer another fingerprint on another day; the router takes every
day's a worker may have probed on, and still refuses another tokenizer."""

from __future__ import annotations

import asyncio
import datetime
import json
import threading
from functools import partial
from pathlib import Path

import pytest

from protocol import WorkerInfo
from protocol.config import RouterSettings
from router import tokenization
from router.block_index import BlockIndex
from router.fingerprint_days import BACK_DAYS, FingerprintDays
from router.load_view import LoadView
from router.planner import standalone_planner
from router.service import RouterConfig, RouterService
from router.tokenization import FingerprintWatch, PromptTokenizer, fingerprints_on, load_tokenizer
from tests.router.fingerprint_variants import build_variant
from tests.router.polling import until
from tests.router.template_clock import TemplateClock

MONDAY = datetime.date(2026, 12, 7)


def _dated(folder: Path, variant: str = "llama31", written: str = "%d %b %Y") -> Path:
    """`variant` with Llama 3.2's `Today Date:` line (strftime_now(`written`)) ahead of its template."""
    build_variant(variant, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = f"{{{{- 'Today Date: ' + strftime_now('{written}') + '\\n' }}}}" + config["chat_template"]
    config_file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def dated(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    return load_tokenizer(_dated(tmp_path_factory.mktemp("dated")))


def _info(worker: str, tokenizer: str) -> WorkerInfo:
    return WorkerInfo(worker=worker, model="llama-3.3", role="agg", engine="vllm", block_size=16, tokenizer=tokenizer)


def _at(when: datetime.datetime) -> partial[datetime.datetime]:
    return partial(lambda t: t, when)


def _probed(tok: PromptTokenizer, day: datetime.date) -> str:
    return fingerprints_on(tok, day).current


def test_a_worker_started_after_midnight_matches_a_router_started_before_it(dated: PromptTokenizer) -> None:
    # The audit's repro: the router at 23:59, a worker of the same files two minutes later, the
    # next day; they differed, and a rolling restart across midnight lost every chat request.
    days = FingerprintDays(
        partial(fingerprints_on, dated), now=_at(datetime.datetime(2026, 12, 7, 23, 59, tzinfo=datetime.UTC))
    )
    assert days.dated and _probed(dated, MONDAY) != _probed(dated, MONDAY + datetime.timedelta(days=1))
    watch = FingerprintWatch(days)
    for n, day in enumerate((MONDAY - datetime.timedelta(days=1), MONDAY, MONDAY + datetime.timedelta(days=1))):
        watch.check(_info(f"w{n}", _probed(dated, day)))  # in any time zone: a day either side of UTC's
    assert watch.report()["text_refused"] == []


def test_another_tokenizer_is_refused_on_every_day_and_told_the_date_may_be_why(
    dated: PromptTokenizer, tmp_path: Path
) -> None:
    days = FingerprintDays(
        partial(fingerprints_on, dated), now=_at(datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.UTC))
    )
    other = load_tokenizer(_dated(tmp_path / "other", "llama31_added_token"))
    watch = FingerprintWatch(days)
    watch.check(_info("other", _probed(other, MONDAY)))
    watch.check(_info("old", _probed(dated, MONDAY - datetime.timedelta(days=3))))  # before the router's days
    why = {r["worker"]: r["why"] for r in watch.report()["text_refused"]}
    assert set(why) == {"other", "old"}
    for text in why.values():
        assert "writes today's date (strftime_now)" in text and "from 2026-12-06 to 2026-12-08" in text
        assert "restart that worker's shim" in text and "give the router the tokenizer" in text


async def test_the_days_before_the_start_are_taken_on_a_thread_where_the_template_writes_the_date(
    dated: PromptTokenizer,
) -> None:
    threads: list[str] = []

    def on(day: datetime.date) -> tokenization.Fingerprints:
        threads.append(threading.current_thread().name)
        return fingerprints_on(dated, day)

    days = FingerprintDays(on, now=_at(datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.UTC)))
    probed_before = _probed(dated, MONDAY - datetime.timedelta(days=20))  # a worker up three weeks
    assert not days.accepts(probed_before)
    await days.backfill()
    assert days.accepts(probed_before)
    assert not days.accepts(_probed(dated, MONDAY - datetime.timedelta(days=BACK_DAYS + 2)))
    assert len(threads) == 3 + BACK_DAYS
    main = threading.main_thread().name
    assert threads[:3] == [main] * 3 and main not in threads[3:], "the first days as the router is built, then threads"


async def test_each_new_day_is_added_and_none_dropped(dated: PromptTokenizer) -> None:
    now = [datetime.datetime(2026, 12, 7, 23, 59, tzinfo=datetime.UTC)]
    days = FingerprintDays(partial(fingerprints_on, dated), now=lambda: now[0])
    thursday = _probed(dated, MONDAY + datetime.timedelta(days=3))
    assert not days.accepts(thursday)
    now[0] = datetime.datetime(2026, 12, 10, 0, 1, tzinfo=datetime.UTC)
    await days.catch_up()
    assert days.accepts(thursday) and days.accepts(_probed(dated, MONDAY - datetime.timedelta(days=1)))


async def test_follow_adds_the_next_day_as_a_utc_day_begins(dated: PromptTokenizer) -> None:
    now = [datetime.datetime(2026, 12, 7, 23, 59, 59, 950000, tzinfo=datetime.UTC)]
    days = FingerprintDays(partial(fingerprints_on, dated), now=lambda: now[0])
    wednesday = _probed(dated, MONDAY + datetime.timedelta(days=2))
    task = asyncio.create_task(days.follow())
    try:
        await asyncio.sleep(0.2)  # asleep until midnight: the clock has not moved
        assert not days.accepts(wednesday)
        now[0] = datetime.datetime(2026, 12, 8, 0, 0, 1, tzinfo=datetime.UTC)
        await until(lambda: days.accepts(wednesday), timeout=5.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_planner_says_the_date_may_be_why_a_worker_differs(dated: PromptTokenizer) -> None:
    days = FingerprintDays(
        partial(fingerprints_on, dated), now=_at(datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.UTC))
    )
    stale = _info("w1", _probed(dated, MONDAY - datetime.timedelta(days=BACK_DAYS + 5)))
    planner = standalone_planner(
        RouterSettings(), lambda: [stale], index=BlockIndex(), view=LoadView(), tokenizer=days.current
    )
    planner.fingerprints = days
    assert "writes today's date" in planner._tokenizer_why(stale)
    assert "writes today's date" in planner.text_refusal("llama-3.3", [stale])


async def test_a_template_that_writes_no_date_has_one_fingerprint(tmp_path: Path) -> None:
    tok = load_tokenizer(build_variant("llama31", tmp_path))
    taken: list[str] = []

    def on(day: datetime.date) -> tokenization.Fingerprints:
        pair = fingerprints_on(tok, day)
        taken.append(pair.current)
        return pair

    days = FingerprintDays(on, now=_at(datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.UTC)))
    await days.backfill()
    # every day is taken (whether a template writes the date shows only over a month: the next test)
    assert len(taken) == 3 + BACK_DAYS and set(taken) == {days.current}
    assert not days.dated and days.note() == ""
    assert days.current == tokenization.tokenizer_fingerprint(tok)


async def test_a_template_that_writes_the_month_alone_takes_the_days_before_the_start(tmp_path: Path) -> None:
    # strftime_now('%B %Y') renders alike on adjacent days: the back days were taken only when the first
    # three differed, so a worker probed last month was refused, told nothing of the date (review of 2026-12-07).
    tok = load_tokenizer(_dated(tmp_path / "month", written="%B %Y"))
    days = FingerprintDays(
        partial(fingerprints_on, tok), now=_at(datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.UTC))
    )
    november = _probed(tok, datetime.date(2026, 11, 28))
    assert not days.accepts(november)
    await days.backfill()
    assert days.dated and days.accepts(november)
    watch = FingerprintWatch(days)
    watch.check(_info("november", november))
    watch.check(_info("october", _probed(tok, datetime.date(2026, 10, 20))))  # before the back days
    assert [r["worker"] for r in watch.report()["text_refused"]] == ["october"]
    assert "writes today's date (strftime_now)" in watch.report()["text_refused"][0]["why"]


async def test_a_worker_refused_is_taken_off_ready_once_its_day_is_added(dated: PromptTokenizer) -> None:
    # Its engine's clock two days ahead: refused until the router's days reach it at midnight; /ready and
    # /debug/workers listed it refused from then on, though text was routed to it (review of 2026-12-07).
    now = [datetime.datetime(2026, 12, 7, 23, tzinfo=datetime.UTC)]
    days = FingerprintDays(partial(fingerprints_on, dated), now=lambda: now[0])
    watch = FingerprintWatch(days)
    ahead = _info("ahead", _probed(dated, MONDAY + datetime.timedelta(days=2)))
    stale = _info("stale", _probed(dated, MONDAY - datetime.timedelta(days=3)))
    watch.check(ahead)
    watch.check(stale)
    assert watch.summary()["text_refused_total"] == 2
    now[0] = datetime.datetime(2026, 12, 8, 0, 0, 5, tzinfo=datetime.UTC)
    await days.catch_up()
    assert [r["worker"] for r in watch.report()["text_refused"]] == ["stale"]
    assert watch.summary()["text_refused_total"] == 1
    assert "from 2026-12-06 to 2026-12-09" in watch.report()["text_refused"][0]["why"], "the days named are now's"


def test_a_router_takes_text_to_a_worker_whose_engine_probed_tomorrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The router as built today; a worker's engine (the same files) renders the probes with its own
    # clock, already on tomorrow's date (it restarted after midnight, or runs in a zone ahead).
    folder = _dated(tmp_path / "dated")
    router = RouterService(RouterConfig(tokenizer=str(folder)))
    # the router's own last day, the UTC day after its start: a second read of the clock could be a
    # day later than the router's, past midnight
    tomorrow = router.fingerprint_days.span[1]
    monkeypatch.setattr(
        tokenization, "datetime", TemplateClock(datetime.datetime(tomorrow.year, tomorrow.month, tomorrow.day, 0, 1))
    )
    worker = _info("w1", tokenization.tokenizer_fingerprint(load_tokenizer(str(folder))))
    monkeypatch.undo()
    router.fingerprints.check(worker)
    assert router.fingerprints.report()["text_refused"] == []
    assert router.eligibility.takes_text(worker)


def test_the_planner_tells_a_refused_client_the_tokenizers_caveat_not_to_give_another(
    dated: PromptTokenizer,
) -> None:
    """A tokenizer whose class transformers builds with its own pipeline (router.tokenizer_class)
    has a caveat: no --tokenizer mends the mismatch. /debug/workers said so, while the 503 of a
    text request told the client to find a router with the worker's tokenizer (final read of
    2026-12-07)."""
    days = FingerprintDays(
        partial(fingerprints_on, dated), now=_at(datetime.datetime(2026, 12, 7, 12, tzinfo=datetime.UTC))
    )
    other = _info("w1", "tok-0123456789abcdef")
    planner = standalone_planner(
        RouterSettings(), lambda: [other], index=BlockIndex(), view=LoadView(), tokenizer=days.current
    )
    planner.caveat = "tokenizer_config.json names Qwen3_5Tokenizer: save the tokenizer as the engine loads it"
    assert planner._tokenizer_why(other).endswith(planner.caveat)
    refusal = planner.text_refusal("m", [other])
    assert planner.caveat in refusal and "a router of its own" not in refusal
    assert refusal.endswith("Send token ids (a completion's `prompt` as a list of ids) to this one.")
