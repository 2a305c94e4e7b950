"""Job-failure triage: an exit code and the tail of a task's log -> user, platform or hardware.

The classes are those of the Philly failure study (Jeon et al., "Analysis of Large-Scale
Multi-Tenant GPU Clusters for DNN Training Workloads", USENIX ATC 2019): most failures are the
user's (syntax and import errors, wrong paths, the program's own out-of-memory); the rest are
the infrastructure's (lost nodes, timeouts, MPI/communication runtime) or the hardware's (ECC,
XID). A burst of platform failures is a platform incident; a burst of user failures is not.

The rules are data: ``triage-rules.yaml`` beside this module (documented there) is the default,
:func:`parse_rules` reads any other. The first rule that matches wins; when none does, the exit
code's type in OpenPAI's exit spec (:func:`apiary.lifecycle.exitspec.classify_exit`) decides.

Pure: no I/O but :func:`default_rules` reading the packaged file (:mod:`importlib.resources`, like
the exit spec), no clock, no threads.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from types import MappingProxyType
from typing import Any

from apiary.errors import ValidationError
from apiary.lifecycle.exitspec import EXIT_PREEMPTED, classify_exit, exit_spec
from apiary.spec.safeyaml import load as safe_load_yaml

__all__ = [
    "DEFAULT_MIN_FAILURES",
    "DEFAULT_THRESHOLD",
    "EXIT_TYPE_CLASSES",
    "MAX_TAIL_LINES",
    "RULES_RESOURCE",
    "Classification",
    "FailureClass",
    "TriageRule",
    "TriageRules",
    "classify_failure",
    "default_rules",
    "parse_rules",
    "platform_failure_rate",
    "should_open_incident",
]

RULES_RESOURCE = "triage-rules.yaml"
#: Only the last this-many lines of a tail are read (the failure is at the end; rules stay cheap).
MAX_TAIL_LINES = 1000
#: A longer evidence line is cut to this many characters.
MAX_EVIDENCE_CHARS = 500


class FailureClass(StrEnum):
    """Who caused a task's failure. Values equal the lower-case names.

    ``user``, ``platform``, ``hardware``: Jeon et al.'s classes (see the module doc). ``unknown``: no
    rule matched and the exit spec does not know either (its ``UNKNOWN_FAILURE`` type, or a code it
    does not define, e.g. a plain ``exit 1``). ``none``: not a failure at all (success, a user stop,
    a preemption), never counted.
    """

    USER = "user"
    PLATFORM = "platform"
    HARDWARE = "hardware"
    UNKNOWN = "unknown"
    NONE = "none"

    @classmethod
    def rule_classes(cls) -> frozenset[FailureClass]:
        """``{user, platform, hardware}``: the classes a rule may assign."""
        return frozenset({cls.USER, cls.PLATFORM, cls.HARDWARE})


#: The exit spec's ``type`` -> class, for a failure no rule matched. USER_SUCCESS and USER_STOP are
#: not failures; RESOURCE_ALLOCATION_TIMEOUT (the platform could not give what it granted) is the
#: platform's.
EXIT_TYPE_CLASSES: Mapping[str, FailureClass] = MappingProxyType({
    "USER_SUCCESS": FailureClass.NONE,
    "USER_STOP": FailureClass.NONE,
    "USER_FAILURE": FailureClass.USER,
    "PLATFORM_FAILURE": FailureClass.PLATFORM,
    "RESOURCE_ALLOCATION_TIMEOUT": FailureClass.PLATFORM,
    "UNKNOWN_FAILURE": FailureClass.UNKNOWN,
})

#: Codes that are not failures whatever the spec's type says: -1003 PodPreemptedForCriticalPod is the
#: code Apiary gives a preempted task (EXIT_PREEMPTED); the spec calls it PLATFORM_FAILURE, but a
#: preemption is the scheduler doing its job, and counting it would open incidents on every busy day.
NOT_FAILURE_CODES = frozenset({EXIT_PREEMPTED})


@dataclass(frozen=True)
class TriageRule:
    """One rule: ``name``, ``klass`` (user / platform / hardware), ``runbook`` (a one-line hint),
    ``patterns`` (compiled, searched in each log line) and ``exit_codes``; a rule with both needs
    both, a rule has at least one."""

    name: str
    klass: FailureClass
    runbook: str
    patterns: tuple[re.Pattern[str], ...] = ()
    exit_codes: frozenset[int] = frozenset()

    def match(self, exit_code: int, lines: list[str]) -> str | None:
        """The evidence if the rule matches: the last line a pattern finds (stripped), or ``""`` for a
        rule of exit codes only. None if it does not match."""
        if self.exit_codes and exit_code not in self.exit_codes:
            return None
        if not self.patterns:
            return ""
        for line in reversed(lines):
            if any(p.search(line) for p in self.patterns):
                return line.strip()[:MAX_EVIDENCE_CHARS]
        return None


@dataclass(frozen=True)
class TriageRules:
    """The rules in evaluation order (the first match wins)."""

    rules: tuple[TriageRule, ...]


@dataclass(frozen=True)
class Classification:
    """Why a task failed.

    ``klass``: a :class:`FailureClass`. ``rule``: the rule's name, or ``exit-spec:<phrase>`` (e.g.
    ``exit-spec:PAIRuntimeExitAbnormally``) when the exit spec decided. ``evidence_line``: the log line
    the rule matched ("" for an exit-code rule or the exit spec). ``runbook``: the rule's hint, or the
    spec's reason. ``exit_code``: the code classified.
    """

    klass: FailureClass
    rule: str
    evidence_line: str
    runbook: str = ""
    exit_code: int = 0


def _as_str(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(field, "must be a non-empty string")
    return value


def parse_rules(data: Any, source: str = "triageRules") -> TriageRules:
    """Rules from parsed YAML in the shape of ``triage-rules.yaml``: ``{"version": 1, "rules": [{"name",
    "class", "runbook", "patterns"?, "exit_codes"?}, ...]}``.

    Raises ValidationError naming the field (``triageRules.rules[3].patterns[0]``) for anything
    malformed: a missing or repeated name, a class other than user / platform / hardware, a pattern
    that is not a valid regular expression, an exit code that is not an integer, a rule with neither
    patterns nor exit codes, an unknown key.
    """
    if not isinstance(data, Mapping):
        raise ValidationError(source, "must be a mapping with 'version' and 'rules'")
    unknown = set(data) - {"version", "rules"}
    if unknown:
        raise ValidationError(f"{source}.{sorted(map(str, unknown))[0]}", "unknown key")
    if data.get("version", 1) != 1:
        raise ValidationError(f"{source}.version", f"must be 1, not {data.get('version')!r}")
    raw_rules = data.get("rules")
    if not isinstance(raw_rules, list) or not raw_rules:
        raise ValidationError(f"{source}.rules", "must be a non-empty list of rules")
    rules: list[TriageRule] = []
    names: set[str] = set()
    for i, raw in enumerate(raw_rules):
        where = f"{source}.rules[{i}]"
        if not isinstance(raw, Mapping):
            raise ValidationError(where, "must be a mapping")
        extra = set(raw) - {"name", "class", "runbook", "patterns", "exit_codes"}
        if extra:
            raise ValidationError(f"{where}.{sorted(map(str, extra))[0]}", "unknown key")
        name = _as_str(raw.get("name"), f"{where}.name")
        if name in names:
            raise ValidationError(f"{where}.name", f"duplicate rule name {name!r}")
        names.add(name)
        klass_raw = raw.get("class")
        klasses = {c.value: c for c in FailureClass.rule_classes()}
        if not isinstance(klass_raw, str) or klass_raw not in klasses:
            raise ValidationError(f"{where}.class", f"must be user, platform or hardware, not {klass_raw!r}")
        klass = klasses[klass_raw]
        runbook = raw.get("runbook", "")
        if not isinstance(runbook, str):
            raise ValidationError(f"{where}.runbook", "must be a string")
        raw_patterns = raw.get("patterns", [])
        if not isinstance(raw_patterns, list):
            raise ValidationError(f"{where}.patterns", "must be a list of regular expressions")
        patterns: list[re.Pattern[str]] = []
        for j, p in enumerate(raw_patterns):
            text = _as_str(p, f"{where}.patterns[{j}]")
            try:
                patterns.append(re.compile(text))
            except re.error as e:
                raise ValidationError(f"{where}.patterns[{j}]", f"not a valid regular expression: {e}") from e
        raw_codes = raw.get("exit_codes", [])
        if not isinstance(raw_codes, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in raw_codes):
            raise ValidationError(f"{where}.exit_codes", "must be a list of integers")
        if not patterns and not raw_codes:
            raise ValidationError(where, "needs patterns, exit_codes or both")
        rules.append(TriageRule(name=name, klass=klass, runbook=runbook, patterns=tuple(patterns),
                                exit_codes=frozenset(raw_codes)))
    return TriageRules(rules=tuple(rules))


@functools.cache
def default_rules() -> TriageRules:
    """The packaged ``triage-rules.yaml``, parsed once per process (through the bounded YAML loader of
    :mod:`apiary.spec.safeyaml`). Raises ValidationError if the packaged file is broken (a bug)."""
    text = resources.files(__package__).joinpath(RULES_RESOURCE).read_text(encoding="utf-8")
    return parse_rules(safe_load_yaml(text, field="triageRules", what=RULES_RESOURCE))


def classify_failure(exit_code: int, log_tail: str | Iterable[str], rules: TriageRules | None = None) -> Classification:
    """Classify one failed task run.

    ``exit_code``: the run's exit code (OpenPAI's exit spec: ``128 + signal`` when killed, Apiary's
    negative codes such as -1001 node lost). ``log_tail``: the end of the task's log, one string or
    its lines; only the last :data:`MAX_TAIL_LINES` lines are read. ``rules``: :func:`default_rules`
    when None.

    In order: a code that is not a failure (the spec's USER_SUCCESS / USER_STOP types, and -1003, a
    preemption) is class ``none`` without reading the log; else the first rule that matches (see
    ``triage-rules.yaml``); else the exit spec's type (:data:`EXIT_TYPE_CLASSES`), with rule
    ``exit-spec:<phrase>`` and the spec's reason as the runbook, except that a code the spec does not
    define (a plain ``exit 1``: the spec's fallback 256 PAIRuntimeExitAbnormally) is ``unknown``, not
    the fallback's PLATFORM_FAILURE: that type blames OpenPAI's runtime wrapper, which Apiary has not.
    Raises TypeError for a non-integer ``exit_code`` (as :func:`~apiary.lifecycle.exitspec.classify_exit`
    does).
    """
    info = classify_exit(exit_code)
    spec_rule = f"exit-spec:{info.phrase}"
    if exit_code in NOT_FAILURE_CODES or EXIT_TYPE_CLASSES.get(info.type) == FailureClass.NONE:
        return Classification(FailureClass.NONE, spec_rule, "", info.reason, exit_code)
    lines = log_tail.splitlines() if isinstance(log_tail, str) else [str(x) for x in log_tail]
    lines = lines[-MAX_TAIL_LINES:]
    for rule in (rules or default_rules()).rules:
        evidence = rule.match(exit_code, lines)
        if evidence is not None:
            return Classification(rule.klass, rule.name, evidence, rule.runbook, exit_code)
    if exit_code not in exit_spec():
        # The spec's shadow fallbacks (256, -8000). In OpenPAI a code ending there means its runtime
        # wrapper misbehaved (256 is PLATFORM_FAILURE); Apiary has no wrapper between a program and its
        # exit status, so an undefined code (a plain `exit 1`) is the program's own and says nothing.
        return Classification(FailureClass.UNKNOWN, spec_rule, "", info.reason, exit_code)
    klass = EXIT_TYPE_CLASSES.get(info.type, FailureClass.UNKNOWN)
    return Classification(klass, spec_rule, "", info.reason, exit_code)


#: Apiary's defaults for :func:`should_open_incident` (its choice, not the study's numbers): user
#: errors are the bulk of failures in a healthy cluster (Jeon et al.), so a quarter of a window's
#: failures being the platform's is well off the normal mix; three is the fewest failures that are
#: more than one unlucky job.
DEFAULT_THRESHOLD = 0.25
DEFAULT_MIN_FAILURES = 3

_PLATFORM_CLASSES = frozenset({FailureClass.PLATFORM, FailureClass.HARDWARE})


def platform_failure_rate(
    classifications: Iterable[Classification],
    classes: Iterable[FailureClass] = _PLATFORM_CLASSES,
) -> float:
    """The share, in [0, 1], of the window's failures whose class is in ``classes`` (platform and
    hardware by default: both are the platform team's to fix).

    ``classifications``: one per failed run in the window (the caller picks the window). Class
    ``none`` (not failures) is left out of both counts; ``unknown`` counts as a failure that is not
    the platform's. 0.0 for a window without failures.
    """
    wanted = frozenset(classes)
    total = hits = 0
    for c in classifications:
        if c.klass == FailureClass.NONE:
            continue
        total += 1
        hits += c.klass in wanted
    return hits / total if total else 0.0


def should_open_incident(
    rate: float,
    threshold: float = DEFAULT_THRESHOLD,
    min_failures: int = DEFAULT_MIN_FAILURES,
    *,
    failures: int,
) -> bool:
    """True when a window's platform failures call for an incident: ``rate >= threshold`` and at least
    ``min_failures`` of them.

    ``rate``: :func:`platform_failure_rate`, in [0, 1]. ``threshold``: in [0, 1]. ``min_failures``: >= 1.
    ``failures``: the number of platform (and hardware) failures in the window, >= 0 (a rate alone
    cannot tell 1 of 1 from 30 of 120). Raises ValidationError naming the parameter for a value out of
    its range.
    """
    for name, value in (("rate", rate), ("threshold", threshold)):
        if isinstance(value, bool) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            raise ValidationError(name, f"must be a fraction in [0, 1], not {value!r}")
    if isinstance(min_failures, bool) or not isinstance(min_failures, int) or min_failures < 1:
        raise ValidationError("min_failures", f"must be an integer >= 1, not {min_failures!r}")
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise ValidationError("failures", f"must be an integer >= 0, not {failures!r}")
    return failures >= min_failures and rate >= threshold
