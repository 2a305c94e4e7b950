"""``apiary model``: the model registry (MLflow's Model Registry, :mod:`apiary.marketplace.models`).

* ``apiary model list [--json]``: the registered models you may read, with their latest version;
* ``apiary model get NAME[/VERSION] [--json]``: a model with its versions, or one version with its
  lineage (the MLflow run, its metrics and UI link, and the Apiary job, attempt and task it came from);
* ``apiary model download NAME/VERSION [-o DIR]``: the version's files into DIR (default
  ``./NAME-VERSION``), one path per line.

The platform forwards your own token to MLflow: MLflow's permissions decide what you see (what you
created or were granted; admins everything). Another user's model is a 403.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from apiary.cli.common import api_client, fail
from apiary.cli.tables import print_rows, when
from apiary.errors import ApiaryError, ValidationError
from apiary.marketplace.models import parse_name_version

console = Console()
model_app = typer.Typer(no_args_is_help=True, help="The model registry (MLflow): list, get, download.")


def _call(fn: Any) -> Any:
    try:
        return fn()
    except ApiaryError as e:
        fail(e)


def _parse(text: str) -> tuple[str, str | None]:
    try:
        return parse_name_version(text, "NAME[/VERSION]")
    except ValidationError as e:
        fail(e)


@model_app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="The API's JSON.")) -> None:
    """The registered models you may read."""
    models = _call(lambda: api_client().models())
    if as_json:
        print(json.dumps(models, indent=2))
        return
    rows = []
    for m in models:
        latest = max((v for v in m["latestVersions"]), key=lambda v: int(v["version"] or 0), default=None)
        rows.append([m["name"], latest["version"] if latest else "-", when(m.get("updatedAt")),
                     (latest or {}).get("runId") or "-"])
    print_rows(console, ["NAME", "LATEST", "UPDATED", "RUN"], rows)


@model_app.command("get")
def get(ref: str = typer.Argument(..., metavar="NAME[/VERSION]"),
        as_json: bool = typer.Option(False, "--json", help="The API's JSON.")) -> None:
    """A model with its versions, or one version with its lineage (run, job)."""
    name, version = _parse(ref)
    if version is None:
        doc = _call(lambda: api_client().model(name))
        if as_json:
            print(json.dumps(doc, indent=2))
            return
        print_rows(console, ["VERSION", "STATUS", "CREATED", "RUN"],
                   [[v["version"], v.get("status") or "-", when(v.get("createdAt")), v.get("runId") or "-"]
                    for v in doc.get("versions") or []], title=name)
        return
    v = _call(lambda: api_client().model_version(name, version))
    if as_json:
        print(json.dumps(v, indent=2))
        return
    console.print(f"{v['name']} version {v['version']}  ({v.get('status')}, {when(v.get('createdAt'))})",
                  markup=False, highlight=False)
    console.print(f"source:  {v.get('source')}", markup=False, highlight=False)
    run, job = v.get("run"), v.get("job")
    if run:
        console.print(f"run:     {run['runId']} ({run.get('status')})  {run.get('url') or ''}", markup=False,
                      highlight=False)
        for key, value in sorted((run.get("metrics") or {}).items()):
            console.print(f"  {key} = {value}", markup=False, highlight=False)
    if job:
        console.print(f"job:     {job['id']}  attempt {job.get('attempt')}  task {job.get('task')}", markup=False,
                      highlight=False)


@model_app.command("download")
def download(ref: str = typer.Argument(..., metavar="NAME/VERSION"),
             output: Path | None = typer.Option(None, "--output", "-o", help="Directory (default ./NAME-VERSION).")
             ) -> None:
    """Download a version's files; prints each path written."""
    name, version = _parse(ref)
    if version is None:
        fail(ValidationError("NAME/VERSION", f"{ref!r} names no version (e.g. {name}/1)"))
    dest = output or Path(f"{name}-{version}")
    for path in _call(lambda: api_client().model_download(name, version, dest)):
        print(dest / path)
