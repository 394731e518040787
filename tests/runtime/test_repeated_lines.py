"""A library that logs every retry says it once, then at most every 30 s with a count."""

from __future__ import annotations

import logging

import pytest

from runtime import RepeatedLines, configure_logging


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(name: str, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_a_repeated_line_goes_through_once_then_every_period_with_a_count() -> None:
    clock = Clock()
    f = RepeatedLines(("etcd3aio",), every_s=30.0, clock=clock)
    retry = "watch: transient error (%s), reconnecting in %.2f s"
    passed = []
    for i in range(6):  # three watches, two rounds of retries
        clock.now += 0.5 * (i % 3 == 0)
        r = record("etcd3aio.watch", retry, "UNAVAILABLE", 1.0)
        if f.filter(r):
            passed.append(r.getMessage())
    assert passed == ["watch: transient error (UNAVAILABLE), reconnecting in 1.00 s"]
    assert f.filter(record("etcd3aio.lease", "another line")), "another line is news"
    assert all(f.filter(record("router.service", "ours")) for _ in range(3)), "our own lines are never held"
    clock.now += 30.5  # 31 s after the line first went through
    r = record("etcd3aio.watch", retry, "UNAVAILABLE", 5.0)
    assert f.filter(r)
    assert r.getMessage() == "watch: transient error (UNAVAILABLE), reconnecting in 5.00 s (5 more like it in 31s)"
    assert not f.filter(record("etcd3aio.watch", retry, "UNAVAILABLE", 5.0))


def test_services_log_etcd3aio_retries_through_the_filter(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "text")
        for _ in range(3):
            logging.getLogger("etcd3aio.watch").warning("watch: transient error (%s)", "UNAVAILABLE")
        logging.getLogger("router.service").warning("ours")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" ", 3)[-1] for line in lines] == [
        "etcd3aio.watch: watch: transient error (UNAVAILABLE)",
        "router.service: ours",
    ]
