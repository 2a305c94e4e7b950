"""Control-plane metrics from a snapshot dict, the cycle histogram and heartbeats."""

from __future__ import annotations

import pytest
from tests.monitoring.helpers import parse, scrape, value

from apiary.monitoring import platform_metrics
from apiary.monitoring.platform_metrics import PlatformCollector, beat, observe_cycle


@pytest.fixture(autouse=True)
def _reset():
    platform_metrics._reset_for_tests()
    yield
    platform_metrics._reset_for_tests()


SNAPSHOT = {
    "now": 10_000.0,
    "jobs": {"vc1": {"RUNNING": 3, "WAITING": 2, "SUCCEEDED": 10}, "vc2": {"RUNNING": 0}},
    "waiting_jobs": [
        {"job": "alice~a", "user": "alice", "virtual_cluster": "vc1", "submitted_at": 9_000.0},
        {"job": "bob~b", "user": "bob", "virtual_cluster": "vc1", "submitted_at": 9_990.0},
    ],
    "preemptions": {"vc1": 4},
    "vc_cells": {"vc1": {"used": 6, "free": 2}, "vc2": {"used": 0, "free": 7, "bad": 1, "opportunistic": 2}},
    "nodes": [{"node": "n1", "healthy": True, "cordoned": False}, {"node": "n2", "healthy": False, "cordoned": True}],
    "heartbeats": [{"service": "node-agent", "instance": "n1", "timestamp": 9_995.0}],
}


def test_snapshot_rendering():
    observe_cycle(0.004, at=9_999.0)
    observe_cycle(0.2, at=9_999.5)
    beat("scheduling-loop", "cp-0", at=9_998.0)
    s = parse(scrape(PlatformCollector(lambda: SNAPSHOT)))
    assert value(s, "apiary_jobs", state="RUNNING", virtual_cluster="vc1") == 3
    assert value(s, "apiary_jobs", state="SUCCEEDED", virtual_cluster="vc1") == 10
    assert value(s, "apiary_jobs", state="RUNNING", virtual_cluster="vc2") == 0
    assert value(s, "apiary_job_queue_length", virtual_cluster="vc1") == 2  # counted from waiting_jobs
    assert value(s, "apiary_job_waiting_seconds", job="alice~a", user="alice", virtual_cluster="vc1") == 1000
    assert value(s, "apiary_job_waiting_seconds", job="bob~b", user="bob", virtual_cluster="vc1") == 10
    assert value(s, "apiary_preemptions_total", virtual_cluster="vc1") == 4
    assert value(s, "apiary_vc_cells", virtual_cluster="vc1", state="used") == 6
    assert value(s, "apiary_vc_cells", virtual_cluster="vc1", state="bad") == 0  # zero-filled
    assert value(s, "apiary_vc_cells", virtual_cluster="vc2", state="opportunistic") == 2
    assert value(s, "apiary_node_healthy", node="n2") == 0 and value(s, "apiary_node_healthy", node="n1") == 1
    assert value(s, "apiary_node_cordoned", node="n2") == 1
    assert value(s, "apiary_service_heartbeat_timestamp_seconds", service="node-agent", instance="n1") == 9_995
    assert value(s, "apiary_service_heartbeat_timestamp_seconds", service="scheduling-loop", instance="cp-0") == 9_998
    assert value(s, "apiary_scheduling_last_cycle_timestamp_seconds") == 9_999.5
    assert value(s, "apiary_scheduling_cycle_seconds_count") >= 2  # module-level: other tests may observe too
    assert value(s, "apiary_scheduling_cycle_seconds_bucket", le="0.005") >= 1


def test_explicit_queue_length_and_last_cycle():
    snap = {"queue_length": {"vc3": 7}, "last_cycle_at": 123.0}
    s = parse(scrape(PlatformCollector(lambda: snap)))
    assert value(s, "apiary_job_queue_length", virtual_cluster="vc3") == 7
    assert value(s, "apiary_scheduling_last_cycle_timestamp_seconds") == 123


def test_empty_snapshot():
    s = parse(scrape(PlatformCollector()))
    assert "apiary_scheduling_last_cycle_timestamp_seconds" not in s  # no cycle yet
    assert "apiary_scheduling_cycle_seconds_count" in s
