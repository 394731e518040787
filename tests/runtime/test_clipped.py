"""runtime.clipped: the one rule for how much of an error's text a log line or a status field
shows (SHOWN_CHARS), so no foreign body rides into the log whole."""

from __future__ import annotations

import pytest

from runtime import SHOWN_CHARS, clipped


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("", ""),
        ("x" * SHOWN_CHARS, "x" * SHOWN_CHARS),  # at the limit: whole
        ("x" * (SHOWN_CHARS + 1), "x" * (SHOWN_CHARS - 3) + "..."),
        ("y" * 21_269, "y" * (SHOWN_CHARS - 3) + "..."),
    ],
    ids=["empty", "at-the-limit", "one-past", "a-whole-metrics-body"],
)
def test_text_past_the_limit_is_cut_to_it_with_an_ellipsis(text: str, shown: str) -> None:
    assert clipped(text) == shown and len(clipped(text)) <= SHOWN_CHARS


def test_a_limit_of_its_own_is_kept() -> None:
    assert clipped("abcdefgh", 6) == "abc..."
