"""The incident state machine: the whole (state, event) table, the append-only timeline, errors."""

from __future__ import annotations

import itertools

import pytest

from apiary.errors import ConflictError, UserError, ValidationError
from apiary.incidents import (
    ENTRY_KINDS,
    TRANSITIONS,
    EntryKind,
    Incident,
    IncidentEvent,
    IncidentState,
    IncidentTransitionError,
    Links,
    Severity,
    allowed_events,
    apply,
    open_incident,
    reachable_states,
)

S = IncidentState
E = IncidentEvent
T0 = 1_700_000_000.0

#: The documented table (machine.py's docstring), written out again: a change to TRANSITIONS must
#: change this too.
NOTES = (E.NOTIFY, E.ACTION, E.COMMENT, E.ALERT)
EXPECTED = {
    (S.TRIGGERED, E.ACKNOWLEDGE): S.ACKNOWLEDGED,
    (S.TRIGGERED, E.MITIGATE): S.MITIGATED,
    (S.TRIGGERED, E.RESOLVE): S.RESOLVED,
    (S.TRIGGERED, E.ESCALATE): S.TRIGGERED,
    (S.ACKNOWLEDGED, E.MITIGATE): S.MITIGATED,
    (S.ACKNOWLEDGED, E.RESOLVE): S.RESOLVED,
    (S.ACKNOWLEDGED, E.RETRIGGER): S.TRIGGERED,
    (S.ACKNOWLEDGED, E.ESCALATE): S.ACKNOWLEDGED,
    (S.MITIGATED, E.RESOLVE): S.RESOLVED,
    (S.MITIGATED, E.ESCALATE): S.MITIGATED,
    (S.RESOLVED, E.CLOSE): S.CLOSED,
    (S.RESOLVED, E.REOPEN): S.TRIGGERED,
    **{(s, e): s for s in (S.TRIGGERED, S.ACKNOWLEDGED, S.MITIGATED, S.RESOLVED) for e in NOTES},
}

#: A path from a new incident to each state.
PATHS = {
    S.TRIGGERED: (),
    S.ACKNOWLEDGED: (E.ACKNOWLEDGE,),
    S.MITIGATED: (E.ACKNOWLEDGE, E.MITIGATE),
    S.RESOLVED: (E.ACKNOWLEDGE, E.MITIGATE, E.RESOLVE),
    S.CLOSED: (E.ACKNOWLEDGE, E.MITIGATE, E.RESOLVE, E.CLOSE),
}


def new_incident(severity: Severity = Severity.SEV2, at: float = T0) -> Incident:
    return open_incident("inc-1", "GPU 0 on worker-1 has ECC errors", severity, "k1", "ApiaryGpuEccDoubleBitError",
                         at)


def incident_in(state: IncidentState, at: float = T0) -> Incident:
    inc = new_incident(at=at)
    for i, ev in enumerate(PATHS[state], start=1):
        inc = apply(inc, ev, "alice", at + 60 * i)
    assert inc.state == state
    return inc


def test_the_table_is_the_documented_one():
    assert dict(TRANSITIONS) == EXPECTED


def test_every_event_has_an_entry_kind():
    assert set(ENTRY_KINDS) == set(IncidentEvent)
    assert ENTRY_KINDS[E.ACKNOWLEDGE] == EntryKind.ACKNOWLEDGEMENT
    assert ENTRY_KINDS[E.ESCALATE] == EntryKind.ESCALATION


@pytest.mark.parametrize(
    ("state", "event"),
    list(itertools.product(IncidentState, IncidentEvent)),
    ids=lambda v: v.value,
)
def test_every_state_event_pair(state: IncidentState, event: IncidentEvent):
    inc = incident_in(state)
    at = inc.last_at + 1
    if (state, event) in EXPECTED:
        out = apply(inc, event, "bob", at)
        assert out.state == EXPECTED[(state, event)]
        last = out.timeline[-1]
        assert (last.from_state, last.to_state, last.event, last.actor, last.at) == (
            state, out.state, event.value, "bob", at)
        assert last.kind == ENTRY_KINDS[event]
    else:
        with pytest.raises(IncidentTransitionError) as err:
            apply(inc, event, "bob", at)
        e = err.value
        assert isinstance(e, ConflictError) and isinstance(e, UserError) and e.status_code == 409
        assert e.field == "state" and e.state == state and e.event == event
        assert e.message.startswith("state: ")
        assert f"cannot {event.value} an incident that is {state.value}" in e.message
        assert e.to_dict()["field"] == "state"


def test_closed_is_final_and_says_so():
    assert allowed_events(S.CLOSED) == ()
    with pytest.raises(IncidentTransitionError, match="closed is final"):
        apply(incident_in(S.CLOSED), E.COMMENT, "alice", T0 + 10_000)


def test_every_state_is_reachable_from_triggered():
    assert reachable_states() == frozenset(IncidentState)
    assert reachable_states(S.CLOSED) == {S.CLOSED}


def test_apply_never_mutates_and_appends_one_entry():
    inc = new_incident()
    before = inc.model_dump()
    detail = {"note": "looking", "nested": {"a": [1]}}
    acked = apply(inc, "acknowledge", "alice", T0 + 30, **detail)
    assert inc.model_dump() == before  # the old incident is untouched
    assert inc.state == S.TRIGGERED and len(inc.timeline) == 1
    assert acked.state == S.ACKNOWLEDGED and len(acked.timeline) == 2
    assert acked.timeline[:1] == inc.timeline  # the old entries are kept as they were
    detail["nested"]["a"].append(2)  # the caller's dict is copied, not shared
    assert acked.timeline[-1].detail == {"note": "looking", "nested": {"a": [1]}}
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        acked.state = S.RESOLVED  # type: ignore[misc]


def test_a_lifecycle_is_recorded_in_order_with_actor_and_time():
    inc = new_incident()
    steps = [
        (E.ESCALATE, "escalation-policy", {"tier": 2}),
        (E.ACKNOWLEDGE, "alice", {}),
        (E.ACTION, "system", {"action": "cordon-node", "target": "worker-1"}),
        (E.MITIGATE, "alice", {}),
        (E.COMMENT, "alice", {"text": "GPU reset scheduled"}),
        (E.RESOLVE, "alice", {}),
        (E.NOTIFY, "system", {"channel": "chat"}),
        (E.CLOSE, "bob", {"postmortem": "PM-7"}),
    ]
    for i, (ev, actor, detail) in enumerate(steps, start=1):
        inc = apply(inc, ev, actor, T0 + i * 10, **detail)
    assert [e.event for e in inc.timeline] == ["open"] + [ev.value for ev, _, _ in steps]
    assert [e.actor for e in inc.timeline][1:] == [actor for _, actor, _ in steps]
    assert [e.at for e in inc.timeline] == [T0 + i * 10 for i in range(len(steps) + 1)]
    assert [e.kind for e in inc.timeline] == [
        EntryKind.STATE_CHANGE, EntryKind.ESCALATION, EntryKind.ACKNOWLEDGEMENT, EntryKind.ACTION,
        EntryKind.STATE_CHANGE, EntryKind.COMMENT, EntryKind.STATE_CHANGE, EntryKind.NOTIFICATION,
        EntryKind.STATE_CHANGE]
    assert inc.timeline[3].detail == {"action": "cordon-node", "target": "worker-1"}
    assert inc.state == S.CLOSED and inc.resolved_at == T0 + 60


def test_the_first_entry_opens_the_incident():
    inc = new_incident(Severity.SEV1)
    (entry,) = inc.timeline
    assert (entry.event, entry.from_state, entry.to_state, entry.kind) == ("open", None, S.TRIGGERED,
                                                                         EntryKind.STATE_CHANGE)
    assert entry.actor == "ApiaryGpuEccDoubleBitError" and entry.at == T0 == inc.opened_at
    assert inc.severity == Severity.SEV1 and inc.dedup_key == "k1"


def test_time_may_not_run_backwards_but_may_stand_still():
    inc = apply(new_incident(), E.ACKNOWLEDGE, "alice", T0)  # same instant: allowed
    with pytest.raises(ValidationError) as err:
        apply(inc, E.RESOLVE, "alice", T0 - 1)
    assert err.value.field == "at"


@pytest.mark.parametrize("at", [float("nan"), float("inf"), "soon", True], ids=repr)
def test_bad_times_name_the_field(at):
    with pytest.raises(ValidationError) as err:
        apply(new_incident(), E.ACKNOWLEDGE, "alice", at)
    assert err.value.field == "at"


@pytest.mark.parametrize("actor", ["", "   "], ids=["empty", "blank"])
def test_an_actor_is_required(actor):
    with pytest.raises(ValidationError) as err:
        apply(new_incident(), E.ACKNOWLEDGE, actor, T0 + 1)
    assert err.value.field == "actor"
    with pytest.raises(ValidationError):
        open_incident("i", "t", Severity.SEV3, "k", actor, T0)


def test_unknown_event_names_the_field():
    with pytest.raises(ValidationError) as err:
        apply(new_incident(), "snooze", "alice", T0 + 1)
    assert err.value.field == "event" and "snooze" in err.value.message


def test_open_incident_checks_its_fields():
    with pytest.raises(ValidationError) as err:
        open_incident("", "t", Severity.SEV3, "k", "system", T0)
    assert err.value.field == "id"
    with pytest.raises(ValidationError) as err:
        open_incident("i", "t", "sev9", "k", "system", T0)  # type: ignore[arg-type]
    assert err.value.field == "severity"


def test_links_and_fingerprints_accumulate_and_are_recorded():
    inc = open_incident("i", "t", Severity.SEV2, "k", "system", T0,
                        links=Links(nodes=("worker-1",), gpu_hours_lost=2.0), fingerprints=["f1"])
    assert inc.timeline[0].detail["links"] == {"nodes": ["worker-1"], "jobs": [], "users": [],
                                              "virtual_clusters": [], "gpu_hours_lost": 2.0}
    inc = apply(inc, E.ALERT, "alertmanager", T0 + 5,
                links=Links(nodes=("worker-2", "worker-1"), jobs=("alice~mnist",), users=("alice",),
                            virtual_clusters=("vc1",), gpu_hours_lost=1.5),
                fingerprints=["f2", "f1"])
    assert inc.links == Links(nodes=("worker-1", "worker-2"), jobs=("alice~mnist",), users=("alice",),
                              virtual_clusters=("vc1",), gpu_hours_lost=3.5)
    assert inc.fingerprints == ("f1", "f2")
    assert inc.timeline[-1].detail["fingerprints"] == ["f1", "f2"]
    assert inc.timeline[-1].detail["links"]["gpu_hours_lost"] == 1.5


def test_links_refuse_negative_gpu_hours():
    with pytest.raises(Exception, match="greater than or equal"):
        Links(gpu_hours_lost=-1.0)


def test_reopen_starts_a_new_episode_and_a_new_resolution():
    inc = apply(new_incident(), E.RESOLVE, "alertmanager", T0 + 100)
    assert inc.resolved_at == T0 + 100
    inc = apply(inc, E.REOPEN, "alertmanager", T0 + 200)
    assert inc.resolved_at is None and inc.timeline[inc.episode_start].event == "reopen"
    inc = apply(inc, E.RESOLVE, "alice", T0 + 300)
    assert inc.resolved_at == T0 + 300
