"""Job-failure triage on the live platform ("rules distilled from experience").

Each FAILED job is classed user / platform / hardware (the classes of the Philly failure study,
:func:`apiary.incidents.classify_failure`: the exit spec plus log-pattern rules), once: the class is
written as the job's tag ``failure:<class>`` (durable, so a restarted control plane does not
classify twice and does not skip the jobs that failed while it was down). The owner of a job that
failed for a user reason is told why (the rule's hint).

The failure rate counts every failed task run (the ``task.exited`` events with state FAILED, the
ones the platform retried included: a node lost or an eviction is retried, so it rarely ends a job
FAILED), classed by exit code. When the platform's share of the last ``window_s`` passes the
threshold (:func:`apiary.incidents.should_open_incident`), an incident is opened (or joined: one
dedup key) as a PagerDuty event.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from apiary.errors import ApiaryError
from apiary.incidents import (
    Classification,
    FailureClass,
    classify_failure,
    default_rules,
    platform_failure_rate,
    should_open_incident,
)
from apiary.incidents.triage import DEFAULT_MIN_FAILURES, DEFAULT_THRESHOLD
from apiary.response.service import IncidentService

logger = logging.getLogger(__name__)

TAG = "failure:"
#: Log lines read per failed job (the tail the rules see).
TAIL_BYTES = 64 * 1024


class JobTriage:
    """:meth:`run_once` classifies the new failures and checks the platform's failure rate."""

    def __init__(self, service: IncidentService, plane: Any, *, window_s: float = 3600.0,
                 threshold: float = DEFAULT_THRESHOLD, min_failures: int = DEFAULT_MIN_FAILURES) -> None:
        self.service, self.plane = service, plane
        self.window_s, self.threshold, self.min_failures = window_s, threshold, min_failures
        self.rules = default_rules()
        self._cursor = 0  # the last event seq read
        self._recent: deque[tuple[float, Classification]] = deque()  # failed runs in the window

    def _tail(self, job: dict[str, Any]) -> str:
        tasks = [t for t in job.get("tasks") or [] if t.get("exitCode") not in (None, 0)] or job.get("tasks") or []
        if not tasks:
            return ""
        t = tasks[0]
        try:
            text = self.plane.read_logs(job["id"], task_role=t.get("taskRole"), index=int(t.get("index", 0)),
                                        stream="all")
        except ApiaryError:
            return ""
        return text[-TAIL_BYTES:]

    def classify(self, job: dict[str, Any]) -> Classification:
        """The class of one FAILED job (its exit code and the tail of its failed task's log)."""
        return classify_failure(int(job.get("exitCode") or 1), self._tail(job), self.rules)

    def _read_failed_runs(self, page: int = 5000) -> None:
        while True:
            events = self.plane.events(after=self._cursor, limit=page)
            for e in events:
                self._cursor = e["seq"]
                data = e.get("data") or {}
                if e["type"] == "task.exited" and data.get("state") == "FAILED":
                    code = data.get("exitCode")
                    self._recent.append((float(e["time"]), classify_failure(int(code if code is not None else 1), "",
                                                                            self.rules)))
            if len(events) < page:
                return

    def run_once(self) -> dict[str, Any]:
        """Classify every FAILED job not classified yet; returns ``{"classified": [...], "rate",
        "platformFailures", "incident"}`` (the incident opened or joined, or None)."""
        now = self.service.clock()
        classified = []
        for job in self.plane.list_jobs(state="FAILED"):
            tag = next((t for t in job.get("tags") or [] if t.startswith(TAG)), None)
            if tag is None:
                c = self.classify(job)
                self.plane.tag_job(job["id"], f"{TAG}{c.klass.value}")
                classified.append({"job": job["id"], "class": c.klass.value, "rule": c.rule})
                logger.info("job %s failed: class=%s rule=%s", job["id"], c.klass.value, c.rule)
                if c.klass == FailureClass.USER and self.service.notify_owner is not None:
                    self.service.notify_owner(
                        job["user"], f"Your job {job['id']} failed: {c.rule}",
                        f"Apiary classed the failure of {job['id']} (exit code {c.exit_code}) as a user error.\n"
                        f"{('Log line: ' + c.evidence_line) if c.evidence_line else ''}\n"
                        f"{c.runbook}\nFix the job and submit it again; the platform will not retry it.")
        self._read_failed_runs()
        while self._recent and now - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        window = [c for _, c in self._recent]
        rate = platform_failure_rate(window)
        platform = sum(c.klass in (FailureClass.PLATFORM, FailureClass.HARDWARE) for c in window)
        incident = None
        if should_open_incident(rate, self.threshold, self.min_failures, failures=platform):
            out = self.service.ingest_event({
                "event_action": "trigger", "dedup_key": "triage:platform-failure-rate",
                "payload": {"summary": f"{platform} of {len(window)} job failures in the last "
                                       f"{self.window_s / 60:g} min were the platform's ({rate:.0%})",
                            "severity": "error", "class": "ApiaryPlatformFailureRate", "component": "jobs",
                            "custom_details": {"rate": rate, "platformFailures": platform,
                                               "failures": len(window), "windowS": self.window_s}}},
                actor="triage")
            incident = out.get("incident")
        return {"classified": classified, "rate": rate, "platformFailures": platform, "incident": incident}
