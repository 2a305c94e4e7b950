"""``apiary job open``: a task instance's web server (JupyterLab, TensorBoard) through the platform's proxy.

Prints, or opens in a browser (Python's :mod:`webbrowser`), the URL of a named port of a running
instance through the API's proxy (``/api/v2/jobs/{id}/proxy/{role}/{index}/{port}/``,
:mod:`apiary.api.routers.proxy`) with the caller's token as ``?token=``: the proxy trades it for a
cookie scoped to that job's proxy path and redirects to the URL without it. Only the job's owner
gets through. The port: ``--port N`` (its number), ``--name NAME`` (a port name, the default
``jupyter``) or ``--tensorboard`` (the tensorboard runtime plugin's port).
"""

from __future__ import annotations

import webbrowser
from collections.abc import Callable
from typing import Annotated, Any
from urllib.parse import quote

import typer

from apiary.errors import ApiaryError, ConflictError, NotFoundError, ValidationError

#: The port name ``apiary job open`` uses without ``--port``, ``--name`` or ``--tensorboard``.
DEFAULT_PORT_NAME = "jupyter"


def pick_task(job: dict, task: str | None) -> dict:
    """The instance of ``job`` (its API form) that ``--task ROLE/INDEX`` names; by default its first
    RUNNING one. Raises ValidationError for a malformed ``--task``, NotFoundError for no such
    instance, ConflictError for one that is not RUNNING."""
    tasks = job["tasks"]
    if task is not None:
        role, sep, index = task.partition("/")
        if not sep or not index.isdigit():
            raise ValidationError("--task", f"{task!r} must be ROLE/INDEX, e.g. notebook/0")
        found = [t for t in tasks if t["taskRole"] == role and t["index"] == int(index)]
        if not found:
            raise NotFoundError(f"Job {job['id']} has no task {task}.")
        chosen = found[0]
    else:
        running = [t for t in tasks if t["state"] == "RUNNING"]
        if not (running or tasks):
            raise NotFoundError(f"Job {job['id']} has no task instance yet.")
        chosen = (running or tasks)[0]
    if chosen["state"] != "RUNNING":
        raise ConflictError(f"Task {chosen['taskRole']}/{chosen['index']} of job {job['id']} is {chosen['state']}; "
                            f"its ports answer only while it runs.")
    return chosen


def proxy_url(api_url: str, job_id: str, task: dict, port: str, token: str | None) -> str:
    """The proxy URL of ``port`` (a number or a name) of ``task``, with ``?token=`` when given."""
    base = (f"{api_url.rstrip('/')}/api/v2/jobs/{quote(job_id, safe='~')}/proxy/"
            f"{quote(task['taskRole'])}/{task['index']}/{quote(port)}/")
    return f"{base}?token={quote(token, safe='')}" if token else base


def add_job_open_command(job_app: typer.Typer, client: Callable[[], Any], token: Callable[[], str | None],
                         fail: Callable[[ApiaryError], None]) -> None:
    """Register ``apiary job open`` on ``job_app``; ``client`` makes the API client, ``token`` gives
    the caller's token, ``fail`` prints an API error and exits."""

    @job_app.command("open")
    def open_(
        job_id: Annotated[str, typer.Argument(help="The job, <user>~<name>.")],
        task: Annotated[str | None, typer.Option("--task", help="ROLE/INDEX (default: the first running instance).")]
        = None,
        port: Annotated[int | None, typer.Option("--port", help="A named port of the instance, by number.")] = None,
        name: Annotated[str | None, typer.Option("--name", help=f"A port name (default {DEFAULT_PORT_NAME}).")]
        = None,
        tensorboard: Annotated[bool, typer.Option("--tensorboard", help="The tensorboard plugin's port.")] = False,
        print_only: Annotated[bool, typer.Option("--print", help="Print the URL instead of opening a browser.")]
        = False,
    ) -> None:
        """Open a task instance's web server (JupyterLab, TensorBoard) through the platform's proxy.

        The URL holds your platform token (?token=): the proxy swaps it for a cookie of that job's
        proxy path and redirects to the URL without it, but it stays in the browser's history and in
        whatever --print writes to. Only the job's owner gets through."""
        if sum(x is not None and x is not False for x in (port, name, tensorboard or None)) > 1:
            fail(ValidationError("--port", "give one of --port, --name and --tensorboard"))
        chosen = str(port) if port is not None else "tensorboard" if tensorboard else name or DEFAULT_PORT_NAME
        try:
            c = client()
            instance = pick_task(c.get(job_id), task)
        except ApiaryError as e:
            fail(e)
            return
        url = proxy_url(c.api_url, job_id, instance, chosen, token())
        if print_only or not webbrowser.open(url):
            typer.echo(url)
