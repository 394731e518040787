"""KVSWITCH_LOG_LEVEL and KVSWITCH_LOG_FORMAT: a value no logger takes is refused at startup, naming
the variable and the allowed values (not a traceback, not a silent fallback to text)."""

from __future__ import annotations

import asyncio

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
