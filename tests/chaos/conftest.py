"""Chaos tests: the experiments in chaos/ against live embedded platforms on loopback.

``start_platform`` starts one (by default Lab 6's two-VC cluster, where the experiments' defaults
pick VC default = hostname-carol as the probe VC and vc1 = hostname-dan as the load and fault VC)
with nodes declared lost after :data:`NODE_LOST_AFTER_S` (30 s in production; short here so the
node-freeze experiment does not wait half a minute). ``run_checked`` runs one experiment through
the runner and checks the verdict and the journal it was drawn from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.support.builders import LAB6, REPO
from tests.support.polling import nodes_ready, until

from apiary.chaos.runner import Verdict, run_experiment
from apiary.client import Tenants
from apiary.embedded import REPO_ROOT, Embedded

EXPERIMENTS = REPO / "chaos"
DATA = Path(__file__).parent / "data"
NODE_LOST_AFTER_S = 6
#: Per experiment: generous for a loaded 2-core CI machine; a passing run takes 10-30 s.
TIMEOUT_S = 240


def start_platform(home: Path, prefect: bool = False, env: dict[str, str] | None = None,
                   cluster: Path = LAB6 / "hived-config-two-vcs.yaml") -> Embedded:
    """A started, supervised platform on ``cluster`` (default Lab 6's two VCs) whose two nodes are ready."""
    p = Embedded(home=home, cluster=cluster, prefect=prefect, workdir=str(REPO_ROOT),
                 env={"APIARY_NODE_LOST_AFTER_S": str(NODE_LOST_AFTER_S), **(env or {})})
    try:
        p.start()
        p.start_supervisor(period_s=0.2)
        until(lambda: nodes_ready(Tenants(p.client()), 2), 60, "node agents")
    except BaseException:
        p.stop()
        raise
    return p


def run(platform: Embedded, experiment: Path, journals: Path) -> Verdict:
    token = (platform.home / "token").read_text().strip()
    return run_experiment(experiment, api_url=platform.api_url, token=token, home=platform.home,
                          journal_dir=journals, timeout_s=TIMEOUT_S)


def run_checked(platform: Embedded, name: str, journals: Path) -> dict:
    """Run ``chaos/<name>.json``; assert it passed and that its journal says so first-hand (the
    steady state met before and after the method, every activity and rollback succeeded). Returns
    the journal."""
    v = run(platform, EXPERIMENTS / f"{name}.json", journals)
    assert v.passed, f"{name}: {v.reasons}\n--- chaostoolkit output:\n{v.log.read_text()[-4000:]}"
    assert v.journal is not None
    journal = json.loads(v.journal.read_text())
    assert journal["status"] == "completed" and not journal["deviated"]
    assert journal["steady_states"]["before"]["steady_state_met"] is True
    assert journal["steady_states"]["after"]["steady_state_met"] is True
    assert {r["activity"]["name"] for r in journal["steady_states"]["after"]["probes"]} >= {
        "api-healthy", "probe-job-within-slo", "store-and-scheduler-consistent", "no-accepted-job-lost",
        "no-task-ran-twice"}
    assert all(r["status"] == "succeeded" for r in journal["run"] + journal["rollbacks"])
    assert v.accepted_jobs, "the steady state submits probe jobs: the ledger cannot be empty"
    token = (platform.home / "token").read_text().strip()
    assert token not in v.journal.read_text() and token not in v.log.read_text(), "the admin token leaked"
    return journal


def outputs(journal: dict) -> dict[str, object]:
    """Method activity name -> its output."""
    return {r["activity"]["name"]: r.get("output") for r in journal["run"]}


def is_root() -> bool:
    return os.geteuid() == 0
