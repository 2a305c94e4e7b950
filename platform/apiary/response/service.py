"""Incident management on the live platform: the pure core (:mod:`apiary.incidents`,
:mod:`apiary.oncall`) plus the store, the channels and the control plane.

* Alerts in: :meth:`IncidentService.ingest_alertmanager` (Alertmanager's webhook payload: one
  group) and :meth:`ingest_event` (PagerDuty Events API v2: drills, AIOps predictions). A response
  rule may join the alert to an open incident (node correlation, "A implies K"); else the dedup key
  decides (:func:`apiary.incidents.correlate`): attach, reopen, or open a new incident.
* A new incident gets its diagnosis (runbook, evidence from Prometheus, the node's recent
  events) and its rule's automatic mitigations (cordon, drain, tag jobs, tell the owners), run by
  the one action pipeline (:class:`apiary.response.actions.ActionPipeline`: once per alert) and
  each an ``action`` entry in the timeline with its undo, and a durable escalation (the first page
  is due at once; :class:`apiary.response.escalator.EscalationWorker` sends it).
* People act with :meth:`act` (acknowledge, mitigate, resolve, close, reopen, comment) from the API,
  the CLI or a signed link; the actor is the authenticated caller. Resolving a Sev1/Sev2 drafts its
  postmortem.

Every change is committed to the store first (:class:`IncidentStore`); nothing is kept in memory.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx

from apiary.errors import ApiaryError, ValidationError
from apiary.incidents import (
    AlertGroup,
    Incident,
    IncidentState,
    Links,
    Severity,
    apply,
    breaches,
    correlate,
    deadlines,
    open_incident,
)
from apiary.incidents.rules import REVERSALS, ignored, join_target, plan
from apiary.oncall import next_page
from apiary.response.actions import ActionPipeline, AlertKey, Outbox, contact_lookup, user_email
from apiary.response.channels import Dispatcher, Message, build_channels
from apiary.response.config import ResponseConfig
from apiary.response.store import IncidentStore, entry_json
from apiary.timefmt import iso

logger = logging.getLogger(__name__)

SYSTEM = "system"
#: Events a person may apply through :meth:`IncidentService.act`.
PEOPLE_EVENTS = ("acknowledge", "mitigate", "resolve", "close", "reopen", "comment")
VERDICTS = ("actionable", "noise")


def _dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class IncidentService:
    """See the module docstring. ``plane``: the :class:`~apiary.control.ControlPlane` the
    mitigations act on (None: mitigations are recorded as skipped). ``pipeline``: the action
    pipeline (default: over ``plane``, with the on-call file's channels and contacts and the user
    directory's emails). ``notify_owner(user, subject, body)``: how the job triage tells an owner
    (default: the pipeline's outbox; failures logged). ``wake``: called after an escalation
    deadline is stored, to wake the worker. ``prometheus_url``: where evidence queries go (None:
    not collected). ``clock``: unix seconds."""

    def __init__(self, store: IncidentStore, config: ResponseConfig, *, plane: Any = None,
                 notify_owner: Callable[[str, str, str], None] | None = None,
                 prometheus_url: str | None = None, clock: Callable[[], float] = time.time,
                 pipeline: ActionPipeline | None = None) -> None:
        self.store, self.config, self.plane = store, config, plane
        self.prometheus_url = prometheus_url
        #: What a Prometheus served over HTTPS is verified against (the platform CA's context, or True:
        #: the system's CAs); set by whoever builds the service.
        self.prometheus_verify: ssl.SSLContext | bool = True
        self.clock = clock
        if pipeline is None:
            outbox = Outbox(Dispatcher(build_channels(config.channels)),
                            contact_lookup(config.contacts, user_email(store.sessions)))
            pipeline = ActionPipeline(plane, outbox, clock=clock)
        self.pipeline = pipeline
        self.notify_owner = notify_owner or self._tell_owner
        self.wake: Callable[[], None] = lambda: None
        self.signer: Any = None  # apiary.response.links.LinkSigner, set by apiary.response.runtime
        #: The drills' last results (:meth:`apiary.drills.board.DrillBoard.latest`), set by the app.
        self.drill_results: Callable[[], dict[str, Any]] | None = None

    def _tell_owner(self, user: str, subject: str, body: str) -> None:
        try:
            self.pipeline.outbox.tell_user(user, Message(incident_id="-", severity="sev4", title=subject, body=body))
        except ApiaryError as e:
            logger.warning("could not tell %s: %s", user, e.message)

    # ------------------------------------------------------------------ alerts in
    def ingest_alertmanager(self, payload: dict[str, Any]) -> dict[str, Any]:
        """One Alertmanager webhook payload (version 4) -> ``{"incident", "action", "reason",
        "actions"}``; ``actions``: the response rule's mitigations run now (``{"action",
        "target", "result", "detail"}``), each claimed for the group's first firing alert."""
        group = AlertGroup.from_alertmanager(payload, by_alertname=self.config.rules.severity)
        firing = [a for a in group.alerts if a.status == "firing"]
        names = sorted({a.labels.get("alertname", "") for a in group.alerts} - {""})
        first = firing[0].labels if firing else (group.alerts[0].labels if group.alerts else {})
        raw = next((a for a in payload.get("alerts") or [] if isinstance(a, dict) and a.get("status") == "firing"),
                   None)
        key = AlertKey(str(raw.get("fingerprint") or ""), str(raw.get("startsAt") or ""),
                       first.get("alertname", "")) if raw is not None else None
        return self._ingest(group, names, first, actor=f"alertmanager:{names[0] if names else 'alert'}", alert=key)

    def ingest_event(self, event: dict[str, Any], actor: str) -> dict[str, Any]:
        """One PagerDuty Events API v2 event (``trigger`` / ``acknowledge`` / ``resolve``)."""
        group = AlertGroup.from_events_v2(event)
        payload = event.get("payload") or {}
        labels = {"alertname": str(payload.get("class") or payload.get("component") or "event")}
        if payload.get("source") and payload.get("component") in (None, "node"):  # the source is a node
            labels["node"] = str(payload["source"])
        details = payload.get("custom_details")
        links = Links.from_labels(labels)
        if isinstance(details, dict) and isinstance(details.get("nodes"), list):
            links = links.merge(Links(nodes=tuple(str(n) for n in details["nodes"][:100])))
        return self._ingest(group, [labels["alertname"]], labels, actor=actor,
                            extra={"evidence": details} if isinstance(details, dict) else {}, links=links)

    def _ingest(self, group: AlertGroup, names: list[str], labels: dict[str, str], *, actor: str,
                extra: dict[str, Any] | None = None, links: Links | None = None,
                alert: AlertKey | None = None) -> dict[str, Any]:
        # One decision at a time: two groups about one node arriving together (Alertmanager sends
        # each group in its own request) must see each other's incident, not open two.
        with self.store.lock:
            return self._decide(group, names, labels, actor=actor, extra=extra, links=links, alert=alert)

    def _decide(self, group: AlertGroup, names: list[str], labels: dict[str, str], *, actor: str,
                extra: dict[str, Any] | None, links: Links | None, alert: AlertKey | None) -> dict[str, Any]:
        now = self.clock()
        if ignored(names, self.config.rules):
            return {"incident": None, "action": "ignore", "reason": "alerts the response rules ignore"}
        links = group.links.merge(links) if links is not None else group.links
        detail = {"alertnames": names, "dedupKey": group.dedup_key, **(extra or {})}
        candidates = self.store.candidates(now - self.config.rules.correlate.reopen_window_s)
        if group.action == "trigger":
            joined = join_target(labels, candidates, now, self.config.rules)
            if joined is not None:
                incident_id, reason = joined
                with self.store.change(incident_id) as box:
                    box[0] = apply(box[0], "alert", actor, max(now, box[0].last_at), links=links,
                                   fingerprints=group.fingerprints, reason=reason, **detail)
                return {"incident": incident_id, "action": "attach", "reason": reason}
        decision = correlate(candidates, group, now, self.config.rules.correlate.reopen_window_s)
        if decision.action == "open":
            incident, ran = self._open(group.title or (names[0] if names else "alert"), group.severity, actor,
                                       dedup_key=group.dedup_key, links=links, fingerprints=group.fingerprints,
                                       labels=labels, alert=alert, reason=decision.reason, **detail)
            return {"incident": incident.id, "action": "open", "reason": decision.reason, "actions": ran}
        if decision.action == "ignore" or decision.incident_id is None:
            return {"incident": None, "action": "ignore", "reason": decision.reason}
        iid = decision.incident_id
        if decision.action == "reopen":
            self._apply(iid, "reopen", actor, reason=decision.reason)
            self._apply(iid, "alert", actor, links=links, fingerprints=group.fingerprints, **detail)
            self._start_escalation(self.store.get(iid))
        elif decision.action == "resolve" and self.config.incidents.resolve_on_alert_resolved:
            self.act(iid, "resolve", actor, message=decision.reason)
        elif decision.action == "acknowledge":
            self.act(iid, "acknowledge", actor, message=decision.reason)
        else:  # attach (or a resolve that only notes the alert)
            self._apply(iid, "alert", actor, links=links, fingerprints=group.fingerprints,
                        reason=decision.reason, status="firing" if group.action == "trigger" else "resolved",
                        **detail)
        return {"incident": iid, "action": decision.action, "reason": decision.reason}

    # ------------------------------------------------------------------ opening
    def open(self, title: str, severity: Severity | str, actor: str, *, dedup_key: str | None = None,
             links: Links | None = None, fingerprints: tuple[str, ...] = (), labels: dict[str, str] | None = None,
             **detail: Any) -> Incident:
        """Open an incident (``triggered``), diagnose and mitigate it by its rule (when ``labels``
        match one) and start its escalation. ``actor``: the authenticated opener."""
        return self._open(title, severity, actor, dedup_key=dedup_key, links=links, fingerprints=fingerprints,
                          labels=labels, **detail)[0]

    def _open(self, title: str, severity: Severity | str, actor: str, *, dedup_key: str | None = None,
              links: Links | None = None, fingerprints: tuple[str, ...] = (), labels: dict[str, str] | None = None,
              alert: AlertKey | None = None, **detail: Any) -> tuple[Incident, list[dict[str, Any]]]:
        now = self.clock()
        try:
            sev = Severity(str(severity).lower())
        except ValueError:
            raise ValidationError("severity", "must be one of sev1, sev2, sev3, sev4") from None
        policy = self.config.incidents.policy
        incident = self.store.create(
            lambda iid: open_incident(iid, title, sev, dedup_key or f"manual:{iid}", actor, now, links=links,
                                      fingerprints=fingerprints, **detail), policy)
        logger.info("incident %s opened severity=%s title=%s", incident.id, sev.value, title)
        ran = self._respond(incident.id, labels, alert) if labels else []
        self._start_escalation(self.store.get(incident.id))
        return self.store.get(incident.id), ran

    def _respond(self, incident_id: str, labels: dict[str, str], alert: AlertKey | None) -> list[dict[str, Any]]:
        """Diagnose (runbook, evidence) and run the rule's mitigations, each recorded; returns the runs."""
        p = plan(labels, self.config.rules)
        if p.rule is None:
            return []
        node = next((labels[k] for k in ("node", "Hostname", "hostname") if labels.get(k)), None)
        evidence = {e.name: self._query(e.query) for e in p.evidence}
        events = self._node_events(node) if node else []
        drills = self._node_drills(node) if node else {}
        self._apply(incident_id, "comment", f"rule:{p.rule}", diagnosis=True, runbook=p.runbook,
                    evidence=evidence, recentEvents=events, drills=drills,
                    suspectedCause=f"node {node}" if node else None)
        ran = [self.run_action(incident_id, action, node, actor=f"rule:{p.rule}", alert=alert)
               for action in p.mitigations]
        return [r for r in ran if r is not None]

    def mitigate(self, incident_id: str, action: str, node: str | None, *, actor: str) -> dict[str, Any]:
        """Run one action of the pipeline (:data:`apiary.response.actions.ACTIONS`: ``cordon-node``,
        ``drain-node``, ``tag-jobs:<tag>``, ``notify-owners``, an undo such as ``uncordon-node``,
        ...) on ``node`` as ``actor``; record it (``action`` entry with ``result`` ok / failed /
        skipped and ``undo``). Returns ``{"action", "target", "result", "detail"}``. Never raises
        for the action's own failure: that is recorded; ValidationError (field ``action``) for an
        unknown action, NotFoundError for an unknown incident."""
        run = self.run_action(incident_id, action, node, actor=actor)
        assert run is not None  # only an alert's action can have run already
        return run

    def run_action(self, incident_id: str | None, action: str, target: str | None, *, actor: str,
                   alert: AlertKey | None = None, message: Message | None = None) -> dict[str, Any] | None:
        """Run ``action`` on ``target`` through the pipeline and record it in incident
        ``incident_id``'s timeline (None: no incident, nothing recorded here). ``alert``: the alert
        it is for; None is returned when that alert's action already ran. An ``email-admin`` of an
        incident with an escalation policy is skipped: on call is paged instead, once. Returns
        ``{"action", "target", "result", "detail"}``."""
        self.pipeline.check(action)
        incident = self.store.get(incident_id) if incident_id is not None else None
        paged = incident is not None and self.store.row(incident.id)["policy"] is not None
        run = self.pipeline.run(action, target, alert=alert, incident=incident, message=message, on_call_paged=paged,
                                actor=actor)
        if run is None:
            return None
        if incident is not None:
            name, _, arg = action.partition(":")
            undo = REVERSALS.get(name)
            self._apply(incident.id, "action", actor, links=run.links, action=action, target=run.target or None,
                        result=run.result, message=run.detail,
                        undo=f"{undo}{':' + arg if arg else ''}" if undo else None)
            logger.info("incident %s %s %s: %s", incident.id, action, run.result, run.detail)
        return run.to_dict()

    # ------------------------------------------------------------------ people
    def act(self, incident_id: str, event: str, actor: str, *, message: str | None = None,
            verdict: str | None = None) -> Incident:
        """Apply ``event`` (:data:`PEOPLE_EVENTS`) as ``actor``. ``verdict`` (``actionable`` /
        ``noise``) is for ``resolve``. Raises ValidationError, NotFoundError, and
        IncidentTransitionError (409) for an event the state does not allow."""
        if event not in PEOPLE_EVENTS:
            raise ValidationError("event", f"must be one of {', '.join(PEOPLE_EVENTS)}")
        if verdict is not None and verdict not in VERDICTS:
            raise ValidationError("verdict", "must be actionable or noise")
        extra: dict[str, Any] = {}
        if message:
            extra["message" if event != "comment" else "text"] = message
        if verdict:
            extra["verdict"] = verdict
        incident = self._apply(incident_id, event, actor, **extra)
        now = incident.last_at
        if verdict:
            self.store.set_fields(incident_id, verdict=verdict)
        if event == "acknowledge":
            self._acknowledged(incident, now)
        elif event in ("resolve", "close"):
            self._stop_escalation(incident_id)
            if event == "resolve" and incident.severity.is_major:
                self._draft_postmortem(incident)
        elif event == "reopen":
            self._start_escalation(incident)
        return self.store.get(incident_id)

    def _apply(self, incident_id: str, event: str, actor: str, **kwargs: Any) -> Incident:
        with self.store.change(incident_id) as box:
            box[0] = apply(box[0], event, actor, max(self.clock(), box[0].last_at), **kwargs)
            return box[0]

    # ------------------------------------------------------------------ escalation facts
    def _start_escalation(self, incident: Incident) -> None:
        policy = self.store.row(incident.id)["policy"]
        if policy is None:
            return
        start = incident.timeline[incident.episode_start].at
        self.store.set_escalation(incident.id, policy=policy, started_at=start, acknowledged_at=None, next_at=start)
        self.wake()

    def _acknowledged(self, incident: Incident, at: float) -> None:
        esc = self.store.escalation(incident.id)
        if esc is None:
            return
        policy = self.config.oncall.policy(esc["policy"])
        started = min(esc["startedAt"], at)
        page = next_page(policy, _dt(started), _dt(at), _dt(at))
        self.store.set_escalation(incident.id, policy=esc["policy"], started_at=started, acknowledged_at=at,
                                  next_at=page.at.timestamp() if page else None)
        self.wake()

    def _stop_escalation(self, incident_id: str) -> None:
        esc = self.store.escalation(incident_id)
        if esc is not None and esc["nextAt"] is not None:
            self.store.set_escalation(incident_id, policy=esc["policy"], started_at=esc["startedAt"],
                                      acknowledged_at=esc["acknowledgedAt"], next_at=None)

    # ------------------------------------------------------------------ postmortems
    def _draft_postmortem(self, incident: Incident) -> None:
        from apiary.incidents.postmortem import draft

        pm = draft(incident, sla=self.config.incidents.sla)
        self.store.set_fields(incident.id, postmortem=pm.to_markdown())
        self.store.set_action_items(incident.id, [_item(i) for i in pm.action_items])

    def set_postmortem(self, incident_id: str, markdown: str) -> list[dict[str, Any]]:
        """Store an edited postmortem; its action-item table is re-read and tracked."""
        from apiary.incidents.postmortem import parse_action_items

        items = parse_action_items(markdown)
        self.store.get(incident_id)  # NotFoundError first
        self.store.set_fields(incident_id, postmortem=markdown)
        self.store.set_action_items(incident_id, [_item(i) for i in items])
        return self.store.action_items(incident_id)

    # ------------------------------------------------------------------ reads
    def view(self, incident: Incident) -> dict[str, Any]:
        """The wire shape of one incident, with its SLA deadlines and breaches now."""
        row = self.store.row(incident.id)
        sla = self.config.incidents.sla
        now = self.clock()
        return {
            "id": incident.id, "title": incident.title, "severity": incident.severity.value,
            "state": incident.state.value, "dedupKey": incident.dedup_key, "openedAt": iso(incident.opened_at),
            "updatedAt": iso(incident.last_at),
            "links": {"nodes": list(incident.links.nodes), "jobs": list(incident.links.jobs),
                      "users": list(incident.links.users), "virtualClusters": list(incident.links.virtual_clusters),
                      "gpuHoursLost": incident.links.gpu_hours_lost},
            "fingerprints": list(incident.fingerprints), "policy": row["policy"], "verdict": row["verdict"],
            "deadlines": {k: iso(v) for k, v in deadlines(incident, sla).items()},
            "breaches": breaches(incident, now, sla) if incident.state != IncidentState.CLOSED else [],
            "escalation": self.store.escalation(incident.id),
            "timeline": [entry_json(e) for e in incident.timeline],
            "hasPostmortem": row["postmortem"] is not None,
        }

    # ------------------------------------------------------------------ evidence
    def _query(self, promql: str) -> Any:
        if not self.prometheus_url:
            return None
        try:
            r = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": promql}, timeout=2.0,
                          verify=self.prometheus_verify)
            r.raise_for_status()
            return [{"labels": s["metric"], "value": float(s["value"][1])} for s in r.json()["data"]["result"]][:20]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            return {"error": str(e)[:200]}

    def _node_drills(self, node: str) -> dict[str, Any]:
        """The node's failures in the last stress drill, and each drill's last result."""
        if self.drill_results is None:
            return {}
        latest = self.drill_results()
        return {"nodeFailures": [f for f in latest.get("nodeFailures", []) if f.get("node") == node],
                "lastRuns": {d.get("drill"): d.get("result") for d in latest.get("drills", [])}}

    def _node_events(self, node: str) -> list[dict[str, Any]]:
        if self.plane is None:
            return []
        try:
            return [{"time": e.get("time"), "type": e.get("type"), "jobId": e.get("jobId")}
                    for e in self.plane.node_events(node, limit=10)]
        except Exception:  # evidence is best effort: a failure here must not lose the incident
            logger.exception("recent events of node %s", node)
            return []


def _item(item: Any) -> dict[str, Any]:
    """A postmortem :class:`~apiary.incidents.postmortem.ActionItem` as the store keeps it."""
    return {"key": item.id, "text": item.text, "owner": item.owner or None, "status": item.status}

