"""``apiary template``: the marketplace's job templates (:mod:`apiary.marketplace.templates`).

* ``apiary template list [-q TEXT] [--tag TAG] [--json]``: the templates you see, official first;
* ``apiary template get NAME [--json]``: one, with its parameters (type, default, bounds);
* ``apiary template publish FILE [--update]``: publish a template YAML file (``--update``: replace
  your own, or any as an admin); ``apiary template delete NAME``;
* ``apiary template run NAME [-p NAME=VALUE ...] [--name JOBNAME] [--vc VC] [--wait]``: submit the
  template's job as you; ``-p`` values are read as the parameter's type. ``--wait`` follows the job
  to its end and exits 0 only if it SUCCEEDED.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from apiary.cli.common import api_client, err, fail
from apiary.cli.tables import print_rows
from apiary.errors import ApiaryError, ValidationError
from apiary.spec import safeyaml
from apiary.spec.template import split_assignments

console = Console()
template_app = typer.Typer(no_args_is_help=True, help="Job templates (the marketplace): list, get, publish, run.")


def _call(fn: Any) -> Any:
    try:
        return fn()
    except ApiaryError as e:
        fail(e)


def _document(path: Path) -> dict:
    """A template YAML file as a document; a ``job`` written as a mapping is sent as its YAML text."""
    try:
        doc = safeyaml.load(path.read_bytes(), field=str(path), what="template")
    except OSError as e:
        fail(ValidationError(str(path), f"cannot read it: {e.strerror}"))
    except ValidationError as e:
        fail(e)
    if not isinstance(doc, dict):
        fail(ValidationError(str(path), "a template file is a YAML mapping (name, summary, ..., job)"))
    return doc


@template_app.command("list")
def template_list(
    q: str | None = typer.Option(None, "-q", "--search", help="Text in the name, summary or tags."),
    tag: str | None = typer.Option(None, "--tag", help="Only templates with this tag."),
    as_json: bool = typer.Option(False, "--json", help="Print the templates as JSON."),
) -> None:
    """List the templates you may see and run, official ones first."""
    templates = _call(lambda: api_client().templates(q=q, tag=tag))
    if as_json:
        print(json.dumps(templates, indent=2))
        return
    print_rows(console, ("name", "official", "owner", "tags"),
               [(t["name"], "yes" if t["official"] else "no", t["owner"], ",".join(t["tags"]) or "-")
                for t in templates],
               sentence="summary", sentences=[t["summary"] for t in templates])


@template_app.command("get")
def template_get(name: str, as_json: bool = typer.Option(False, "--json", help="Print it as JSON.")) -> None:
    """Show a template: who publishes it, its parameters and their defaults, its description."""
    t = _call(lambda: api_client().template(name))
    if as_json:
        print(json.dumps(t, indent=2))
        return
    console.print(f"[bold]{t['name']}[/bold]{' (official)' if t['official'] else ''}: {t['summary']}",
                  markup=True, highlight=False)
    console.print(f"owner {t['owner']}, author {t['author'] or '-'}, tags {', '.join(t['tags']) or '-'}",
                  markup=False, highlight=False)

    def bounds(p: dict) -> str:
        parts = [f"min {p['minimum']}" if p.get("minimum") is not None else "",
                 f"max {p['maximum']}" if p.get("maximum") is not None else "",
                 f"one of {', '.join(map(str, p['enum']))}" if p.get("enum") else ""]
        return "; ".join(x for x in parts if x)

    params = t["parameters"]
    print_rows(console, ("parameter", "type", "default"),
               [(p["name"], p["type"], json.dumps(p["default"])) for p in params],
               sentence="about", sentences=[" ".join(x for x in (p.get("title") or "", bounds(p)) if x)
                                            for p in params])
    if t["description"]:
        console.print(t["description"], markup=False, highlight=False)


@template_app.command("publish")
def template_publish(
    file: Path = typer.Argument(..., help="The template YAML (name, summary, description, tags, visibility, "
                                          "parameterSchema, job)."),
    update: bool = typer.Option(False, "--update", help="Replace the template of that name (yours, or any "
                                                        "as an admin)."),
) -> None:
    """Publish a job template; you own it."""
    doc = _document(file)
    if isinstance(doc.get("job"), dict):
        import yaml

        doc["job"] = yaml.safe_dump(doc["job"], sort_keys=False)
    client = api_client()
    if update:
        name = doc.get("name")
        if not isinstance(name, str):
            fail(ValidationError("name", "the file names no template"))
        t = _call(lambda: client.update_template(name, {k: v for k, v in doc.items() if k != "name"}))
    else:
        t = _call(lambda: client.publish_template(doc))
    console.print(f"{t['name']} {'updated' if update else 'published'} "
                  f"({len(t['parameters'])} parameter(s))", markup=False, highlight=False)


@template_app.command("delete")
def template_delete(name: str) -> None:
    """Delete a template (yours, or any as an admin)."""
    _call(lambda: api_client().delete_template(name))
    console.print(f"{name} deleted", markup=False, highlight=False)


@template_app.command("run")
def template_run(
    name: str,
    param: list[str] = typer.Option([], "-p", "--param", help="NAME=VALUE, read as the parameter's type; "
                                                              "repeat for each."),
    job_name: str | None = typer.Option(None, "--name", help="The job's name (default: the template's job name "
                                                             "and a short random suffix)."),
    vc: str | None = typer.Option(None, "--vc", help="Run in this virtual cluster instead of the template's."),
    wait: bool = typer.Option(False, "--wait", help="Wait for the job to end; exit 0 only if it SUCCEEDED."),
    timeout: float | None = typer.Option(None, "--timeout", help="With --wait: give up after this many seconds "
                                                                 "(exit 2)."),
) -> None:
    """Run a template: its job is submitted as you, with your values for its parameters."""
    try:
        values = split_assignments(param, "param")
    except ValidationError as e:
        fail(e)
    client = api_client()
    job = _call(lambda: client.run_template(name, values, job_name=job_name, virtual_cluster=vc))
    console.print(f"{job['id']} {job['state']}", markup=False, highlight=False)
    if not wait:
        return
    try:
        job = client.wait(job["id"], timeout=timeout)
    except TimeoutError as e:
        err.print(str(e))
        raise typer.Exit(2) from e
    except ApiaryError as e:
        fail(e)
    console.print(f"{job['id']} {job['state']} exitCode={job['exitCode']}", markup=False, highlight=False)
    raise typer.Exit(0 if job["state"] == "SUCCEEDED" else 1)
