"""CI/CD metrics: pipeline runs and production deployments, rendered from the store at scrape time.

:class:`CiCollector` renders a snapshot (:meth:`apiary.ci.records.CiRecords.metrics_snapshot`,
read from the CI records (``ci_records``) on every scrape, so the values survive a restart of the
control plane: the store is their only owner). Families (platform/apiary/monitoring/METRICS.md):

* ``apiary_ci_stage_duration_seconds{stage}`` (histogram) over the stages of the newest finished
  runs (a window: its counts stop growing once the window is full, so read it with
  ``histogram_quantile`` over the buckets themselves, not over ``rate()``);
* ``apiary_ci_runs_total{result}``: finished runs (``success``, ``failure``, ``error``);
* ``apiary_ci_default_branch_last_run_success{repo}``: 1 when the repository's newest finished
  default-branch (``deploy``) run succeeded, else 0;
* ``apiary_deploy_total{result}``, ``apiary_deploy_rollbacks_total``,
  ``apiary_deploy_duration_seconds`` (the newest deployment's),
  ``apiary_deploy_last_success_timestamp_seconds``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

#: 1 s .. 1 h: a lint stage takes seconds, a test or image build stage minutes, a deploy up to an hour.
STAGE_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 2700.0, 3600.0)


class CiCollector:
    """Renders ``snapshot()`` (keys: :meth:`apiary.ci.records.CiRecords.metrics_snapshot`; all optional)."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]], *, max_stages: int = 100) -> None:
        self._snapshot = snapshot
        self._max_stages = max_stages

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield self._stage_histogram(snap.get("stage_durations") or ())

        runs = CounterMetricFamily("apiary_ci_runs", "Finished CI pipeline runs by result (success, failure, error).",
                                   labels=["result"])
        for result, n in sorted((snap.get("runs") or {}).items()):
            runs.add_metric([str(result)], float(n))
        yield runs

        default = GaugeMetricFamily(
            "apiary_ci_default_branch_last_run_success",
            "1 when the repository's newest finished default-branch (deploy) pipeline run succeeded, else 0.",
            labels=["repo"])
        for repo, ok in sorted((snap.get("default_branch") or {}).items()):
            default.add_metric([str(repo)], 1.0 if ok else 0.0)
        yield default

        deploys = CounterMetricFamily("apiary_deploy", "Production deployments by result (succeeded, rolled_back, "
                                                       "failed).", labels=["result"])
        for result, n in sorted((snap.get("deploys") or {}).items()):
            deploys.add_metric([str(result)], float(n))
        yield deploys
        yield CounterMetricFamily("apiary_deploy_rollbacks", "Deployments that rolled production back (a failed "
                                  "gate's automatic rollback, or an operator's rollback).",
                                  value=float(snap.get("rollbacks") or 0))
        took = GaugeMetricFamily("apiary_deploy_duration_seconds", "Duration of the newest deployment.")
        if snap.get("last_deploy_duration") is not None:
            took.add_metric([], float(snap["last_deploy_duration"]))
        yield took
        ok = GaugeMetricFamily("apiary_deploy_last_success_timestamp_seconds",
                               "End of the newest succeeded deployment (epoch s); absent until one succeeds.")
        if snap.get("last_deploy_success_at") is not None:
            ok.add_metric([], float(snap["last_deploy_success_at"]))
        yield ok

    def _stage_histogram(self, durations: Iterable[tuple[str, float]]) -> HistogramMetricFamily:
        counts: dict[str, list[int]] = {}
        sums: dict[str, float] = {}
        for stage, seconds in durations:
            if stage not in counts:
                if len(counts) >= self._max_stages:
                    continue  # bounded label values: the newest runs' stage names win
                counts[stage], sums[stage] = [0] * (len(STAGE_BUCKETS) + 1), 0.0
            counts[stage][bisect.bisect_left(STAGE_BUCKETS, seconds)] += 1  # le is inclusive
            sums[stage] += seconds
        family = HistogramMetricFamily(
            "apiary_ci_stage_duration_seconds",
            "Durations of the CI pipeline's stages over the newest finished runs (a window of runs).",
            labels=["stage"])
        for stage in sorted(counts):
            cumulative, buckets = 0, []
            for le, n in zip((*map(floatToGoString, STAGE_BUCKETS), "+Inf"), counts[stage], strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric([stage], buckets, sums[stage])
        return family
