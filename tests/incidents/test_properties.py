"""Property: any event sequence either raises or moves along the table, one entry per accepted event."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from apiary.incidents import (
    TRANSITIONS,
    IncidentEvent,
    IncidentTransitionError,
    Severity,
    apply,
    open_incident,
    reachable_states,
)

T0 = 1_700_000_000.0
REACHABLE = reachable_states()

steps = st.lists(
    st.tuples(st.sampled_from(list(IncidentEvent)), st.floats(min_value=0, max_value=86_400),
              st.sampled_from(["alice", "system", "ApiaryNodeDown"])),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(severity=st.sampled_from(list(Severity)), steps=steps)
def test_any_event_sequence(severity, steps):
    inc = open_incident("i", "t", severity, "k", "system", T0)
    at = T0
    accepted = 0
    for event, dt, actor in steps:
        at += dt
        before = inc
        try:
            inc = apply(inc, event, actor, at)
        except IncidentTransitionError as e:
            assert (before.state, event) not in TRANSITIONS
            assert before.state.value in e.message
            assert inc is before
            continue
        accepted += 1
        assert inc.state == TRANSITIONS[(before.state, event)]
        assert inc.state in REACHABLE
        assert len(inc.timeline) == len(before.timeline) + 1
        assert inc.timeline[:-1] == before.timeline  # append-only
        assert (inc.timeline[-1].actor, inc.timeline[-1].at) == (actor, at)
    assert len(inc.timeline) == 1 + accepted
    assert [e.at for e in inc.timeline] == sorted(e.at for e in inc.timeline)
    assert inc.state == inc.timeline[-1].to_state
