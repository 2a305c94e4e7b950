"""Prefect flow ``apiary-job``: submit one OpenPAI job to Apiary and wait for it.

The run form in the Prefect UI is the job spec (``job``: :class:`apiary.spec.job.JobSpec`,
camelCase wire names) plus ``user`` and ``api_url``. The flow POSTs the job with its own flow
run id in ``X-Apiary-Flow-Run-Id``, so the bridge (:mod:`apiary.tracking.bridge`) attaches the
job's task runs, logs and placement artifact to THIS flow run; the flow then polls the job
and ends Completed (returns the job JSON) on SUCCEEDED, Failed on FAILED/STOPPED. The flow
run is named after the job id (``user~name``), as the runs the bridge creates are.
"""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run

from apiary.spec.job import JobSpec
from apiary.tracking.submit import flow_run_name, submit_and_wait


@flow(name="apiary-job", flow_run_name=flow_run_name, persist_result=False)
async def apiary_job(job: JobSpec, user: str = "prefect", api_url: str | None = None) -> dict:
    """Run ``job`` on Apiary as ``user``; ``api_url`` defaults to ``APIARY_API_URL``."""
    return await submit_and_wait(job, user=user, api_url=api_url, flow_run_id=flow_run.get_id())
