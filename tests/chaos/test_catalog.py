"""Every experiment in chaos/: valid for chaostoolkit (every function and argument exists), the
standard steady state before and after, tags, undo-only rollbacks, described in chaos/README.md
and run by a test of this directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaoslib.provider.python import validate_python_activity
from tests.chaos.conftest import DATA, EXPERIMENTS

STEADY_STATE = ["api-healthy", "probe-job-within-slo", "store-and-scheduler-consistent", "no-accepted-job-lost",
                "no-task-ran-twice"]
UNDO = {"thaw_agent", "clear_gpu_faults", "uncordon_node", "free_disk", "restore_network", "detach_netns_node",
        "restart_replicas", "thaw_leader", "reconnect_to_store", "heal_partition"}
FILES = sorted(EXPERIMENTS.glob("*.json"))


def test_the_catalog() -> None:
    assert [f.stem for f in FILES] == [
        "agent-partition", "gpu-faults", "gpu-oom-job", "kill-agent", "kill-control-plane", "kill-postgres",
        "kill-prefect-server", "leader-cut-from-store", "leader-freeze", "leader-kill", "network-degraded",
        "node-freeze", "postgres-restart", "store-disk-full"]


@pytest.mark.parametrize("path", [*FILES, DATA / "broken-rollback.json"], ids=lambda p: p.stem)
def test_every_activity_calls_an_existing_function_with_its_arguments(path: Path) -> None:
    doc = json.loads(path.read_text())
    activities = [*doc["steady-state-hypothesis"]["probes"], *doc["method"], *doc.get("rollbacks", [])]
    for a in activities:
        validate_python_activity(a)  # raises InvalidActivity naming the function or argument


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_experiment_has_the_steady_state_tags_and_undo_rollbacks(path: Path) -> None:
    doc = json.loads(path.read_text())
    probes = doc["steady-state-hypothesis"]["probes"]
    assert [p["name"] for p in probes] == STEADY_STATE
    assert all(p["tolerance"] is True for p in probes)
    assert "apiary" in doc["tags"] and len(doc["tags"]) >= 2
    assert {r["provider"]["func"] for r in doc.get("rollbacks", [])} <= UNDO
    assert doc["configuration"]["apiary_token"] == {"type": "env", "key": "APIARY_TOKEN", "default": ""}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_experiment_is_documented_and_run_by_a_test(path: Path) -> None:
    assert f"`{path.name}`" in (EXPERIMENTS / "README.md").read_text()
    # The chaos tests, and the many-host e2e, which runs leader-freeze and agent-partition against
    # its own full deployment.
    runners = [p for p in Path(__file__).parent.glob("test_*.py") if p.name != Path(__file__).name]
    runners.append(Path(__file__).parents[1] / "e2e" / "test_multihost.py")
    tests = "".join(p.read_text() for p in runners)
    assert f'"{path.stem}"' in tests
