"""apiary.monitoring.incident_metrics: IncidentCollector renders apiary.incidents.stats.snapshot()."""

from __future__ import annotations

from tests.monitoring.helpers import parse, scrape, value

from apiary.incidents import Incident, Severity, apply, open_incident
from apiary.incidents.stats import snapshot
from apiary.monitoring.incident_metrics import IncidentCollector

T0 = 1_795_600_800.0
MIN = 60.0


def incidents() -> list[Incident]:
    # sev1: acknowledged after 10 min (5 min SLA: breached), mitigated at 20, resolved at 60, one failed IM page
    a = open_incident("a", "ApiaryNodeDown: worker-1", Severity.SEV1, "ka", "system", T0)
    a = apply(a, "notify", "system", T0 + 1, channel="phone", target="+15550100")
    a = apply(a, "notify", "system", T0 + 1, channel="im", result="failed")
    a = apply(a, "escalate", "escalation-policy", T0 + 5 * MIN, tier=2)
    a = apply(a, "acknowledge", "bob", T0 + 10 * MIN)
    a = apply(a, "mitigate", "bob", T0 + 20 * MIN)
    a = apply(a, "resolve", "bob", T0 + 60 * MIN)
    # sev3: still triggered; sev3 acknowledged
    b = open_incident("b", "ApiaryGpuTooHot: worker-2", Severity.SEV3, "kb", "system", T0)
    c = open_incident("c", "ApiaryNodeDiskFull: worker-3", Severity.SEV3, "kc", "system", T0)
    c = apply(c, "acknowledge", "carol", T0 + 30 * MIN)
    return [a, b, c]


def test_the_snapshot_is_rendered_as_the_documented_families() -> None:
    got = parse(scrape(IncidentCollector(lambda: snapshot(incidents(), now=T0 + 2 * 3600))))
    assert value(got, "apiary_incidents_open", severity="sev3", state="triggered") == 1.0
    assert value(got, "apiary_incidents_open", severity="sev3", state="acknowledged") == 1.0
    assert value(got, "apiary_incidents_open", severity="sev1", state="triggered") == 0.0
    assert len(got["apiary_incidents_open"]) == 4 * 3  # every severity x open state
    assert value(got, "apiary_incident_mtta_seconds", severity="sev1") == 10 * MIN
    assert value(got, "apiary_incident_mtta_seconds", severity="sev3") == 30 * MIN
    assert value(got, "apiary_incident_mttm_seconds", severity="sev1") == 20 * MIN
    assert value(got, "apiary_incident_mttr_seconds", severity="sev1") == 60 * MIN
    # no sample: no series (a 0 would read as "instant")
    assert {s.labels["severity"] for s in got["apiary_incident_mttr_seconds"]} == {"sev1"}
    assert "sev2" not in {s.labels["severity"] for s in got["apiary_incident_mtta_seconds"]}
    assert value(got, "apiary_incident_sla_breaches_total", severity="sev1", milestone="acknowledge") == 1.0
    assert value(got, "apiary_incident_sla_breaches_total", severity="sev1", milestone="mitigate") == 0.0
    assert len(got["apiary_incident_sla_breaches_total"]) == 4 * 3
    assert value(got, "apiary_incidents_total", severity="sev3") == 2.0
    assert value(got, "apiary_incidents_total", severity="sev2") == 0.0
    assert value(got, "apiary_incident_notifications_total", channel="phone", result="sent") == 1.0
    assert value(got, "apiary_incident_notifications_total", channel="im", result="failed") == 1.0
    assert value(got, "apiary_incident_notifications_total", channel="email", result="failed") == 0.0
    assert value(got, "apiary_incident_escalations_total") == 1.0


def test_the_exposition_declares_types_and_help() -> None:
    text = scrape(IncidentCollector(lambda: snapshot([], now=T0)))
    for name, kind in (("apiary_incidents_open", "gauge"), ("apiary_incident_mtta_seconds", "gauge"),
                       ("apiary_incident_sla_breaches_total", "counter"), ("apiary_incidents_total", "counter"),
                       ("apiary_incident_notifications_total", "counter"),
                       ("apiary_incident_escalations_total", "counter")):
        assert f"# TYPE {name.removesuffix('_total')} {kind}" in text or f"# TYPE {name} {kind}" in text, name
        assert f"# HELP {name.removesuffix('_total')} " in text or f"# HELP {name} " in text, name


def test_an_empty_snapshot_exports_zero_counters_and_no_means() -> None:
    got = parse(scrape(IncidentCollector(dict)))  # every key optional
    assert value(got, "apiary_incident_escalations_total") == 0.0
    for absent in ("apiary_incidents_open", "apiary_incident_mtta_seconds", "apiary_incidents_total"):
        assert absent not in got
    zeros = parse(scrape(IncidentCollector(lambda: snapshot([], now=T0))))
    assert {s.value for s in zeros["apiary_incidents_total"]} == {0.0}
    assert "apiary_incident_mttr_seconds" not in zeros


def test_the_values_follow_the_store_at_each_scrape() -> None:
    store: list[Incident] = []
    collector = IncidentCollector(lambda: snapshot(store, now=T0 + 3600))
    assert value(parse(scrape(collector)), "apiary_incidents_total", severity="sev1") == 0.0
    store.extend(incidents())
    assert value(parse(scrape(collector)), "apiary_incidents_total", severity="sev1") == 1.0
