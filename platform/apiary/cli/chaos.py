"""``apiary chaos run EXPERIMENT... [--target URL] [--token T]``: chaostoolkit experiments against a
running platform, one verdict each (see :mod:`apiary.chaos.runner` and chaos/README.md).

The platform is ``--target``, else ``APIARY_API_URL``, else the one ``apiary up`` recorded in
``APIARY_HOME``; the token ``--token``, else ``APIARY_TOKEN``, else ``APIARY_HOME/token`` (an
admin's: faults, cordons and the consistency check are admin-only). Exit 0 only if every
experiment passed.

``--deployment ROOT`` (or ``APIARY_DEPLOYMENT``) points the experiments at a many-hosts
deployment instead: its ``ROOT/deployment.json`` gives the replicas' URLs, the CA, the admin token
and the hosts the multi-host actions act on (:mod:`apiary.chaos.multihost`); ``--target``,
``--token`` and ``--ca-cert`` still win. No home is assumed unless ``--home`` is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

chaos_app = typer.Typer(no_args_is_help=True, help="Chaos experiments (chaostoolkit) against a running platform.")
console = Console()
err = Console(stderr=True)


def verdict_table(verdicts: list) -> Table:
    table = Table("experiment", "verdict", "seconds", "reasons", title="Chaos experiments")
    for v in verdicts:
        mark = "[green]PASS[/green]" if v.passed else "[red]FAIL[/red]"
        table.add_row(v.name, mark, f"{v.durations.get('wall', 0.0):.1f}", "\n".join(v.reasons) or "-")
    return table


@chaos_app.command("run")
def run_cmd(
    experiments: list[Path] = typer.Argument(..., exists=True, dir_okay=False, help="Experiment files (JSON or YAML)."),
    target: str | None = typer.Option(None, "--target", help="Control-plane URL (default APIARY_API_URL)."),
    token: str | None = typer.Option(None, "--token", help="An admin's token (default APIARY_TOKEN / home/token)."),
    home: Path | None = typer.Option(None, "--home", help="Platform home for pids and files (default APIARY_HOME)."),
    deployment: Path | None = typer.Option(
        None, "--deployment", envvar="APIARY_DEPLOYMENT", file_okay=False,
        help="Root of a many-hosts deployment (its deployment.json names the replicas, CA, token and hosts)."),
    ca_cert: Path | None = typer.Option(
        None, "--ca-cert", dir_okay=False, help="Platform CA to verify HTTPS against (default APIARY_CA_CERT)."),
    tag: str | None = typer.Option(None, "--tag", help="Run only the experiments carrying this tag (e.g. ci)."),
    journal_dir: Path | None = typer.Option(
        None, "--journal-dir", help="Where journals and logs go (default HOME/chaos-journals, else ./chaos-journals)."),
    timeout: float = typer.Option(600.0, "--timeout", min=1, help="Seconds per experiment."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON instead of a table."),
) -> None:
    """Run each experiment with chaostoolkit and judge its journal: PASS only if it completed, did not
    deviate, met its steady state before and after, and every activity and rollback succeeded."""
    import yaml

    from apiary.chaos.journal import tags
    from apiary.chaos.runner import run_experiment
    from apiary.settings import Settings

    settings = Settings()
    if deployment is not None:
        from apiary.chaos.target import load_deployment
        from apiary.errors import ValidationError

        try:
            load_deployment(deployment)
        except ValidationError as e:
            err.print(f"--deployment: {e}")
            raise typer.Exit(1) from None
        url = target
        the_home = home
    else:
        url = target or settings.resolved_api_url()
        if not url:
            err.print("No Apiary platform found: pass --target or --deployment, set APIARY_API_URL or run `apiary up`.")
            raise typer.Exit(1)
        the_home = home or (settings.home_dir if settings.home_dir.exists() else None)
    selected = []
    for path in experiments:
        if tag is not None and tag not in tags(yaml.safe_load(path.read_text()) or {}):
            continue
        selected.append(path)
    if not selected:
        err.print(f"No experiment carries tag {tag!r}.")
        raise typer.Exit(1)
    journals = journal_dir or (the_home / "chaos-journals" if the_home is not None else
                               deployment / "chaos-journals" if deployment is not None else Path("chaos-journals"))
    the_token = token if deployment is not None else token or settings.resolved_token()
    the_ca = ca_cert or (None if deployment is not None else settings.ca_cert)
    verdicts = []
    for path in selected:
        err.print(f"running {path} ...")
        verdicts.append(run_experiment(path, api_url=url, token=the_token, home=the_home, journal_dir=journals,
                                       timeout_s=timeout, deployment=deployment, ca_cert=the_ca))
    if as_json:
        console.print_json(json.dumps([v.to_dict() for v in verdicts]))
    else:
        console.print(verdict_table(verdicts))
        console.print(f"journals in {journals}/")
    if not all(v.passed for v in verdicts):
        raise typer.Exit(1)
