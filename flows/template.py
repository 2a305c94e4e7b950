"""Flow ``apiary-template``: a job template of Apiary's marketplace as a Prefect deployment.

``flows/serve.py`` serves one deployment per template (named after it) whose run form is made
from the template's parameters (:func:`apiary.tracking.portal.template_form_schema`): their types,
defaults, titles, bounds and choices, plus the Apiary user the job runs as. Pressing Run submits
the template's job through Apiary (``POST /api/v2/templates/{name}/runs``, the bridge's token on
behalf of that user: their VCs, quota and storage grants apply, and a template they may not see is
refused) and follows it to its end, exactly as ``apiary-job/submit`` does.

Thin: the logic is :func:`apiary.tracking.portal.run_template_job`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from pydantic import Field

from apiary.tracking.portal import NAME_PATTERN, TEMPLATE_FLOW, run_template_job
from job import _end


def _run_name() -> str:
    p = flow_run.parameters
    return f"{p.get('user')}~{p.get('job_name') or p.get('template')}"


@flow(name=TEMPLATE_FLOW, flow_run_name=_run_name, persist_result=False)
async def run_template(
    template: str = Field(pattern=NAME_PATTERN, title="Template", description="The job template to run."),
    user: str = Field(pattern=NAME_PATTERN, title="User", description="Your Apiary user name."),
    parameters: dict[str, Any] = Field(default_factory=dict, title="Parameters",
                                       description="Values of the template's parameters; the rest keep their "
                                                   "defaults."),
    job_name: str | None = Field(None, title="Job name", description="Optional job name."),
) -> Any:
    """Run an Apiary job template for a user and follow its job to its end."""
    job = await run_template_job(flow_run_id=flow_run.get_id(), template=template, user=user, values=parameters,
                                 job_name=job_name)
    return _end(job)
