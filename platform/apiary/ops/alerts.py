"""Alert intake: Alertmanager's webhook (payload version 4) -> recorded alerts -> actions.

Modelled on OpenPAI's alert handler: an alert can cordon its node, stop or tag its job, and
email the admin or the job's owner; Apiary adds a Slack/Teams-style chat post. Which actions
run comes from the actions config (``default-actions.yaml`` beside this file, or
``APIARY_ALERT_ACTIONS``) matched on the alert's labels, or from the request itself
(``?action=cordon-node``: an Alertmanager receiver per action, OpenPAI's routing style).

Every firing alert is stored; every action run is stored with its outcome, unique per
(alert fingerprint, startsAt, action, target), so Alertmanager's resends never run an action
twice. Resolved notifications are stored and run nothing. ``on_alert`` callbacks get each
stored alert: the hook incidents and on-call use (a later issue).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from apiary.errors import ApiaryError, ValidationError
from apiary.ops.alertlog import AlertLog
from apiary.ops.notifiers import ChatWebhookNotifier, EmailNotifier, Notifier
from apiary.store.models import Alert

logger = logging.getLogger(__name__)

DEFAULT_ACTIONS = Path(__file__).with_name("default-actions.yaml")
ACTIONS = ("cordon-node", "stop-job", "tag-job", "email-admin", "email-owner", "chat")
# Label names that carry the node / the job id. Node-scoped rules normalise to `node`; the
# exporters label GPUs with dcgm-exporter's `Hostname`. A task metric's job id arrives as
# `job_id` (Prometheus keeps `job` for the scrape job).
NODE_LABELS = ("node", "Hostname", "hostname")
JOB_LABELS = ("job_id", "exported_job", "job")


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
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = 25
    sender: str = "apiary@localhost"
    starttls: bool = False


class ActionsConfig(BaseModel):
    """The actions config. ``tag-job:<tag>`` tags the job with ``<tag>``."""

    model_config = ConfigDict(extra="forbid")
    admin_email: str | None = None
    user_email_domain: str | None = None
    smtp: SmtpConfig | None = None
    chat_webhook: str | None = None
    rules: list[Rule] = []

    @classmethod
    def load(cls, path: Path | None = None) -> ActionsConfig:
        """Read and validate; raises ValidationError naming the field."""
        path = path or DEFAULT_ACTIONS
        try:
            config = cls.model_validate(yaml.safe_load(Path(path).read_text()) or {})
        except (OSError, yaml.YAMLError) as e:
            raise ValidationError("alertActions", f"cannot read {path}: {e}") from e
        except Exception as e:  # pydantic.ValidationError
            raise ValidationError("alertActions", str(e)) from e
        for i, rule in enumerate(config.rules):
            for a in rule.actions:
                if a.split(":", 1)[0] not in ACTIONS:
                    raise ValidationError(f"rules[{i}].actions", f"unknown action {a!r}; known: {ACTIONS}")
        return config


class AlertReceiver:
    """Records alerts and runs their actions against a :class:`~apiary.control.ControlPlane`.

    Alerts and action runs are written to ``log`` (an :class:`~apiary.ops.alertlog.AlertLog` on the
    plane's store unless given); the actions call the plane's public cordon / stop / tag.

    ``notifiers`` maps ``"email"`` / ``"chat"`` to :class:`Notifier` objects (built from the
    config when not given, so tests can pass their own).
    """

    def __init__(self, plane, config: ActionsConfig, notifiers: dict[str, Notifier] | None = None,
                 clock: Callable[[], float] = time.time, log: AlertLog | None = None) -> None:
        self.plane = plane
        self.log = log if log is not None else AlertLog(plane.sessions, clock)
        self.config = config
        self.clock = clock
        self.on_alert: list[Callable[[Alert], None]] = []
        if notifiers is None:
            notifiers = {}
            if config.smtp:
                s = config.smtp
                notifiers["email"] = EmailNotifier(s.host, s.port, s.sender, starttls=s.starttls)
            if config.chat_webhook:
                notifiers["chat"] = ChatWebhookNotifier(config.chat_webhook)
        self.notifiers = notifiers

    def receive(self, payload: AlertmanagerPayload, actions: list[str] | None = None) -> list[dict]:
        """Store the payload's alerts and run the actions of the firing ones. Returns one dict
        per action run now: ``{alertname, action, target, status, detail}``. Idempotent."""
        if payload.version != "4":
            raise ValidationError("version", f"unsupported Alertmanager webhook version {payload.version!r}")
        done: list[dict] = []
        for a in payload.alerts:
            alert = self._store(a)
            for hook in self.on_alert:
                try:
                    hook(alert)
                except Exception:  # a broken hook must not lose the alert or its actions
                    logger.exception("on_alert hook failed")
            if a.status != "firing":
                continue
            wanted = actions if actions is not None else self._actions_for(a.labels)
            for action in wanted:
                result = self._run_once(a, action)
                if result is not None:
                    done.append(result)
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

    def _run_once(self, a: AlertmanagerAlert, action: str) -> dict | None:
        name, _, arg = action.partition(":")
        target = self._target(name, arg, a.labels)
        alertname = a.labels.get("alertname", "")
        if target is None:
            return {"alertname": alertname, "action": action, "target": "", "status": "skipped",
                    "detail": f"alert has no {'node' if name == 'cordon-node' else 'job'} label"}
        key = {"fingerprint": a.fingerprint, "starts_at": a.startsAt, "action": action, "target": target}
        # The claim is committed before the action runs: a resend stops here (a failed run is retried).
        if not self.log.claim_alert_action(alertname=alertname, **key):
            return None
        try:
            detail, status = self._do(name, arg, target, a), "ok"
        except ApiaryError as e:
            detail, status = e.message, "failed"
            logger.warning("alert action failed alert=%s action=%s target=%s: %s", alertname, action, target,
                           e.message)
        self.log.finish_alert_action(status=status, detail=detail, **key)
        logger.info("alert action alert=%s action=%s target=%s status=%s", alertname, action, target, status)
        return {"alertname": alertname, "action": action, "target": target, "status": status, "detail": detail}

    def _target(self, name: str, arg: str, labels: dict[str, str]) -> str | None:
        if name == "cordon-node":
            return next((labels[k] for k in NODE_LABELS if labels.get(k)), None)
        if name in ("stop-job", "tag-job", "email-owner"):
            return next((labels[k] for k in JOB_LABELS if "~" in labels.get(k, "")), None)
        if name == "email-admin":
            return self.config.admin_email or "admin"
        return "chat"

    def _do(self, name: str, arg: str, target: str, a: AlertmanagerAlert) -> str:
        subject = f"[{a.labels.get('severity', 'alert')}] {a.labels.get('alertname', '')}: " + a.annotations.get(
            "summary", "")
        body = "\n".join([a.annotations.get("description", ""), "", *(f"{k}={v}" for k, v in
                                                                       sorted(a.labels.items()))])
        if name == "cordon-node":
            self.plane.cordon(target, True)
            return f"node {target} cordoned"
        if name == "stop-job":
            self.plane.stop(target)
            return f"job {target} stop requested"
        if name == "tag-job":
            tag = arg or a.labels.get("alertname", "alert")
            self.plane.tag_job(target, tag)
            return f"job {target} tagged {tag}"
        if name in ("email-admin", "email-owner"):
            email = self.notifiers.get("email")
            if email is None:
                raise ValidationError("smtp", "no SMTP server configured for email actions")
            if name == "email-admin":
                to = [self.config.admin_email or "root@localhost"]
            else:
                user = self.plane.get_job(target)["user"]
                to = [f"{user}@{self.config.user_email_domain or 'localhost'}"]
            email.send(subject, body, to)
            return f"emailed {', '.join(to)}"
        chat = self.notifiers.get("chat")
        if chat is None:
            raise ValidationError("chat_webhook", "no chat webhook configured")
        chat.send(subject, body, [])
        return "posted to chat"
