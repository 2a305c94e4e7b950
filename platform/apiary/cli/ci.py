"""``apiary ci``: the CI pipeline runs the flows recorded (``GET /api/v2/ci/runs``; admins).

* ``apiary ci runs [--limit N] [--repo OWNER/NAME] [--result R] [--kind K] [--json]``: a table of
  the newest runs (id, repo, PR, short sha, kind, result, failed stage, duration, start), newest
  first; ``--json`` prints the API's records as they are.

The platform and the token are the other commands' (``APIARY_API_URL`` / ``APIARY_TOKEN``, else
the platform ``apiary up`` recorded in ``APIARY_HOME``). Ids and shas are never cut, any other
cell is folded, not cropped (:mod:`apiary.cli.tables`).
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from apiary.cli.common import api_client, fail
from apiary.cli.tables import COMPACT, duration, folded, result_text, short_sha, uncut, when, word
from apiary.errors import ApiaryError

ci_app = typer.Typer(no_args_is_help=True, help="CI pipeline runs (what the CI/CD flows recorded).")
console = Console()


def runs_table(runs: list[dict], out: Console) -> Table:
    """The pipeline runs as a table for ``out`` (its width decides which columns fold)."""
    table = Table(
        uncut("id", [str(r["id"]) for r in runs], out), folded("repo"), word("PR"),
        uncut("sha", [short_sha(r["sha"]) for r in runs], out), word("kind"), word("result"),
        folded("failed stage"), word("took"), folded("started (UTC)", min_width=10),
        title="CI pipeline runs (newest first)", **COMPACT)
    for r in runs:
        table.add_row(str(r["id"]), Text(r["repo"]), "-" if r.get("prNumber") is None else f"#{r['prNumber']}",
                      short_sha(r["sha"]), r["kind"], result_text(r["result"]), Text(r.get("failedStage") or "-"),
                      duration(r.get("durationS")), when(r.get("startedAt")))
    return table


@ci_app.command("runs")
def runs_command(
    limit: int = typer.Option(50, "--limit", min=1, max=1000, help="At most this many runs, newest first."),
    repo: str | None = typer.Option(None, "--repo", help="Only this repository (owner/name)."),
    result: str | None = typer.Option(None, "--result", help="Only runs with this result: running, success, "
                                                             "failure or error."),
    kind: str | None = typer.Option(None, "--kind", help="pr (pull requests) or deploy (the default branch)."),
    as_json: bool = typer.Option(False, "--json", help="Print the runs as JSON."),
) -> None:
    """List the newest CI pipeline runs (admins)."""
    try:
        runs = api_client().ci_runs(limit, repo=repo, result=result, kind=kind)
    except ApiaryError as e:
        fail(e)
    if as_json:
        print(json.dumps(runs, indent=2))
        return
    console.print(runs_table(runs, console))
