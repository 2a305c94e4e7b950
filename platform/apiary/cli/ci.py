"""``apiary ci``: the CI pipeline runs the flows recorded (``GET /api/v2/ci/runs``; admins).

* ``apiary ci runs [--limit N] [--repo OWNER/NAME] [--result R] [--kind K] [--json]``: a table of
  the newest runs (id, repo, PR, short sha, kind, result, failed stage, duration, start), newest
  first; ``--json`` prints the API's records as they are.

The platform and the token are the other commands' (``APIARY_API_URL`` / ``APIARY_TOKEN``, else
the platform ``apiary up`` recorded in ``APIARY_HOME``). The table helpers here serve
``apiary deploy history`` too: ids and shas are never cut, any other cell is folded, not cropped.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from apiary.errors import ApiaryError

ci_app = typer.Typer(no_args_is_help=True, help="CI pipeline runs (what the CI/CD flows recorded).")
console = Console()

SHORT_SHA = 7  # git's default abbreviation
#: Tables of many columns in 80: a rule under the header, no borders (they would take 10 columns).
COMPACT: dict[str, Any] = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False, "collapse_padding": True}
_STYLES = {"success": "green", "succeeded": "green", "failure": "red", "failed": "red", "error": "red",
           "rolled_back": "yellow", "running": "cyan"}


def api_client() -> Any:
    """The CLI's client of the platform (:func:`apiary.cli.main._client`: the URL, the token and
    the cluster-id check every command shares). Imported here, not at the top: main imports this module."""
    from apiary.cli import main

    return main._client()


def fail(e: ApiaryError) -> NoReturn:
    """Print the API's error the way every command does, and exit 1."""
    from apiary.cli import main

    main._fail(e)
    raise typer.Exit(1)  # main._fail exits already


def uncut(header: str, values: list[str], out: Console) -> Column:
    """A column whose values are never cut (ids, shas): one line while ``out`` has room, folded
    over several lines (every character kept) when a value is wider than the terminal."""
    longest = max((len(v) for v in values), default=len(header))
    room = max(out.width - 4, 1)
    if max(longest, len(header)) <= room:
        return Column(header, no_wrap=True, min_width=max(longest, len(header)))
    return Column(header, overflow="fold", min_width=room)


def folded(header: str, min_width: int | None = None) -> Column:
    """A column that wraps and folds its text rather than cropping it with an ellipsis."""
    return Column(header, overflow="fold", min_width=min_width)


def word(header: str) -> Column:
    """A column of one short word per cell (a state, a duration): kept on one line."""
    return Column(header, no_wrap=True)


def short_sha(sha: str | None) -> str:
    return (sha or "")[:SHORT_SHA] or "-"


def duration(seconds: float | None) -> str:
    """``12s``, ``3m20s``, ``1h02m``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def when(iso: str | None) -> str:
    """An ISO 8601 UTC time as ``2026-11-25 10:00`` (UTC; a narrow column shows the date over the
    time); ``-`` when absent."""
    if not iso:
        return "-"
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return iso


def result_text(result: str) -> Text:
    return Text(result, style=_STYLES.get(result, ""))


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
