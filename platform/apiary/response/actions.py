"""The one pipeline of alert and incident actions: cordon, drain, stop, tag, notify.

Every automatic or human action on the platform caused by an alert or an incident runs here:
the actions config and ``?action=`` selectors of the alert intake (:mod:`apiary.ops.alerts`,
OpenPAI's alert-handler names), an incident's response-rule mitigations and a responder's
``apiary incident mitigate``. The actions (the target each acts on in brackets):

* ``cordon-node`` / ``uncordon-node`` [node]: the plane's public cordon, keyed by who acts
  (:func:`cordon_source`): ``incident:<id>`` for an incident's action, else ``alert:<alertname>``;
  an ``uncordon-node`` removes that source's cordon only, never an admin's, a drill's or another's.
* ``drain-node`` [node]: the plane's drain (its cordon keyed the same way); its jobs re-placed as
  platform retries.
* ``stop-job`` [job], ``tag-job[:TAG]`` [job]: the alert's job (an Apiary job id, ``user~name``).
* ``tag-jobs[:TAG]`` / ``untag-jobs[:TAG]`` [node]: every job on the node.
* ``notify-owners`` [node]: the owners of the incident's linked jobs (email, else IM).
* ``email-owner`` [job]: the job's owner; ``email-admin`` [the admin address]; ``chat`` [the IM channel].

People are told through one set of channels, :mod:`apiary.response.channels` behind one
:class:`~apiary.response.channels.Dispatcher` (retries, fallback, circuit breaker), and a user's
address comes from one lookup: the on-call file's ``contacts``, else the user directory's
``User.email`` (:func:`contact_lookup`). Nothing invents an address.

**Once per alert.** An action caused by an alert carries the alert's :class:`AlertKey`; with an
:class:`ActionLog` (:class:`apiary.ops.alertlog.AlertLog`) its run is claimed per (fingerprint,
startsAt, action, target) before it runs, so Alertmanager's resends, and the response rule and the
actions config asking for the same action, run it once. A failed run may be claimed again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import select

from apiary.control.nodes import MAX_CORDON_REASON
from apiary.errors import ApiaryError, UnavailableError, ValidationError
from apiary.incidents import Incident, Links
from apiary.incidents.model import JOB_LABELS, NODE_LABELS, job_id_of
from apiary.response.channels import Contact, Dispatcher, Message, delivered
from apiary.store.models import User
from apiary.store.unit import Sessions, reading

logger = logging.getLogger(__name__)

#: Every action the pipeline runs (``tag-job``, ``tag-jobs`` and ``untag-jobs`` take ``:TAG``).
ACTIONS = ("cordon-node", "uncordon-node", "drain-node", "stop-job", "tag-job", "tag-jobs", "untag-jobs",
           "notify-owners", "email-owner", "email-admin", "chat")
NODE_ACTIONS = ("cordon-node", "uncordon-node", "drain-node", "tag-jobs", "untag-jobs", "notify-owners")
JOB_ACTIONS = ("stop-job", "tag-job", "email-owner")


@dataclass(frozen=True)
class AlertKey:
    """The alert an action is for: Alertmanager's ``fingerprint`` and ``startsAt`` (one firing)."""

    fingerprint: str
    starts_at: str
    alertname: str


class ActionLog(Protocol):
    """Where alert-action runs are claimed and finished (:class:`apiary.ops.alertlog.AlertLog`)."""

    def claim_alert_action(self, *, fingerprint: str, starts_at: str, alertname: str, action: str,
                           target: str) -> bool: ...

    def finish_alert_action(self, *, fingerprint: str, starts_at: str, action: str, target: str, status: str,
                            detail: str) -> None: ...


class Platform(Protocol):
    """What the actions call on the control plane (:class:`~apiary.control.ControlPlane`'s public
    methods); raises ApiaryError subclasses (NotFoundError for an unknown node or job, ...)."""

    def cordon(self, node: str, cordoned: bool = True, *, source: str = "admin", reason: str = "",
               by: str = "", every_source: bool = False) -> dict: ...

    def drain(self, node: str, reason: str | None = None, *, source: str = "admin", by: str = "") -> list[str]: ...

    def jobs_on_node(self, node: str) -> list[str]: ...

    def stop(self, job_id: str) -> dict: ...

    def tag_job(self, job_id: str, tag: str) -> dict: ...

    def untag_job(self, job_id: str, tag: str) -> dict: ...

    def get_job(self, job_id: str) -> dict: ...


@dataclass(frozen=True)
class ActionRun:
    """One run's outcome: ``result`` ``ok`` / ``failed`` / ``skipped``; ``links``: what it touched."""

    action: str
    target: str
    result: str
    detail: str
    links: Links = field(default_factory=Links)

    def to_dict(self) -> dict[str, Any]:
        """``{"action", "target", "result", "detail"}``."""
        return {"action": self.action, "target": self.target, "result": self.result, "detail": self.detail}


def cordon_source(alert: AlertKey | None, incident: Incident | None) -> tuple[str, str]:
    """Whose cordon an action sets or removes, and why: ``("incident:<id>", "incident <id>: <title>")``
    for an incident's action, else ``("alert:<alertname>", "alert <alertname> firing")``
    (``alert:unknown`` with no alert name); the reason cut to :data:`MAX_CORDON_REASON` characters,
    the most a cordon holds."""
    if incident is not None:
        return f"incident:{incident.id}", f"incident {incident.id}: {incident.title}"[:MAX_CORDON_REASON]
    name = re.sub(r"[^A-Za-z0-9_.:-]", "_", alert.alertname if alert else "")[:100] or "unknown"
    reason = f"alert {alert.alertname if alert and alert.alertname else name} firing"
    return f"alert:{name}", reason[:MAX_CORDON_REASON]


def user_email(sessions: Sessions) -> Callable[[str], str | None]:
    """The user directory's lookup: a user name -> ``User.email`` (None: no such user or no email)."""

    def lookup(user: str) -> str | None:
        with reading(sessions, "read user email") as s:
            return s.scalar(select(User.email).where(User.name == user))

    return lookup


def contact_lookup(config_contacts: Mapping[str, Contact],
                   email_of: Callable[[str], str | None]) -> Callable[[str], Contact | None]:
    """The one owner/person lookup: the configured contact (the on-call file's ``contacts``), else a
    contact with the user's directory email; None when neither knows the user."""

    def lookup(user: str) -> Contact | None:
        if user in config_contacts:
            return config_contacts[user]
        email = email_of(user)
        return Contact(name=user, email=email) if email else None

    return lookup


class Outbox:
    """Tells people through ``dispatcher``'s channels (``email``, ``im``). ``contact``: the
    :func:`contact_lookup`. Each method blocks, returns a detail for the record, and raises
    ValidationError when nobody can be addressed (no contact, no channel) or UnavailableError when
    every channel failed."""

    def __init__(self, dispatcher: Dispatcher, contact: Callable[[str], Contact | None]) -> None:
        self.dispatcher, self.contact = dispatcher, contact

    def tell_user(self, user: str, message: Message) -> str:
        """Email the user, else post to IM mentioning them."""
        who = self.contact(user)
        if who is None:
            raise ValidationError("contacts", f"no contact for user {user}: give them an email in the user "
                                              "directory or add them to the on-call file's contacts")
        return self._deliver(message, who, ["email", "im"])

    def tell_address(self, address: str | None, message: Message) -> str:
        """Email ``address`` (the admin's; None: not configured, a ValidationError)."""
        if not address:
            raise ValidationError("admin_email", "no admin address configured (the actions config's admin_email)")
        try:
            who = Contact(name=address, email=address)
        except ValueError as e:  # pydantic's ValidationError
            raise ValidationError("admin_email", f"{address!r} is not an email address") from e
        return self._deliver(message, who, ["email"])

    def post(self, message: Message) -> str:
        """Post to the IM channel (Slack or Teams)."""
        return self._deliver(message, Contact(name="apiary"), ["im"])

    def _deliver(self, message: Message, who: Contact, channels: list[str]) -> str:
        if not any(c in self.dispatcher.channels for c in channels):
            raise ValidationError("channels", f"no {' or '.join(channels)} channel configured (the on-call "
                                              "file's channels, or the actions config's smtp/chat_webhook)")
        attempts = self.dispatcher.deliver(message, who, channels)
        sent = delivered(attempts)
        if sent is None:
            raise UnavailableError(f"could not reach {who.name}: {attempts[-1].detail if attempts else 'no channel'}")
        return f"told {who.name} by {sent.channel}"


class ActionPipeline:
    """Runs the :data:`ACTIONS` on ``plane`` (its public cordon, drain, stop, tag; None: every
    action is recorded as skipped) and tells people
    through ``outbox``. ``admin_email``: where ``email-admin`` goes. ``log``: the alert-action log
    that makes an alert's action run once (None: no deduplication). ``clock``: unix seconds."""

    def __init__(self, plane: Platform | None, outbox: Outbox, *, admin_email: str | None = None,
                 log: ActionLog | None = None, clock: Callable[[], float] = time.time) -> None:
        self.plane, self.outbox, self.admin_email, self.log, self.clock = plane, outbox, admin_email, log, clock

    @staticmethod
    def check(action: str, field_name: str = "action") -> None:
        """Raise ValidationError naming ``field_name`` unless ``action`` is one of :data:`ACTIONS`."""
        if action.partition(":")[0] not in ACTIONS:
            raise ValidationError(field_name, f"unknown action {action!r}; known: {', '.join(ACTIONS)}")

    def target(self, action: str, labels: Mapping[str, str], node: str | None = None) -> str | None:
        """What ``action`` acts on for an alert with ``labels`` (``node`` overrides the node label):
        a node, an Apiary job id, the admin address or ``chat``; None when the alert names none."""
        name = action.partition(":")[0]
        if name in NODE_ACTIONS:
            return node or next((labels[k] for k in NODE_LABELS if labels.get(k)), None)
        if name in JOB_ACTIONS:
            return next((j for j in (job_id_of(labels.get(k, "")) for k in JOB_LABELS) if j), None)
        if name == "email-admin":
            return self.admin_email or "admin"
        return "chat"

    def run(self, action: str, target: str | None, *, alert: AlertKey | None = None,
            incident: Incident | None = None, message: Message | None = None,
            on_call_paged: bool = False, actor: str | None = None) -> ActionRun | None:
        """Run ``action`` on ``target`` once. ``alert``: the alert it is for (claimed in the log:
        None is returned, and nothing runs, when it already ran or is running). ``incident``: the
        incident it belongs to (its links name the owners to notify; its id keys the cordon).
        ``message``: what the notify actions send (default: about the incident); its title is an
        alert's cordon reason. ``actor``: who acts, the cordon's ``by`` (None: ``alertmanager`` for
        an alert's action, else ``apiary``). ``on_call_paged``: the incident has an
        escalation policy, so ``email-admin`` is skipped (recorded): people are paged once. Never
        raises for the action's own failure: that is the run's ``failed`` result; ValidationError
        for an unknown action."""
        self.check(action)
        name, _, arg = action.partition(":")
        if name == "tag-job" and not arg and alert is not None:  # the actions config's bare tag-job
            arg = alert.alertname
        if target is None:
            what = "node" if name in NODE_ACTIONS else "Apiary job id (user~name)"
            return ActionRun(action, "", "skipped", f"the alert names no {what}")
        key = None
        if alert is not None and self.log is not None:
            key = {"fingerprint": alert.fingerprint, "starts_at": alert.starts_at, "action": action, "target": target}
            if not self.log.claim_alert_action(alertname=alert.alertname, **key):
                return None
        links = Links()
        try:
            by = actor or ("alertmanager" if alert is not None and incident is None else "apiary")
            result, detail, links = self._do(name, arg, target, incident, message, on_call_paged,
                                             cordon=(*self._cordon_of(alert, incident, message), by))
        except ApiaryError as e:
            result, detail = "failed", e.message
            logger.warning("action %s on %s failed: %s", action, target, e.message)
        except Exception as e:  # the claim must still be finished, or every resend is skipped for good
            result, detail = "failed", f"{type(e).__name__}: {e}"
            logger.exception("action %s on %s failed", action, target)
        if key is not None and self.log is not None:
            self.log.finish_alert_action(status=result, detail=detail, **key)
        logger.info("action %s target=%s result=%s incident=%s", action, target, result,
                    incident.id if incident else "-")
        return ActionRun(action, target, result, detail, links)

    @staticmethod
    def _cordon_of(alert: AlertKey | None, incident: Incident | None, message: Message | None) -> tuple[str, str]:
        source, reason = cordon_source(alert, incident)
        if incident is None and message is not None and message.title:
            reason = message.title[:500]
        return source, reason

    def _do(self, name: str, arg: str, target: str, incident: Incident | None, message: Message | None,
            on_call_paged: bool, cordon: tuple[str, str, str]) -> tuple[str, str, Links]:
        plane = self.plane
        if plane is None:
            return "skipped", "no control plane", Links()
        source, reason, by = cordon
        if name == "cordon-node":
            plane.cordon(target, True, source=source, reason=reason, by=by)
            return "ok", f"node {target} cordoned ({source}: {reason})", Links()
        if name == "uncordon-node":
            left = plane.cordon(target, False, source=source, by=by).get("cordons") or []
            others = f"; still cordoned by {', '.join(c['source'] for c in left)}" if left else ""
            return "ok", f"node {target}: {source}'s cordon removed{others}", Links()
        if name == "drain-node":
            return self._drain(plane, target, incident, source, reason, by)
        if name == "stop-job":
            plane.stop(target)
            return "ok", f"job {target} stop requested", Links(jobs=(target,), users=(target.split("~", 1)[0],))
        if name in ("tag-job", "tag-jobs", "untag-jobs"):
            tag = arg or (f"incident-{incident.id}" if incident else "alert")
            jobs = [target] if name == "tag-job" else list(plane.jobs_on_node(target))
            for j in jobs:
                (plane.untag_job if name == "untag-jobs" else plane.tag_job)(j, tag)
            verb = "untagged" if name == "untag-jobs" else "tagged"
            linked = Links(jobs=tuple(jobs)) if name == "tag-job" else Links()
            return "ok", f"{verb} {tag}: {', '.join(jobs) or 'none'}", linked
        msg = message or _incident_message(incident, target)
        if name == "notify-owners":
            owners = sorted({j.split("~", 1)[0] for j in incident.links.jobs} | set(incident.links.users)) \
                if incident else []
            told, failed = [], []
            for user in owners:
                try:
                    told.append(self.outbox.tell_user(user, msg))
                except ApiaryError as e:
                    failed.append(f"{user}: {e.message}")
            detail = "; ".join(told + failed) or "told nobody (no jobs affected)"
            return ("failed" if failed else "ok"), detail, Links()
        if name == "email-owner":
            owner = plane.get_job(target)["user"]
            return "ok", self.outbox.tell_user(owner, msg), Links(users=(owner,))
        if name == "email-admin":
            if on_call_paged and incident is not None:
                return "skipped", f"incident {incident.id} pages on call", Links()
            return "ok", self.outbox.tell_address(self.admin_email, msg), Links()
        return "ok", self.outbox.post(msg), Links()

    def _drain(self, plane: Platform, node: str, incident: Incident | None, source: str, reason: str,
               by: str) -> tuple[str, str, Links]:
        before = {j: plane.get_job(j) for j in plane.jobs_on_node(node)}
        # The drain re-cordons the node as `source` with `why`, replacing the reason the cordon-node
        # before it gave: `why` keeps that cause (the incident's or the alert's title, e.g. which GPU
        # failed how), which the drained jobs' attempts then carry too.
        why = f"Node {node} was drained by " + (reason if incident else f"an alert: {reason}")
        moved = plane.drain(node, why, source=source, by=by)
        jobs = [before.get(j) or plane.get_job(j) for j in moved]
        links = Links(jobs=tuple(moved), users=tuple(j["user"] for j in jobs),
                      virtual_clusters=tuple(j["virtualCluster"] for j in jobs),
                      gpu_hours_lost=round(sum(_gpu_hours_on(j, node, self.clock()) for j in jobs), 6))
        return "ok", f"node {node} drained; re-placed as platform retries: {', '.join(moved) or 'none'}", links


def _incident_message(incident: Incident | None, node: str) -> Message:
    if incident is None:
        return Message(incident_id="-", severity="sev4", title=f"Apiary: node {node}")
    return Message(incident_id=incident.id, severity=incident.severity.value, title=incident.title,
                   body=f"Your jobs on node {node} were affected by incident {incident.id}: {incident.title}. "
                        f"They were re-placed as platform retries; nothing is needed from you.")


def _gpu_hours_on(job: dict[str, Any], node: str, now: float) -> float:
    """GPU-hours the job's runs on ``node`` had done when it was drained: lost, the retry starts over."""
    total = 0.0
    for t in job.get("tasks") or []:
        if t.get("node") != node or not t.get("startTime") or t.get("completionTime"):
            continue
        started = datetime.fromisoformat(str(t["startTime"]).replace("Z", "+00:00")).timestamp()
        total += max(0.0, now - started) * len(t.get("gpus") or []) / 3600.0
    return total
