"""Response rules, "distilled from experience" (AI-System 7.6.5.3): correlate, diagnose, mitigate.

One YAML document (``response-rules.yaml`` beside this module is the default)::

    severity:                 # alertname -> incident severity (overrides the alert's level)
      ApiaryGpuEccDoubleBitError: sev2
    correlate:
      node_window_s: 600      # alerts on one node within 10 min: one incident, suspected cause the node
      reopen_window_s: 3600   # the same problem firing again within 1 h reopens its incident
    implies:                  # "alert A on a server implies service K fails": K's alerts join A's incident
      - parent: ApiaryNodeDown
        children: ['ApiaryTask.*', 'ApiaryJob.*']   # alertname regexes (full match)
        scope: node           # node: the same node label; cluster: any open incident of the parent
    rules:                    # first match wins
      - name: gpu-hardware
        match_re: {alertname: 'ApiaryGpu(EccDoubleBitError|XidError)'}
        runbook: gpu-node-repair
        evidence: [{name: ecc_dbe, query: 'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{node="$node"}'}]
        mitigate: [cordon-node, drain-node, notify-owners]

Pure: :func:`join_target` decides whether an alert joins an open incident (before the dedup key
is consulted), :func:`plan` what to attach and run. The caller (``apiary.response``) runs the
mitigations and records each in the timeline with :data:`REVERSALS`' undo.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from apiary.errors import ValidationError
from apiary.incidents.model import NODE_LABELS, Incident, Severity

__all__ = [
    "MITIGATIONS",
    "REVERSALS",
    "Evidence",
    "Implication",
    "Plan",
    "ResponseRule",
    "ResponseRules",
    "alertnames",
    "default_response_rules",
    "ignored",
    "join_target",
    "parse_response_rules",
    "plan",
]

#: The automatic mitigations a rule may name. ``tag-jobs:<tag>`` tags the node's jobs.
MITIGATIONS = ("cordon-node", "drain-node", "tag-jobs", "notify-owners")
#: How each mitigation is undone (None: nothing to undo; a drained job's retry is not moved back).
REVERSALS: Mapping[str, str | None] = {
    "cordon-node": "uncordon-node",
    "drain-node": "uncordon-node",
    "tag-jobs": "untag-jobs",
    "notify-owners": None,
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Evidence(_Model):
    """A PromQL ``query`` attached to the incident as ``name``; ``$node`` is the alert's node."""

    name: str = Field(min_length=1, max_length=100)
    query: str = Field(min_length=1, max_length=2000)


class ResponseRule(_Model):
    """Alerts whose labels equal ``match`` and fully match the regexes of ``match_re``: attach
    ``runbook`` (a runbook flow's name) and ``evidence``, and run ``mitigate`` in order."""

    name: str = Field(min_length=1, max_length=100)
    match: dict[str, str] = Field(default_factory=dict)
    match_re: dict[str, str] = Field(default_factory=dict)
    runbook: str | None = None
    evidence: tuple[Evidence, ...] = ()
    mitigate: tuple[str, ...] = ()

    @field_validator("match_re")
    @classmethod
    def _regexes(cls, value: dict[str, str]) -> dict[str, str]:
        for label, pattern in value.items():
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{label}: not a regular expression: {e}") from e
        return value

    @field_validator("mitigate")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for action in value:
            if action.split(":", 1)[0] not in MITIGATIONS:
                raise ValueError(f"unknown mitigation {action!r}; known: {', '.join(MITIGATIONS)}")
        return value

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match.items()) and all(
            re.fullmatch(p, labels.get(k, "")) for k, p in self.match_re.items())


class Implication(_Model):
    """An open incident holding alert ``parent`` absorbs alerts named by ``children`` (regexes)."""

    parent: str = Field(min_length=1)
    children: tuple[str, ...] = Field(min_length=1)
    scope: Literal["node", "cluster"] = "node"


class Correlate(_Model):
    """``node_window_s``: seconds within which alerts on one node become one incident (0: off).
    ``reopen_window_s``: seconds after a resolve within which the same problem reopens it."""

    node_window_s: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    reopen_window_s: float = Field(default=3600.0, ge=0, allow_inf_nan=False)


class ResponseRules(_Model):
    """The whole document; see the module docstring. ``ignore``: alertname regexes that never
    open or join an incident (the incident system's own alerts, which Alertmanager emails)."""

    severity: dict[str, Severity] = Field(default_factory=dict)
    ignore: tuple[str, ...] = ()
    correlate: Correlate = Correlate()
    implies: tuple[Implication, ...] = ()
    rules: tuple[ResponseRule, ...] = ()


@dataclass(frozen=True)
class Plan:
    """What to do for one alert: the matching ``rule`` (None: no rule), its ``runbook``, its
    ``evidence`` with ``$node`` filled in, and its ``mitigations`` in order."""

    rule: str | None
    runbook: str | None
    evidence: tuple[Evidence, ...]
    mitigations: tuple[str, ...]


def parse_response_rules(data: Any, source: str = "responseRules") -> ResponseRules:
    """The rules from plain data. Raises ValidationError naming the field (``rules[0].mitigate``)."""
    try:
        return ResponseRules.model_validate(data or {})
    except Exception as e:  # pydantic.ValidationError: name the first field
        errors: list[Any] = getattr(e, "errors", lambda: [])()
        if errors:
            loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in errors[0]["loc"]).lstrip(".")
            raise ValidationError(f"{source}.{loc}" if loc else source, errors[0]["msg"]) from e
        raise ValidationError(source, str(e)) from e


def default_response_rules() -> ResponseRules:
    """The packaged ``response-rules.yaml``."""
    import yaml

    text = resources.files("apiary.incidents").joinpath("response-rules.yaml").read_text()
    return parse_response_rules(yaml.safe_load(text), "response-rules.yaml")


def _node(labels: Mapping[str, str]) -> str | None:
    return next((labels[k] for k in NODE_LABELS if labels.get(k)), None)


def alertnames(incident: Incident) -> frozenset[str]:
    """The alert rules whose alerts the incident holds: each entry's ``detail["alertnames"]``."""
    out: set[str] = set()
    for entry in incident.timeline:
        names = entry.detail.get("alertnames")
        if isinstance(names, list | tuple):
            out.update(n for n in names if isinstance(n, str))
    return frozenset(out)


def join_target(labels: Mapping[str, str], incidents: Iterable[Incident], now: float,
                rules: ResponseRules) -> tuple[str, str] | None:
    """The open incident an alert with ``labels`` joins by rule, and why; None: decide by dedup key.

    In order: an implication whose parent alert is held by an open incident (same node for scope
    ``node``) and whose children match the alert's ``alertname``; then node correlation: the open
    incident on the alert's node whose newest entry is at most ``node_window_s`` before ``now``
    (the most recent one). ``now``: seconds since the epoch.
    """
    name, node = labels.get("alertname", ""), _node(labels)
    live = sorted((i for i in incidents if i.state.is_open), key=lambda i: i.last_at, reverse=True)
    for imp in rules.implies:
        if not any(re.fullmatch(p, name) for p in imp.children):
            continue
        for incident in live:
            same_scope = imp.scope == "cluster" or (node is not None and node in incident.links.nodes)
            if imp.parent in alertnames(incident) and same_scope:
                return incident.id, f"{name} is implied by {imp.parent}" + (f" on {node}" if node else "")
    window = rules.correlate.node_window_s
    if node and window > 0:
        for incident in live:
            if node in incident.links.nodes and now - incident.last_at <= window:
                return incident.id, f"another alert on node {node} within {window:g} s: suspected cause the node"
    return None


def ignored(alertnames: Iterable[str], rules: ResponseRules) -> bool:
    """True when every one of ``alertnames`` (at least one) matches an ``ignore`` regex."""
    names = list(alertnames)
    return bool(names) and all(any(re.fullmatch(p, n) for p in rules.ignore) for n in names)


def plan(labels: Mapping[str, str], rules: ResponseRules) -> Plan:
    """The first rule matching ``labels`` as a :class:`Plan` (an empty plan when none matches)."""
    node = _node(labels) or ""
    for rule in rules.rules:
        if rule.matches(labels):
            evidence = tuple(Evidence(name=e.name, query=e.query.replace("$node", node)) for e in rule.evidence)
            return Plan(rule.name, rule.runbook, evidence, rule.mitigate)
    return Plan(None, None, (), ())
