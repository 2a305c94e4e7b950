"""The on-call configuration file: schedules, escalation policies and a routing table in one YAML
document (``oncall.example.yaml`` beside this module is a complete example).

Checked beyond each part's own rules: schedule and policy names are unique, and every schedule a
policy's tier targets is defined in the same file.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from apiary.oncall.common import FieldError, OncallModel, parse_model, parse_yaml
from apiary.oncall.escalation import Policy
from apiary.oncall.routing import DEFAULT_ROUTING, Routing
from apiary.oncall.schedule import Schedule

__all__ = ["OncallConfig", "load_config", "parse_config"]


class OncallConfig(OncallModel):
    """``schedules`` and ``policies`` (lists; names unique) and ``routing`` (default
    :data:`apiary.oncall.routing.DEFAULT_ROUTING`)."""

    schedules: tuple[Schedule, ...] = ()
    policies: tuple[Policy, ...] = ()
    routing: Routing = DEFAULT_ROUTING

    @model_validator(mode="after")
    def _check(self) -> OncallConfig:
        for kind, all_names in (
            ("schedules", [s.name for s in self.schedules]),
            ("policies", [p.name for p in self.policies]),
        ):
            for i, name in enumerate(all_names):
                if name in all_names[:i]:
                    raise FieldError((kind, i, "name"), f"duplicate name {name!r}")
        names = {s.name for s in self.schedules}
        for p, policy in enumerate(self.policies):
            for t, tier in enumerate(policy.tiers):
                for g, target in enumerate(tier.targets):
                    if target.schedule is not None and target.schedule not in names:
                        raise FieldError(
                            ("policies", p, "tiers", t, "targets", g, "schedule"),
                            f"unknown schedule {target.schedule!r}",
                        )
        return self

    def schedule_map(self) -> dict[str, Schedule]:
        """The schedules by name, as :func:`apiary.oncall.escalation.resolve_targets` takes them."""
        return {s.name: s for s in self.schedules}

    def policy(self, name: str) -> Policy:
        """The policy called ``name``. Raises KeyError if there is none."""
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(name)


def parse_config(data: Any) -> OncallConfig:
    """An :class:`OncallConfig` from plain data. Raises :class:`apiary.errors.ValidationError`
    naming the field (``schedules[0].layers[0].time_zone: unknown time zone 'Mars/Base'``)."""
    return parse_model(OncallConfig, data)


def load_config(text: str | bytes) -> OncallConfig:
    """An :class:`OncallConfig` from YAML text (the caller reads the file: this package does no
    I/O). Raises :class:`apiary.errors.ValidationError` for bad YAML or a bad field."""
    return parse_config(parse_yaml(text, field="config", what="on-call config"))
