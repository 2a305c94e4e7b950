"""The bridge's event reader (apiary.tracking.events): raw events of the log as typed events."""

from __future__ import annotations

import pytest

from apiary.lifecycle.states import JobState, TaskState
from apiary.tracking.events import (
    Completed,
    EventError,
    EventType,
    OtherEvent,
    Placed,
    Submitted,
    TaskExited,
    read_event,
)


def raw(type_: str, data: dict | None = None, seq: int = 7) -> dict:
    return {"seq": seq, "time": 1700000000.5, "jobId": "ann~a", "type": type_, "data": data or {}}


def test_each_type_reads_as_its_typed_body_with_the_lifecycle_enums():
    ev = read_event(raw("job.submitted", {"user": "ann", "name": "a", "virtualCluster": "vc1",
                                          "priorityClass": "prod", "flowRunId": None}))
    assert (ev.seq, ev.time, ev.job_id) == (7, 1700000000.5, "ann~a")
    assert ev.body == Submitted("ann", "a", "vc1", "prod", None)
    placed = read_event(raw("job.placed", {"attempt": 1, "placements": [
        {"taskRole": "train", "index": 0, "node": "n1", "gpus": [0]}]})).body
    assert isinstance(placed, Placed) and placed.attempt == 1 and placed.placements[0].node == "n1"
    exited = read_event(raw("task.exited", {"attempt": 0, "taskRole": "train", "index": 0, "exitCode": 1,
                                            "phrase": "UserError", "state": "FAILED"})).body
    assert exited == TaskExited(0, "train", 0, 1, "UserError", TaskState.FAILED)
    done = read_event(raw("job.completed", {"state": "stopped", "exitCode": -210, "attempt": 0})).body
    assert done == Completed(JobState.STOPPED, -210, 0)
    assert {t.value for t in EventType} >= {"job.submitted", "job.completed", "task.started", "job.retry"}


def test_a_completed_job_in_an_unknown_or_unfinished_state_reads_as_failed():
    assert read_event(raw("job.completed", {"state": "WEIRD"})).body == Completed(JobState.FAILED, None, None)
    assert read_event(raw("job.completed", {"state": "RUNNING"})).body.state is JobState.FAILED


def test_an_unknown_type_is_kept_as_other_and_a_bad_field_is_named():
    other = read_event(raw("job.tagged", {"tag": "x"})).body
    assert other == OtherEvent("job.tagged", {"tag": "x"})
    with pytest.raises(EventError, match=r"seq=7: data.taskRole"):
        read_event(raw("task.started", {"attempt": 0, "index": 0}))
    with pytest.raises(EventError, match=r"data.index: an integer"):
        read_event(raw("task.exited", {"taskRole": "train", "index": "zero"}))
    with pytest.raises(EventError, match=r"jobId"):
        read_event({"seq": 3, "type": "job.waiting", "data": {}})
