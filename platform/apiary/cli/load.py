"""``apiary load``: load tests of a running platform (Locust, in a subprocess) judged by gate files.

* ``apiary load run [--profile smoke|ramp|steady|spike] [--target URL] [--token TOKEN] [--gates FILE]
  [--users N] [--duration S] [--out DIR] [--agents] [--no-plots] [--json]``: prepares users and
  tokens on the target with the admin token, runs the profile (``loadtests/<profile>.py``), prints
  the gate table (measured vs threshold per endpoint, PASS/FAIL) and exits 0 only if every gate
  passed (1 otherwise, or on an error). See loadtests/README.md.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from apiary.errors import ApiaryError

load_app = typer.Typer(no_args_is_help=True, help="Load tests (Locust) with pass/fail gates.")
console = Console()
err = Console(stderr=True)


def gate_table(result) -> Table:
    """The gate rows of a :class:`~apiary.load.runner.LoadResult` as a rich table."""
    verdict = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
    table = Table("endpoint", "metric", "measured", "threshold", "result", "note",
                  title=f"Load gates: {result.profile}, {result.users} people, {result.agents} node agents, "
                        f"{result.duration_s:g} s: {verdict}")
    for r in result.rows:
        measured = "-" if r.measured is None else f"{r.measured:,.0f}" if r.measured >= 1000 else f"{r.measured:.4g}"
        # Text, not markup: request names hold brackets ("/api/v2/jobs/[id]")
        table.add_row(Text(r.endpoint), r.metric, measured, Text(r.threshold),
                      "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]", Text(r.note))
    return table


def _target(target: str | None, token: str | None) -> tuple[str, str]:
    """``--target``/``--token``, else the platform ``apiary up`` recorded (APIARY_API_URL /
    APIARY_HOME, APIARY_TOKEN / APIARY_HOME/token), whose cluster id must match its home's."""
    from apiary.client import ApiaryClient
    from apiary.settings import Settings

    settings = Settings()
    url = target or settings.resolved_api_url()
    tok = token or settings.resolved_token()
    if not url:
        err.print("No Apiary platform found: pass --target, run `apiary up` or set APIARY_API_URL.")
        raise typer.Exit(1)
    if not tok:
        err.print("No token: pass --token (an admin's), set APIARY_TOKEN, or run `apiary login`.")
        raise typer.Exit(1)
    expected = settings.cluster_id()
    if target is None and not settings.api_url and expected is not None:
        c = ApiaryClient(url, token=tok, ca_cert=settings.ca_cert)
        try:
            answered = c.health().get("clusterId")
        except ApiaryError as e:
            err.print(f"[red]error[/red] ({e.status_code}): {e.message}")
            raise typer.Exit(1) from e
        finally:
            c.close()
        if answered != expected:
            err.print(f"error: the platform at {url} is cluster {answered}, but APIARY_HOME {settings.home_dir} "
                      f"belongs to cluster {expected}; pass --target to load that platform anyway.",
                      markup=False, highlight=False)
            raise typer.Exit(1)
    return url.rstrip("/"), tok


@load_app.command("run")
def run_cmd(
    profile: str = typer.Option("smoke", "--profile", help="smoke, ramp, steady or spike (loadtests/<profile>.py)."),
    target: str | None = typer.Option(None, "--target", help="Control-plane URL (default: the platform apiary up "
                                                             "recorded, or APIARY_API_URL)."),
    token: str | None = typer.Option(None, "--token", help="An admin's token (default APIARY_TOKEN, else "
                                                           "APIARY_HOME/token)."),
    gates: Path | None = typer.Option(None, "--gates", exists=True, dir_okay=False,
                                      help="Gate file (default loadtests/gates/<profile>.yaml)."),
    users: int | None = typer.Option(None, "--users", min=1, help="Simulated people at the peak (default: the "
                                                                  "profile's)."),
    duration: float | None = typer.Option(None, "--duration", min=1, help="Seconds (default: the profile's)."),
    out: Path | None = typer.Option(None, "--out", file_okay=False,
                                    help="Output folder (default APIARY_HOME/load/<profile>-<UTC time>)."),
    agents: bool = typer.Option(False, "--agents/--no-agents",
                                help="Also simulate one node agent per ready node (duplicate heartbeats and long "
                                     "polls on top of the real agents; see loadtests/README.md)."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Render latency.png and throughput.png."),
    vc: str | None = typer.Option(None, "--vc", help="Virtual cluster to submit to (default: the largest)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of the table."),
) -> None:
    """Run a load profile against the platform; exit 0 only if every gate passed."""
    from apiary.load.profiles import PROFILES
    from apiary.load.runner import run_load
    from apiary.settings import Settings

    if profile not in PROFILES:
        err.print(f"unknown profile {profile!r}; one of {', '.join(PROFILES)}")
        raise typer.Exit(2)
    url, tok = _target(target, token)
    if out is None:
        out = Settings().home_dir / "load" / f"{profile}-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}"
    try:
        result = run_load(url, tok, profile=profile, gates=gates, users=users, duration_s=duration, out_dir=out,
                          agents=agents, plots=plots, virtual_cluster=vc)
    except ApiaryError as e:
        err.print(f"[red]error[/red] ({e.status_code}): {e.message}")
        raise typer.Exit(1) from e
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(gate_table(result))
        j = result.jobs
        console.print(f"jobs: {j.accepted} accepted, {j.listed} listed, {len(j.lost)} lost; "
                      f"Locust exit {result.locust_exit_code}; {result.wall_s:.0f} s")
        for f in result.failures[:5]:
            console.print(f"failure x{f.occurrences} {f.endpoint}: {f.error}", markup=False, highlight=False,
                          soft_wrap=True)
        console.print(f"raw stats: {result.stats_json}, {result.stats_csv}, {result.history_csv}", soft_wrap=True)
        if result.plots:
            console.print(f"plots: {', '.join(str(p) for p in result.plots)}", soft_wrap=True)
        console.print("[green]PASS[/green]: every gate passed" if result.passed else
                      f"[red]FAIL[/red]: {sum(not r.passed for r in result.rows)} gate(s) failed")
    raise typer.Exit(0 if result.passed else 1)
