"""Reports over the stored incidents: the ``apiary_incident_*`` metrics' snapshot and the weekly
alert-quality report (a Prefect artifact, ``GET /api/v2/incidents/quality``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select

from apiary.incidents.quality import Firing, report_markdown
from apiary.incidents.quality import quality_report as build_quality
from apiary.incidents.stats import snapshot
from apiary.response.service import IncidentService
from apiary.store.models import Alert
from apiary.store.unit import reading

#: The most incidents a scrape or a report reads (newest first): bounded work per call.
MAX_INCIDENTS = 5000


def metrics_snapshot(service: IncidentService) -> dict[str, Any]:
    """:func:`apiary.incidents.stats.snapshot` over the newest :data:`MAX_INCIDENTS` incidents."""
    return snapshot(service.store.recent(limit=MAX_INCIDENTS), service.clock(), service.config.incidents.sla)


def _epoch(value: str | None) -> float | None:
    if not value or value.startswith("0001-"):  # Alertmanager's "no end yet"
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def firings(service: IncidentService, since: float) -> list[Firing]:
    """One :class:`Firing` per stored alert (fingerprint, startsAt) that started since ``since``;
    its end is the resolved notification's ``endsAt``."""
    periods: dict[tuple[str, str], Firing] = {}
    with reading(service.store.sessions, "read alerts") as s:
        rows = s.scalars(select(Alert).where(Alert.received >= since).order_by(Alert.id).limit(50_000)).all()
        for a in rows:
            start = _epoch(a.starts_at)
            if start is None:
                continue
            end = _epoch(a.ends_at) if a.status == "resolved" else None
            key = (a.fingerprint, a.starts_at)
            old = periods.get(key)
            periods[key] = Firing(a.alertname, a.fingerprint, start,
                                  max(end, start) if end is not None else (old.ends_at if old else None))
    return list(periods.values())


def quality_report(service: IncidentService, days: float = 7.0) -> dict[str, Any]:
    """The report over the last ``days``: ``{"since", "days", "report": {...}, "markdown"}``."""
    since = service.clock() - days * 86400
    incidents = service.store.recent(limit=MAX_INCIDENTS, since=since)
    report = build_quality(incidents, service.store.verdicts(i.id for i in incidents), firings(service, since))
    return {"since": since, "days": days, "report": report.to_dict(),
            "markdown": report_markdown(report, title=f"Alert quality, last {days:g} days")}
