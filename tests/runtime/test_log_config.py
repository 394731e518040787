"""KVSWITCH_LOG_LEVEL and KVSWITCH_LOG_FORMAT: a value no logger takes is refused at startup, naming
the variable and the allowed values (not a traceback, not a silent fallback to text)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from runtime import LogConfigError, configure_logging, run_service


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("KVSWITCH_LOG_LEVEL", "verbose", "debug, info, warning, error, critical"),
        ("KVSWITCH_LOG_FORMAT", "jsn", "text, json"),
    ],
)
def test_an_unknown_log_level_or_format_is_refused_naming_the_variable(
    name: str, value: str, allowed: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(LogConfigError, match=f"invalid {name} = '{value}': allowed values: {allowed}"):
        configure_logging()
    ran: list[bool] = []

    async def main(stop: asyncio.Event) -> int:
        ran.append(True)
        return 0

    assert run_service(main) == 2 and not ran
    assert f"invalid {name} = '{value}'" in capsys.readouterr().err


def test_text_lines_are_stamped_in_utc_and_other_formatters_keep_their_clock() -> None:
    configure_logging("info", "text")  # tests/conftest.py puts the root's handlers back
    configure_logging("info", "text")
    (handler,) = logging.getLogger().handlers  # a second call replaces the first
    assert handler.formatter is not None and handler.formatter.converter is time.gmtime
    record = logging.LogRecord("kvswitch", logging.INFO, __file__, 1, "up", None, None)
    record.created = 0.0  # midnight UTC: a local clock east or west of it says another hour
    assert handler.formatter.format(record).startswith("1970-01-01 00:00:00")
    # it was set on logging.Formatter itself: pytest's log capture and any library's formatter
    # turned UTC with it, and stayed so after the configuration was put back
    assert logging.Formatter().converter is time.localtime
