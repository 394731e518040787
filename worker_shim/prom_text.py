"""Reading the few samples the shim needs from Prometheus text exposition (vLLM's and SGLang's /metrics)."""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["Sample", "mean_samples", "parse_samples", "sum_samples"]

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
