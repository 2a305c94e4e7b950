"""Job and task state machines: every legal edge passes, a sample of illegal ones raise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from apiary.errors import InvalidTransitionError, PlatformError
from apiary.lifecycle import (
    JOB_TRANSITIONS,
    TASK_TRANSITIONS,
    JobState,
    TaskState,
    check_job_transition,
    check_task_transition,
)

J = JobState
T = TaskState


def _edge_id(edge: tuple) -> str:
    old, new = edge
    return f"{'new' if old is None else old.value}->{new.value}"


EXPECTED_JOB_EDGES = {
    (None, J.WAITING),
    (J.WAITING, J.RUNNING),
    (J.WAITING, J.WAITING),
    (J.WAITING, J.STOPPED),
    (J.WAITING, J.FAILED),
    (J.RUNNING, J.WAITING),
    (J.RUNNING, J.SUCCEEDED),
    (J.RUNNING, J.FAILED),
    (J.RUNNING, J.STOPPED),
}

EXPECTED_TASK_EDGES = {
    (None, T.WAITING),
    (T.WAITING, T.STARTING),
    (T.WAITING, T.STOPPED),
    (T.STARTING, T.RUNNING),
    (T.STARTING, T.FAILED),
    (T.STARTING, T.STOPPED),
    (T.RUNNING, T.SUCCEEDED),
    (T.RUNNING, T.FAILED),
    (T.RUNNING, T.STOPPED),
}


def test_job_table_is_the_documented_one():
    assert set(JOB_TRANSITIONS) == EXPECTED_JOB_EDGES
    assert all(isinstance(v, str) and v for v in JOB_TRANSITIONS.values())


def test_task_table_is_the_documented_one():
    assert set(TASK_TRANSITIONS) == EXPECTED_TASK_EDGES
    assert all(isinstance(v, str) and v for v in TASK_TRANSITIONS.values())


def test_tables_are_read_only():
    with pytest.raises(TypeError):
        JOB_TRANSITIONS[(J.SUCCEEDED, J.RUNNING)] = "no"  # type: ignore[index]
    with pytest.raises(TypeError):
        TASK_TRANSITIONS[(T.SUCCEEDED, T.RUNNING)] = "no"  # type: ignore[index]


@pytest.mark.parametrize("edge", sorted(EXPECTED_JOB_EDGES, key=_edge_id), ids=_edge_id)
def test_legal_job_edges_pass(edge):
    check_job_transition(*edge)


@pytest.mark.parametrize("edge", sorted(EXPECTED_TASK_EDGES, key=_edge_id), ids=_edge_id)
def test_legal_task_edges_pass(edge):
    check_task_transition(*edge)


ILLEGAL_JOB_EDGES = [
    (J.SUCCEEDED, J.RUNNING),
    (J.STOPPED, J.WAITING),
    (J.FAILED, J.WAITING),
    (J.SUCCEEDED, J.FAILED),
    (J.STOPPED, J.STOPPED),
    (J.WAITING, J.SUCCEEDED),
    (J.RUNNING, J.RUNNING),
    (None, J.RUNNING),
    (None, J.SUCCEEDED),
]


@pytest.mark.parametrize("edge", ILLEGAL_JOB_EDGES, ids=_edge_id)
def test_illegal_job_edges_raise(edge):
    old, new = edge
    with pytest.raises(InvalidTransitionError) as caught:
        check_job_transition(old, new)
    message = str(caught.value)
    assert new.value in message
    assert (old.value if old is not None else "<new>") in message


ILLEGAL_TASK_EDGES = [
    (T.SUCCEEDED, T.RUNNING),
    (T.STOPPED, T.WAITING),
    (T.FAILED, T.WAITING),
    (T.WAITING, T.RUNNING),
    (T.WAITING, T.SUCCEEDED),
    (T.WAITING, T.FAILED),
    (T.STARTING, T.SUCCEEDED),
    (T.RUNNING, T.STARTING),
    (T.RUNNING, T.WAITING),  # a retry in place is a new record, not a way back
    (T.STARTING, T.WAITING),
    (None, T.STARTING),
]


@pytest.mark.parametrize("edge", ILLEGAL_TASK_EDGES, ids=_edge_id)
def test_illegal_task_edges_raise(edge):
    old, new = edge
    with pytest.raises(InvalidTransitionError) as caught:
        check_task_transition(old, new)
    assert new.value in str(caught.value)


@pytest.mark.parametrize("state", list(J), ids=lambda s: s.value)
def test_final_job_states_have_no_outgoing_edge(state):
    outgoing = [new for (old, new) in JOB_TRANSITIONS if old is state]
    assert (not outgoing) == state.is_final


@pytest.mark.parametrize("state", list(T), ids=lambda s: s.value)
def test_final_task_states_have_no_outgoing_edge(state):
    outgoing = [new for (old, new) in TASK_TRANSITIONS if old is state]
    assert (not outgoing) == state.is_final


def test_final_states_helpers():
    assert J.final_states() == frozenset({J.SUCCEEDED, J.FAILED, J.STOPPED})
    assert T.final_states() == frozenset({T.SUCCEEDED, T.FAILED, T.STOPPED})
    assert not J.WAITING.is_final and not J.RUNNING.is_final
    assert not T.STARTING.is_final


def test_states_are_strings_equal_to_their_names():
    for enum in (J, T):
        for member in enum:
            assert isinstance(member, str)
            assert member == member.name == member.value == str(member)


def test_plain_strings_are_accepted_and_unknown_names_rejected():
    check_job_transition("WAITING", "RUNNING")
    check_task_transition(None, "WAITING")
    with pytest.raises(InvalidTransitionError, match="BOGUS"):
        check_job_transition(J.WAITING, "BOGUS")
    with pytest.raises(InvalidTransitionError, match="STARTING"):
        # STARTING is a task state, not a job state
        check_job_transition("STARTING", J.RUNNING)


def test_invalid_transition_is_a_platform_error():
    with pytest.raises(PlatformError) as caught:
        check_job_transition(J.SUCCEEDED, J.RUNNING)
    assert caught.value.to_dict()["code"] == "InvalidTransitionError"


# STATES.md is documentation, not package data: read it from the source tree.
STATES_MD = Path(__file__).resolve().parents[2] / "platform" / "apiary" / "lifecycle" / "STATES.md"
_ROW = re.compile(r"^\|\s*([jt])\d+\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")


def _doc_edges(prefix: str) -> set[tuple[str | None, str]]:
    text = STATES_MD.read_text(encoding="utf-8")
    edges = set()
    for line in text.splitlines():
        match = _ROW.match(line)
        if match and match.group(1) == prefix:
            old, new = (cell.strip("`") for cell in match.group(2, 3))
            edges.add((None if old == "(new)" else old, new))
    return edges


def test_states_md_lists_exactly_the_job_edges():
    assert _doc_edges("j") == {(o and o.value, n.value) for o, n in JOB_TRANSITIONS}


def test_states_md_lists_exactly_the_task_edges():
    assert _doc_edges("t") == {(o and o.value, n.value) for o, n in TASK_TRANSITIONS}
