"""apiary.incidents.quality: per alert rule firings, acknowledgements, noise ratio and flapping, and
the Markdown / dict forms of the weekly report."""

from __future__ import annotations

import json

import pytest

from apiary.errors import ValidationError
from apiary.incidents import Incident, Severity, apply, open_incident
from apiary.incidents.quality import Firing, alert_rules, quality_report, report_markdown, verdict_of

T0 = 1_795_600_800.0
MIN = 60.0
HOUR = 3600.0


def incident(id: str, title: str = "ApiaryGpuTooHot: GPU 0 on worker-1 is hot", *, ack_after: float | None = None,
             verdict: str | None = None, **open_detail: object) -> Incident:
    inc = open_incident(id, title, Severity.SEV3, f"k-{id}", "system", T0, **open_detail)
    if ack_after is not None:
        inc = apply(inc, "acknowledge", "carol", T0 + ack_after)
    resolve_detail = {"verdict": verdict} if verdict is not None else {}
    return apply(inc, "resolve", "carol", T0 + 2 * HOUR, **resolve_detail)


@pytest.mark.parametrize(
    ("title", "detail", "expected"),
    [
        ("ApiaryGpuTooHot: hot", {}, ("ApiaryGpuTooHot",)),
        ("Training jobs fail: NCCL", {}, ()),  # a person's title: the prefix is not an alert name
        ("no colon at all", {}, ()),
        ("ApiaryGpuTooHot: hot", {"alertname": "ApiaryNodeDown"}, ("ApiaryNodeDown",)),  # detail wins
        ("x", {"alertnames": ["B", "A", 3]}, ("A", "B")),
        ("x", {"labels": {"alertname": "ApiaryNodeDown", "node": "w1"}}, ("ApiaryNodeDown",)),
    ],
    ids=["title-prefix", "human-title", "no-colon", "detail-over-title", "alertnames-list", "labels"],
)
def test_alert_rules_of_an_incident(title: str, detail: dict, expected: tuple[str, ...]) -> None:
    inc = open_incident("i", title, Severity.SEV3, "k", "system", T0, **detail)
    assert alert_rules(inc) == expected


def test_rules_named_by_later_alert_entries_count_too() -> None:
    inc = open_incident("i", "ApiaryNodeDown: worker-1", Severity.SEV1, "k", "system", T0, alertname="ApiaryNodeDown")
    inc = apply(inc, "alert", "system", T0 + 5, alertnames=["ApiaryGpuXidError"])
    assert alert_rules(inc) == ("ApiaryGpuXidError", "ApiaryNodeDown")


def test_verdicts_come_from_the_mapping_then_the_resolve_entry() -> None:
    inc = incident("a", verdict="noise")
    assert verdict_of(inc) == "noise"
    assert verdict_of(inc, {"a": "actionable"}) == "actionable"
    assert verdict_of(inc, {"a": None}) is None  # the mapping says "not judged"
    assert verdict_of(incident("b", verdict="maybe")) is None


def test_a_noisy_rule_gets_the_verdict_and_a_useful_rule_does_not() -> None:
    noisy = [incident(f"n{i}", verdict="noise") for i in range(3)] + [incident("n3", verdict="actionable")]
    useful = [incident(f"u{i}", "ApiaryNodeDown: worker-1", verdict="actionable", ack_after=MIN) for i in range(3)]
    report = quality_report([*noisy, *useful])
    by = {r.alertname: r for r in report.rules}
    hot, down = by["ApiaryGpuTooHot"], by["ApiaryNodeDown"]
    assert (hot.judged, hot.noise, hot.actionable, hot.noise_ratio) == (4, 3, 1, 0.75)
    assert hot.verdicts and hot.verdicts[0].startswith("noisy:") and "`for:`" in hot.verdicts[0]
    assert down.noise_ratio == 0.0 and down.verdicts == ()
    assert report.rules[0].alertname == "ApiaryGpuTooHot"  # rules to fix come first


@pytest.mark.parametrize(
    ("verdicts", "noisy"),
    [
        (["noise", "noise"], False),  # 2 judged: too few to say
        (["noise", "noise", "actionable"], True),
        (["noise", "actionable", "actionable", "noise"], False),  # exactly 0.5 is not above it
        (["noise", "noise", None, None], False),  # not judged does not count as judged
    ],
    ids=["too-few", "two-of-three", "exactly-half", "unjudged"],
)
def test_the_noise_threshold(verdicts: list[str | None], noisy: bool) -> None:
    incidents = [incident(f"i{n}") for n in range(len(verdicts))]
    (rule,) = quality_report(incidents, {f"i{n}": v for n, v in enumerate(verdicts)}).rules
    assert any(v.startswith("noisy:") for v in rule.verdicts) is noisy


def test_acknowledgement_times_median_and_nearest_rank_p90() -> None:
    acks = [60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 420.0, 480.0, 540.0, 6000.0]
    incidents = [incident(f"a{i}", ack_after=t) for i, t in enumerate(acks)]
    incidents.append(incident("unacked"))  # resolved without an acknowledgement: not acknowledged here
    (rule,) = quality_report(incidents).rules
    assert rule.incidents == 11 and rule.acknowledged == 10
    assert rule.tta_median_s == 330.0  # mean of the two middle values (300, 360)
    assert rule.tta_p90_s == 540.0  # the 9th of 10 sorted samples: the outlier is above p90


def test_a_reopened_incident_gives_one_ack_sample_per_episode() -> None:
    inc = open_incident("r", "ApiaryGpuTooHot: x", Severity.SEV3, "k", "system", T0)
    inc = apply(inc, "acknowledge", "carol", T0 + 100)
    inc = apply(inc, "resolve", "carol", T0 + 200)
    inc = apply(inc, "reopen", "system", T0 + 1000)
    inc = apply(inc, "acknowledge", "carol", T0 + 1300)
    (rule,) = quality_report([inc]).rules
    assert (rule.tta_median_s, rule.acknowledged) == (200.0, 1)  # samples 100 and 300


def test_flapping_counts_fingerprints_that_fire_again_within_the_window() -> None:
    firings = [
        # fp-a: resolved, fired again 30 min later (flap), resolved, again 2 h later (not a flap)
        ("ApiaryGpuTooHot", "fp-a", T0, T0 + 10 * MIN),
        ("ApiaryGpuTooHot", "fp-a", T0 + 40 * MIN, T0 + 50 * MIN),
        ("ApiaryGpuTooHot", "fp-a", T0 + 50 * MIN + 2 * HOUR, None),
        # fp-b: fires again exactly one hour after resolving: within the window (inclusive)
        Firing("ApiaryGpuTooHot", "fp-b", T0, T0 + MIN),
        Firing("ApiaryGpuTooHot", "fp-b", T0 + MIN + HOUR, None),
        # fp-c: fires once and is still firing
        ("ApiaryGpuTooHot", "fp-c", T0, None),
        # another rule, steady
        ("ApiaryNodeDown", "fp-d", T0, T0 + HOUR),
    ]
    report = quality_report([], firings=firings)
    by = {r.alertname: r for r in report.rules}
    assert (by["ApiaryGpuTooHot"].firings, by["ApiaryGpuTooHot"].flapping, by["ApiaryGpuTooHot"].flaps) == (6, 2, 2)
    assert any(v.startswith("flapping:") for v in by["ApiaryGpuTooHot"].verdicts)
    assert (by["ApiaryNodeDown"].flapping, by["ApiaryNodeDown"].verdicts) == (0, ())
    assert by["ApiaryNodeDown"].incidents == 0  # a rule that only fired still has a line
    # a shorter window: fp-b's re-firing after an hour is no longer a flap
    short = {r.alertname: r for r in quality_report([], firings=firings, flap_window_s=HOUR - 1).rules}
    assert short["ApiaryGpuTooHot"].flapping == 1


@pytest.mark.parametrize(
    ("firing", "field"),
    [
        (("A", "fp", T0, T0 - 1), "firings[0].ends_at"),
        (("A", "fp", float("nan"), None), "firings[0].starts_at"),
        (("", "fp", T0, None), "firings[0].alertname"),
        (("A", "fp"), "firings[0]"),
    ],
    ids=["ends-before-start", "nan", "no-name", "short-tuple"],
)
def test_malformed_firings_are_refused_naming_the_field(firing: tuple, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        quality_report([], firings=[firing])
    assert e.value.field == field


def test_markdown_and_dict_forms() -> None:
    incidents = [incident(f"n{i}", verdict="noise", ack_after=60.0 * (i + 1)) for i in range(3)]
    report = quality_report(incidents, firings=[("ApiaryGpuTooHot", "fp", T0, None)])
    md = report_markdown(report)
    lines = md.splitlines()
    assert lines[0] == "# Alert quality"
    header = next(ln for ln in lines if ln.startswith("| rule |"))
    row = next(ln for ln in lines if ln.startswith("| ApiaryGpuTooHot |"))
    assert header.count("|") == row.count("|") - row.count("\\|")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:9] == ["ApiaryGpuTooHot", "1", "3", "3", "120", "180", "3 / 3", "1.00", "0"]
    assert cells[9].startswith("noisy:")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["rules"][0]["alertname"] == "ApiaryGpuTooHot" and data["rules"][0]["noise_ratio"] == 1.0
    assert data["flap_window_s"] == 3600.0
    assert "No alert fired" in report_markdown(quality_report([]))
