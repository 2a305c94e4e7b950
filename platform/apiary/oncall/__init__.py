"""On-call, the pure core: schedules, escalation policies and notification routing.

* :mod:`.schedule`: rotation layers, restrictions and overrides (PagerDuty's model);
  :func:`on_call` and :func:`shifts`.
* :mod:`.escalation`: tiers, loops and acknowledgement timeouts; :func:`escalation_plan`,
  :func:`next_page` (the deadlines a durable escalation worker stores) and :func:`resolve_targets`.
* :mod:`.routing`: channels by severity and hour (AI-System 7.6.2); :func:`route`.
* :mod:`.config`: the YAML file holding all three (``oncall.example.yaml``).

Pure like :mod:`apiary.scheduler`: no I/O (besides the zone database), no clock (every instant is
an argument), no threads. Aware datetimes in, UTC datetimes out; naive ones raise ValueError.
Bad configuration raises :class:`apiary.errors.ValidationError` naming the field.
"""

from apiary.oncall.config import OncallConfig, load_config, parse_config
from apiary.oncall.escalation import (
    Page,
    Policy,
    Target,
    Tier,
    escalation_plan,
    load_policy,
    next_page,
    parse_policy,
    resolve_targets,
)
from apiary.oncall.routing import (
    DEFAULT_ROUTING,
    DEFAULT_RULES,
    DEFAULT_WORKING_HOURS,
    Channel,
    Routing,
    Rule,
    Severity,
    When,
    WorkingHours,
    load_routing,
    parse_routing,
    route,
)
from apiary.oncall.schedule import (
    Layer,
    Override,
    Restriction,
    Rotation,
    Schedule,
    Shift,
    load_schedule,
    on_call,
    parse_schedule,
    shifts,
)

__all__ = [
    "DEFAULT_ROUTING",
    "DEFAULT_RULES",
    "DEFAULT_WORKING_HOURS",
    "Channel",
    "Layer",
    "OncallConfig",
    "Override",
    "Page",
    "Policy",
    "Restriction",
    "Rotation",
    "Routing",
    "Rule",
    "Schedule",
    "Severity",
    "Shift",
    "Target",
    "Tier",
    "When",
    "WorkingHours",
    "escalation_plan",
    "load_config",
    "load_policy",
    "load_routing",
    "load_schedule",
    "next_page",
    "on_call",
    "parse_config",
    "parse_policy",
    "parse_routing",
    "parse_schedule",
    "resolve_targets",
    "route",
    "shifts",
]
