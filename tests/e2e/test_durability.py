"""kill -9 of Apiary's processes loses no accepted job and runs no task twice.

Lab 6 scenario 2 (test job preempted by a prod job on vc1's single GPU) with the control plane
killed by SIGKILL in the middle; the supervisor restarts it, as ``apiary up`` does.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from tests.support.builders import job_text
from tests.support.polling import done, task_running, until

pytestmark = pytest.mark.e2e


def run_intervals(client, job_ids):
    """(run key, node, started, exited) for every task run, from the event history."""
    started, exited = {}, {}
    for e in client.events(limit=5000):
        if e["jobId"] not in job_ids:
            continue
        d = e["data"]
        key = (e["jobId"], d.get("attempt"), d.get("taskRole"), d.get("index"))
        if e["type"] == "task.started":
            assert key not in started, f"task run started twice: {key}"
            started[key] = (d["node"], e["time"])
        elif e["type"] == "task.exited":
            exited.setdefault(key, e["time"])
    return [(k, node, t0, exited.get(k, float("inf"))) for k, (node, t0) in started.items()]


def assert_never_two_on_one_gpu(intervals):
    by_node = {}
    for key, node, t0, t1 in intervals:
        by_node.setdefault(node, []).append((t0, t1, key))
    for node, spans in by_node.items():
        spans.sort()
        for (_a0, a1, ka), (b0, _b1, kb) in zip(spans, spans[1:], strict=False):
            # Events are stamped when the control plane hears of them, so allow the report lag.
            assert b0 >= a1 - 0.5, f"{ka} and {kb} overlapped on {node}"


def test_control_plane_sigkill_during_preemption(platform_factory):
    p, c = platform_factory()
    low = c.submit(job_text(1, 4), user="alice")["id"]
    until(lambda: task_running(c, low), what="job-config-1 running")
    high = c.submit(job_text(2, 4), user="bob")["id"]
    cp = p.children["control-plane"]
    old_pid = cp.proc.pid
    os.kill(old_pid, signal.SIGKILL)
    until(lambda: c.health()["pid"] != old_pid if _answers(c) else False, 60, "control plane restarted")
    assert cp.restarts == 1
    jobs = {j["id"]: j for j in c.list()}
    assert set(jobs) == {low, high}, "an accepted job was lost"
    j_high, j_low = done(c, high), done(c, low)
    assert (j_high["state"], j_low["state"]) == ("SUCCEEDED", "SUCCEEDED")
    assert j_low["retryDetails"]["platform"] == 1
    intervals = run_intervals(c, {low, high})
    assert {node for _, node, _, _ in intervals} == {"hostname-dan"}
    assert_never_two_on_one_gpu(intervals)


def test_agent_sigkill_keeps_tasks_running(platform_factory):
    p, c = platform_factory()
    job = c.submit(job_text(3, 6), user="alice")["id"]
    j = until(lambda: task_running(c, job), what="job-config-3 running")
    pid_before = j["tasks"][0]
    agent = p.children["agent"]
    os.kill(agent.proc.pid, signal.SIGKILL)
    until(lambda: agent.restarts == 1 and agent.alive(), 30, "agent restarted")
    final = done(c, job)
    assert final["state"] == "SUCCEEDED"
    # Re-adopted, not re-run: one attempt, no retry, one start.
    assert final["retries"] == 0 and final["attempt"] == 0
    assert final["tasks"][0]["startTime"] == pid_before["startTime"]
    assert len([k for k in run_intervals(c, {job})]) == 1
    assert "final test_acc" in c.logs(job)


def _answers(c) -> bool:
    try:
        c.health()
        return True
    except Exception:
        time.sleep(0.1)
        return False
