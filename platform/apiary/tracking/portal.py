"""The Prefect UI as a job portal: the run form's fields, and what a run of ``apiary-job`` does.

Three deployments of flow ``apiary-job`` (``flows/job.py``, served by ``flows/serve.py``):

* ``submit``: a form an ML engineer fills in the UI (:class:`TaskRoleForm` and the flow's own
  fields: name, user, virtual cluster, priority class, retries); :func:`job_from_form` turns it
  into an OpenPAI job (``protocolVersion: 2``, ``type: job`` filled in, not asked);
* ``submit-yaml``: a complete OpenPAI job YAML in one text field;
* ``job``: the runs Apiary's bridge makes for jobs submitted by the CLI or REST API. Such a run
  executes only when someone presses Retry on it (or runs the deployment by hand).

A run submits its job with its own flow run id, so the bridge attaches the job's states, task
runs and logs to it (:mod:`apiary.tracking.bridge`), then waits for the job to end and ends
with the job's state (:func:`apiary.tracking.states.final`). Retry on a finished run executes
the run again: :func:`run_job` sees the job it already submitted has ended and submits a copy
(``POST /jobs/{id}/clone`` -> ``<name>-retry<N>``), attached to the same run and linked in its
logs, instead of failing on the name that is taken. No Prefect import: tested without a server.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from apiary.errors import ConflictError, UnavailableError, UserError, error_from_response
from apiary.tracking.source import API_PREFIX, FLOW_RUN_HEADER, ON_BEHALF_HEADER, service_headers
from apiary.tracking.submit import FINAL_STATES, platform_api_url, platform_verify, submit_job, wait_for_job

logger = logging.getLogger(__name__)

__all__ = ["TEMPLATE_FLOW", "PriorityClass", "TaskRoleForm", "job_from_form", "run_job", "run_template_job",
           "template_form_schema", "template_job_name", "yaml_name"]

#: OpenPAI's job priority classes (``extras.hivedScheduler.jobPriorityClass``), highest first.
PriorityClass = Literal["crit", "prod", "test", "oppo"]

#: Pattern of job and task role names (OpenPAI protocol v2: ``^[a-zA-Z0-9_-]+$``).
NAME_PATTERN = r"^[a-zA-Z0-9_-]+$"


class TaskRoleForm(BaseModel):
    """One task role in the run form: what each instance runs and the resources it gets."""

    model_config = ConfigDict(title="Task role")

    name: str = Field("train", pattern=NAME_PATTERN, title="Task role name",
                      description="A name for this group of identical tasks, e.g. train, worker or ps. "
                                  "Letters, digits, '_' and '-'.")
    instances: int = Field(1, ge=1, le=1000, title="Instances",
                           description="How many copies of the task run side by side (for distributed "
                                       "training, one per worker). Default 1.")
    gpus: int = Field(1, ge=0, le=64, title="GPUs per instance",
                      description="Whole GPUs each instance gets; its CUDA_VISIBLE_DEVICES lists them. "
                                  "0 for a CPU-only task. Default 1.")
    cpu: int = Field(2, ge=1, le=1024, title="CPU cores per instance", description="Default 2.")
    memory_mb: int = Field(4096, ge=64, title="Memory per instance (MiB)", description="Default 4096 MiB.")
    image: str = Field("python:3.11", min_length=1, title="Docker image",
                       description="The image the task runs in, e.g. pytorch/pytorch:2.3.0-cuda12.1-cudnn8-"
                                   "runtime. On the process runtime (nodes without Docker) it is recorded "
                                   "but the command runs on the node itself.")
    commands: list[str] = Field(min_length=1, title="Commands",
                                description="Shell commands run one after another in each instance, e.g. "
                                            "'python train.py --epochs 1'. The task fails if one fails.")


def job_from_form(
    name: str,
    virtual_cluster: str,
    task_roles: list[TaskRoleForm],
    priority_class: str = "test",
    retries: int = 0,
) -> dict[str, Any]:
    """The OpenPAI job (wire dict, protocol v2) for the ``submit`` form.

    One ``dockerimage`` prerequisite per distinct image (``image-0``, ``image-1``, ...), task roles
    in form order, ``defaults.virtualCluster``, ``jobRetryCount`` and
    ``extras.hivedScheduler.jobPriorityClass``. Validation is left to Apiary (the answer names
    the field, e.g. ``taskRoles.train.resourcePerInstance.gpu``), so the form and the API reject
    the same jobs with the same words.
    """
    images: dict[str, str] = {}
    roles: dict[str, Any] = {}
    for role in task_roles:
        ref = images.setdefault(role.image, f"image-{len(images)}")
        roles[role.name] = {
            "instances": role.instances,
            "dockerImage": ref,
            "resourcePerInstance": {"gpu": role.gpus, "cpu": role.cpu, "memoryMB": role.memory_mb},
            "commands": list(role.commands),
        }
    return {
        "protocolVersion": 2,
        "name": name,
        "type": "job",
        "jobRetryCount": retries,
        "prerequisites": [{"protocolVersion": 2, "name": ref, "type": "dockerimage", "uri": uri}
                          for uri, ref in images.items()],
        "taskRoles": roles,
        "defaults": {"virtualCluster": virtual_cluster},
        "extras": {"hivedScheduler": {"jobPriorityClass": priority_class}},
    }


async def _get(client: httpx.AsyncClient, job_id: str) -> dict:
    try:
        resp = await client.get(f"{API_PREFIX}/jobs/{job_id}")
    except httpx.HTTPError as exc:
        raise UnavailableError(f"job id={job_id}: apiary unreachable: {exc!r}") from exc
    if resp.status_code >= 400:
        raise error_from_response(resp.status_code, resp.content, f"job id={job_id}")
    return resp.json()


async def _clone(client: httpx.AsyncClient, job_id: str, flow_run_id: str | None) -> str:
    headers = {FLOW_RUN_HEADER: str(flow_run_id)} if flow_run_id else {}
    try:
        resp = await client.post(f"{API_PREFIX}/jobs/{job_id}/clone", headers=headers)
    except httpx.HTTPError as exc:
        raise UnavailableError(f"clone job id={job_id}: apiary unreachable: {exc!r}") from exc
    if resp.status_code >= 400:
        raise error_from_response(resp.status_code, resp.content, f"clone job id={job_id}")
    return str(resp.json()["id"])


async def run_job(
    *,
    flow_run_id: str | None,
    job: Any = None,
    user: str | None = None,
    job_id: str | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> dict:
    """The body of every ``apiary-job`` run: submit (or re-run) a job, wait, return its final JSON.

    Give either ``job`` (wire dict or YAML text) with ``user``, or ``job_id`` of an existing job.
    Apiary is reached at the platform's configured URL only
    (:func:`apiary.tracking.submit.platform_api_url`), never at one a run parameter names: the
    calls carry the bridge's service token.

    * First run: submits ``job`` attached to ``flow_run_id``.
    * The job exists already and is attached to this run (Retry, or the run restarted): if it
      ended, a copy is submitted (``<name>-retry<N>``) and followed; if not, it is followed.
    * ``job_id`` given: the same, for the job of a CLI-submitted run.
    * ``job`` names a job that exists and belongs to another run: ConflictError (409, the name is
      taken), as the API answers.

    Returns the final job JSON (any final state: the caller maps it with
    :func:`apiary.tracking.states.final`). Raises UserError for a bad job (Apiary's message, naming
    the field), PlatformError / UnavailableError when Apiary fails or is unreachable.
    """
    if (job is None) == (job_id is None):
        raise UserError("job: give either a job spec or the id of an existing job")
    base = platform_api_url()
    async with httpx.AsyncClient(base_url=base, timeout=30.0, headers=service_headers(),
                                 verify=platform_verify()) as client:
        if job is not None:
            if not user:
                raise UserError("user: required to submit a job")
            if not prefect_protected():
                raise UserError(UNPROTECTED)
            try:
                job_id = await submit_job(client, job, user, flow_run_id)
            except ConflictError:
                name = job.get("name") if isinstance(job, dict) else yaml_name(job)
                job_id = f"{user}~{name}"
                existing = await _get(client, job_id)
                if not flow_run_id or existing.get("flowRunId") != str(flow_run_id):
                    raise
                job_id = await _follow_or_clone(client, existing, flow_run_id)
        else:
            assert job_id is not None
            existing = await _get(client, job_id)
            job_id = await _follow_or_clone(client, existing, flow_run_id)
        return await wait_for_job(client, job_id, poll_s=poll_s, timeout_s=timeout_s)


#: Why a run form's submission is refused on an open Prefect server.
UNPROTECTED = ("user: this Prefect server is not protected (no PREFECT_API_AUTH_STRING), so anyone who reaches "
               "it could submit as any user; Apiary accepts jobs from its form only behind Prefect's basic auth "
               "(apiary up sets it). Submit with 'apiary job submit' instead.")


def prefect_protected() -> bool:
    """Whether this process talks to a Prefect server behind basic auth: only then is the user
    named in a run form someone who holds the server's password (the README's trust model)."""
    from prefect.settings import PREFECT_API_AUTH_STRING  # the process's settings, or a test's override

    return bool(os.environ.get("PREFECT_API_AUTH_STRING") or PREFECT_API_AUTH_STRING.value())


async def _follow_or_clone(client: httpx.AsyncClient, existing: dict, flow_run_id: str | None) -> str:
    """The job to follow: ``existing`` while it runs, else a fresh copy of it attached to this run."""
    if existing.get("state") not in FINAL_STATES:
        logger.info("following job id=%s state=%s", existing["id"], existing.get("state"))
        return str(existing["id"])
    new_id = await _clone(client, existing["id"], flow_run_id)
    logger.info("job id=%s had ended %s: re-run as new job id=%s", existing["id"], existing.get("state"), new_id)
    return new_id


def yaml_name(text: Any) -> str | None:
    """The ``name`` of an OpenPAI job YAML text; None when it is not YAML or has no name."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return doc.get("name") if isinstance(doc, dict) else None



#: Titles the run form shows for the ``submit`` flow's own fields (Prefect titles them by the
#: parameter's Python name otherwise).
_TITLES = {"name": "Job name", "user": "User", "virtual_cluster": "Virtual cluster", "task_roles": "Task roles",
           "priority_class": "Priority class", "retries": "Retries",
           "job_yaml": "OpenPAI job (YAML)", "job_id": "Job id"}


def form_schema(schema: dict[str, Any], virtual_clusters: list[str] | None = None) -> dict[str, Any]:
    """The run form's parameter schema (a deployment's ``parameter_openapi_schema``), made for people.

    Prefect derives the schema from the flow's signature but titles top-level fields by their
    Python names and drops their constraints; this puts back the titles, the name pattern,
    ``minItems`` of the task roles, and, when ``virtual_clusters`` is given (the cluster's VC
    names, read from Apiary when the deployment is served), an ``enum`` so the form offers a
    drop-down. The flows take no URL: they reach Apiary at the platform's configured URL only.
    Returns a new dict; ``schema`` is not changed.
    """
    import copy

    out = copy.deepcopy(schema)
    props = out.get("properties", {})
    for key, title in _TITLES.items():
        if key in props:
            props[key]["title"] = title
    for key in ("name", "user"):
        if key in props:
            props[key]["pattern"] = NAME_PATTERN
    if "task_roles" in props:
        props["task_roles"]["minItems"] = 1
    if virtual_clusters and "virtual_cluster" in props:
        props["virtual_cluster"]["enum"] = sorted(virtual_clusters)
        if len(virtual_clusters) == 1:
            props["virtual_cluster"]["default"] = virtual_clusters[0]
    return out


# --------------------------------------------------------------------------- job templates
#: Flow name of the template runs (one deployment per template, named after it: flows/template.py).
TEMPLATE_FLOW = "apiary-template"


def template_job_name(job_name: str, flow_run_id: str | None) -> str | None:
    """The job name a template run submits: ``<the template job's name>-<first 8 characters of the
    flow run id>``, the same every time the run executes (Retry, a restart), so a second execution
    finds the job of the first; None without a flow run (the platform draws a suffix)."""
    if not flow_run_id:
        return None
    return f"{job_name[:190]}-{str(flow_run_id).replace('-', '')[:8]}"


async def _post_template_run(client: httpx.AsyncClient, template: str, body: dict, user: str,
                             flow_run_id: str | None) -> dict:
    headers = {ON_BEHALF_HEADER: user}
    if flow_run_id:
        headers[FLOW_RUN_HEADER] = str(flow_run_id)
    try:
        resp = await client.post(f"{API_PREFIX}/templates/{template}/runs", json=body, headers=headers)
    except httpx.HTTPError as exc:
        raise UnavailableError(f"run template {template}: apiary unreachable: {exc!r}") from exc
    if resp.status_code >= 400:
        raise error_from_response(resp.status_code, resp.content, f"run template {template}")
    return resp.json()


async def run_template_job(
    *,
    flow_run_id: str | None,
    template: str,
    user: str | None,
    values: dict[str, Any] | None = None,
    job_name: str | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> dict:
    """The body of an ``apiary-template`` run: run ``template`` with ``values`` for ``user``, wait,
    return the job's final JSON (the caller maps its state as :func:`run_job`'s do).

    The job is submitted through ``POST /api/v2/templates/{template}/runs`` with the bridge's token
    on behalf of ``user`` (who must see the template and be granted its VC, as for any job) and
    attached to ``flow_run_id``; its name is ``job_name`` or :func:`template_job_name`. A second
    execution of the same run (Retry, a restarted run) finds that job: it is followed while it
    runs, re-run as ``<name>-retry<N>`` when it ended, as :func:`run_job` does.

    Raises UserError for no user, an unprotected Prefect server, an unknown parameter or a bad
    value (Apiary's message, naming ``parameters.<name>``), NotFoundError for a template ``user``
    does not see, ConflictError for a job name another run holds; PlatformError /
    UnavailableError when Apiary fails or is unreachable.
    """
    if not user:
        raise UserError("user: required to run a template")
    if not prefect_protected():
        raise UserError(UNPROTECTED)
    base = platform_api_url()
    async with httpx.AsyncClient(base_url=base, timeout=30.0, headers=service_headers(),
                                 verify=platform_verify()) as client:
        if job_name is None:
            try:
                resp = await client.get(f"{API_PREFIX}/templates/{template}")
            except httpx.HTTPError as exc:
                raise UnavailableError(f"template {template}: apiary unreachable: {exc!r}") from exc
            if resp.status_code >= 400:
                raise error_from_response(resp.status_code, resp.content, f"template {template}")
            job_name = template_job_name(str(resp.json()["jobName"]), flow_run_id)
        body: dict[str, Any] = {"parameters": dict(values or {})}
        if job_name:
            body["name"] = job_name
        try:
            job_id = str((await _post_template_run(client, template, body, user, flow_run_id))["id"])
        except ConflictError:
            if not job_name or not flow_run_id:
                raise
            existing = await _get(client, f"{user}~{job_name}")
            if existing.get("flowRunId") != str(flow_run_id):
                raise
            job_id = await _follow_or_clone(client, existing, flow_run_id)
        logger.info("template run template=%s user=%s job=%s flow_run=%s", template, user, job_id, flow_run_id)
        return await wait_for_job(client, job_id, poll_s=poll_s, timeout_s=timeout_s)


def template_form_schema(template: dict[str, Any]) -> dict[str, Any]:
    """The run form (a deployment's ``parameter_openapi_schema``) of a template, from its JSON as
    ``GET /api/v2/templates/{name}`` answers it: ``template`` (fixed to its name), ``user``
    (required: the Apiary user the job runs as), ``parameters`` (an object with one property per
    template parameter: its type, default, title, description, minimum, maximum and enum; see
    :meth:`apiary.spec.template.Parameter.json_schema`) and ``job_name`` (optional)."""
    from apiary.spec.template import Parameter

    params = [Parameter(p["name"], p["type"], p["default"], p.get("title"), p.get("description"), p.get("minimum"),
                        p.get("maximum"), tuple(p["enum"]) if p.get("enum") is not None else None)
              for p in template.get("parameters", [])]
    name = template["name"]
    return {
        "title": "Parameters", "type": "object",
        "properties": {
            "template": {"title": "Template", "type": "string", "enum": [name], "default": name, "position": 0,
                         "description": template.get("summary") or f"Job template {name}."},
            "user": {"title": "User", "type": "string", "pattern": NAME_PATTERN, "position": 1,
                     "description": "Your Apiary user name: the job runs as this user (your VCs, quota and "
                                    "storage)."},
            "parameters": {"title": "Parameters", "type": "object", "position": 2,
                           "description": "The template's parameters; each starts at its default.",
                           "properties": {p.name: p.json_schema() for p in params},
                           "default": {p.name: p.default for p in params}},
            "job_name": {"title": "Job name", "position": 3,
                         "anyOf": [{"type": "string", "pattern": NAME_PATTERN}, {"type": "null"}], "default": None,
                         "description": "Optional. Default: the template's job name and a suffix from this run."},
        },
        "required": ["template", "user"],
        "definitions": {},
    }
