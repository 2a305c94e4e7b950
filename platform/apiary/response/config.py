"""The incident-response configuration: one YAML file (``APIARY_ONCALL``, default
``home/oncall.yaml``; none: incidents are recorded and mitigated, but nobody is paged).

::

    schedules: [...]          # apiary.oncall: rotation layers, overrides
    policies: [...]           # escalation policies: tiers, delays, loops, ack timeout
    routing: {...}            # channels by severity and working hours
    incidents:
      policy: ml-platform     # the escalation policy new incidents follow
      public_url: https://apiary.example.com   # where signed links point (default: the API's URL)
      link_ttl_s: 604800
      resolve_on_alert_resolved: true          # Alertmanager's "resolved" resolves the incident
      sla: {targets: {sev1: {ack_s: 300, mitigate_s: 1800, resolve_s: 14400}, ...}}  # all four; default DEFAULT_SLA
    contacts:                 # who is reached how (else the user directory's email; none: not reached)
      alice: {email: alice@example.com, phone: "+15550100", im_handle: U024BE7LH}
    channels: {...}           # apiary.response.channels.ChannelsConfig: smtp, slack, teams, twilio
    responseRules: {...}      # apiary.incidents.rules (default: the packaged response-rules.yaml)

Errors name the field (ValidationError, 400 / a clear CLI message).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from apiary.errors import ValidationError
from apiary.incidents import DEFAULT_SLA, SlaPolicy
from apiary.incidents.rules import ResponseRules, default_response_rules, parse_response_rules
from apiary.oncall import OncallConfig, parse_config
from apiary.response.channels import ChannelsConfig, Contact

logger = logging.getLogger(__name__)

ENV = "APIARY_ONCALL"


class IncidentSettings(BaseModel):
    """The ``incidents`` section (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    policy: str | None = None
    public_url: str | None = None
    link_ttl_s: int = Field(default=7 * 86400, ge=60)
    resolve_on_alert_resolved: bool = True
    sla: SlaPolicy = DEFAULT_SLA


class ResponseConfig:
    """The parsed file: ``oncall`` (schedules, policies, routing), ``incidents``, ``contacts``,
    ``channels`` and ``rules``."""

    def __init__(self, oncall: OncallConfig, incidents: IncidentSettings, contacts: dict[str, Contact],
                 channels: ChannelsConfig, rules: ResponseRules) -> None:
        self.oncall, self.incidents, self.contacts, self.channels, self.rules = (
            oncall, incidents, contacts, channels, rules)
        if incidents.policy is not None:
            try:
                oncall.policy(incidents.policy)
            except KeyError:
                raise ValidationError("incidents.policy", f"no escalation policy named {incidents.policy!r}") from None

    @classmethod
    def parse(cls, data: Any) -> ResponseConfig:
        """From plain data; raises ValidationError naming the field."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValidationError("oncall", "must be a mapping")
        data = dict(data)
        incidents, contacts = data.pop("incidents", None) or {}, data.pop("contacts", None) or {}
        if isinstance(incidents, dict) and "user_email_domain" in incidents:
            # Addresses are the directory's or the contacts' (never ``user@domain``): ignored.
            incidents = {k: v for k, v in incidents.items() if k != "user_email_domain"}
            logger.warning("oncall: incidents.user_email_domain is ignored: people are reached at their contacts' "
                           "or the user directory's address")
        channels, rules = data.pop("channels", None) or {}, data.pop("responseRules", None)
        oncall = parse_config(data)
        return cls(oncall, _model(IncidentSettings, incidents, "incidents"),
                   {name: _model(Contact, {"name": name, **(c or {})}, f"contacts.{name}")
                    for name, c in contacts.items()},
                   _model(ChannelsConfig, channels, "channels"),
                   default_response_rules() if rules is None else parse_response_rules(rules))

    @classmethod
    def load(cls, path: Path | None) -> ResponseConfig:
        """The file at ``path`` (or ``$APIARY_ONCALL``); no file: the defaults (nobody paged)."""
        path = path or (Path(os.environ[ENV]) if os.environ.get(ENV) else None)
        if path is None or not path.exists():
            return cls.parse({})
        try:
            return cls.parse(yaml.safe_load(path.read_text()))
        except yaml.YAMLError as e:
            raise ValidationError("oncall", f"{path} is not valid YAML: {e}") from e


def _model(model: type[BaseModel], data: Any, field: str) -> Any:
    try:
        return model.model_validate(data)
    except Exception as e:  # pydantic.ValidationError: name the first field
        errors: list[Any] = getattr(e, "errors", lambda: [])()
        if errors:
            loc = ".".join(str(p) for p in errors[0]["loc"])
            raise ValidationError(f"{field}.{loc}" if loc else field, errors[0]["msg"]) from e
        raise ValidationError(field, str(e)) from e
