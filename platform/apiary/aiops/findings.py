"""A finding of a detector or of the failure predictor, and its PagerDuty Events API v2 event.

An AIOps finding is a warning, never a page: :func:`finding_to_event` sends severity ``info``, which
:meth:`apiary.incidents.model.AlertGroup.from_events_v2` maps to ``sev4`` (info -> info -> Sev4,
handled by the day's DRI). The dedup key ``aiops:<rule>:<subject>`` makes repeated findings of one
rule on one node (job, VC) join one incident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

SubjectKind = Literal["node", "job", "vc"]


@dataclass(frozen=True)
class Finding:
    """``rule`` fired on ``subject`` (a node, a job id or a VC, see ``kind``) at ``t`` (seconds).

    ``score``: the rule's score, 0..1 (GaussianScorer's, or the failure model's probability).
    ``evidence``: JSON-ready; the metric values that fired it, the window they were judged against
    (``window: {"from_s", "to_s", "observations"}``) and the rule's thresholds.
    """

    rule: str
    subject: str
    kind: SubjectKind
    t: float
    score: float
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def node(self) -> str | None:
        """The node concerned: the subject of a node finding, a job's node, None for a VC."""
        if self.kind == "node":
            return self.subject
        node = self.evidence.get("node")
        return str(node) if node else None


def finding_to_event(finding: Finding) -> dict[str, Any]:
    """The Events API v2 trigger for ``finding``: ``{"event_action": "trigger", "dedup_key":
    "aiops:<rule>:<subject>", "payload": {"summary", "severity": "info", "source": subject,
    "component", "group", "class", "custom_details": evidence}}``. Summary and dedup key are cut to
    the Events API's limits (1,024 and 255 characters)."""
    return {
        "event_action": "trigger",
        "dedup_key": f"aiops:{finding.rule}:{finding.subject}"[:255],
        "payload": {
            "summary": finding.summary[:1024],
            "severity": "info",
            "source": finding.subject,
            "component": finding.kind,
            "group": "aiops",
            "class": finding.rule,
            "custom_details": {**finding.evidence, "score": round(finding.score, 4), "t": finding.t},
        },
    }
