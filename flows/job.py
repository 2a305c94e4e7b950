"""Flow ``apiary-job``: one flow run per Apiary job, three ways to start one (``flows/serve.py``).

* ``submit_form`` (deployment ``submit``): the Custom run form, one field per thing an ML
  engineer decides (name, user, virtual cluster, priority class, task roles);
* ``submit_yaml`` (deployment ``submit-yaml``): a complete OpenPAI job YAML;
* ``rerun_job`` (deployment ``job``): the runs Apiary's bridge makes for CLI/REST jobs; runs
  only on Retry, which re-runs the job as ``<name>-retry<N>``.

Who a run acts as: the bridge's service token (``APIARY_TOKEN`` of the serving process), which may
submit on behalf of an existing user, stop and clone; it is sent only to the platform's configured
URL (``APIARY_API_URL``): no parameter names a URL, and Prefect refuses a run with an unknown one.

Thin: the logic is :mod:`apiary.tracking.portal` (what a run does) and
:mod:`apiary.tracking.states` (the state it ends in). Each run ends with the job's state:
Completed, Failed (exit code and its exit-spec meaning) or Cancelled.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import State, StateType
from pydantic import Field

from apiary.tracking import states
from apiary.tracking.portal import NAME_PATTERN, PriorityClass, TaskRoleForm, job_from_form, run_job


def _end(job: dict) -> State:
    """The run's final state: the job's, by the one mapping (apiary.tracking.states)."""
    spec = states.final(job.get("state", "FAILED"), job.get("exitCode"), job.get("attempt"))
    return State(type=StateType(spec.type), name=spec.name, message=f"{job.get('id')}: {spec.message}", data=job)


def _name_from_params() -> str:
    p = flow_run.parameters
    if p.get("job_id"):
        return str(p["job_id"])
    if p.get("name"):
        return f"{p.get('user')}~{p['name']}"
    from apiary.tracking.portal import yaml_name

    return f"{p.get('user')}~{yaml_name(p.get('job_yaml') or '') or 'job'}"


@flow(name="apiary-job", flow_run_name=_name_from_params, persist_result=False)
async def submit_form(
    name: str = Field(pattern=NAME_PATTERN, title="Job name",
                      description="Letters, digits, '_' and '-'. Your job's id is user~name; a name can be used "
                                  "once per user."),
    user: str = Field(pattern=NAME_PATTERN, title="User", description="Your Apiary user name."),
    virtual_cluster: str = Field(title="Virtual cluster",
                                 description="The virtual cluster (your team's share of the cluster) the job runs "
                                             "in; its quota and GPU type apply."),
    task_roles: list[TaskRoleForm] = Field(min_length=1, title="Task roles",
                                           description="What runs: one entry per group of identical tasks "
                                                       "(a single 'train' role for most jobs)."),
    priority_class: PriorityClass = Field("test", title="Priority class",
                                          description="prod outranks test and may preempt it; oppo runs only on "
                                                      "idle GPUs and is preempted first; crit is for operators. "
                                                      "Default test."),
    retries: int = Field(0, ge=0, le=10, title="Retries",
                         description="How many times Apiary retries the job after a failure of your code "
                                     "(platform failures are retried anyway). Default 0."),
) -> Any:
    """Submit a job to Apiary from the form and follow it to its end."""
    job = job_from_form(name, virtual_cluster, task_roles, priority_class, retries)
    return _end(await run_job(flow_run_id=flow_run.get_id(), job=job, user=user))


@flow(name="apiary-job", flow_run_name=_name_from_params, persist_result=False)
async def submit_yaml(
    job_yaml: str = Field(title="OpenPAI job (YAML)",
                          description="A complete OpenPAI job protocol v2 YAML, as `apiary job submit` takes."),
    user: str = Field(pattern=NAME_PATTERN, title="User", description="Your Apiary user name."),
) -> Any:
    """Submit an OpenPAI job YAML to Apiary and follow it to its end."""
    return _end(await run_job(flow_run_id=flow_run.get_id(), job=job_yaml, user=user))


@flow(name="apiary-job", flow_run_name=_name_from_params, persist_result=False)
async def rerun_job(
    job_id: str = Field(title="Job id", description="user~name of the job to follow, or to re-run if it ended."),
) -> Any:
    """Follow a job, or re-run it as a new job (<name>-retry<N>) if it ended (the Retry button)."""
    return _end(await run_job(flow_run_id=flow_run.get_id(), job_id=job_id))
