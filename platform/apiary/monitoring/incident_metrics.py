"""Incident metrics: open incidents, MTTA / MTTM / MTTR, SLA breaches, notifications, escalations.

:class:`IncidentCollector` renders a snapshot (:func:`apiary.incidents.stats.snapshot` over the
stored incidents, computed on every scrape, so the values survive a restart of the control plane:
the store is their only owner). Families (platform/apiary/monitoring/METRICS.md):

* ``apiary_incidents_open{severity,state}``: open incidents (``triggered``, ``acknowledged``,
  ``mitigated``), every severity x state present;
* ``apiary_incident_mtta_seconds{severity}``, ``apiary_incident_mttm_seconds{severity}``,
  ``apiary_incident_mttr_seconds{severity}``: mean time from an episode's start to acknowledge /
  mitigate / resolve; absent for a severity without a sample;
* ``apiary_incident_sla_breaches_total{severity,milestone}``: missed SLA deadlines (every severity
  x milestone present, 0 included, so ``increase()`` sees the first);
* ``apiary_incidents_total{severity}``: incidents recorded;
* ``apiary_incident_notifications_total{channel,result}``: ``notify`` timeline entries;
* ``apiary_incident_escalations_total``: ``escalate`` timeline entries.

Counters count timeline entries and incidents in the store: they only go down if incidents are
deleted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

#: The snapshot keys of the mean-time gauges, and their metric names and help.
_MEANS = (
    ("mtta", "apiary_incident_mtta_seconds",
     "Mean time from an incident episode's start to its acknowledgement (an incident resolved unacknowledged "
     "counts at its resolution), by severity."),
    ("mttm", "apiary_incident_mttm_seconds",
     "Mean time from an incident episode's start to its mitigation (or resolution), by severity."),
    ("mttr", "apiary_incident_mttr_seconds", "Mean time from an incident episode's start to its resolution, "
                                             "by severity."),
)


class IncidentCollector:
    """Renders ``snapshot()`` (keys: :func:`apiary.incidents.stats.snapshot`'s; all optional).

    ``snapshot`` is called once per scrape, so it should be bounded (e.g. the incidents of a
    retention window). Wiring it into the control plane's registry (``apiary.api.app``, like
    ``CiCollector``) is the caller's.
    """

    def __init__(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()

        open_ = GaugeMetricFamily("apiary_incidents_open", "Open incidents by severity and state (triggered, "
                                  "acknowledged, mitigated).", labels=["severity", "state"])
        for severity, states in sorted((snap.get("open") or {}).items()):
            for state, n in sorted(states.items()):
                open_.add_metric([str(severity), str(state)], float(n))
        yield open_

        for key, name, help_text in _MEANS:
            family = GaugeMetricFamily(name, help_text, labels=["severity"])
            for severity, seconds in sorted((snap.get(key) or {}).items()):
                if seconds is not None:
                    family.add_metric([str(severity)], float(seconds))
            yield family

        breaches = CounterMetricFamily("apiary_incident_sla_breaches", "Missed incident SLA deadlines by severity "
                                       "and milestone (acknowledge, mitigate, resolve).",
                                       labels=["severity", "milestone"])
        for severity, milestones in sorted((snap.get("sla_breaches") or {}).items()):
            for milestone, n in sorted(milestones.items()):
                breaches.add_metric([str(severity), str(milestone)], float(n))
        yield breaches

        total = CounterMetricFamily("apiary_incidents", "Incidents recorded, by severity.", labels=["severity"])
        for severity, n in sorted((snap.get("total") or {}).items()):
            total.add_metric([str(severity)], float(n))
        yield total

        notes = CounterMetricFamily("apiary_incident_notifications", "Incident notifications by channel and "
                                    "result (sent, failed).", labels=["channel", "result"])
        for channel, results in sorted((snap.get("notifications") or {}).items()):
            for result, n in sorted(results.items()):
                notes.add_metric([str(channel), str(result)], float(n))
        yield notes

        yield CounterMetricFamily("apiary_incident_escalations", "Incident escalations to a next on-call tier.",
                                  value=float(snap.get("escalations") or 0))
