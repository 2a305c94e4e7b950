"""The one Apiary -> Prefect state table (apiary.tracking.states)."""

from __future__ import annotations

from apiary.tracking import states


def test_waiting_is_pending_named_waiting_with_the_reason():
    s = states.waiting("VC vc1 has 0 of 2 GPU leaf cells free")
    assert (s.type, s.name, s.message) == ("PENDING", "Waiting", "VC vc1 has 0 of 2 GPU leaf cells free")
    assert not s.final


def test_waiting_after_preemption_is_awaiting_retry_with_the_cause_then_the_reason():
    s = states.waiting("no free cells", retry_cause="attempt 0 preempted by bob~prod: Preempted by bob~prod.")
    assert (s.type, s.name) == ("PENDING", "AwaitingRetry")
    assert s.message.startswith("attempt 0 preempted by bob~prod") and s.message.endswith("waiting: no free cells")


def test_final_states_carry_the_exit_code_and_its_exit_spec_meaning():
    ok, failed, stopped = (states.final("SUCCEEDED", 0), states.final("FAILED", 137, attempt=2),
                           states.final("STOPPED", -210, stopped_by="Cancel in the Prefect UI"))
    assert (ok.type, ok.name) == ("COMPLETED", "Completed") and ok.final
    assert (failed.type, failed.name) == ("FAILED", "Failed")
    assert "exit code 137: ContainerSigKillReceived" in failed.message and "(attempt 2)" in failed.message
    assert (stopped.type, stopped.name) == ("CANCELLED", "Cancelled")
    assert "Cancel in the Prefect UI" in stopped.message
    assert states.final("WEIRD", None).type == "FAILED"


def test_submitted_is_running_so_the_run_starts_when_apiary_accepts_the_job():
    s = states.submitted("alice", "vc1", "prod")
    assert (s.type, s.name) == ("RUNNING", "Submitted") and "alice" in s.message


def test_one_table_holds_every_job_state_and_the_helpers_read_it():
    from apiary.lifecycle.states import JobState

    assert {s for s, _ in states.FLOW_RUN_STATES if s is not None} == set(JobState)
    for s in JobState.final_states():
        spec = states.final(s, 0)
        assert (spec.type, spec.name) == states.FLOW_RUN_STATES[(s, False)] and spec.final
    assert (states.awaiting_retry("preempted").type, states.awaiting_retry("preempted").name) == \
        states.FLOW_RUN_STATES[(JobState.WAITING, True)]
    assert states.FINAL_TYPES[JobState.STOPPED] == "CANCELLED" and states.FINAL_TYPES["STOPPED"] == "CANCELLED"
