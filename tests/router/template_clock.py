"""A `datetime` for router.tokenization whose now() is set by the test: a chat template's
strftime_now reads it, so a test puts the router or a worker on the day it needs."""

from __future__ import annotations

import datetime
from typing import cast


class TemplateClock:
    """Monkeypatch `router.tokenization.datetime` with `.datetime`; move the time with `.at`."""

    def __init__(self, at: datetime.datetime) -> None:
        outer = self

        class _Datetime(datetime.datetime):
            @classmethod
            def now(cls, tz: datetime.tzinfo | None = None) -> _Datetime:
                return cast(_Datetime, outer.at)

        self.at = at
        self.datetime = _Datetime
