"""Alert intake: Alertmanager's webhook (payload version 4) -> recorded alerts -> incidents and actions.

One intake, one pipeline. :meth:`AlertReceiver.receive` stores every alert of the group
(:class:`~apiary.ops.alertlog.AlertLog`), hands the group to incident response (open, join,
reopen or resolve an incident, whose response rule may mitigate: :mod:`apiary.response.service`)
and runs the actions asked for each firing alert through the same action pipeline
(:class:`apiary.response.actions.ActionPipeline`: cordon, drain, stop, tag, notify), recorded once
in the alert-action log and in the incident's timeline when there is one.

Which actions run comes from the actions config (``default-actions.yaml`` beside this file, or
``APIARY_ALERT_ACTIONS``) matched on the alert's labels, modelled on OpenPAI's alert handler, or
from the request itself (``?action=cordon-node``: an Alertmanager receiver per action, OpenPAI's
routing style; these select actions of the same pipeline). An action runs once per (alert
fingerprint, startsAt, action, target), whoever asks for it: Alertmanager's resends, a response
rule and the actions config asking for the same cordon. Resolved notifications are stored and run
no action (the incident may resolve).

People are told through the response package's channels; the actions config's ``smtp`` and
``chat_webhook`` only fill in an email or IM channel the on-call file does not configure, and an
owner's address is the user directory's (or the on-call file's contacts), never invented.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from apiary.errors import ValidationError
from apiary.incidents import ALERT_SEVERITY_TO_SEVERITY, Severity
from apiary.ops.alertlog import AlertLog
from apiary.response.actions import ActionPipeline, AlertKey, Outbox, contact_lookup, user_email
from apiary.response.channels import Channel, Dispatcher, EmailChannel, Message, SlackChannel
from apiary.response.service import IncidentService
from apiary.store.models import Alert

logger = logging.getLogger(__name__)

DEFAULT_ACTIONS = Path(__file__).with_name("default-actions.yaml")
#: Keys an older actions config may hold that no longer mean anything (ignored, with a warning):
#: owners' addresses come from the user directory, not ``user@domain``.
RETIRED_KEYS = ("user_email_domain",)


class AlertmanagerAlert(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: str
    labels: dict[str, str]
    annotations: dict[str, str] = {}
    startsAt: str
    endsAt: str | None = None
    generatorURL: str | None = None
    fingerprint: str = ""


class AlertmanagerPayload(BaseModel):
    """Alertmanager webhook payload, version 4 (prometheus.io/docs/alerting/latest/configuration/#webhook_config)."""

    model_config = ConfigDict(extra="allow")
    version: str = "4"
    groupKey: str | None = None
    status: str
    receiver: str = ""
    groupLabels: dict[str, str] = {}
    commonLabels: dict[str, str] = {}
    commonAnnotations: dict[str, str] = {}
    externalURL: str | None = None
    alerts: list[AlertmanagerAlert]


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    match: dict[str, str] = Field(default_factory=dict, description="label -> exact value")
    match_re: dict[str, str] = Field(default_factory=dict, description="label -> regex (full match)")
    actions: list[str]

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match.items()) and all(
            re.fullmatch(v, labels.get(k, "")) for k, v in self.match_re.items()
        )


class SmtpConfig(BaseModel):
    """An SMTP server for the ``email`` channel when the on-call file configures none."""

    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(default=25, ge=1, le=65535)
    sender: str = "apiary@localhost"
    starttls: bool = False


class ActionsConfig(BaseModel):
    """The actions config. ``admin_email``: where ``email-admin`` goes. ``smtp`` /
    ``chat_webhook`` (a Slack-style incoming webhook): the email / IM channel when the on-call
    file has none. ``rules``: label matchers -> actions (:data:`apiary.response.actions.ACTIONS`;
    ``tag-job:<tag>`` tags the job with ``<tag>``)."""

    model_config = ConfigDict(extra="forbid")
    admin_email: str | None = None
    smtp: SmtpConfig | None = None
    chat_webhook: str | None = None
    rules: list[Rule] = []

    @classmethod
    def load(cls, path: Path | None = None) -> ActionsConfig:
        """Read and validate; raises ValidationError naming the field."""
        path = path or DEFAULT_ACTIONS
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValidationError("alertActions", f"cannot read {path}: {e}") from e
        if isinstance(data, dict):
            for key in RETIRED_KEYS:
                if data.pop(key, None) is not None:
                    logger.warning("%s: %s is ignored: owners are emailed at the user directory's address", path, key)
        try:
            config = cls.model_validate(data)
        except Exception as e:  # pydantic.ValidationError
            raise ValidationError("alertActions", str(e)) from e
        for i, rule in enumerate(config.rules):
            for a in rule.actions:
                ActionPipeline.check(a, f"rules[{i}].actions")
        return config

    def channels(self) -> dict[str, Channel]:
        """The email / IM channels this config names (``email``, ``slack`` and ``im``)."""
        out: dict[str, Channel] = {}
        if self.smtp:
            s = self.smtp
            out["email"] = EmailChannel(s.host, s.port, s.sender, starttls=s.starttls)
        if self.chat_webhook:
            out["slack"] = out["im"] = SlackChannel(self.chat_webhook)
        return out


class AlertReceiver:
    """The alert intake (see the module docstring) over ``plane`` (its public cordon, drain,
    stop, tag). ``notifiers``: the channels by name (``email``, ``im``; default: the config's
    :meth:`ActionsConfig.channels`). ``log``: the alert log (default: over the plane's store).
    Until :meth:`use_incidents` is called the actions run in a pipeline of its own, with no
    incident and no on-call contacts.
    """

    def __init__(self, plane: Any, config: ActionsConfig, notifiers: Mapping[str, Channel] | None = None,
                 clock: Callable[[], float] = time.time, log: AlertLog | None = None) -> None:
        self.plane = plane
        self.config = config
        self.clock = clock
        self.log = log if log is not None else AlertLog(plane.sessions, clock)
        self.channels = dict(notifiers) if notifiers is not None else config.channels()
        outbox = Outbox(Dispatcher(self.channels), contact_lookup({}, user_email(plane.sessions)))
        self.pipeline = ActionPipeline(plane, outbox, admin_email=config.admin_email, log=self.log, clock=clock)
        self.incidents: IncidentService | None = None

    def use_incidents(self, service: IncidentService) -> None:
        """Hand every group to ``service`` and run all actions through its pipeline: its channels
        (plus this config's email / IM channel where it has none), its contacts, this config's admin
        address and this intake's alert log (so its response rules' actions also run once)."""
        pipeline = service.pipeline
        for name, channel in self.channels.items():
            pipeline.outbox.dispatcher.channels.setdefault(name, channel)
        pipeline.admin_email = self.config.admin_email
        pipeline.log = self.log
        self.pipeline, self.incidents = pipeline, service

    def receive(self, payload: AlertmanagerPayload, actions: list[str] | None = None) -> list[dict]:
        """Store the payload's alerts, hand the group to incidents, and run the actions of the
        firing alerts (``actions``: the request's selectors; None: the actions config). Returns one
        dict per action run now: ``{alertname, action, target, status, detail}`` (the incident's
        rule mitigations first). Idempotent: a resend runs nothing again. Raises ValidationError
        for an unsupported version or an unknown selector."""
        if payload.version != "4":
            raise ValidationError("version", f"unsupported Alertmanager webhook version {payload.version!r}")
        for action in actions or ():
            ActionPipeline.check(action)
        for a in payload.alerts:
            self._store(a)
        done: list[dict] = []
        incident: str | None = None
        if self.incidents is not None:
            decision = self.incidents.ingest_alertmanager(payload.model_dump())
            if decision.get("action") in ("open", "attach", "reopen"):
                incident = decision.get("incident")
            first = next((a for a in payload.alerts if a.status == "firing"), None)
            name = first.labels.get("alertname", "") if first else ""
            done += [_result(name, r) for r in decision.get("actions", [])]
        for a in payload.alerts:
            if a.status != "firing":
                continue
            alertname = a.labels.get("alertname", "")
            key = AlertKey(a.fingerprint, a.startsAt, alertname)
            message = self._message(a, incident)
            for action in actions if actions is not None else self._actions_for(a.labels):
                target = self.pipeline.target(action, a.labels)
                if self.incidents is not None:
                    ran = self.incidents.run_action(incident, action, target, actor=f"alertmanager:{alertname}",
                                                    alert=key, message=message)
                else:
                    run = self.pipeline.run(action, target, alert=key, message=message)
                    ran = run.to_dict() if run is not None else None
                if ran is not None:
                    done.append(_result(alertname, ran))
        return done

    def recent(self, limit: int = 100) -> list[dict]:
        """Newest stored alerts first."""
        return self.log.recent_alerts(limit)

    def recent_actions(self, limit: int = 100) -> list[dict]:
        """Newest action runs first: ``{alertname, action, target, status, detail, time}``."""
        return self.log.recent_alert_actions(limit)

    def _actions_for(self, labels: dict[str, str]) -> list[str]:
        out: list[str] = []
        for rule in self.config.rules:
            if rule.matches(labels):
                out += [a for a in rule.actions if a not in out]
        return out

    def _store(self, a: AlertmanagerAlert) -> Alert:
        return self.log.record_alert(
            fingerprint=a.fingerprint or "", alertname=a.labels.get("alertname", ""), status=a.status,
            severity=a.labels.get("severity"), labels=a.labels, annotations=a.annotations,
            starts_at=a.startsAt, ends_at=a.endsAt, received=self.clock(),
        )

    def _message(self, a: AlertmanagerAlert, incident: str | None) -> Message:
        severity = ALERT_SEVERITY_TO_SEVERITY.get(a.labels.get("severity", ""), Severity.SEV4)
        title = f"{a.labels.get('alertname', '')}: {a.annotations.get('summary', '')}".rstrip(": ")
        body = "\n".join([a.annotations.get("description", ""), "",
                          *(f"{k}={v}" for k, v in sorted(a.labels.items()))]).strip()
        return Message(incident_id=incident or "-", severity=severity.value, title=title, body=body)


def _result(alertname: str, run: dict) -> dict:
    return {"alertname": alertname, "action": run["action"], "target": run["target"] or "",
            "status": run["result"], "detail": run["detail"]}
