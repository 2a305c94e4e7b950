"""Pass/fail gates of a load test, evaluated on Locust's own output.

Locust has no thresholds of its own; a gate file (``loadtests/gates/<profile>.yaml``) gives them::

    description: what the profile proves
    endpoints:
      "POST /api/v2/jobs":            # "<METHOD> <Locust request name>"
        max_failure_ratio: 0          # failures / requests
        max_p95_ms: 300               # response-time percentiles, milliseconds
        max_p99_ms: 500
        min_rps: 1.0                  # requests / second over the endpoint's active period
        min_requests: 10              # default 1 for a named endpoint: a gate that measured nothing fails
      "Aggregated": {max_failure_ratio: 0}   # every request together
      "*": {max_failure_ratio: 0}     # every endpoint present that is not named above
    jobs:
      max_lost: 0                     # accepted (202) jobs missing from GET /api/v2/jobs afterwards
      min_accepted: 1

Statistics come from Locust's ``--json-file`` (:func:`stats_from_json`: per endpoint, the full
response-time histogram, from which the percentiles are computed exactly as Locust computes its
own) or from its ``--csv`` ``_stats.csv`` (:func:`stats_from_csv`: the ``95%``/``99%`` columns).
Pure: files in, rows out (no clock, no network).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from apiary.errors import ValidationError

#: The key of the all-requests row (Locust's own name for it in the CSV).
AGGREGATED = "Aggregated"
#: The gate key that applies to every endpoint present and not named.
DEFAULT = "*"


# ---------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class EndpointStats:
    """One endpoint's numbers over a whole run (times in milliseconds)."""

    method: str
    name: str
    requests: int
    failures: int
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    rps: float
    """Requests per second between the endpoint's first and last request (Locust's ``Requests/s``)."""

    @property
    def key(self) -> str:
        """``"<METHOD> <name>"``, or ``"Aggregated"`` for the all-requests row."""
        return f"{self.method} {self.name}" if self.method else self.name

    @property
    def failure_ratio(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.key, **asdict(self), "failure_ratio": round(self.failure_ratio, 6)}


def percentile(response_times: Mapping[int, int], num_requests: int, percent: float) -> float:
    """Locust's own percentile of a response-time histogram (``{rounded ms: count}``):
    the smallest recorded time with at most ``(1 - percent)`` of the requests above it."""
    at_most_above = int(num_requests * percent)
    processed = 0
    for rt in sorted(response_times, reverse=True):
        processed += response_times[rt]
        if num_requests - processed <= at_most_above:
            return float(rt)
    return 0.0


def _entry(method: str, name: str, hist: Mapping[int, int], requests: int, failures: int, max_ms: float | None,
           span_s: float) -> EndpointStats:
    counted = sum(hist.values())

    def pct(p: float) -> float | None:
        return percentile(hist, counted, p) if counted else None

    return EndpointStats(
        method=method, name=name, requests=requests, failures=failures, p50_ms=pct(0.5), p95_ms=pct(0.95),
        p99_ms=pct(0.99), max_ms=max_ms, rps=requests / span_s if span_s > 0 else 0.0,
    )


def stats_from_json(source: Path | str | list[dict]) -> list[EndpointStats]:
    """Per-endpoint stats of Locust's ``--json-file`` output (a file, or its parsed list), plus the
    :data:`AGGREGATED` row (histograms merged). Requests/s, as Locust computes its own, divide by the
    whole run's span (the first entry's start to the last request of any). ValidationError if it is
    not Locust's format."""
    entries = source if isinstance(source, list) else json.loads(Path(source).read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValidationError("stats", "Locust's JSON stats are a list of endpoint entries")
    parsed = []
    for i, e in enumerate(entries):
        try:
            hist = {int(float(k)): int(v) for k, v in (e.get("response_times") or {}).items()}
            requests, failures = int(e["num_requests"]), int(e["num_failures"])
            last = e.get("last_request_timestamp")
            parsed.append((str(e["method"] or ""), str(e["name"]), hist, requests, failures,
                           float(e["max_response_time"]) if requests else None, float(e["start_time"]),
                           float(last) if last is not None else None))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValidationError(f"stats[{i}]", f"not a Locust stats entry: {err!r}") from err
    if not parsed:
        return []
    lasts = [p[7] for p in parsed if p[7] is not None]
    span = (max(lasts) - min(p[6] for p in parsed)) if lasts else 0.0
    out = [_entry(m, n, h, r, f, mx, span) for m, n, h, r, f, mx, _start, _last in parsed]
    merged: dict[int, int] = {}
    for p in parsed:
        for k, v in p[2].items():
            merged[k] = merged.get(k, 0) + v
    maxes = [p[5] for p in parsed if p[5] is not None]
    out.append(_entry("", AGGREGATED, merged, sum(p[3] for p in parsed), sum(p[4] for p in parsed),
                      max(maxes) if maxes else None, span))
    return out


def _num(row: Mapping[str, str], col: str) -> float | None:
    raw = (row.get(col) or "").strip()
    if not raw or raw == "N/A":
        return None
    return float(raw)


def stats_from_csv(path: Path | str) -> list[EndpointStats]:
    """Per-endpoint stats of Locust's ``--csv PREFIX`` file ``PREFIX_stats.csv`` (its ``Aggregated``
    row included). ValidationError if a column is missing."""
    out: list[EndpointStats] = []
    with Path(path).open(newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            try:
                requests = int(row["Request Count"])
                out.append(EndpointStats(
                    method=row["Type"] or "", name=row["Name"], requests=requests, failures=int(row["Failure Count"]),
                    p50_ms=_num(row, "50%"), p95_ms=_num(row, "95%"), p99_ms=_num(row, "99%"),
                    max_ms=_num(row, "Max Response Time") if requests else None, rps=_num(row, "Requests/s") or 0.0,
                ))
            except (KeyError, TypeError, ValueError) as err:
                raise ValidationError(f"{Path(path).name}: row {i + 1}", f"not Locust's stats CSV: {err!r}") from err
    return out


@dataclass(frozen=True)
class FailureStat:
    """One distinct error of Locust's ``PREFIX_failures.csv``."""

    endpoint: str
    error: str
    occurrences: int


def failures_from_csv(path: Path | str) -> list[FailureStat]:
    """The errors of Locust's ``PREFIX_failures.csv``, most frequent first ([] if there is no file)."""
    p = Path(path)
    if not p.exists():
        return []
    with p.open(newline="", encoding="utf-8") as f:
        out = [FailureStat(f"{row['Method']} {row['Name']}", row["Error"], int(row["Occurrences"]))
               for row in csv.DictReader(f)]
    return sorted(out, key=lambda x: (-x.occurrences, x.endpoint, x.error))


# ---------------------------------------------------------------------- gates
@dataclass(frozen=True)
class EndpointGate:
    """Thresholds for one endpoint; None = not checked."""

    max_failure_ratio: float | None = None
    max_p95_ms: float | None = None
    max_p99_ms: float | None = None
    min_rps: float | None = None
    min_requests: int | None = None


@dataclass(frozen=True)
class JobGate:
    max_lost: int | None = 0
    """Accepted (202) jobs missing from ``GET /api/v2/jobs`` after the run."""
    min_accepted: int | None = None


@dataclass(frozen=True)
class Gates:
    endpoints: dict[str, EndpointGate] = field(default_factory=dict)
    """By ``"<METHOD> <name>"``, :data:`AGGREGATED` or :data:`DEFAULT`."""
    jobs: JobGate = field(default_factory=JobGate)
    description: str = ""


def _gate(where: str, doc: object, cls: type) -> Any:
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ValidationError(where, "must be a mapping of thresholds")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValidationError(f"{where}.{unknown[0]}", f"unknown threshold; one of {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for k, v in doc.items():
        if v is None:
            values[k] = None
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValidationError(f"{where}.{k}", f"must be a number >= 0, not {v!r}")
        values[k] = int(v) if k in ("min_requests", "max_lost", "min_accepted") else float(v)
    return cls(**values)


def parse_gates(doc: object) -> Gates:
    """A gate file's parsed YAML as :class:`Gates`; ValidationError naming the offending field."""
    if not isinstance(doc, dict):
        raise ValidationError("gates", "a gate file is a mapping with 'endpoints' and 'jobs'")
    unknown = sorted(set(doc) - {"description", "endpoints", "jobs"})
    if unknown:
        raise ValidationError(unknown[0], "unknown key; one of description, endpoints, jobs")
    eps = doc.get("endpoints") or {}
    if not isinstance(eps, dict):
        raise ValidationError("endpoints", "must map '<METHOD> <name>' to thresholds")
    endpoints = {str(k): _gate(f"endpoints.{k}", v, EndpointGate) for k, v in eps.items()}
    jobs = _gate("jobs", doc.get("jobs"), JobGate) if "jobs" in doc else JobGate()
    return Gates(endpoints=endpoints, jobs=jobs, description=str(doc.get("description") or ""))


def load_gates(path: Path | str) -> Gates:
    """:func:`parse_gates` of a YAML file."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValidationError(str(path), f"not valid YAML: {e}") from e
    return parse_gates(doc)


@dataclass(frozen=True)
class JobCheck:
    """Accepted jobs (202 from ``POST /api/v2/jobs``) vs the jobs listed afterwards."""

    accepted: int
    listed: int
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class GateRow:
    """One check: ``measured`` against ``threshold`` (``"<= 500"``); ``measured`` None: nothing measured."""

    endpoint: str
    metric: str
    measured: float | None
    threshold: str
    passed: bool
    note: str = ""

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


_CHECKS = (
    # (gate field, metric name, stats attribute, is a maximum)
    ("max_failure_ratio", "failure_ratio", "failure_ratio", True),
    ("max_p95_ms", "p95_ms", "p95_ms", True),
    ("max_p99_ms", "p99_ms", "p99_ms", True),
    ("min_rps", "rps", "rps", False),
    ("min_requests", "requests", "requests", False),
)


def _fmt(v: float) -> str:
    return f"{v:g}"


def _endpoint_rows(key: str, gate: EndpointGate, s: EndpointStats | None) -> list[GateRow]:
    rows: list[GateRow] = []
    if s is None or s.requests == 0:
        need = gate.min_requests if gate.min_requests is not None else 1
        return [GateRow(key, "requests", 0.0, f">= {need}", need <= 0, "no request of this endpoint in the run")]
    for gate_field, metric, attr, is_max in _CHECKS:
        limit = getattr(gate, gate_field)
        if limit is None or (gate_field == "min_requests" and limit == 0):  # optional and present: nothing to say
            continue
        value = getattr(s, attr)
        if value is None:
            rows.append(GateRow(key, metric, None, f"{'<=' if is_max else '>='} {_fmt(limit)}", False, "not measured"))
            continue
        ok = value <= limit if is_max else value >= limit
        rows.append(GateRow(key, metric, float(value), f"{'<=' if is_max else '>='} {_fmt(limit)}", ok))
    return rows


def evaluate(gates: Gates, stats: Iterable[EndpointStats], jobs: JobCheck | None = None) -> list[GateRow]:
    """Every check of ``gates`` on ``stats`` (and ``jobs``), in the gate file's order, then the
    :data:`DEFAULT` gate for every other endpoint in the run (sorted), then the job checks. A named
    endpoint absent from the run fails (unless its ``min_requests`` is 0); ``jobs`` None with a
    job gate fails too: the run did not say what became of its jobs."""
    by_key = {s.key: s for s in stats}
    rows: list[GateRow] = []
    for key, gate in gates.endpoints.items():
        if key != DEFAULT:
            rows += _endpoint_rows(key, gate, by_key.get(key))
    default = gates.endpoints.get(DEFAULT)
    if default is not None:
        for key in sorted(k for k in by_key if k not in gates.endpoints and k != AGGREGATED):
            rows += _endpoint_rows(key, default, by_key[key])
    jg = gates.jobs
    if jg.max_lost is not None:
        if jobs is None:
            rows.append(GateRow("jobs", "lost", None, f"<= {jg.max_lost}", False, "accepted jobs were not checked"))
        else:
            note = ", ".join(jobs.lost[:5]) + (" ..." if len(jobs.lost) > 5 else "")
            rows.append(GateRow("jobs", "lost", float(len(jobs.lost)), f"<= {jg.max_lost}",
                                len(jobs.lost) <= jg.max_lost, f"{jobs.listed}/{jobs.accepted} accepted jobs listed"
                                + (f"; missing {note}" if note else "")))
    if jg.min_accepted is not None:
        got = float(jobs.accepted) if jobs is not None else None
        rows.append(GateRow("jobs", "accepted", got, f">= {jg.min_accepted}",
                            got is not None and got >= jg.min_accepted))
    return rows


def passed(rows: Iterable[GateRow]) -> bool:
    """The verdict: at least one check, and every check passed."""
    rows = list(rows)
    return bool(rows) and all(r.passed for r in rows)
