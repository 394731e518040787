"""Reading the few samples the shim needs from Prometheus text exposition (vLLM's and SGLang's /metrics),
and the counts of any engine's load reading (TensorRT-LLM's JSON stats too)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

from worker_shim.adapters.base import EngineError

__all__ = ["Sample", "as_count", "mean_samples", "parse_samples", "repeated_series", "sum_samples"]

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]


def parse_samples(text: str, names: frozenset[str]) -> Iterator[Sample]:
    """Samples whose metric name is in `names`; unparseable lines are skipped."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        if line[:name_end] not in names:
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        yield m.group(1), labels, value


def sum_samples(samples: list[Sample], name: str) -> float | None:
    """The sum over label sets (one per engine/DP rank), None when the metric is absent."""
    values = [v for n, _, v in samples if n == name]
    return sum(values) if values else None


def mean_samples(samples: list[Sample], name: str) -> float | None:
    """The mean over label sets (a ratio per engine/DP rank), None when the metric is absent."""
    values = [v for n, _, v in samples if n == name]
    return sum(values) / len(values) if values else None


def as_count(value: object, series: str) -> int | None:
    """`value` (`series`'s, summed or read) as the count it must be, None as None. EngineError (502
    `engine_protocol`) naming the series for NaN, an infinity, a fraction or no number: int() raised
    ValueError on NaN (an ERROR with a traceback, and /health named no series) and cut 2.7 to 2 with
    no word (until 2026-12-07). A whole float is its integer: vLLM prints counters as 3.0. The range
    is the load reporter's to judge (load_reporter._unusable)."""
    if value is None:
        return None
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    raise EngineError(502, "engine_protocol", f"the engine's {series} is {value!r}, not a count")


def repeated_series(samples: Iterable[Sample]) -> str | None:
    """Why the samples are no one engine's reading when a series (name and label set) is given
    twice, naming the first; None when each is there once. The text format has each series once:
    one given twice is summed twice by sum_samples (until 2026-12-07: running and waiting doubled)."""
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for name, labels, _ in samples:
        key = (name, frozenset(labels.items()))
        if key in seen:
            series = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
            return (
                f"the engine's /metrics gives {series} twice, which summed would count it twice: is it two "
                "engines behind one port, or a proxy that relabels them alike?"
            )
        seen.add(key)
    return None
