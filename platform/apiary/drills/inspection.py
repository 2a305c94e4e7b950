"""The inspection probe: a black-box check that each virtual cluster takes and runs a job in time.

AI-System 7.6.3.3's inspection: a tiny job per VC, submitted through the public API like a user's,
measured from outside: submit -> running -> succeeded, against an SLO (default 120 s from
submission to success; ``APIARY_DRILL_PROBE_SLO_S``). The job is opportunistic
(``extras.hivedScheduler.jobPriorityClass: oppo``, HiveD priority -1): it runs only on idle GPUs
and is preempted first, so a probe never delays users' guaranteed jobs; and, like every
opportunistic job, it may run on any idle cell of the cluster, not only on its VC's. A probe not
done by its deadline is stopped and counts as a failure, with the phase it was stuck in. On a
cluster with no idle GPU at all the probe waits and fails too: it measures what a new job
would see.

Phases (from the API's own timestamps, milliseconds): ``schedule`` = submission to the task's
start, ``run`` = the task's start to the job's completion, ``total`` = submission to completion.

Results reach Prometheus through the control plane: :func:`run_inspection` reports them to
``POST /api/v2/drills/results``, and ``/metrics`` then shows ``apiary_probe_success``,
``apiary_probe_duration_seconds``, ``apiary_probe_last_run_timestamp_seconds`` and
``apiary_probe_runs_total`` per VC (alert ``ApiaryInspectionProbeFailing``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from apiary.drills.common import DrillApi, DrillOutcome, drill_job, parse_iso, record, unique_suffix
from apiary.errors import ApiaryError

logger = logging.getLogger(__name__)

FINAL = ("SUCCEEDED", "FAILED", "STOPPED")
PROBE_PREFIX = "apiary-probe"
PROBE_COMMAND = "echo apiary-probe ok"


@dataclass
class ProbeResult:
    """One VC's probe. ``phases``: seconds of the phases reached; ``reason``: why it failed."""

    virtual_cluster: str
    success: bool
    job_id: str | None = None
    state: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def wire(self) -> dict[str, Any]:
        return {"virtualCluster": self.virtual_cluster, "success": self.success, "jobId": self.job_id,
                "phases": {k: round(v, 3) for k, v in self.phases.items()}, "reason": self.reason[:2000]}

    def row(self) -> dict[str, Any]:
        return {"virtualCluster": self.virtual_cluster, "success": self.success, "job": self.job_id,
                "state": self.state, **{f"{k}S": round(v, 3) for k, v in self.phases.items()},
                "reason": self.reason}


def _phases(job: dict) -> dict[str, float]:
    submitted = parse_iso(job.get("submissionTime"))
    started = min((t for t in (parse_iso(t.get("startTime")) for t in job.get("tasks") or []) if t is not None),
                  default=None)
    completed = parse_iso(job.get("completionTime"))
    out: dict[str, float] = {}
    if submitted is not None and started is not None:
        out["schedule"] = max(0.0, started - submitted)
    if started is not None and completed is not None:
        out["run"] = max(0.0, completed - started)
    if submitted is not None and completed is not None:
        out["total"] = max(0.0, completed - submitted)
    return out


def probe(api: DrillApi, virtual_clusters: list[str] | None = None, *, slo_s: float = 120.0, image: str,
          poll_s: float = 0.5, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> list[ProbeResult]:
    """Probe each VC (default: every VC of ``GET /api/v2/cluster/status``) at once: one job each,
    followed until it ends or ``slo_s`` passes (then stopped). Never raises for a probe's failure:
    an API that refuses or cannot be reached is that VC's failed result."""
    try:
        vcs = virtual_clusters or sorted(api.cluster_status().get("virtualClusters", {}))
    except ApiaryError as e:
        return [ProbeResult("*", False, reason=f"cluster status unavailable: {e.message}")]
    suffix = unique_suffix()
    deadline = clock() + slo_s
    pending: dict[str, str] = {}  # vc -> job id
    results: dict[str, ProbeResult] = {}
    for vc in vcs:
        name = f"{PROBE_PREFIX}-{vc}-{suffix}"[:255]
        try:
            job = api.submit_job(drill_job(name, vc, image=image, commands=[PROBE_COMMAND], gpu=1, memory_mb=256))
            pending[vc] = job["id"]
        except ApiaryError as e:
            results[vc] = ProbeResult(vc, False, reason=f"submission refused: {e.message}")
    last: dict[str, dict] = {}
    while pending:
        for vc, job_id in list(pending.items()):
            try:
                job = api.get(job_id)
            except ApiaryError as e:  # transient: keep polling until the deadline
                logger.warning("probe vc=%s job=%s unreadable: %s", vc, job_id, e.message)
                continue
            last[vc] = job
            if job["state"] in FINAL:
                del pending[vc]
                phases = _phases(job)
                ok = job["state"] == "SUCCEEDED" and phases.get("total", slo_s + 1) <= slo_s
                reason = "" if ok else (
                    f"{job['state']} (exit code {job.get('exitCode')}: {job.get('exitPhrase') or 'n/a'})"
                    if job["state"] != "SUCCEEDED" else f"took {phases.get('total', 0):.1f} s > SLO {slo_s:g} s")
                results[vc] = ProbeResult(vc, ok, job_id, job["state"], phases, reason)
        if not pending:
            break
        if clock() >= deadline:
            for vc, job_id in pending.items():
                job = last.get(vc, {})
                state = job.get("state", "unknown")
                why = f": {job['waitingReason']}" if job.get("waitingReason") else ""
                results[vc] = ProbeResult(vc, False, job_id, state, _phases(job),
                                          f"still {state} after the SLO of {slo_s:g} s{why}")
                try:
                    api.stop(job_id)  # a late probe must not run later, on capacity users may want
                except ApiaryError as e:
                    logger.warning("probe job=%s not stopped: %s", job_id, e.message)
            break
        sleep(poll_s)
    for r in results.values():
        logger.info("probe vc=%s success=%s job=%s phases=%s reason=%s", r.virtual_cluster, r.success, r.job_id,
                    r.phases, r.reason)
    return [results[vc] for vc in vcs if vc in results]


def run_inspection(api: DrillApi, virtual_clusters: list[str] | None = None, *, slo_s: float = 120.0,
                   image: str, report: bool = True, **timing: Any) -> DrillOutcome:
    """The ``inspection`` drill: :func:`probe` every VC, then report the results (``report``) so the
    control plane's ``/metrics`` shows them. Passed when every VC's probe met the SLO."""
    started = time.time()
    results = probe(api, virtual_clusters, slo_s=slo_s, image=image, **timing)
    failed = [r for r in results if not r.success]
    outcome = DrillOutcome(
        drill="inspection", result="failed" if failed or not results else "passed",
        summary=(f"{len(results) - len(failed)}/{len(results)} VCs met the SLO of {slo_s:g} s"
                 + ("; failed: " + "; ".join(f"{r.virtual_cluster}: {r.reason}" for r in failed) if failed else "")),
        started_at=started, finished_at=time.time(), rows=[r.row() for r in results],
        details={"sloS": slo_s, "probes": [r.wire() for r in results]},
    )
    if report:
        record(api, outcome, probes=[r.wire() for r in results if r.virtual_cluster != "*"])
    return outcome
