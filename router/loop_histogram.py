"""LoopHistogram: a Prometheus histogram observed from one event loop only, without a lock.

prometheus_client's Histogram takes a mutex for its sum and again for its bucket, and walks its
bounds one by one, on every observation, and the router's ITL histogram is observed for every
streamed chunk (its `observe` was the largest of the router's own per-chunk costs, py-spy of
2026-12-07; docs/benchmarks.md). This one bisects into plain counts (protocol.histogram), a
chunk's tokens in one call. Its exposition is Histogram's, sample for sample and value for value
(`_sum` too: one addition per observation), `_created` included unless prometheus_client's switch
leaves it out; its `describe` names it, so a registry refuses another collector of the name.
Observed and collected on the loop that owns it only: the registry's collection runs there
(RouterMetrics.render_off_loop formats on a thread what was collected).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as client_metrics
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from protocol.histogram import BucketCounts

__all__ = ["LoopHistogram"]

_le = cast(Callable[[float], str], floatToGoString)  # untyped: a bound as Histogram writes it


class LoopHistogram(BucketCounts):
    __slots__ = ("_created", "_les", "documentation", "name")

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        super().__init__(tuple(float(b) for b in buckets))
        self.name = name
        self.documentation = documentation
        self._les = [*(_le(b) for b in self.bounds), "+Inf"]
        self._created = time.time()
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        # the family without samples, as Histogram's: a registry refuses a second collector of its names
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation)
        buckets = [(le, float(acc)) for le, (_, acc) in zip(self._les, self.cumulative(), strict=True)]
        family.add_metric([], buckets, self.sum)
        # read when collected, as Histogram does: PROMETHEUS_DISABLE_CREATED_SERIES or disable_created_metrics()
        if client_metrics._use_created:
            family.samples.append(Sample(f"{self.name}_created", {}, self._created))
        yield family
