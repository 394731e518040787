"""Reading the few samples the shim needs from Prometheus text exposition (vLLM's and SGLang's /metrics)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = ["Sample", "mean_samples", "parse_samples", "repeated_series", "sum_samples"]

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
