"""Liveness probes through the platform: Kubernetes' busybox liveness-exec example
(examples/probes/liveness-exec.yaml), shortened from 30 s healthy to 3 s."""

from __future__ import annotations

import time

import pytest
import yaml
from tests.support.polling import done, task_running, until

from apiary.embedded import REPO_ROOT
from apiary.lifecycle import EXIT_LIVENESS_FAILED

pytestmark = pytest.mark.e2e


def test_failing_liveness_probe_fails_the_attempt_and_the_job_retries(platform_factory):
    p, c = platform_factory("hived-config-one-vc.yaml")
    doc = yaml.safe_load((REPO_ROOT / "examples/probes/liveness-exec.yaml").read_text())
    role = doc["taskRoles"]["liveness"]
    role["commands"] = [role["commands"][0].replace("sleep 30", "sleep 3")]
    probe = doc["extras"]["apiary"]["taskRoles"]["liveness"]["livenessProbe"]
    probe.update(initialDelaySeconds=1, periodSeconds=1, failureThreshold=2)
    job = c.submit(yaml.safe_dump(doc), user="alice")["id"]
    until(lambda: task_running(c, job), 60, "the task running")
    t0 = time.monotonic()
    time.sleep(2.0)  # inside the healthy window the probe passes and the task keeps running
    assert c.get(job)["tasks"][0]["state"] == "RUNNING" and c.get(job)["attempt"] == 0
    final = done(c, job)
    assert final["state"] == "FAILED" and final["exitCode"] == EXIT_LIVENESS_FAILED
    assert final["retryDetails"] == {"user": 1, "platform": 0}  # jobRetryCount: 1, probe code is RETRY_TO_MAX
    assert time.monotonic() - t0 < 60
    assert any(e["type"] == "task.exited" and e["data"]["exitCode"] == EXIT_LIVENESS_FAILED
               for e in c.events(job_id=job))
