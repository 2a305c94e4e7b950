"""Gate evaluation on recorded Locust output (tests/data/load/): a passing smoke run against an
embedded platform on Lab 6's two-VC cluster (5 people, 2 node agents, 30 s) and one whose users were
rate-limited to 8 calls/min (429s). Pure: no Locust, no platform."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from apiary.errors import ValidationError
from apiary.load.gates import (
    AGGREGATED,
    EndpointGate,
    EndpointStats,
    Gates,
    JobCheck,
    JobGate,
    evaluate,
    failures_from_csv,
    load_gates,
    parse_gates,
    passed,
    percentile,
    stats_from_csv,
    stats_from_json,
)
from apiary.load.runner import LOADTESTS_DIR, default_gates, locustfile, pick_virtual_cluster

DATA = Path(__file__).resolve().parents[1] / "data" / "load"
PASS_RUN = DATA / "smoke-pass"
LIMITED_RUN = DATA / "smoke-429"
SUBMIT = "POST /api/v2/jobs"
ENDPOINTS = {
    SUBMIT, "GET /api/v2/jobs/[id]", "GET /api/v2/jobs/[id]/logs", "GET /api/v2/jobs?username=[user]",
    "GET /api/v2/nodes", "GET /api/v2/cluster/status", "POST /api/v2/nodes/[node]/status",
    "GET /api/v2/nodes/[node]/assignments", "GET /api/v2/nodes/[node]/assignments?wait", AGGREGATED,
}


def stats(key: str, requests: int = 100, failures: int = 0, p95: float | None = 50.0, p99: float | None = 80.0,
          rps: float = 2.0) -> EndpointStats:
    """A builder: one endpoint's numbers, keyed ``"<METHOD> <name>"`` (or ``Aggregated``)."""
    method, _, name = key.partition(" ") if key != AGGREGATED else ("", "", AGGREGATED)
    return EndpointStats(method=method, name=name, requests=requests, failures=failures, p50_ms=10.0, p95_ms=p95,
                         p99_ms=p99, max_ms=p99, rps=rps)


def by_key(rows):
    return {(r.endpoint, r.metric): r for r in rows}


# ---------------------------------------------------------------------- reading Locust's output
def test_json_stats_have_every_endpoint_and_the_aggregate() -> None:
    got = {s.key: s for s in stats_from_json(PASS_RUN / "stats.json")}
    assert set(got) == ENDPOINTS
    agg = got[AGGREGATED]
    assert agg.requests == sum(s.requests for k, s in got.items() if k != AGGREGATED)
    assert agg.failures == 0 and got[SUBMIT].requests == 8
    assert agg.max_ms == max(s.max_ms for k, s in got.items() if k != AGGREGATED)


def test_json_percentiles_and_rates_match_locusts_own_csv() -> None:
    """The evaluator computes percentiles from the JSON histogram as Locust does: the same numbers
    as the 95%/99% columns Locust itself wrote to the CSV of the same run."""
    from_json = {s.key: s for s in stats_from_json(PASS_RUN / "stats.json")}
    from_csv = {s.key: s for s in stats_from_csv(PASS_RUN / "locust_stats.csv")}
    assert set(from_json) == set(from_csv)
    for key, j in from_json.items():
        c = from_csv[key]
        assert (j.requests, j.failures) == (c.requests, c.failures), key
        assert (j.p50_ms, j.p95_ms, j.p99_ms) == (c.p50_ms, c.p95_ms, c.p99_ms), key
        assert j.rps == pytest.approx(c.rps, rel=0.02), key


def test_csv_stats_count_the_rate_limited_failures() -> None:
    got = {s.key: s for s in stats_from_csv(LIMITED_RUN / "locust_stats.csv")}
    assert got[SUBMIT].failures == 2 and got[SUBMIT].failure_ratio == pytest.approx(2 / 9)
    assert got[AGGREGATED].failures == 4
    errors = failures_from_csv(LIMITED_RUN / "locust_failures.csv")
    assert sum(f.occurrences for f in errors) == 4
    assert all("429" in f.error for f in errors)
    assert failures_from_csv(LIMITED_RUN / "absent.csv") == []


@pytest.mark.parametrize(
    ("hist", "n", "pct", "want"),
    [
        ({10: 1}, 1, 0.99, 10.0),
        ({10: 98, 20: 1, 500: 1}, 100, 0.95, 10.0),
        ({10: 98, 20: 1, 500: 1}, 100, 0.99, 500.0),
        ({10: 97, 20: 2, 500: 1}, 100, 0.98, 20.0),
        ({10: 50, 20: 50}, 100, 0.5, 20.0),
        ({}, 0, 0.99, 0.0),
    ],
    ids=["one", "p95-bulk", "p99-one-in-100", "p98-second", "median-boundary", "empty"],
)
def test_percentile_is_locusts(hist, n, pct, want) -> None:
    """Expected values are what locust.stats.calculate_response_time_percentile answers (checked
    once by hand in a separate process: the tests never import Locust). Note Locust's p99 of 100
    samples is the slowest one."""
    assert percentile(hist, n, pct) == want


@pytest.mark.parametrize("bad", [[[1, 2]], [{"name": "x"}], [{"method": "GET", "name": "/x",
                                                                      "num_requests": "many"}]],
                         ids=["not-an-entry", "missing-fields", "bad-number"])
def test_json_that_is_not_locusts_is_refused(bad) -> None:
    with pytest.raises(ValidationError):
        stats_from_json(bad)


# ---------------------------------------------------------------------- the shipped gate files
@pytest.mark.parametrize("profile", ["smoke", "ramp", "steady", "spike"])
def test_every_profile_has_a_locustfile_and_a_gate_file_that_parses(profile: str) -> None:
    assert locustfile(profile).exists()
    gates = load_gates(default_gates(profile))
    assert gates.jobs.max_lost == 0
    assert gates.endpoints[SUBMIT].max_failure_ratio == 0
    assert gates.description


def test_steady_gates_hold_the_issue_targets() -> None:
    gates = load_gates(LOADTESTS_DIR / "gates" / "steady.yaml")
    assert gates.endpoints[SUBMIT].max_p99_ms == 500
    assert gates.endpoints["*"].max_failure_ratio == 0 and gates.endpoints[AGGREGATED].max_failure_ratio == 0
    assert gates.jobs.max_lost == 0


def test_smoke_gates_pass_the_recorded_passing_run() -> None:
    rows = evaluate(load_gates(default_gates("smoke")), stats_from_json(PASS_RUN / "stats.json"),
                    JobCheck(accepted=8, listed=8))
    assert passed(rows), [r for r in rows if not r.passed]
    got = by_key(rows)
    assert got[(SUBMIT, "p99_ms")].measured == 130.0
    assert got[("jobs", "lost")].measured == 0 and got[("jobs", "lost")].note == "8/8 accepted jobs listed"
    # the default gate covers the endpoint the file does not name
    assert ("GET /api/v2/nodes/[node]/assignments", "failure_ratio") in got


def test_smoke_gates_fail_the_rate_limited_run() -> None:
    rows = evaluate(load_gates(default_gates("smoke")), stats_from_csv(LIMITED_RUN / "locust_stats.csv"),
                    JobCheck(accepted=7, listed=7))
    assert not passed(rows)
    failed = {(r.endpoint, r.metric) for r in rows if not r.passed}
    assert failed == {(SUBMIT, "failure_ratio"), ("GET /api/v2/jobs/[id]", "failure_ratio"),
                      (AGGREGATED, "failure_ratio")}


def test_an_impossible_p99_fails() -> None:
    gates = parse_gates({"endpoints": {SUBMIT: {"max_p99_ms": 0.001}}})
    rows = evaluate(gates, stats_from_json(PASS_RUN / "stats.json"), JobCheck(8, 8))
    got = by_key(rows)
    assert not got[(SUBMIT, "p99_ms")].passed and got[(SUBMIT, "p99_ms")].threshold == "<= 0.001"
    assert not passed(rows)


# ---------------------------------------------------------------------- evaluation rules
@pytest.mark.parametrize(
    ("gate", "s", "metric", "ok"),
    [
        (EndpointGate(max_failure_ratio=0), stats(SUBMIT, failures=1), "failure_ratio", False),
        (EndpointGate(max_failure_ratio=0.01), stats(SUBMIT, requests=200, failures=2), "failure_ratio", True),
        (EndpointGate(max_p95_ms=50), stats(SUBMIT, p95=50.0), "p95_ms", True),
        (EndpointGate(max_p95_ms=50), stats(SUBMIT, p95=51.0), "p95_ms", False),
        (EndpointGate(max_p99_ms=500), stats(SUBMIT, p99=499.0), "p99_ms", True),
        (EndpointGate(max_p99_ms=500), stats(SUBMIT, p99=None), "p99_ms", False),
        (EndpointGate(min_rps=1.0), stats(SUBMIT, rps=0.9), "rps", False),
        (EndpointGate(min_rps=1.0), stats(SUBMIT, rps=1.0), "rps", True),
        (EndpointGate(min_requests=101), stats(SUBMIT, requests=100), "requests", False),
    ],
    ids=["failure-over-zero", "failure-under-ratio", "p95-at-limit", "p95-over", "p99-under", "p99-unmeasured",
         "rps-under", "rps-at-floor", "too-few-requests"],
)
def test_each_threshold(gate: EndpointGate, s: EndpointStats, metric: str, ok: bool) -> None:
    rows = evaluate(Gates(endpoints={SUBMIT: gate}, jobs=JobGate(max_lost=None)), [s])
    assert [(r.metric, r.passed) for r in rows] == [(metric, ok)]


def test_a_named_endpoint_without_requests_fails_unless_optional() -> None:
    gates = Gates(endpoints={SUBMIT: EndpointGate(max_failure_ratio=0),
                             "GET /api/v2/nodes": EndpointGate(max_failure_ratio=0, min_requests=0)},
                  jobs=JobGate(max_lost=None))
    got = by_key(evaluate(gates, [stats("GET /api/v2/jobs/[id]")]))
    assert not got[(SUBMIT, "requests")].passed and "no request" in got[(SUBMIT, "requests")].note
    assert got[("GET /api/v2/nodes", "requests")].passed


def test_the_default_gate_covers_every_unnamed_endpoint_but_not_the_aggregate() -> None:
    gates = Gates(endpoints={SUBMIT: EndpointGate(max_p99_ms=100), "*": EndpointGate(max_failure_ratio=0)},
                  jobs=JobGate(max_lost=None))
    rows = evaluate(gates, [stats(SUBMIT, failures=5), stats("GET /b", failures=1), stats("GET /a"),
                            stats(AGGREGATED, failures=6)])
    assert [(r.endpoint, r.metric, r.passed) for r in rows] == [
        (SUBMIT, "p99_ms", True), ("GET /a", "failure_ratio", True), ("GET /b", "failure_ratio", False)]


@pytest.mark.parametrize(
    ("jobs", "ok", "note"),
    [
        (JobCheck(accepted=3, listed=3), True, "3/3 accepted jobs listed"),
        (JobCheck(accepted=3, listed=2, lost=("u~a",)), False, "2/3 accepted jobs listed; missing u~a"),
        (None, False, "accepted jobs were not checked"),
    ],
    ids=["none-lost", "one-lost", "not-checked"],
)
def test_no_accepted_job_lost(jobs: JobCheck | None, ok: bool, note: str) -> None:
    rows = evaluate(Gates(jobs=JobGate(max_lost=0)), [], jobs)
    assert [(r.endpoint, r.metric, r.passed, r.note) for r in rows] == [("jobs", "lost", ok, note)]


def test_min_accepted() -> None:
    rows = evaluate(Gates(jobs=JobGate(max_lost=None, min_accepted=5)), [], JobCheck(accepted=4, listed=4))
    assert [(r.metric, r.measured, r.passed) for r in rows] == [("accepted", 4.0, False)]


def test_no_check_is_no_pass() -> None:
    assert not passed([])


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ([], "gates"),
        ({"endpoint": {}}, "endpoint"),
        ({"endpoints": ["POST /x"]}, "endpoints"),
        ({"endpoints": {SUBMIT: {"max_p99": 5}}}, f"endpoints.{SUBMIT}.max_p99"),
        ({"endpoints": {SUBMIT: {"max_p99_ms": -1}}}, f"endpoints.{SUBMIT}.max_p99_ms"),
        ({"endpoints": {SUBMIT: {"max_p99_ms": True}}}, f"endpoints.{SUBMIT}.max_p99_ms"),
        ({"endpoints": {SUBMIT: {"max_p99_ms": "500"}}}, f"endpoints.{SUBMIT}.max_p99_ms"),
        ({"endpoints": {SUBMIT: 5}}, f"endpoints.{SUBMIT}"),
        ({"jobs": {"lost": 0}}, "jobs.lost"),
    ],
    ids=["not-a-mapping", "unknown-key", "endpoints-list", "unknown-threshold", "negative", "bool", "string",
         "scalar-gate", "unknown-job-gate"],
)
def test_bad_gate_files_name_the_field(doc, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_gates(doc)
    assert e.value.field == field


def test_load_gates_refuses_bad_yaml(tmp_path: Path) -> None:
    p = tmp_path / "g.yaml"
    p.write_text("endpoints: {a: [")
    with pytest.raises(ValidationError):
        load_gates(p)
    p.write_text(yaml.safe_dump({"endpoints": {SUBMIT: {"max_p99_ms": 500}}}))
    assert load_gates(p).endpoints[SUBMIT].max_p99_ms == 500.0
    assert load_gates(p).jobs.max_lost == 0  # "no accepted job lost" holds unless a file says otherwise


@pytest.mark.parametrize(
    ("vcs", "want"),
    [
        ({"default": {"quota": 1}, "vc1": {"quota": 1}}, "default"),
        ({"default": {"quota": 1}, "vc1": {"quota": 4}}, "vc1"),
        ({"a": {"quota": 2}, "b": {"quota": 2}}, "a"),
    ],
    ids=["tie-default", "largest", "tie-by-name"],
)
def test_pick_virtual_cluster(vcs: dict, want: str) -> None:
    assert pick_virtual_cluster({"virtualClusters": vcs}) == want
