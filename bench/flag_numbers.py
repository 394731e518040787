"""The number checks of the bench's flags, run before anything starts: a value that is not finite
and in range is a ValueError naming its flag (`kvswitch bench ...` prints it and exits 2).

Below every bench command's module (bench.cli imports overhead and replicas at load, so those could
not import the checks from it): NaN and infinities passed `<= 0` tests, and an infinite rate sent
every request at once, a NaN one none, a rate of 0 divided by zero once a cluster had started.
"""

from __future__ import annotations

import math

__all__ = ["check_non_negative", "check_positive", "positive_numbers"]


def check_positive(flag: str, value: float) -> None:
    """ValueError naming `flag` unless `value` is a finite number > 0."""
    if not 0 < value < math.inf:  # NaN fails too
        raise ValueError(f"{flag} must be > 0 and finite, got {value:g}")


def check_non_negative(flag: str, value: float) -> None:
    """ValueError naming `flag` unless `value` is a finite number >= 0."""
    if not 0 <= value < math.inf:  # NaN fails too
        raise ValueError(f"{flag} must be >= 0 and finite, got {value:g}")


def positive_numbers(flag: str, text: str) -> list[float]:
    """`text`, a comma-separated list of finite numbers > 0 (`--rates 0.5,1,2`); ValueError naming
    `flag` for one that is not a number, or not finite and > 0."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: comma-separated numbers, got {text!r}") from None
    bad = [v for v in values if not 0 < v < math.inf]
    if bad:
        raise ValueError(f"{flag} must be finite numbers > 0, got {', '.join(f'{v:g}' for v in bad)}")
    return values
