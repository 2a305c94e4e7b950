"""Run several collectors in one scrape so that one failing collector cannot fail ``/metrics``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class GuardedCollectors(Collector):
    """Collect ``collectors`` (name -> collector) in order; a collector that raises contributes no
    families that scrape (all-or-nothing per collector) and ``apiary_exporter_collector_up{collector}``
    goes to 0. Also exports ``apiary_exporter_collector_duration_seconds{collector}``.

    ``constant_labels`` (e.g. ``{"Hostname": node}``) are added to those two families only.
    """

    def __init__(self, collectors: Mapping[str, Collector], constant_labels: Mapping[str, str] | None = None):
        self.collectors = dict(collectors)
        self.constant_labels = dict(constant_labels or {})
        self._failing: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        extra = list(self.constant_labels)
        up = GaugeMetricFamily(
            "apiary_exporter_collector_up", "1 when the collector succeeded this scrape.", labels=["collector", *extra]
        )
        took = GaugeMetricFamily(
            "apiary_exporter_collector_duration_seconds", "Time the collector took this scrape.",
            labels=["collector", *extra],
        )
        values = list(self.constant_labels.values())
        for name, collector in self.collectors.items():
            start = time.perf_counter()
            try:
                families = list(collector.collect())
            except Exception:
                if name not in self._failing:
                    logger.exception("metrics collector %s failed", name)
                    self._failing.add(name)
                families, ok = [], False
            else:
                if name in self._failing:
                    logger.info("metrics collector %s recovered", name)
                    self._failing.discard(name)
                ok = True
            took.add_metric([name, *values], time.perf_counter() - start)
            up.add_metric([name, *values], 1.0 if ok else 0.0)
            yield from families
        yield up
        yield took
