"""Alert quality: per alert rule, how often it fires, how fast people take it, and whether it was noise.

Pure: no I/O, no clock, no threads. AI-System 7.6.2: alerts that are mostly false teach people to
ignore them; so the weekly report (a Prefect markdown artifact, :func:`report_markdown`) names the
rules to fix.

**What is read.**

* *The rules of an incident* (:func:`alert_rules`): every ``alertname`` named in its timeline
  entries' ``detail``: ``detail["alertname"]`` (a string), ``detail["alertnames"]`` (a list of
  strings) and ``detail["labels"]["alertname"]``. When no entry names one, the prefix of the title
  before the first ``:`` when it is a Prometheus metric-style name (``[A-Za-z_][A-Za-z0-9_]*``):
  :meth:`apiary.incidents.model.AlertGroup.from_alertmanager` titles an incident
  ``"<alertname>: <summary>"``. An incident with neither (opened by a person) counts for no rule.
* *The verdict* of an incident: ``verdicts[incident.id]`` when given (``actionable``, ``noise``, or
  None for not judged); otherwise ``detail["verdict"]`` of its latest ``resolve`` entry, where the
  responder marks it at resolve. Any other value counts as not judged.
* *Acknowledged*: an incident with at least one explicit ``acknowledge`` entry (a person took it;
  an incident resolved without one is not acknowledged here, unlike the SLA rule in
  :mod:`apiary.incidents.stats`). *Time to acknowledge*: per episode (``open`` or ``reopen`` to the
  episode's first ``acknowledge``), so a reopened incident can give several samples.
* *Firings* (:class:`Firing`): Alertmanager's view, one per alert instance firing period:
  ``(alertname, fingerprint, starts_at, ends_at)``, ``ends_at`` None while it fires.
* *Flapping*: a fingerprint flaps when it fires again at most ``flap_window_s`` (default 1 h) after
  a firing of it ended. ``flapping`` counts such fingerprints; ``flaps`` the re-firings.

**Median and p90** of the acknowledgement times: :func:`statistics.median` (the mean of the two
middle values for an even count) and the nearest-rank 90th percentile (the smallest sample with at
least 90 % of the samples at or below it, so a value that occurred).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from apiary.errors import ValidationError
from apiary.incidents.model import Incident

__all__ = [
    "DEFAULT_FLAP_WINDOW_S",
    "Firing",
    "QualityReport",
    "RuleQuality",
    "Verdict",
    "alert_rules",
    "quality_report",
    "report_markdown",
    "verdict_of",
]

Verdict = Literal["actionable", "noise"]
_VERDICTS = ("actionable", "noise")

#: A fingerprint that fires again within an hour of resolving is flapping (Apiary's choice; the
#: rule's ``for:`` or Alertmanager's ``keep_firing_for`` is usually too short).
DEFAULT_FLAP_WINDOW_S = 3600.0
_ALERTNAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Firing:
    """One firing period of one alert: ``alertname``, Alertmanager ``fingerprint``, ``starts_at`` and
    ``ends_at`` (epoch s; ``ends_at`` None while it still fires)."""

    alertname: str
    fingerprint: str
    starts_at: float
    ends_at: float | None = None


@dataclass(frozen=True)
class RuleQuality:
    """One alert rule's line of the report.

    ``firings``: firing periods seen. ``incidents``: incidents naming the rule. ``acknowledged``: of
    those, how many a person acknowledged. ``tta_median_s`` / ``tta_p90_s``: time to acknowledge
    (s), None without samples. ``judged`` / ``noise`` / ``actionable``: verdicts given.
    ``noise_ratio``: ``noise / judged``, None when nothing was judged. ``flapping``: fingerprints
    that flapped; ``flaps``: re-firings within the window. ``verdicts``: what to do, one sentence
    each (empty: nothing to fix).
    """

    alertname: str
    firings: int
    incidents: int
    acknowledged: int
    tta_median_s: float | None
    tta_p90_s: float | None
    judged: int
    noise: int
    actionable: int
    noise_ratio: float | None
    flapping: int
    flaps: int
    verdicts: tuple[str, ...]


@dataclass(frozen=True)
class QualityReport:
    """The report: ``rules`` (rules with verdicts first, then by firings, most first, then by name)
    and the parameters it was computed with."""

    rules: tuple[RuleQuality, ...]
    flap_window_s: float
    noise_threshold: float
    min_judged: int

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable): ``{"rules": [{field: value}], "flap_window_s", ...}``."""
        return {
            "rules": [{**asdict(r), "verdicts": list(r.verdicts)} for r in self.rules],
            "flap_window_s": self.flap_window_s,
            "noise_threshold": self.noise_threshold,
            "min_judged": self.min_judged,
        }


def alert_rules(incident: Incident) -> tuple[str, ...]:
    """The alert rule names ``incident`` carries, sorted (see the module docstring). Never raises."""
    names: set[str] = set()
    for entry in incident.timeline:
        d = entry.detail
        if isinstance(d.get("alertname"), str) and d["alertname"]:
            names.add(d["alertname"])
        if isinstance(d.get("alertnames"), list):
            names.update(n for n in d["alertnames"] if isinstance(n, str) and n)
        labels = d.get("labels")
        if isinstance(labels, Mapping) and isinstance(labels.get("alertname"), str) and labels["alertname"]:
            names.add(labels["alertname"])
    if not names and ":" in incident.title:
        prefix = incident.title.split(":", 1)[0].strip()
        if _ALERTNAME.fullmatch(prefix):
            names.add(prefix)
    return tuple(sorted(names))


def verdict_of(incident: Incident, verdicts: Mapping[str, str | None] | None = None) -> Verdict | None:
    """``actionable``, ``noise`` or None (not judged): ``verdicts[incident.id]`` when the mapping has
    the id, else the latest ``resolve`` entry's ``detail["verdict"]``."""
    if verdicts is not None and incident.id in verdicts:
        given = verdicts[incident.id]
    else:
        given = next((e.detail.get("verdict") for e in reversed(incident.timeline) if e.event == "resolve"), None)
    if given == "actionable":
        return "actionable"
    if given == "noise":
        return "noise"
    return None


def _ack_times(incident: Incident) -> list[float]:
    out: list[float] = []
    start: float | None = None
    acked = False
    for e in incident.timeline:
        if e.event in ("open", "reopen"):
            start, acked = e.at, False
        elif e.event == "acknowledge" and not acked and start is not None:
            out.append(e.at - start)
            acked = True
    return out


def _p90(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def _flaps(firings: Iterable[Firing], window_s: float) -> tuple[int, int]:
    by_fp: dict[str, list[Firing]] = {}
    for f in firings:
        by_fp.setdefault(f.fingerprint, []).append(f)
    flapping = flaps = 0
    for periods in by_fp.values():
        periods.sort(key=lambda f: f.starts_at)
        n = sum(1 for prev, nxt in zip(periods, periods[1:], strict=False)
                if prev.ends_at is not None and 0 <= nxt.starts_at - prev.ends_at <= window_s)
        flaps += n
        flapping += 1 if n else 0
    return flapping, flaps


def _as_firing(raw: Firing | Sequence[Any], i: int) -> Firing:
    if isinstance(raw, Firing):
        f = raw
    else:
        try:
            name, fp, starts, ends = raw
        except (TypeError, ValueError) as e:
            raise ValidationError(f"firings[{i}]", "must be (alertname, fingerprint, starts_at, ends_at)") from e
        f = Firing(alertname=name, fingerprint=fp, starts_at=starts, ends_at=ends)
    if not isinstance(f.alertname, str) or not f.alertname:
        raise ValidationError(f"firings[{i}].alertname", "must be a non-empty string")
    for field, t in (("starts_at", f.starts_at), ("ends_at", f.ends_at)):
        if t is None and field == "ends_at":
            continue
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ValidationError(f"firings[{i}].{field}", f"must be a finite time in seconds, not {t!r}")
    if f.ends_at is not None and f.ends_at < f.starts_at:
        raise ValidationError(f"firings[{i}].ends_at", "must not be earlier than starts_at")
    return f


def quality_report(
    incidents: Iterable[Incident],
    verdicts: Mapping[str, str | None] | None = None,
    firings: Iterable[Firing | Sequence[Any]] = (),
    *,
    flap_window_s: float = DEFAULT_FLAP_WINDOW_S,
    noise_threshold: float = 0.5,
    min_judged: int = 3,
) -> QualityReport:
    """The alert-quality report over ``incidents`` and ``firings`` (see the module docstring).

    ``verdicts``: ``{incident id: "actionable" | "noise" | None}``, overriding what the timelines say.
    ``firings``: :class:`Firing` values or ``(alertname, fingerprint, starts_at, ends_at)`` tuples.
    A rule appears when it fired or named an incident. Its ``verdicts`` say "noisy" when
    ``noise_ratio > noise_threshold`` with at least ``min_judged`` judged incidents, and "flapping"
    when any fingerprint flapped within ``flap_window_s``. Raises ValidationError naming the field
    for a malformed firing (``firings[2].ends_at``) or a negative or non-finite window.
    """
    if isinstance(flap_window_s, bool) or not math.isfinite(flap_window_s) or flap_window_s < 0:
        raise ValidationError("flap_window_s", f"must be a finite number of seconds >= 0, not {flap_window_s!r}")
    fires: dict[str, list[Firing]] = {}
    for i, raw in enumerate(firings):
        f = _as_firing(raw, i)
        fires.setdefault(f.alertname, []).append(f)

    per_rule: dict[str, list[Incident]] = {}
    for incident in incidents:
        for name in alert_rules(incident):
            per_rule.setdefault(name, []).append(incident)

    lines: list[RuleQuality] = []
    for name in sorted(set(fires) | set(per_rule)):
        mine = per_rule.get(name, [])
        ttas = [t for inc in mine for t in _ack_times(inc)]
        judged = [v for v in (verdict_of(inc, verdicts) for inc in mine) if v is not None]
        noise = judged.count("noise")
        ratio = noise / len(judged) if judged else None
        flapping, flaps = _flaps(fires.get(name, []), flap_window_s)
        advice: list[str] = []
        if ratio is not None and ratio > noise_threshold and len(judged) >= min_judged:
            advice.append(f"noisy: {noise} of {len(judged)} judged incidents were noise; consider raising the "
                          "threshold or lengthening `for:`")
        if flapping:
            advice.append(f"flapping: {flapping} alert(s) fired again within {flap_window_s:g} s of resolving "
                          f"({flaps} times); consider a longer `for:` or `keep_firing_for:`")
        lines.append(RuleQuality(
            alertname=name, firings=len(fires.get(name, [])), incidents=len(mine),
            acknowledged=sum(1 for inc in mine if any(e.event == "acknowledge" for e in inc.timeline)),
            tta_median_s=float(statistics.median(ttas)) if ttas else None,
            tta_p90_s=_p90(ttas) if ttas else None,
            judged=len(judged), noise=noise, actionable=len(judged) - noise, noise_ratio=ratio,
            flapping=flapping, flaps=flaps, verdicts=tuple(advice)))
    lines.sort(key=lambda r: (not r.verdicts, -r.firings, r.alertname))
    return QualityReport(rules=tuple(lines), flap_window_s=float(flap_window_s),
                         noise_threshold=float(noise_threshold), min_judged=min_judged)


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report_markdown(report: QualityReport, *, title: str = "Alert quality") -> str:
    """The report as Markdown (a Prefect markdown artifact): a heading, one table row per rule
    (firings, incidents, acknowledged, TTA median / p90 in s, noise judged, noise ratio, flapping,
    verdict), and a line when there is nothing to report."""
    out = [f"# {title}", ""]
    if not report.rules:
        out.append("No alert fired and no incident named an alert rule.")
        return "\n".join(out) + "\n"
    out += [
        f"Flapping: fired again within {report.flap_window_s:g} s of resolving. Noisy: noise ratio above "
        f"{report.noise_threshold:g} with at least {report.min_judged} judged incidents.",
        "",
        "| rule | firings | incidents | acknowledged | TTA median (s) | TTA p90 (s) | noise / judged "
        "| noise ratio | flapping | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report.rules:
        ratio = "-" if r.noise_ratio is None else f"{r.noise_ratio:.2f}"
        verdict = "; ".join(r.verdicts) if r.verdicts else "ok"
        out.append(f"| {_cell(r.alertname)} | {r.firings} | {r.incidents} | {r.acknowledged} | "
                   f"{_seconds(r.tta_median_s)} | {_seconds(r.tta_p90_s)} | {r.noise} / {r.judged} | {ratio} | "
                   f"{r.flapping} | {_cell(verdict)} |")
    return "\n".join(out) + "\n"
