"""apiary.incidents.postmortem: a draft in Google SRE's shape filled from the timeline, its Markdown,
and the action-item table read back after a person edits it."""

from __future__ import annotations

import re

import pytest

from apiary.errors import ValidationError
from apiary.incidents import Incident, Links, Severity, apply, open_incident
from apiary.incidents.postmortem import (
    ActionItem,
    draft,
    format_duration,
    iso_utc,
    parse_action_items,
    summarize,
    with_items,
)

T0 = 1_795_600_800.0  # 2026-11-25T10:00:00Z
ECC = "ApiaryGpuEccDoubleBitError"
SECTIONS = ["## Summary", "## Impact", "## Root causes", "## Trigger", "## Resolution", "## Detection",
            "## Action items", "## Lessons learned", "### What went well", "### What went wrong",
            "### Where we got lucky", "## Timeline"]


def ecc_incident(*, ack_after: float = 1000.0, uncordoned: bool = False) -> Incident:
    """The issue's end-to-end story: a double-bit ECC error on worker-1, paged by email and IM (IM
    fails), cordon + drain, escalation to tier 2, acknowledged, mitigated, resolved."""
    links = Links(nodes=("worker-1",), jobs=("alice~mnist", "bob~bert"), users=("alice", "bob"),
                  virtual_clusters=("default",), gpu_hours_lost=3.5)
    inc = open_incident("inc-7", f"{ECC}: double-bit ECC on worker-1 GPU 0", Severity.SEV2, "k", ECC, T0,
                        links=links, alertnames=[ECC], suspected_cause="node worker-1")
    inc = apply(inc, "notify", "system", T0 + 1, channel="email", target="dri@example.org")
    inc = apply(inc, "notify", "system", T0 + 1, channel="im", target="#oncall", result="failed", error="HTTP 500")
    inc = apply(inc, "action", "system", T0 + 5, action="cordon-node", target="worker-1")
    inc = apply(inc, "action", "system", T0 + 6, action="drain-node", target="worker-1", result="2 jobs re-placed")
    if ack_after > 900:  # tier 1's delay passed unacknowledged
        inc = apply(inc, "escalate", "escalation-policy", T0 + 900, tier=2, targets=["bob"])
    inc = apply(inc, "acknowledge", "bob", T0 + ack_after)
    inc = apply(inc, "comment", "bob", T0 + ack_after + 100, text="GPU 0 | swapped, running the burn-in")
    inc = apply(inc, "mitigate", "bob", T0 + ack_after + 200)
    if uncordoned:
        inc = apply(inc, "action", "bob", T0 + 3000, action="uncordon-node", target="worker-1")
    return apply(inc, "resolve", "bob", T0 + 3600, verdict="actionable")


def test_the_draft_has_google_sres_sections_in_order() -> None:
    md = draft(ecc_incident()).to_markdown()
    positions = [md.index(f"\n{s}\n") for s in SECTIONS]
    assert positions == sorted(positions)
    assert md.startswith(f"# Postmortem: {ECC}: double-bit ECC on worker-1 GPU 0\n")
    for field in ("**Date:** 2026-11-25", "**Authors:** bob", "**Status:** Draft"):
        assert field in md


def test_the_timeline_lists_every_entry_with_time_actor_and_detail() -> None:
    inc = ecc_incident()
    pm = draft(inc)
    assert len(pm.timeline) == len(inc.timeline)
    assert [(r.at, r.actor, r.event) for r in pm.timeline] == [(iso_utc(e.at), e.actor, e.event) for e in inc.timeline]
    summaries = {r.event: r.summary for r in reversed(pm.timeline)}  # first of each event
    assert summaries["notify"] == "notified dri@example.org by email"
    assert pm.timeline[2].summary == "notified #oncall by im: failed (HTTP 500)"
    assert summaries["escalate"] == "escalated to tier 2 (bob)"
    assert summaries["action"] == "ran cordon-node on worker-1"
    assert pm.timeline[4].summary == "ran drain-node on worker-1: 2 jobs re-placed"
    assert summaries["comment"] == "GPU 0 | swapped, running the burn-in"
    assert summaries["acknowledge"] == "triggered -> acknowledged"
    assert summaries["resolve"] == "mitigated -> resolved; verdict actionable"
    md = pm.to_markdown()
    table = md[md.index("## Timeline"):]
    rows = [ln for ln in table.splitlines() if re.match(r"^\| \d{4}-", ln)]
    assert len(rows) == len(inc.timeline)
    assert rows[0].startswith("| 2026-11-25T10:00:00Z | ApiaryGpuEccDoubleBitError | open |")
    assert "GPU 0 \\| swapped" in md  # a pipe in a comment does not break the table


def test_summary_impact_detection_and_resolution_are_filled_in() -> None:
    pm = draft(ecc_incident(), metrics={"jobs_failed": 2, "tokens_lost": "1.2M"})
    assert pm.summary.startswith(f'SEV2 incident "{ECC}: double-bit ECC on worker-1 GPU 0"')
    assert "opened at 2026-11-25T10:00:00Z" in pm.summary and "lasted 1h" in pm.summary
    assert pm.impact == (
        "Nodes affected (1): worker-1",
        "Jobs affected (2): alice~mnist, bob~bert",
        "Users affected (2): alice, bob",
        "Virtual clusters affected (1): default",
        "GPU-hours lost: 3.5",
        "jobs_failed: 2",
        "tokens_lost: 1.2M",
    )
    assert pm.detection[0] == f"Detected by alert {ECC} at 2026-11-25T10:00:00Z (opened by {ECC})"
    assert "2026-11-25T10:00:01Z (+1s): notified dri@example.org by email" in pm.detection
    assert "2026-11-25T10:15:00Z (+15m): escalated to tier 2 (bob)" in pm.detection
    # sev2: acknowledge within 15 min; 1000 s is 1m 40s late
    assert pm.detection[-1] == ("Acknowledged by bob at 2026-11-25T10:16:40Z, 16m 40s after opening "
                                "(SLA 15m: missed by 1m 40s)")
    assert "Mitigated 20m after opening (SLA 2h: met)" in pm.resolution
    assert "Resolved 1h after opening (SLA 1d: met)" in pm.resolution
    assert pm.root_causes[0] == "Suspected (from the response rules): node worker-1"
    assert pm.trigger.startswith(f"Alert {ECC} fired at 2026-11-25T10:00:00Z")


def test_action_items_are_seeded_from_actions_breaches_and_failed_channels() -> None:
    items = draft(ecc_incident()).action_items
    assert [i.id for i in items] == [f"AI-{n}" for n in range(1, len(items) + 1)]
    texts = [(i.text, i.type, i.status) for i in items]
    assert ("Uncordon worker-1 after repair", "mitigate", "open") in texts
    assert any(t.startswith("Return worker-1 to service") for t, _, _ in texts)
    assert ("SLA missed: acknowledge took 16m 40s (target 15m); find why (paging, routing, runbook) and fix it",
            "process", "open") in texts
    assert ("Fix notifications by im to #oncall: delivery failed", "process", "open") in texts
    assert texts[-1][1] == "prevent"
    assert all(i.owner == "" for i in items)


def test_a_reversal_already_in_the_timeline_marks_the_follow_up_done() -> None:
    items = {i.text: i.status for i in draft(ecc_incident(uncordoned=True)).action_items}
    assert items["Uncordon worker-1 after repair"] == "done"
    assert items[next(t for t in items if t.startswith("Return worker-1"))] == "done"


def test_an_acknowledgement_within_sla_is_a_lesson_not_an_action_item() -> None:
    pm = draft(ecc_incident(ack_after=300.0))
    assert not any(i.text.startswith("SLA missed") for i in pm.action_items)
    assert "Acknowledged within the SLA (5m)" in pm.lessons.went_well
    assert pm.detection[-1].endswith("(SLA 15m: met)")


def test_an_unresolved_incident_opened_by_a_person() -> None:
    inc = open_incident("inc-9", "Training jobs hang on VC research", Severity.SEV1, "k", "carol", T0)
    inc = apply(inc, "comment", "carol", T0 + 60, text="looking")
    pm = draft(inc)
    assert pm.detection[0] == "Opened by carol at 2026-11-25T10:00:00Z"
    assert pm.detection[-1] == "Never acknowledged (SLA: 5m)"
    assert pm.resolution[-1] == "Not resolved yet (state triggered)"
    assert pm.impact[0].startswith("TODO")
    assert pm.authors == ("carol",)
    assert draft(inc, authors=["dave", "erin"]).authors == ("dave", "erin")
    # counted at the newest entry's time (1 min): the 5 min ack deadline is not yet past
    assert not any(i.text.startswith("SLA missed") for i in pm.action_items)


def test_the_action_item_table_reads_back_unchanged() -> None:
    pm = draft(ecc_incident())
    assert parse_action_items(pm.to_markdown()) == list(pm.action_items)


def test_a_persons_edits_to_the_table_are_read_back() -> None:
    md = draft(ecc_incident()).to_markdown()
    head, rest = md.split("## Action items\n", 1)
    table, tail = rest.split("\n\n## Lessons learned", 1)
    lines = table.strip("\n").splitlines()
    # The person reorders the columns, assigns AI-1 and closes it, and adds a row without an id.
    reordered = ["| Status | ID | Owner | Action item | Type | Bug |", "|---|---|---|---|---|---|"]
    for ln in lines[2:]:
        c = [x.strip() for x in re.split(r"(?<!\\)\|", ln.strip().strip("|"))]
        item_id, text, kind, owner, bug, status = c
        if item_id == "AI-1":
            owner, status, bug = "bob", "Done", "APIARY-42"
        reordered.append(f"| {status} | {item_id} | {owner} | {text} | {kind} | {bug} |")
    reordered.append("| todo |  | carol | Add a burn-in drill before returning a node | process | |")
    edited = head + "## Action items\n\n" + "\n".join(reordered) + "\n\n## Lessons learned" + tail
    items = parse_action_items(edited)
    assert items[0] == ActionItem(id="AI-1", text="Uncordon worker-1 after repair", type="mitigate", owner="bob",
                                  bug="APIARY-42", status="done")
    n = len(draft(ecc_incident()).action_items)
    assert items[-1] == ActionItem(id=f"AI-{n + 1}", text="Add a burn-in drill before returning a node",
                                   type="process", owner="carol", status="open")
    assert [i.id for i in items[1:-1]] == [f"AI-{k}" for k in range(2, n + 1)]
    assert with_items(draft(ecc_incident()), items).action_items == tuple(items)


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ("", "action_items"),
        ("just text\n", "action_items"),
        ("| ID | Owner |\n|---|---|\n| AI-1 | bob |\n", "action_items"),
        ("| ID | Action item | Type |\n|---|---|---|\n| AI-1 | x | fix |\n", "action_items[0].type"),
        ("| ID | Action item | Status |\n|---|---|---|\n| AI-1 | x | maybe |\n", "action_items[0].status"),
        ("| ID | Action item |\n|---|---|\n| AI-1 | x |\n| AI-1 | y |\n", "action_items[1].id"),
        ("| ID | Action item |\n|---|---|\n| 7 | x |\n", "action_items[0].id"),
        ("| ID | Action item |\n|---|---|\n| AI-1 |  |\n", "action_items[0].text"),
    ],
    ids=["no-table", "text-only", "no-action-column", "bad-type", "bad-status", "duplicate-id", "bad-id", "empty"],
)
def test_a_broken_table_is_refused_naming_the_field(table: str, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_action_items(f"# Postmortem\n\n## Action items\n\n{table}\n## Timeline\n")
    assert e.value.field == field


def test_markdown_without_the_heading_is_refused() -> None:
    with pytest.raises(ValidationError) as e:
        parse_action_items("# Postmortem\n\n## Summary\n")
    assert e.value.field == "action_items"


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (59.6, "1m"), (3725, "1h 2m 5s"), (90000, "1d 1h"),
                                               (-90, "-1m 30s")])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_summaries_of_other_entries() -> None:
    inc = open_incident("i", "t", Severity.SEV3, "k", "system", T0)
    inc = apply(inc, "alert", "system", T0 + 1, alertname="ApiaryNodeDown", status="resolved")
    inc = apply(inc, "action", "system", T0 + 2)
    inc = apply(inc, "resolve", "system", T0 + 3, reason="the source reported the problem resolved")
    assert [summarize(e) for e in inc.timeline] == [
        "opened as triggered",
        "alert ApiaryNodeDown resolved",
        "ran an action",
        "triggered -> resolved (the source reported the problem resolved)",
    ]


def test_the_response_services_detail_keys_are_read() -> None:
    """What apiary.response writes: notify (recipient, ok/outcome, attempt, detail), actions with a
    result and an ``undo`` action, a rule's diagnosis comment with ``suspectedCause``."""
    inc = open_incident("inc-3", f"{ECC}: worker-2", Severity.SEV2, "k", "alertmanager", T0, alertnames=[ECC])
    inc = apply(inc, "comment", "rule:gpu-dbe", T0 + 1, diagnosis=True, runbook="runbooks/gpu-dbe",
                evidence={"dbe": [], "xid": []}, suspectedCause="node worker-2")
    inc = apply(inc, "action", "rule:gpu-dbe", T0 + 2, action="cordon-node", target="worker-2", result="failed",
                message="control plane unavailable", undo="uncordon-node")
    inc = apply(inc, "action", "rule:gpu-dbe", T0 + 3, action="tag-jobs:ecc", target="worker-2", result="ok",
                message="tagged ecc: alice~mnist", undo="untag-jobs:ecc")
    inc = apply(inc, "action", "rule:gpu-dbe", T0 + 4, action="restart-agent", target="worker-2", result="ok",
                undo="reinstall-agent")
    inc = apply(inc, "notify", "system", T0 + 5, channel="sms", recipient="carol", attempt=2, ok=False,
                outcome="rejected", detail="invalid number", tier=1)
    inc = apply(inc, "notify", "system", T0 + 5, recipient="dave", ok=False, tier=1, detail="no contact for dave")
    inc = apply(inc, "acknowledge", "carol", T0 + 60)
    inc = apply(inc, "action", "carol", T0 + 600, action="untag-jobs:ecc", target="worker-2", result="ok")
    inc = apply(inc, "resolve", "carol", T0 + 900, message="GPU replaced", verdict="actionable")
    pm = draft(inc)
    rows = [r.summary for r in pm.timeline]
    assert rows[1] == "diagnosis; suspected cause node worker-2; runbook runbooks/gpu-dbe; evidence: dbe, xid"
    assert rows[2] == "ran cordon-node on worker-2: failed (control plane unavailable)"
    assert rows[5] == "notified carol by sms (attempt 2): rejected (invalid number)"
    assert rows[6] == "notified dave by unknown: failed (no contact for dave)"
    assert rows[-1] == "acknowledged -> resolved (GPU replaced); verdict actionable"
    assert pm.root_causes[0] == "Suspected (from the response rules): node worker-2"
    items = {i.text: i.status for i in pm.action_items}
    assert not any("Uncordon" in t for t in items)  # the cordon failed: nothing to undo
    assert items["Remove the incident tag from the jobs of worker-2 once their owners are told"] == "done"
    assert items["Reverse restart-agent on worker-2 after repair (reinstall-agent)"] == "open"
    assert items["Fix notifications by sms to carol: delivery failed"] == "open"
    assert "ran cordon-node on worker-2: failed (control plane unavailable)" in pm.lessons.went_wrong
