"""``apiary deploy``: Kubernetes manifests of the platform.

* ``apiary deploy render --values FILE --out DIR``: render the manifests the values give (defaults
  and every key: ``deploy/kubernetes/values.yaml``) into DIR, one file per manifest, and print
  their paths; ``kubectl apply -f DIR`` then applies them in order (see deploy/kubernetes/README.md).
* ``apiary deploy history [--limit N] [--sha S] [--result R] [--json]``: the production deployments
  the deploy flow recorded (``GET /api/v2/deployments``; admins), newest first.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from apiary.cli.common import api_client, fail
from apiary.cli.tables import COMPACT, duration, folded, result_text, short_sha, uncut, when, word
from apiary.errors import ApiaryError

deploy_app = typer.Typer(no_args_is_help=True, help="Deploy the platform to Kubernetes (manifests).")
err = Console(stderr=True)
console = Console()


@deploy_app.command("render")
def render_command(
    values: Path = typer.Option(..., "--values", exists=True, dir_okay=False, help="Values YAML."),
    out: Path = typer.Option(..., "--out", file_okay=False, help="Directory for the manifests (created)."),
) -> None:
    """Render the Kubernetes manifests into DIR, one file per manifest; prints their paths."""
    from apiary.deploy import render

    try:
        paths = render(values, out)
    except ApiaryError as e:
        err.print(f"error: {e.message}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    for path in paths:
        print(path)


def history_table(deployments: list[dict], out: Console) -> Table:
    """The deployments as a table for ``out``: id and short sha never cut, the reason folded."""
    table = Table(
        uncut("id", [str(d["id"]) for d in deployments], out),
        uncut("sha", [short_sha(d["sha"]) for d in deployments], out), word("result"), word("trigger"),
        folded("actor"), word("took"), folded("started (UTC)", min_width=10), folded("reason"),
        title="Production deployments (newest first)", **COMPACT)
    for d in deployments:
        table.add_row(str(d["id"]), short_sha(d["sha"]), result_text(d["result"]), d["trigger"], Text(d["actor"]),
                      duration(d.get("durationS")), when(d.get("startedAt")), Text(d.get("reason") or ""))
    return table


@deploy_app.command("history")
def history_command(
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="At most this many deployments, newest first."),
    sha: str | None = typer.Option(None, "--sha", help="Only deployments of commits starting with this (short) sha."),
    result: str | None = typer.Option(None, "--result", help="Only succeeded, rolled_back or failed ones."),
    as_json: bool = typer.Option(False, "--json", help="Print the deployments as JSON."),
) -> None:
    """List the production deployments the deploy flow recorded (admins)."""
    try:
        deployments = api_client().deployments(limit, sha=sha, result=result)
    except ApiaryError as e:
        fail(e)
    if as_json:
        print(json.dumps(deployments, indent=2))
        return
    console.print(history_table(deployments, console))
