"""What the control plane answers: jobs and nodes as the REST API's JSON (OpenPAI's field names).

Read-only renderings of committed rows; :mod:`apiary.api.schemas` declares the same shapes as
pydantic models for ``/docs``.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from apiary.store.models import Job, Node, Task
from apiary.timefmt import iso


def simulated_nodes(s: Session) -> set[str]:
    return set(s.scalars(select(Node.name).where(Node.simulated_gpus.is_(True))))


def latest_tasks(s: Session, job: Job, attempt: int | None = None) -> list[Task]:
    """The newest run of each instance of attempt ``attempt`` (default: the current one), by role and index."""
    a = job.attempt if attempt is None else attempt
    return list(s.scalars(
        select(Task).where(Task.job_id == job.id, Task.attempt == a, Task.latest.is_(True))
        .order_by(Task.task_role, Task.index)
    ))


def job_json(s: Session, job: Job, tasks: list[Task] | None = None, simulated: set[str] | None = None) -> dict:
    """A job as ``GET /api/v2/jobs/{id}`` answers it: OpenPAI's job fields plus Apiary's
    ``waitingReason``, ``retryDetails`` and the current attempt's ``tasks``."""
    tasks = latest_tasks(s, job) if tasks is None else tasks
    simulated = simulated_nodes(s) if simulated is None else simulated
    return {
        "id": job.id,
        "name": job.name,
        "user": job.user,
        "virtualCluster": job.virtual_cluster,
        "priorityClass": job.priority_class,
        "priority": job.priority,
        "gang": job.gang,
        "state": job.state,
        "executionType": job.execution_type,
        "attempt": job.attempt,
        "retries": job.retries_user + job.retries_platform,
        "retryDetails": {"user": job.retries_user, "platform": job.retries_platform},
        "submissionTime": iso(job.submission_time),
        "launchTime": iso(job.launch_time),
        "completionTime": iso(job.completion_time),
        "exitCode": job.exit_code,
        "exitPhrase": job.exit_phrase,
        "waitingReason": job.waiting_reason,
        "flowRunId": job.flow_run_id,
        "tags": list(job.tags or []),
        "tasks": [
            {
                "taskRole": t.task_role,
                "index": t.index,
                "attempt": t.attempt,
                "taskAttempt": t.task_attempt,
                "state": t.state,
                "node": t.node,
                "gpus": list(t.gpus or []),
                # The node advertises the cluster config's GPUs without having them.
                "simulatedGpus": t.node in simulated if t.node else None,
                "exitCode": t.exit_code,
                "exitPhrase": t.exit_phrase,
                "startTime": iso(t.started),
                "completionTime": iso(t.finished),
            }
            for t in tasks
        ],
    }
